"""GPU benchmark: jaxpm_halos against jz-tree (the CUDA peer) on one GPU, in one process.

    python benchmarks/gpu.py                       # 64^3, 128^3, 256^3
    python benchmarks/gpu.py --sizes 512 --fof-only --scipy-up-to 256

It needs a CUDA GPU, JaxPM, and jz-tree (``jztree`` and ``jztree-cu13``, which need
jax >= 0.8). For each size it makes the data on the GPU: a JaxPM z = 0 snapshot (the
recipe of ``run.py``: 2LPT at a = 0.1, 20 PM steps, a box of 1 Mpc/h per particle spacing,
seed 0, here on one device) and uniform random points. Then, after a warm-up, the minimum
of several runs of:

* FoF with catalogue (b = 0.2, 20 members): ``jaxpm_halos.fof`` against
  ``jztree.fof.fof_and_catalogue``;
* kNN k = 16: ``jaxpm_halos.knn_density`` against ``jztree.knn.knn`` asked for the same
  neighbour (jz-tree counts the particle itself, so it is asked for k + 1);
* one PM step (a JaxPM force evaluation) and in-situ FoF + kNN density (k = 16), as a ratio.

First it records what XLA compiles ``lax.top_k`` to on the card (its top-k kernel or a sort
of every row) for the merge shapes kNN has used, with their times.

Correctness: jaxpm_halos' labels are compared with scipy's (``cKDTree.query_pairs`` +
``connected_components``, run on the host) and its densities with cKDTree's, and the
particles whose label differs and the largest relative density difference are recorded
(``fof_wrong_particles``, ``knn_max_rel_err``). jz-tree's labels and radii are compared
with the same references (beyond ``--scipy-up-to``, jz-tree's labels with ours). jz-tree
is rerun with twice its node buffer when it reports an overflow.
``--profile DIR`` records the largest size's warm FoF and kNN runs with ``jax.profiler``
and lists the GPU kernels that dominate them, with the XLA instruction each runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

# jz-tree reports through host callbacks, which need the CPU platform too.
os.environ.setdefault("JAX_PLATFORMS", "cuda,cpu")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import tables  # noqa: E402
from run import MIN_MEMBERS, B, canonical, min_time, scipy_fof, timed, uniform_points  # noqa: E402
from scipy.spatial import cKDTree  # noqa: E402

import jaxpm_halos as jh  # noqa: E402

K = 16


def snapshot(nc):
    """JaxPM z = 0 displacement and momentum on the GPU (run.py's recipe, one device)."""
    from jaxpm_halos.simulation import run_simulation

    t = time.perf_counter()
    result = run_simulation(nc, float(nc), 20, mesh=None, seed=0)
    y = jax.block_until_ready(jnp.stack([result.state[0], result.state[1]]))
    print(f"snapshot {nc}^3: {time.perf_counter() - t:.1f} s", flush=True)
    return y


def jztree_config(name, nodes):
    """jz-tree's default FoF or kNN config with ``nodes`` times its default node buffer."""
    import dataclasses

    import jztree

    cfg = getattr(jztree.config, name)()
    return dataclasses.replace(
        cfg, tree=dataclasses.replace(cfg.tree, alloc_fac_nodes=cfg.tree.alloc_fac_nodes * nodes)
    )


def jztree_timed(make):
    """``timed`` for jz-tree, whose buffers can be too small for clustered data: it raises,
    naming ``alloc_fac_nodes``, and is retried with twice the buffer. Returns the timing
    and the factor over jz-tree's default that worked."""
    for nodes in (1, 2, 4, 8):
        try:
            return timed(make(nodes)) + (nodes,)
        except Exception as error:  # jz-tree reports through a host callback
            if "alloc_fac" not in str(error):
                raise
            print(f"jz-tree overflowed with {nodes}x its node buffer, retrying", flush=True)
    raise RuntimeError("jz-tree overflowed with 8x its default node buffer")


def jztree_fof(pos, box, l):
    import jztree

    assert jztree.config.FofConfig().catalogue.npart_min == MIN_MEMBERS
    return lambda nodes: (
        lambda: jztree.fof.fof_and_catalogue.jit(
            pos, rlink=l, boxsize=box, cfg=jztree_config("FofConfig", nodes)
        )
    )


def jztree_fof_labels(pos, box, l, nodes):
    import jztree

    _, igroup = jztree.fof.fof_labels.jit(
        pos, rlink=l, boxsize=box, output_order="input", cfg=jztree_config("FofConfig", nodes)
    )
    return canonical(np.asarray(igroup))


def jztree_knn(pos, box, k):
    import jztree

    def radii(nodes):
        def run():
            out = jztree.knn.knn.jit(
                pos, k=k, boxsize=box, result="rad", cfg=jztree_config("KNNConfig", nodes)
            )
            return out[0] if isinstance(out, (tuple, list)) else out

        return run

    return radii


def bench(nc, kind, y, rows, check_scipy, profile_dir, with_knn=True):
    box = float(nc)
    n = nc**3
    if kind == "jaxpm":
        parts = jh.from_jaxpm(y[0], None, box)
        x, fof_args, knn_args = parts, (), ()
        pos = np.asarray(parts.pos).reshape(-1, 3)
    else:
        pos = uniform_points(nc)
        x, fof_args, knn_args = jnp.asarray(pos), (box,), (box,)
    pos_gpu = jnp.asarray(pos)
    l = B * box / nc
    row = dict(size=nc, kind=kind, n=n)

    first, warm, (labels, cat) = timed(lambda: jh.fof(x, *fof_args, b=B, min_members=MIN_MEMBERS))
    labels = np.asarray(labels).reshape(-1)
    row.update(fof_first=first, fof=warm, halos=int(np.sum(np.asarray(cat.num))))
    jz_first, jz_warm, (_, jz_cat), nodes = jztree_timed(jztree_fof(pos_gpu, box, l))
    row.update(
        jz_fof_first=jz_first, jz_fof=jz_warm, jz_halos=int(jz_cat.ngroups), jz_fof_nodes=nodes
    )
    jz_labels = jztree_fof_labels(pos_gpu, box, l, nodes)
    if check_scipy:
        t, ref = min_time(lambda: canonical(scipy_fof(pos, box, l)), repeats=1)
        row["scipy_fof"] = t
        row["fof_wrong_particles"] = int(np.sum(labels != ref))
        row["jz_fof_wrong_particles"] = int(np.sum(jz_labels != ref))
    else:
        # Two independent codes: any difference would be reported, and is not expected.
        row["jz_fof_wrong_particles"] = int(np.sum(jz_labels != labels))

    if not with_knn:
        rows.append(row)
        print(json.dumps(row), flush=True)
        return
    first, warm, rho = timed(lambda: jh.knn_density(x, *knn_args, k=K))
    rho = np.asarray(rho).reshape(-1)
    row.update(knn_first=first, knn=warm)
    jz_first, jz_warm, jz_r, nodes = jztree_timed(jztree_knn(pos_gpu, box, K + 1))
    row.update(jz_knn_first=jz_first, jz_knn=jz_warm, jz_knn_nodes=nodes)
    jz_r = np.asarray(jz_r)[:, K]
    t = time.perf_counter()
    r_ref = cKDTree(pos, boxsize=box).query(pos, k=K + 1, workers=-1)[0][:, K]
    row["ckdtree_knn"] = time.perf_counter() - t
    rho_ref = (K - 1) / (4 / 3 * np.pi * r_ref**3)
    row["knn_max_rel_err"] = float(np.max(np.abs(rho / rho_ref - 1)))
    row["jz_knn_max_rel_err"] = float(np.max(np.abs(jz_r / r_ref - 1)))

    if profile_dir is not None:
        fof = jax.jit(lambda x: jh.fof(x, *fof_args, b=B, min_members=MIN_MEMBERS))
        knn = jax.jit(lambda x: jh.knn_density(x, *knn_args, k=K))
        row["profile"] = {
            name: top_kernels(fn, (x,), profile_dir / f"{nc}_{kind}_{name}")
            for name, fn in (("fof", fof), ("knn", knn))
        }
        jh.clear_caches()
    rows.append(row)
    print(json.dumps(row), flush=True)


# (group_size, batch_size, chunk_size) of KNNConfig tried by --knn-sweep; None = default.
SWEEP = (
    (None, 16, 256),
    (256, 16, 256),
    (4096, 16, 256),
    (1024, 8, 256),
    (1024, 32, 256),
    (1024, 16, 2048),  # merge rows of 2048 values (every chunk_size below 1008: 1024)
)


def knn_sweep(nc, y, rows):
    """kNN density k = 16 on the JaxPM snapshot with other GPU settings (``SWEEP``): warm
    time of each, and whether its densities are bitwise those of the default settings."""
    parts = jh.from_jaxpm(y[0], None, float(nc))
    reference = None
    for group, batch, chunk in SWEEP:
        config = jh.KNNConfig(group_size=group, batch_size=batch, chunk_size=chunk)
        first, warm, rho = timed(lambda: jh.knn_density(parts, k=K, config=config))
        rho = np.asarray(rho)
        reference = rho if reference is None else reference
        rows.append(
            dict(
                size=nc,
                kind="knn sweep",
                group_size=group,
                batch_size=batch,
                chunk_size=chunk,
                knn_first=first,
                knn=warm,
                same_as_default=bool(np.array_equal(rho, reference)),
            )
        )
        print(json.dumps(rows[-1]), flush=True)


def pm_and_insitu(nc, y, rows):
    import jax_cosmo as jc
    from jaxpm.pm import make_diffrax_ode

    ode = make_diffrax_ode((nc,) * 3, paint_absolute_pos=False)
    cosmo = jc.Planck15(Omega_c=0.25, sigma8=0.8)
    step = jax.jit(lambda y: ode(1.0, y, cosmo))
    _, t_pm, _ = timed(lambda: step(y))
    insitu = jh.InSitu(box_size=float(nc), analyses=("fof", "knn_density"), k=K)
    first, warm, out = timed(lambda: insitu(y, 1.0))
    jh.check_insitu(out)
    rows.append(
        dict(size=nc, kind="in situ", n=nc**3, pm_step=t_pm, insitu=warm, insitu_first=first)
    )
    print(json.dumps(rows[-1]), flush=True)


def top_k_lowering(rows, lists=16384):
    """What XLA makes of ``lax.top_k`` on this GPU: for rows of several widths and several
    k, whether the compiled program calls the top-k kernel (``__gpu$TopK``) or sorts, and
    the warm time of selecting from ``lists`` rows."""
    for width, k in ((64, 16), (273, 18), (1024, 2), (1024, 16), (1024, 17), (1024, 18)):
        x = jax.random.uniform(jax.random.key(0), (lists, width))
        fn = jax.jit(lambda x, k=k: jax.lax.top_k(x, k))
        hlo = fn.lower(x).compile().as_text()
        rows.append(
            dict(
                kind="top_k",
                lists=lists,
                width=width,
                k=k,
                kernel="__gpu$TopK" in hlo,
                sorts=len(re.findall(r"\bsort\(", hlo)),
                seconds=min_time(lambda: jax.block_until_ready(fn(x)))[0],
            )
        )
        print(json.dumps(rows[-1]), flush=True)


def top_kernels(fn, args, log_dir, top=6):
    """GPU time of one warm call of the jitted ``fn(*args)`` by kernel, as shares of the
    total, each with the XLA instruction it runs and that instruction's source line."""
    jax.block_until_ready(fn(*args))
    with jax.profiler.trace(str(log_dir)):
        jax.block_until_ready(fn(*args))
    from jax.profiler import ProfileData

    kernels = {}
    for path in Path(log_dir).rglob("*.xplane.pb"):
        for plane in ProfileData.from_file(str(path)).planes:
            if plane.name.startswith("/device:GPU"):
                for line in plane.lines:
                    for event in line.events:
                        kernels[event.name] = kernels.get(event.name, 0.0) + event.duration_ns
    total = sum(kernels.values())
    hlo = fn.lower(*args).compile().as_text()
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1])[:top]
    return dict(
        gpu_ms=total / 1e6,
        kernels=[
            (name[:80], round(ns / max(total, 1), 3), hlo_source(hlo, name)) for name, ns in ranked
        ],
    )


