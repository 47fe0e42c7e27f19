"""A longer exactness campaign than the suite: random adversarial layouts, every test mesh.

    python tests/fuzz_exactness.py --seeds 20          # about 50 min on 2 cores
    python tests/fuzz_exactness.py --seeds 20 --search scan   # the accelerator path
    python tests/fuzz_exactness.py --seeds 20 --search scan --knn-only   # its kNN alone
    python tests/fuzz_exactness.py --seeds 20 --as-gpu --knn-only   # with a GPU's settings

Each seed draws clumps on pencil faces, edges and box corners (widths from 0.01 to 2.5
linking lengths), chains spaced 0.9 l that may cross the whole box, runs of exact
duplicates, and coordinates at 0, L, just below L and just outside the box, over a uniform
background. Positions sit on a grid whose step is a power of two near L / 4096, so squared
distances near the linking length are exact in float32, and the linking length is chosen
so that no pair lies at exactly l: float32 and float64 FoF must then agree.

On meshes (1, 8), (8, 1), (2, 4), (4, 2) and on one device it checks FoF labels against
scipy (``cKDTree.query_pairs`` + ``connected_components``), kNN against ``cKDTree.query``
(and the same distances and ids on every mesh: runs of duplicates tie at the k-th distance),
and the catalogue's density peaks (the member at the smallest k-th neighbour distance) and
SO masses about them (200 and 1000 times the mean density, hard, and smooth with
``smoothing=0.1`` at 200) against a float64 brute force.
The calls run with default configs and grow their buffers themselves (``grow=True``); any
exception, ``CapacityError`` included, counts as a failure, and the growth warnings are
counted. ``--paste`` instead answers each ``CapacityError`` of ``grow=False`` calls by
pasting its suggestion as written, which checks that the suggested value then works. An
``--n`` that is not a multiple of 8 goes in unsharded
with ``mesh=`` (padded inside). Not collected by pytest.
"""

import argparse
import os
import re
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from conftest import MESH_SHAPES, make_mesh  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P
from test_knn import _check_exact  # noqa: E402

import jaxpm_halos as jh  # noqa: E402
from jaxpm_halos.testing import reference as ref  # noqa: E402

CONFIGS = {
    "DomainConfig": jh.DomainConfig,
    "FoFConfig": jh.FoFConfig,
    "KNNConfig": jh.KNNConfig,
    "SOConfig": jh.SOConfig,
}


def layout(seed, n, box, link):
    rng = np.random.default_rng(seed)
    parts = []
    planes = np.arange(9) * box / 8
    for _ in range(rng.integers(1, 25)):
        centre = rng.choice(planes, 3) if rng.random() < 0.7 else rng.uniform(0, box, 3)
        width = rng.choice([0.01, 0.05, 0.2, 0.5]) * link * rng.uniform(1, 5)
        parts.append(centre + rng.normal(0, width, (rng.integers(3, 200), 3)))
    for _ in range(rng.integers(0, 3)):
        start, direction = rng.uniform(0, box, 3), rng.normal(size=3)
        steps = int(rng.uniform(0.2, 1.5) * box / (0.9 * link))
        parts.append(
            start + np.outer(np.arange(steps) * 0.9 * link, direction / np.linalg.norm(direction))
        )
    for _ in range(rng.integers(0, 4)):
        source = np.concatenate(parts)
        parts.append(np.repeat(source[rng.integers(len(source))][None], rng.integers(2, 30), 0))
    below = float(np.nextafter(np.float32(box), np.float32(0)))
    parts.append(
        np.array(
            [
                [0, 0, 0],
                [box, box, box],
                [box, 0, box / 2],
                [0, box / 2, box],
                [-1e-6, box / 3, box + 1e-6],
                [below] * 3,
            ]
        )
    )
    pos = np.concatenate(parts)[: n - 100]
    pos = np.concatenate([pos, rng.uniform(0, box, (n - len(pos), 3))])
    rng.shuffle(pos)
    step = grid_step(box)
    pos = np.round(pos / step) * step
    pos = np.where((pos >= 0) & (pos <= box), pos, np.mod(pos, box))  # keep 0 and L
    return pos.astype(np.float32)


def grid_step(box):
    return 2.0 ** np.floor(np.log2(box / 4096))


def with_suggestions(run, config, tries=6):
    """``run(config, grow=False)``, pasting each CapacityError's suggestion as written."""
    for _ in range(tries):
        try:
            return run(config, grow=False)
        except jh.CapacityError as error:
            setting = re.search(r"Rerun with config=(.*?\))\.(?: |$)", str(error))
            assert setting, f"no pasteable suggestion in: {error}"
            config = eval(setting.group(1), dict(CONFIGS))
    raise AssertionError(f"still overflowing after {tries} suggestions")


