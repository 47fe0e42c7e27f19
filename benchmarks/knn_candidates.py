"""How many candidate rows a kNN batch scans, and how many a finer node cover would save.

A numpy model of the first search pass of ``jaxpm_halos.knn_density`` on one device of the
(2, 4) mesh (the pencil at the origin, its ghost layer and z images, rows in Morton order):
for random batches of ``batch_size`` consecutive queries it counts the rows in the
batch's search box (bounding box grown by the estimated k-th neighbour distance), in the
cover by at most 64 octree nodes the code scans, and in the covers one and two levels
finer. Batch breaks at gaps are ignored. No timing: it explains the candidate volume
behind kNN's cost (docs/design.md).

    python benchmarks/knn_candidates.py [--nc 64] [--k 16] [--batches 300]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxpm_halos import KNNConfig  # noqa: E402
from jaxpm_halos.core.cells import MORTON_BITS  # noqa: E402
from jaxpm_halos.knn._search import _NODES, uniform_knn_radius  # noqa: E402
from jaxpm_halos.testing.snapshots import jaxpm_snapshot  # noqa: E402

MESH = (2, 4)


def morton(cells):
    key = np.zeros(len(cells), np.int64)
    for bit in range(MORTON_BITS):
        for dim in range(3):
            key |= ((cells[:, dim] >> bit) & 1) << (3 * bit + 2 - dim)
    return key


def device_rows(pos, box, width):
    """Rows of the device at the origin, Morton-sorted in its frame, and its frame."""
    pencil = np.array([box / MESH[0], box / MESH[1], box])
    lo, hi = -width, pencil + width
    shifts = np.stack(np.meshgrid(*[(-box, 0.0, box)] * 3, indexing="ij"), -1).reshape(-1, 3)
    rows = np.concatenate([p[np.all((p >= lo) & (p < hi), 1)] for p in (pos + s for s in shifts)])
    side = (box + 2 * width) * (1 + 1e-5)
    local = rows - lo
    cells = np.clip(np.floor(local / (side / 2**MORTON_BITS)).astype(int), 0, 2**MORTON_BITS - 1)
    local = local[np.argsort(morton(cells), kind="stable")]
    owned = np.all((local >= width) & (local < width + pencil), 1)
    return local, np.flatnonzero(owned), side


def cover_rows(local, lo, hi, side, finer):
    """Rows in the cover of [lo, hi] by the finest level of at most _NODES nodes, made
    ``finer`` levels finer; and its node count."""
    for level in range(MORTON_BITS, -1, -1):
        span = np.floor(hi / (side / 2**level)) - np.floor(lo / (side / 2**level)) + 1
        if np.prod(span) <= _NODES:
            break
    node = side / 2 ** min(level + finer, MORTON_BITS)
    n_lo, n_hi = np.floor(lo / node), np.floor(hi / node) + 1
    inside = np.all((local >= n_lo * node) & (local < n_hi * node), 1)
    return inside.sum(), int(np.prod(n_hi - n_lo))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nc", type=int, default=64)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batches", type=int, default=300)
    args = parser.parse_args(argv)
    nc, k, box = args.nc, args.k, float(args.nc)
    config = KNNConfig()
    snap = jaxpm_snapshot(nc, box, args.steps)
    lattice = np.stack(np.meshgrid(*[np.arange(nc)] * 3, indexing="ij"), -1)
    pos = np.mod((lattice + snap.disp) * (box / nc), box).reshape(-1, 3)
    width = min(config.ghost_factor * uniform_knn_radius(k, nc**3, box), box / MESH[1])
    local, owned, side = device_rows(pos, box, width)
    batch = config.batch_size
    rng = np.random.default_rng(0)
    counts = []
    for b in rng.choice(len(owned) // batch, args.batches, replace=False):
        rows = owned[b * batch : (b + 1) * batch]
        q = local[rows]
        qmin, qmax = q.min(0), q.max(0)
        extent = np.maximum(qmax - qmin, np.max(qmax - qmin) / 4)
        rho = config.radius_factor * (
            3 * k * np.prod(extent) / (4 * np.pi * (rows[-1] - rows[0] + 1))
        ) ** (1 / 3)
        lo, hi = np.clip(qmin - rho, 0, side), np.clip(qmax + rho, 0, side)
        exact = np.all((local >= lo) & (local <= hi), 1).sum()
        counts.append([exact, *(x for f in range(3) for x in cover_rows(local, lo, hi, side, f))])
    mean = np.mean(counts, axis=0)
    print(f"{nc}^3, k = {k}, batches of {batch}, {args.batches} batches of one device:")
    print(f"  search box itself:       {mean[0]:6.0f} rows")
    names = ["cover scanned (level L)", "cover at level L + 1", "cover at level L + 2"]
    for f, name in enumerate(names):
        print(f"  {name + ':':24} {mean[1 + 2 * f]:6.0f} rows, {mean[2 + 2 * f]:5.0f} nodes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
