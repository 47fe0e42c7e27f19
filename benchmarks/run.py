"""Benchmark suite: jaxpm_halos against the serial references, in one process.

    python benchmarks/run.py                 # 32^3, 64^3, 128^3 (writes benchmarks/RESULTS.md)
    python benchmarks/run.py --sizes 32 64   # a subset

For each size (JaxPM z=0 snapshots with a box of 1 Mpc/h per particle spacing, made by the
benchmark itself and cached in benchmarks/cache, and uniform random points of the same
size) it times, after a warm-up, the minimum of several runs of:

* FoF with its catalogue (b = 0.2, 20 members) through jaxpm_halos on 8 CPU devices with
  mesh (2, 4) and on one device, against scipy (cKDTree.query_pairs + connected_components)
  and kdcount's fof;
* kNN density (k = 8, 16 and 32) through jaxpm_halos against cKDTree.query(workers=-1);
  at 64^3 and 128^3 also k = 16 through the accelerator path (``KNNConfig(search="scan")``,
  the program a GPU runs), with the sorts and TopKs over candidate lists in its compiled
  program;
* the first call (compile) of each jaxpm_halos program;
* one JaxPM PM step (a force evaluation) at the same size, and the in-situ cost of FoF plus
  kNN density (k = 16) in one shared decomposition, as a ratio to it;
* spherical-overdensity masses (200 times the mean density, about every FoF halo's
  centre of mass) against cKDTree.query_ball_point plus a sort per centre, at 64^3 and
  128^3, and the in-situ cost of adding SO (200c, 200m, vir about the density peak);
* what a run directory adds per snapshot at 64^3 (merger links, member ids, light cone),
  against one PM step;
* the in-situ recipe of docs/insitu.md (64^3, 128 Mpc/h, 10 LeapfrogMidpoint steps, mesh (2, 4))
  with 1, 2 and 5 save times through ``InSitu.saveat``: the extra time per snapshot in PM
  steps of that solve, its compile with and without the analyses, and the XLA temporaries
  of its solve compiled in a plain ``jax.jit`` without analyses, with FoF and kNN density,
  and with M200m and peak centres too, on one device and on (2, 4);
* the peak memory of each jaxpm_halos function, in a child process (max RSS above the
  process's RSS before the call), per particle, and XLA's temporaries.

Every jaxpm_halos result is checked against the reference it is timed against; a wrong
answer stops the benchmark. Figures compared are ratios measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # tables.py, when this file is loaded by path

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import tables  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from scipy.spatial import cKDTree  # noqa: E402
from tables import KEEP_BELOW, KNN_KS, KNN_SIZES, RECIPE, RECIPE_SAVES, SCAN  # noqa: E402

import jaxpm_halos as jh  # noqa: E402
from jaxpm_halos.testing.reference import fof_components as scipy_fof  # noqa: E402
from jaxpm_halos.testing.reference import smallest_member_labels as canonical  # noqa: E402

B = 0.2
MIN_MEMBERS = 20
REPEATS = 3


def mesh_of(shape):
    return jax.make_mesh(shape, ("x", "y"), axis_types=(AxisType.Auto,) * 2)


def timed(fn, repeats=REPEATS):
    """(first call seconds, min warm seconds, result).

    The compiled programs are dropped afterwards: every one keeps its JIT code mapped, and a
    full run would otherwise pass the kernel's ``vm.max_map_count`` (docs/capacities.md)."""
    from insitu_save_times import min_time

    result, first, best = min_time(fn, repeats)
    jh.clear_caches()
    return first, best, result


def data(nc, kind, mesh):
    """Positions as jaxpm_halos input (sharded over ``mesh`` or not) and as numpy."""
    box = float(nc)
    if kind == "jaxpm":
        from jaxpm_halos.testing.snapshots import jaxpm_snapshot

        snap = jaxpm_snapshot(nc, box, 20)
        disp = (
            snap.disp
            if mesh is None
            else jax.device_put(snap.disp, NamedSharding(mesh, P("x", "y")))
        )
        parts = jh.from_jaxpm(disp, None, box)
        return parts, np.asarray(parts.pos).reshape(-1, 3), box
    pos = uniform_points(nc)
    x = pos if mesh is None else jax.device_put(pos, NamedSharding(mesh, P(("x", "y"))))
    return x, pos, box