def growing(run, config):
    """``run(config)`` with the default automatic growth; returns the result and the
    number of growth warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", jh.GrowthWarning)
        result = run(config)
    return result, sum(issubclass(w.category, jh.GrowthWarning) for w in caught)


def _check_smooth_so(x, pos, box, centres, density, mesh, call):
    """Smooth SO masses (h = 0.1) about the peaks equal the float64 definition."""
    if len(centres) == 0:
        return
    _, got = call(
        lambda c, **kw: jh.spherical_overdensity(
            x, centres, box_size=box, density=density, mesh=mesh, smoothing=0.1, config=c, **kw
        ),
        jh.SOConfig(),
    )
    want = ref.soft_so_reference(pos, centres, box, density, 1.0, 0.1)[0]
    off = np.max(np.abs(np.asarray(got) - want) / np.maximum(want, 1), initial=0)
    assert off <= 1e-4, f"smooth SO m200 is {off:.2g} (relative) from the float64 definition"


def _check_peaks_and_so(pos, box, labels, cat, r_k, thresholds):
    """Each halo's peak is a member at the smallest k-th neighbour distance of its group
    (the highest kNN density; ties may pick any of equal distance), and its SO masses
    about the peak equal a float64 brute force to within one particle."""
    for hid, peak in zip(cat["id"], cat["peak"]):
        members = np.where(labels == hid)[0]
        # Members given at L or just outside the box come back wrapped.
        offset = np.abs(pos[members] - peak)
        offset = np.max(np.minimum(offset, box - offset), axis=1)
        at = members[offset <= 1e-6 * box]
        assert len(at), f"peak of halo {hid} is not one of its members"
        densest = r_k[at].min() <= r_k[members].min() * (1 + 1e-6)
        assert densest, f"peak of halo {hid} is not the densest member"
    densities = np.array(list(thresholds.values()))
    brute = ref.so_reference(pos, cat["peak"], box, densities, 1.0)
    for d, name in enumerate(thresholds):
        off = np.max(np.abs(cat["m" + name] - brute[:, d]), initial=0)
        assert off <= 1, f"SO m{name} is {off} particles from the brute force"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--box", type=float, default=16.0)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument(
        "--search",
        choices=("auto", "tree", "scan"),
        default="auto",
        help="KNNConfig.search of the kNN and peak searches (scan: the accelerator path)",
    )
    parser.add_argument(
        "--knn-only",
        action="store_true",
        help="only the kNN checks (against cKDTree and across meshes): a kNN change's campaign",
    )
    parser.add_argument(
        "--as-gpu",
        action="store_true",
        help="the settings kNN picks on a GPU (merge rows, top_k calls), traced on the CPU, "
        "with 64 batches per step (a GPU's 1024 can exceed XLA:CPU's wait between collectives)",
    )
    parser.add_argument(
        "--paste",
        action="store_true",
        help="grow=False, pasting each suggestion instead of growing",
    )
    args = parser.parse_args(argv)
    box, k = args.box, args.k
    step = grid_step(box)
    link = float(np.sqrt(round((0.2 * box / args.n ** (1 / 3) / step) ** 2) + 0.5) * step)
    meshes = [make_mesh(shape) for shape in MESH_SHAPES] + [None]
    mean = args.n / box**3
    thresholds = {"200": 200 * mean, "1000": 1000 * mean}
    failures = grown = 0
    knn_config = jh.KNNConfig(search=args.search)
    if args.as_gpu:
        from jaxpm_halos.knn import _search

        _search._backend = lambda: "gpu"
        knn_config = jh.KNNConfig(search="scan", group_size=64)

    def call(run, config):
        nonlocal grown
        if args.paste:
            return with_suggestions(run, config)
        result, warned = growing(run, config)
        grown += warned
        return result

    def check_knn(x, mesh):
        """kNN against cKDTree, and the same distances and ids as the first mesh's (runs of
        duplicates tie at the k-th distance); returns the distances."""
        nonlocal first
        dist, idx = call(lambda c, **kw: jh.knn(x, box, k, mesh=mesh, config=c, **kw), knn_config)
        _check_exact(pos, box, k, dist, idx)
        dist, idx = np.asarray(dist), np.asarray(idx)
        first = (dist, idx) if first is None else first
        differ = int(np.sum(idx != first[1]) + np.sum(dist != first[0]))
        assert differ == 0, f"kNN: {differ} distances or ids differ between meshes"
        return dist

    for seed in range(args.first_seed, args.first_seed + args.seeds):
        start = time.time()
        pos = layout(seed, args.n, box, link)
        want = ref.fof_labels(pos, box, link)
        first = None  # the first mesh's neighbours: every other mesh lists the same ids
        for mesh in meshes:
            # An N the devices cannot split evenly goes in unsharded (padded inside).
            x = (
                pos
                if mesh is None or args.n % mesh.size
                else jax.device_put(pos, NamedSharding(mesh, P(tuple(mesh.axis_names))))
            )
            where = "one device" if mesh is None else f"mesh {tuple(mesh.shape.values())}"
            try:
                if args.knn_only:
                    check_knn(x, mesh)
                    continue
                labels, cat = call(
                    lambda c, **kw: jh.fof(
                        x,
                        box,
                        link,
                        min_members=5,
                        mesh=mesh,
                        so=thresholds,
                        centre="peak",
                        k=k,
                        config=c,
                        **kw,
                    ),
                    jh.FoFConfig(knn=knn_config),
                )
                wrong = int(np.sum(np.asarray(labels) != want))
                assert wrong == 0, f"FoF: {wrong} labels differ from scipy's"
                dist = check_knn(x, mesh)
                halos = cat.to_numpy()
                _check_peaks_and_so(
                    pos, box, np.asarray(labels), halos, np.asarray(dist)[:, k - 1], thresholds
                )
                _check_smooth_so(x, pos, box, halos["peak"], thresholds["200"], mesh, call)
            except Exception as error:  # noqa: BLE001 - every exception is a failure here
                failures += 1
                print(f"seed {seed}, {where}: {type(error).__name__}: {error}", flush=True)
        if seed % 4 == 3:
            jh.clear_caches()  # compiled programs hold memory maps (docs/capacities.md)
        print(
            f"seed {seed}: {len(np.unique(want))} groups, {time.time() - start:.0f} s", flush=True
        )
    print(f"{failures} failures" + ("" if args.paste else f", {grown} calls grew buffers"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
