"""What an exact kNN certificate over aligned Morton cells must scan per query.

A numpy model (no timing) of two of issue #19's directions, on a JaxPM z = 0 snapshot with
cKDTree's true k-th neighbour distances ``r_k``, over the whole periodic box (a device
only adds ghosts to this). A query whose box ``[q - r_k, q + r_k]`` crosses the boundary of
a grid's frame is uncertified in that grid (it would need the periodic images).

1. **Windows of consecutive rows in Morton order.** A query's window is the rows within
   ``W`` places of its own in key order. It is exact when it holds every row of the cells
   covering the query's box (cells of the finest level whose side is at least ``2 r_k``, so
   at most 2 per axis): the k-ball is then inside the window. With shifted copies of the
   grid (shifts 0, L/3, 2L/3 and a random one) a query needs only one copy to certify it.
   This prints the fraction certified for half-windows of 32 to 256 rows.
2. **Per-query covers.** The rows in the cells of side at least ``f r_k`` covering the
   query's box, and how many cells that takes, for a sample of queries.

Compare with the first pass of ``knn_density`` (``knn_candidates.py``):
about 920 candidate slots per query, shared by a batch of 16.

    python benchmarks/knn_covers.py [--nc 64] [--k 16] [--sample 3000]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
from scipy.spatial import cKDTree

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxpm_halos.testing.snapshots import jaxpm_snapshot  # noqa: E402

BITS = 10  # Morton bits per axis of the model's key (the cells of the finest level)
SHIFT_FRACTIONS = (0.0, 1 / 3, 2 / 3)


def morton(cells):
    """Morton keys (...,) of integer cells (..., 3), BITS bits per axis."""
    key = np.zeros(cells.shape[:-1], np.int64)
    for bit in range(BITS):
        for dim in range(3):
            key |= ((cells[..., dim] >> bit) & 1) << (3 * bit + 2 - dim)
    return key


def sorted_keys(pos, box):
    cells = np.clip(np.floor(pos / box * 2**BITS).astype(np.int64), 0, 2**BITS - 1)
    key = morton(cells)
    order = np.argsort(key, kind="stable")
    rank = np.empty(len(pos), np.int64)
    rank[order] = np.arange(len(pos))
    return key[order], rank


def inside_box(pos, r_k, box):
    return np.all((pos - r_k[:, None] >= 0) & (pos + r_k[:, None] < box), axis=1)


def window_needed(pos, r_k, box):
    """Half-window (rows) each query needs so that its window holds the cells of side >=
    2 r_k covering its box; a huge number where the box crosses the boundary."""
    keys, rank = sorted_keys(pos, box)
    level = np.clip(np.floor(np.log2(box / (2 * r_k))).astype(np.int64), 0, BITS)
    side = box / 2.0**level
    shift = 3 * (BITS - level)
    first = np.full(len(pos), np.iinfo(np.int64).max)
    last = np.zeros(len(pos), np.int64)
    for corner in range(8):
        sign = np.array([(corner >> d) & 1 for d in range(3)], bool)
        point = np.clip(np.where(sign, pos + r_k[:, None], pos - r_k[:, None]), 0, box * (1 - 1e-7))
        prefix = morton(np.floor(point / side[:, None]).astype(np.int64))
        first = np.minimum(first, np.searchsorted(keys, prefix << shift))
        last = np.maximum(last, np.searchsorted(keys, (prefix + 1) << shift))
    need = np.maximum(rank - first, last - 1 - rank)
    return np.where(inside_box(pos, r_k, box), need, np.iinfo(np.int64).max)


def cover(keys, q, r, box, factor):
    """Rows and cells of the cover of ``[q - r, q + r]`` by cells of side >= factor r."""
    level = int(np.clip(np.floor(np.log2(box / (factor * r))), 0, BITS))
    side = box / 2**level
    lo, hi = np.floor((q - r) / side).astype(int), np.floor((q + r) / side).astype(int)
    cells = np.stack(
        np.meshgrid(*[np.arange(lo[d], hi[d] + 1) for d in range(3)], indexing="ij"), -1
    ).reshape(-1, 3)
    prefix = morton(cells) << (3 * (BITS - level))
    rows = np.searchsorted(keys, prefix + (1 << (3 * (BITS - level)))) - np.searchsorted(
        keys, prefix
    )
    return rows.sum(), len(cells)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nc", type=int, default=64)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--sample", type=int, default=3000)
    args = parser.parse_args(argv)
    nc, k, box = args.nc, args.k, float(args.nc)
    snap = jaxpm_snapshot(nc, box, args.steps)
    lattice = np.stack(np.meshgrid(*[np.arange(nc)] * 3, indexing="ij"), -1)
    pos = np.mod((lattice + snap.disp) * (box / nc), box).reshape(-1, 3)
    r_k = cKDTree(pos, boxsize=box).query(pos, k=k + 1, workers=-1)[0][:, k]
    print(
        f"{nc}^3 JaxPM snapshot, k = {k}; queries whose box stays inside: "
        f"{np.mean(inside_box(pos, r_k, box)):.3f}"
    )

    rng = np.random.default_rng(0)
    shifts = [np.full(3, f * box) for f in SHIFT_FRACTIONS] + [rng.uniform(0, box, 3)]
    best = None
    print("1. windows in Morton order, certified by the cells (side >= 2 r_k) covering the box")
    for copies, shift in enumerate(shifts, 1):
        need = window_needed(np.mod(pos + shift, box), r_k, box)
        best = need if best is None else np.minimum(best, need)
        shares = ", ".join(f"{w}: {np.mean(best <= w):.3f}" for w in (32, 64, 128, 256))
        print(f"   {copies} grid(s): certified with a half-window of {shares}")

    keys, _ = sorted_keys(pos, box)
    pick = rng.choice(np.flatnonzero(inside_box(pos, r_k, box)), args.sample, replace=False)
    print(f"2. per-query covers of the box ({args.sample} queries)")
    for factor in (2, 1, 0.5, 0.25):
        rows, cells = np.array([cover(keys, pos[i], r_k[i], box, factor) for i in pick]).T
        print(
            f"   cells of side >= {factor:g} r_k: rows median {np.median(rows):.0f}, "
            f"mean {np.mean(rows):.0f}; cells per query median {np.median(cells):.0f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