def uniform_points(nc):
    """nc^3 uniform float32 points in a box of side nc, the same for a given nc."""
    box = float(nc)
    pos = np.random.default_rng(nc).uniform(0, box, (nc**3, 3)).astype(np.float32)
    # float32 rounding can give exactly L, which cKDTree(boxsize=L) rejects.
    return np.where(pos >= box, np.float32(0), pos)


def min_time(fn, repeats=REPEATS):
    best, out = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def bench_size(nc, kind, rows):
    mesh = mesh_of((2, 4))
    x8, pos, box = data(nc, kind, mesh)
    x1, _, _ = data(nc, kind, None)
    n = len(pos)
    l = B * box / nc
    t_scipy, ref = min_time(lambda: canonical(scipy_fof(pos, box, l)))
    import kdcount.cluster as kc

    t_kd, kd = min_time(
        lambda: kc.fof(kc.dataset(pos.astype(np.float64), boxsize=box), l, np=0).labels
    )
    if not np.array_equal(canonical(kd), ref):
        raise AssertionError("kdcount and scipy disagree")
    for label, x in (("8 dev (2,4)", x8), ("1 dev", x1)):
        first, warm, (labels, cat) = timed(
            lambda: (
                jh.fof(x, b=B, min_members=MIN_MEMBERS)
                if kind == "jaxpm"
                else jh.fof(x, box, b=B, min_members=MIN_MEMBERS)
            )
        )
        if not np.array_equal(np.asarray(labels).reshape(-1), ref):
            raise AssertionError(f"FoF labels differ from scipy at {nc}^3 {kind} {label}")
        rows.append(
            dict(
                size=nc,
                kind=kind,
                what="fof",
                where=label,
                n=n,
                first=first,
                warm=warm,
                ref="scipy",
                ref_time=t_scipy,
                kdcount=t_kd,
                halos=int(np.sum(np.asarray(cat.num))),
            )
        )
        print(rows[-1], flush=True)
    references = {}  # k: (cKDTree seconds, its kNN density)
    for k in KNN_KS:
        t_ref, (d, _) = min_time(lambda: cKDTree(pos, boxsize=box).query(pos, k=k + 1, workers=-1))
        r_ref = d[:, k]
        rho_ref = (k - 1) / (4 / 3 * np.pi * r_ref**3)
        references[k] = t_ref, rho_ref
        first, warm, rho = timed(
            lambda: jh.knn_density(x8, box, k) if kind != "jaxpm" else jh.knn_density(x8, k=k)
        )
        rho = np.asarray(rho).reshape(-1)
        if not np.allclose(rho, rho_ref, rtol=2e-5):
            raise AssertionError(f"kNN density differs from cKDTree at {nc}^3 {kind} k={k}")
        rows.append(
            dict(
                size=nc,
                kind=kind,
                what=f"knn_density k={k}",
                where="8 dev (2,4)",
                n=n,
                first=first,
                warm=warm,
                ref="cKDTree",
                ref_time=t_ref,
            )
        )
        print(rows[-1], flush=True)
    if kind == "jaxpm" and nc in KNN_SIZES:
        bench_scan(nc, x8, n, *references[16], rows)


def selection_ops(compiled_text):
    """Sorts and TopKs over lists of neighbours in a compiled CPU program: ``sort`` of
    rank-2 operands (lists x entries) and the ``TopK`` custom calls. The rows' Morton key
    sorts (rank 1) are not counted."""
    shapes = re.findall(r"= \(?(\w+\[[\d,]*\])[^\n]*? sort\(", compiled_text)
    return {
        "sort": sum(shape.count(",") == 1 for shape in shapes),
        "topk": compiled_text.count('custom_call_target="TopK"'),
    }


def bench_scan(nc, x8, n, t_ref, rho_ref, rows):
    """kNN density k = 16 through the accelerator path (``KNNConfig(search="scan")``, the
    program a GPU runs) on (2, 4), against cKDTree(k = 17) as timed for the default path
    (``t_ref`` seconds, density ``rho_ref``), and the sorts and TopKs over candidate lists
    its compiled program holds."""
    k, config = 16, jh.KNNConfig(search="scan")
    fn = jax.jit(lambda x: jh.knn_density(x, k=k, config=config))
    first, warm, rho = timed(lambda: fn(x8))
    ops = selection_ops(fn.lower(x8).compile().as_text())  # after: the first call compiles
    if not np.allclose(np.asarray(rho).reshape(-1), rho_ref, rtol=2e-5):
        raise AssertionError(f"the scan path's kNN density differs from cKDTree at {nc}^3")
    rows.append(
        dict(
            size=nc,
            kind="jaxpm",
            what=SCAN,
            where="8 dev (2,4)",
            n=n,
            first=first,
            warm=warm,
            ref="cKDTree",
            ref_time=t_ref,
            selection_ops=ops,
        )
    )
    print(rows[-1], flush=True)