def hlo_source(hlo, kernel):
    """The HLO instruction a kernel is named after (``sort_6_1`` runs ``sort.6``), with the
    JAX operation and source line in its metadata."""
    parts = kernel.split("_")
    for cut in range(len(parts) - 1, 0, -1):
        name = "_".join(parts[:cut]) + "." + ".".join(parts[cut:])
        for candidate in (name, name.rsplit(".", 1)[0]):
            match = re.search(r"\n\s*(?:ROOT )?%?" + re.escape(candidate) + r" = [^\n]*", hlo)
            if match:
                meta = re.search(r'op_name="([^"]*)".*?source_line=(\d+)', match.group(0))
                file = re.search(r'source_file="([^"]*)"', match.group(0))
                where = (
                    f"{meta.group(1)} ({Path(file.group(1)).name}:{meta.group(2)})"
                    if meta and file
                    else ""
                )
                return f"{candidate} {where}".strip()
    return ""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument(
        "--scipy-up-to",
        type=int,
        default=256,
        help="check against scipy up to this size (beyond: jz-tree vs ours)",
    )
    parser.add_argument("--profile", default=None, help="folder for the profile traces")
    parser.add_argument(
        "--fof-only",
        action="store_true",
        help="FoF on the JaxPM snapshots only (for sizes whose kNN check is long)",
    )
    parser.add_argument(
        "--knn-sweep",
        type=int,
        default=None,
        metavar="NC",
        help="also time kNN density with the settings of SWEEP at this size",
    )
    parser.add_argument("--out", default=str(HERE / "gpu_results.json"))
    args = parser.parse_args(argv)
    print(jax.devices(), jax.__version__, flush=True)
    rows = []
    top_k_lowering(rows)
    for nc in args.sizes:
        y = snapshot(nc)
        profile = Path(args.profile) if args.profile and nc == max(args.sizes) else None
        for kind in ("jaxpm",) if args.fof_only else ("jaxpm", "uniform"):
            bench(
                nc,
                kind,
                y,
                rows,
                nc <= args.scipy_up_to,
                profile if kind == "jaxpm" else None,
                with_knn=not args.fof_only,
            )
            Path(args.out).write_text(json.dumps(rows, indent=1))
        if not args.fof_only:
            pm_and_insitu(nc, y, rows)
        if nc == args.knn_sweep:
            knn_sweep(nc, y, rows)
        Path(args.out).write_text(json.dumps(rows, indent=1))
        del y
    print("\n".join(tables.gpu_lines(rows, jax.devices()[0].device_kind)))


if __name__ == "__main__":
    main()