def pm_step_seconds(nc, mesh, y):
    """Warm time of one JaxPM force evaluation (JaxPM's displacement mode) on the stacked
    state ``y`` of nc^3 particles sharded over ``mesh``."""
    import jax_cosmo as jc
    from jaxpm.pm import make_diffrax_ode

    sharding = NamedSharding(mesh, P("x", "y"))
    ode = make_diffrax_ode(
        (nc,) * 3, paint_absolute_pos=False, halo_size=min(nc // 4, 24), sharding=sharding
    )
    cosmo = jc.Planck15(Omega_c=0.25, sigma8=0.8)
    step = jax.jit(lambda y: ode(1.0, y, cosmo))
    return timed(lambda: step(y))[1]


def pm_and_insitu(nc, rows):
    """One PM force evaluation vs in-situ FoF + kNN density (k=16), at nc^3 on (2, 4)."""

    from jaxpm_halos.testing.snapshots import jaxpm_snapshot

    mesh = mesh_of((2, 4))
    snap = jaxpm_snapshot(nc, float(nc), 20)
    sharding = NamedSharding(mesh, P("x", "y"))
    y = jnp.stack([jax.device_put(snap.disp, sharding), jax.device_put(snap.mom, sharding)])
    t_pm = pm_step_seconds(nc, mesh, y)
    insitu = jh.InSitu(box_size=float(nc), analyses=("fof", "knn_density"), k=16)
    first, warm, _ = timed(lambda: insitu(y, 1.0))
    rows.append(
        dict(
            size=nc,
            kind="jaxpm",
            what="in-situ fof+knn_density k=16",
            where="8 dev (2,4)",
            n=nc**3,
            first=first,
            warm=warm,
            ref="PM step",
            ref_time=t_pm,
        )
    )
    print(rows[-1], flush=True)
    so = jh.InSitu(
        box_size=float(nc),
        analyses=("fof", "knn_density"),
        k=16,
        omega_m=0.3,
        so=("200c", "200m", "vir"),
        centre="peak",
    )
    first, warm, _ = timed(lambda: so(y, 1.0))
    rows.append(
        dict(
            size=nc,
            kind="jaxpm",
            what="in-situ fof+knn_density+so (peak)",
            where="8 dev (2,4)",
            n=nc**3,
            first=first,
            warm=warm,
            ref="PM step",
            ref_time=t_pm,
        )
    )
    print(rows[-1], flush=True)


def run_products(nc, rows):
    """What a run directory adds per snapshot at nc^3 on (2, 4): the merger links between
    consecutive snapshots (jitted, on the devices), the member ids (host) and the light cone
    to z = 0.1 (host), against one PM step. Three snapshots of one JaxPM run (a = 0.5,
    0.75, 1), their catalogues from InSitu; links and members checked against the serial
    reference and the catalogue counts."""

    from jaxpm_halos.testing.reference import merger_links_reference
    from jaxpm_halos.testing.snapshots import jaxpm_history

    mesh, times = mesh_of((2, 4)), (0.5, 0.75, 1.0)
    history = jaxpm_history(nc, float(nc), 20, times)
    sharding = NamedSharding(mesh, P(None, "x", "y"))
    states = [
        jax.device_put(np.stack([d, m]), sharding) for d, m in zip(history["disp"], history["mom"])
    ]
    insitu = jh.InSitu(box_size=float(nc), analyses=("fof",), omega_m=history["omega_m"])
    outs = [insitu(y, a)["fof"] for y, a in zip(states, times)]
    catalogues = [out["catalogue"].to_numpy() for out in outs]
    pair = (outs[1]["labels"], outs[1]["catalogue"], outs[2]["labels"], outs[2]["catalogue"])
    link = jax.jit(jh.merger_links)
    first, t_links, links = timed(lambda: link(*pair))
    expected = merger_links_reference(
        np.asarray(pair[0]), catalogues[1]["id"], np.asarray(pair[2]), catalogues[2]["id"]
    )
    for got, want in zip(links.to_numpy(), expected):
        if any(not np.array_equal(got[k], want[k]) for k in want):
            raise AssertionError("merger_links differs from the serial reference")
    labels = outs[2]["labels"]
    t_members, members = min_time(lambda: jh.halo_members(labels, catalogues[2]["id"]))
    if not np.array_equal(members["count"], catalogues[2]["count"]):
        raise AssertionError("halo_members disagrees with the catalogue's counts")
    cosmology = {"Omega_m": history["omega_m"]}
    cone = lambda: jh.lightcone(
        catalogues, times, observer=(nc / 2,) * 3, z_max=0.1, cosmology=cosmology, box_size=nc
    )
    t_cone = min_time(cone)[0] / len(times)
    t_pm = pm_step_seconds(nc, mesh, states[-1])
    rows.append(
        dict(
            size=nc,
            kind="jaxpm",
            what=tables.PRODUCTS,
            where="8 dev (2,4)",
            n=nc**3,
            first=first + t_members + t_cone,
            warm=t_links + t_members + t_cone,
            ref="PM step",
            ref_time=t_pm,
            parts={"links": t_links, "members": t_members, "light cone": t_cone},
            halos=len(catalogues[2]["id"]),
        )
    )
    print(rows[-1], flush=True)


def run_statistics(nc, rows):
    """What each differentiable summary adds in situ at nc^3 on (2, 4), against one PM step,
    forward and its reverse-mode gradient with respect to the state: smooth SO m200m
    (h = 0.1) beyond the hard one in the FoF catalogue, the smoothed kNN-CDF (1,000 queries,
    k = 1, 2, 4, 8, 8 radii) and the soft counts of the smooth masses (10 bins). One a = 1
    state of a JaxPM run; each in-situ call jitted as a user writes it."""
    from jaxpm_halos.insitu.registry import REGISTRY
    from jaxpm_halos.stats import random_queries, register_knn_cdf, soft_counts
    from jaxpm_halos.testing.snapshots import jaxpm_history

    mesh, box = mesh_of((2, 4)), float(nc)
    history = jaxpm_history(nc, box, 20, (0.5, 0.75, 1.0))
    y = jax.device_put(
        np.stack([history["disp"][-1], history["mom"][-1]]), NamedSharding(mesh, P(None, "x", "y"))
    )
    query, radii = random_queries(1000, box, seed=0), np.linspace(0.5, 4.0, 8)
    register_knn_cdf("bench_knn_cdf", query=query, radii=radii, smoothing=0.1)
    fof = dict(analyses=("fof",), so=("200m",), omega_m=history["omega_m"])
    runs = {
        "hard SO": (jh.InSitu(box_size=box, **fof), lambda out: _so_sum(out)),
        "smooth SO": (jh.InSitu(box_size=box, so_smoothing=0.1, **fof), lambda out: _so_sum(out)),
        "kNN-CDF": (
            jh.InSitu(box_size=box, analyses=("bench_knn_cdf",)),
            lambda out: jnp.sum(out["bench_knn_cdf"]["cdf"]),
        ),
    }
    seconds = {}
    for name, (insitu, summary) in runs.items():
        forward = jax.jit(lambda y, insitu=insitu, summary=summary: summary(insitu(y, a=1.0)))
        gradient = jax.jit(
            jax.grad(lambda y, insitu=insitu, summary=summary: summary(insitu(y, a=1.0)))
        )
        seconds[name] = (timed(lambda: forward(y))[1], timed(lambda: gradient(y))[1])
    counts = jax.jit(lambda m, v: soft_counts(m, np.linspace(11.5, 14.0, 11), width=0.1, valid=v))
    cat = runs["smooth SO"][0](y, a=1.0)["fof"]["catalogue"]
    mass, valid = cat.so["m200m"], cat.id >= 0
    counts_gradient = jax.jit(jax.grad(lambda m, v: jnp.sum(counts(m, v) ** 2)))
    seconds["soft counts"] = (
        timed(lambda: counts(mass, valid))[1],
        timed(lambda: counts_gradient(mass, valid))[1],
    )
    REGISTRY.pop("bench_knn_cdf")
    t_pm = pm_step_seconds(nc, mesh, y)
    hard = seconds.pop("hard SO")
    seconds["smooth SO"] = tuple(s - h for s, h in zip(seconds["smooth SO"], hard))
    for name, (forward, gradient) in seconds.items():
        rows.append(
            dict(
                size=nc, kind="jaxpm", what=f"{tables.STATISTICS}: {name}", where="8 dev (2,4)",
                n=nc**3, first=float("nan"), warm=forward, ref="PM step", ref_time=t_pm,
                parts={"forward": forward, "gradient": gradient},
            )
        )  # fmt: skip
        print(rows[-1], flush=True)


def _so_sum(out):
    cat = out["fof"]["catalogue"]
    return jnp.sum(jnp.where(cat.id >= 0, cat.so["m200m"], 0)) / 1e12


def insitu_in_solve(rows):
    """The in-situ recipe through ``InSitu.saveat`` with 1, 2 and 5 save times on (2, 4):
    its diffeqsolve from the 2LPT state, with the analyses against the same solve saving
    only the states. The extra time per snapshot is compared with one PM step of that
    solve (its time without the analyses over its steps; LeapfrogMidpoint takes one force
    per step)."""
    import diffrax
    from insitu_save_times import analyses, initial_state, recipe

    nc, box, steps = RECIPE["nc"], RECIPE["box"], RECIPE["steps"]
    mesh = mesh_of((2, 4))
    sharding = NamedSharding(mesh, P("x", "y"))
    y0 = jax.jit(lambda: initial_state(nc, box, sharding, 0))()
    insitu = analyses(RECIPE["box"])
    for ts in RECIPE_SAVES:
        off = recipe(nc, steps, mesh, diffrax.SaveAt(ts=jnp.asarray(ts)))
        on = recipe(nc, steps, mesh, insitu.saveat(ts, t0=0.1, t1=1.0))
        first_off, t_off, _ = timed(lambda: off(y0))
        first, t_on, (out, ok) = timed(lambda: on(y0))
        if not bool(ok):
            raise AssertionError(f"the recipe's solve failed with ts={ts}")
        jh.check_insitu(out, insitu)
        extra = (t_on - t_off) / len(ts)
        rows.append(
            dict(
                size=nc,
                kind="jaxpm",
                where="8 dev (2,4)",
                n=nc**3,
                what=f"in-situ saveat fof+knn_density k=16, per snapshot of {len(ts)}",
                first=first - t_on + extra,
                warm=extra,
                ref=f"PM step (solve / {steps})",
                ref_time=t_off / steps,
                solve_first=(first_off, first),
                solve_compile=(first_off - t_off, first - t_on),
            )
        )  # without, with the analyses
        print(rows[-1], flush=True)


def solve_memory():
    """XLA temporaries (bytes) of the recipe's compiled solve with one save time in a user's
    plain ``jax.jit``, on one device and on (2, 4): ``{where: (without, with, with_all)}``,
    without analyses, with FoF and kNN density, and with FoF, kNN density, M200m and peak
    centres."""
    import diffrax
    from insitu_save_times import analyses, solve_temporaries

    nc, steps = RECIPE["nc"], RECIPE["steps"]
    insitu = analyses(RECIPE["box"])
    every = dataclasses.replace(insitu, so=("200m",), centre="peak")
    out = {}
    for where, mesh in (("1 dev", None), ("8 dev (2,4)", mesh_of((2, 4)))):
        out[where] = tuple(
            solve_temporaries(nc, steps, mesh, saveat)
            for saveat in (
                diffrax.SaveAt(ts=jnp.asarray([1.0])),
                insitu.saveat([1.0], t0=0.1, t1=1.0),
                every.saveat([1.0], t0=0.1, t1=1.0),
            )
        )
        jh.clear_caches()
        print("solve temporaries", where, out[where], flush=True)
    return out


def scipy_so(pos, box, centres, density, radius):
    """First-downcrossing SO masses (unit particle masses) with cKDTree.query_ball_point
    and a sort per centre: the serial reference."""
    tree = cKDTree(pos, boxsize=box)
    masses = np.zeros(len(centres))
    for h, (centre, near) in enumerate(
        zip(centres, tree.query_ball_point(centres, radius, workers=-1))
    ):
        d = pos[near] - centre
        d -= box * np.round(d / box)
        r = np.sort(np.sqrt(np.sum(d * d, 1)))
        below = np.arange(1, len(r) + 1) < density * 4 / 3 * np.pi * r**3
        first = int(np.argmax(below)) if below.any() else len(r)
        masses[h] = first
    return masses


def bench_so(nc, rows):
    """SO masses (200 times the mean density) about every FoF halo's centre of mass, on
    (2, 4), against :func:`scipy_so` with the same search radius; and the in-situ cost of
    adding SO (200c, 200m, vir about the density peak) to FoF + kNN density."""
    mesh = mesh_of((2, 4))
    x8, pos, box = data(nc, "jaxpm", mesh)
    _, cat = jh.fof(x8, b=B, min_members=MIN_MEMBERS)
    centres = cat.to_numpy()["pos"]
    radius = 4.0  # the default search radius: 4 mean separations
    t_ref, ref = min_time(lambda: scipy_so(pos.astype(np.float64), box, centres, 200.0, radius))
    first, warm, (_, mass) = timed(
        lambda: jh.spherical_overdensity(
            x8, centres, density=200.0, config=jh.SOConfig(radius=radius)
        )
    )
    if np.max(np.abs(np.asarray(mass) - ref)) > 1:
        raise AssertionError(f"SO masses differ from the scipy reference at {nc}^3")
    rows.append(
        dict(
            size=nc,
            kind="jaxpm",
            what=f"so 200m ({len(centres)} centres)",
            where="8 dev (2,4)",
            n=nc**3,
            first=first,
            warm=warm,
            ref="cKDTree+sort",
            ref_time=t_ref,
        )
    )
    print(rows[-1], flush=True)


# The functions whose memory is read in a child process, by name.
MEMORY_CHILDREN = {
    "fof": lambda p: jh.fof(p, b=B, min_members=MIN_MEMBERS)[0],
    "knn_density k=16": lambda p: jh.knn_density(p, k=16),
    "knn k=16 (lists)": lambda p: jh.knn(p, k=16),
}


def child_memory(nc, what):
    """Peak memory of one function in a fresh process, in bytes.

    Returns ``(first, warm, temp, own)``: the peak RSS growth of the first call
    (compilation included) and of a warm call (the peak reset between them through
    ``/proc/self/clear_refs``; glibc is told to return every large block, so freed buffers
    do not hide a new peak), and XLA's own count of the compiled program's temporary
    buffers (per device, times the number of devices): ``temp`` inside a user's plain
    ``jax.jit``, ``own`` as the call compiles it outside ``jit`` (with the library's
    compiler options).
    """
    code = f"""
import gc, os, sys
sys.argv = ['x']
sys.path.insert(0, {str(HERE)!r})
import run as b
import jax, numpy as np

def rss(field):
    for line in open('/proc/self/status'):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

mesh = b.mesh_of((2, 4))
x, pos, box = b.data({nc}, 'jaxpm', mesh)
del pos
jax.block_until_ready(x.pos)
fn_of = b.MEMORY_CHILDREN[{what!r}]
fn = lambda: fn_of(x)
gc.collect()
base = rss('VmRSS')
jax.block_until_ready(fn())
first = rss('VmHWM') - base
gc.collect()
with open('/proc/self/clear_refs', 'w') as f:
    f.write('5')
base = rss('VmRSS')
jax.block_until_ready(fn())
warm = rss('VmHWM') - base
from jaxpm_halos.core.pipeline import JitProgram

def temporaries(jitted):
    stats = jitted.lower(x).compile().memory_analysis()
    return stats.temp_size_in_bytes * len(jax.devices()) if stats is not None else -1

print('RSS', first, warm, temporaries(jax.jit(fn_of)), temporaries(JitProgram(fn_of)))
"""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=1800, env=env
    )
    line = [l for l in out.stdout.splitlines() if l.startswith("RSS")]
    if not line:
        raise RuntimeError(f"memory child failed:\n{out.stderr[-3000:]}")
    return tuple(map(int, line[0].split()[1:]))


def commit():
    """The commit measured, ``-dirty`` when files other than this run's outputs differ."""

    def git(*args):
        return subprocess.run(
            ["git", *args], cwd=HERE, capture_output=True, text=True, timeout=10
        ).stdout.strip()

    try:
        # Pathspecs are relative to HERE, the folder of the outputs.
        outputs = [f":(exclude){name}" for name in ("RESULTS.md", "results.json", "scaling.png")]
        dirty = git("status", "--porcelain", "--", "..", *outputs)
        return git("rev-parse", "--short", "HEAD") + ("-dirty" if dirty else "")
    except OSError:
        return ""


def machine():
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores, jax {jax.__version__}, "
        f"{len(jax.devices())} {jax.devices()[0].platform} devices"
    )


def report(results, path, figures: bool = True):
    """Write the run's tables to the top of ``path`` (RESULTS.md), keeping what is written
    below :data:`tables.KEEP_BELOW`, and (``figures``) its figures to ``results.json``
    beside it."""
    path = Path(path)
    lines = ["# jaxpm_halos benchmark results", "", *tables.report_lines(results)]
    kept = path.read_text().partition(KEEP_BELOW)[2] if path.is_file() else ""
    path.write_text("\n".join(lines) + ("\n\n" + KEEP_BELOW + kept if kept else "\n"))
    if figures:
        path.with_name("results.json").write_text(json.dumps(results, indent=1) + "\n")


def results_of(rows, memory, solve_mem):
    """The run's figures as ``results.json`` holds them (:mod:`tables`): memory per
    particle, in the order of the sizes."""
    return {
        "measured": str(datetime.date.today()),
        "machine": machine(),
        "commit": commit(),
        "rows": rows,
        "memory": [
            dict(
                nc=nc,
                what=what,
                first=first / nc**3,
                warm=warm / nc**3,
                own=own / nc**3,
                plain_jit=temp / nc**3,
            )
            for (nc, what), (first, warm, temp, own) in sorted(memory.items())
        ],
        "solve_memory": [
            dict(zip(("without", "with", "with_all"), (b / RECIPE["nc"] ** 3 for b in bytes_)))
            | {"where": where}
            for where, bytes_ in solve_mem.items()
        ],
    }


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    series = {}
    for r in rows:
        if r["kind"] != "jaxpm" or "in-situ" in r["what"]:
            continue
        series.setdefault(f"jaxpm_halos {r['what']} [{r['where']}]", []).append((r["n"], r["warm"]))
        if r["what"] == "fof" and r["where"].startswith("8"):
            series.setdefault("scipy fof", []).append((r["n"], r["ref_time"]))
        if r["what"].startswith("knn_density k=8"):
            series.setdefault("cKDTree k=8", []).append((r["n"], r["ref_time"]))
    for name, points in series.items():
        n, t = np.array(sorted(points)).T
        ax.loglog(n, t, "o-" if "jaxpm_halos" in name else "s--", label=name)
    if series:
        n = np.array(sorted({p[0] for pts in series.values() for p in pts}), float)
        ref = [pts for name, pts in series.items() if name.startswith("jaxpm_halos fof")]
        t0 = sorted(ref[0])[0][1] if ref else 1.0
        ax.loglog(n, t0 * n * np.log(n) / (n[0] * np.log(n[0])), "k:", label="N log N")
    ax.set_xlabel("particles N")
    ax.set_ylabel("warm time (s)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument(
        "--memory-only",
        action="store_true",
        help="only the child-process memory runs (printed, not written)",
    )
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    args = parser.parse_args(argv)
    if args.memory_only:
        args.out = "/dev/stdout"
    rows, memory, solve_mem = [], {}, {}
    # The report is rewritten after every size, so a stopped run keeps what it measured.
    for nc in [] if args.memory_only else args.sizes:
        for kind in ("jaxpm", "uniform"):
            bench_size(nc, kind, rows)
        if nc == 64 or nc == max(args.sizes):
            pm_and_insitu(nc, rows)
        if nc == 64:
            run_products(nc, rows)
            run_statistics(nc, rows)
        if nc >= 64:
            bench_so(nc, rows)
        if nc == RECIPE["nc"]:
            insitu_in_solve(rows)
        report(results_of(rows, memory, solve_mem), args.out, figures=not args.memory_only)
    if not args.no_memory:
        if RECIPE["nc"] in args.sizes:
            solve_mem = solve_memory()
        for nc in args.sizes:
            for what in MEMORY_CHILDREN:
                memory[(nc, what)] = child_memory(nc, what)
                print(nc, what, memory[(nc, what)], flush=True)
    report(results_of(rows, memory, solve_mem), args.out, figures=not args.memory_only)
    if args.memory_only:
        return
    plot(rows, Path(args.out).with_name("scaling.png"))
    print(Path(args.out).read_text())


if __name__ == "__main__":
    main()
