"""Sorted cells: the spatial index shared by FoF and kNN, local to one device.

Rows are sorted by the key of the cell that holds them, ``(cx * ny + cy) * nz + cz``, so
every cell, and every run of consecutive cells along z (a "row segment"), is one contiguous
range of the sorted order. Neighbour searches then cost two binary searches per row segment
and never depend on how full the cells are. The frame is a device's extended pencil:
``x, y`` over the pencil plus its ghost layers, ``z`` over the box plus periodic images.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

int32 = jnp.int32
_MAX_CELLS = 1 << 30
_SENTINEL = jnp.iinfo(jnp.int32).max


@dataclasses.dataclass(frozen=True)
class CellGrid:
    """A static grid of ``shape`` cells of ``side`` over a box starting at a traced origin.

    Sides are at least ``min_side`` (times 1 + 1e-4, so that float rounding can never put two
    points closer than ``min_side`` two cells apart). The number of cells is capped below
    2**30 by enlarging the sides, which keeps keys in int32.
    """

    shape: tuple[int, int, int]
    side: tuple[float, float, float]

    @classmethod
    def covering(cls, lengths, min_side: float) -> "CellGrid":
        min_side = float(min_side) * (1 + 1e-4)
        while True:
            shape = tuple(max(1, int(length // min_side)) for length in lengths)
            if math.prod(shape) < _MAX_CELLS:
                return cls(shape, tuple(length / n for length, n in zip(lengths, shape)))
            min_side *= 1.25

    def coords(self, local_pos, origin):
        """Integer cell coordinates (…, 3) of positions in the grid's frame."""
        side = jnp.asarray(self.side, local_pos.dtype)
        c = jnp.floor((local_pos - origin) / side).astype(int32)
        return jnp.clip(c, 0, jnp.asarray(self.shape, int32) - 1)

    def key(self, cx, cy, cz):
        _, ny, nz = self.shape
        return (cx * ny + cy) * nz + cz


class SortedCells(NamedTuple):
    """Rows sorted by cell.

    Attributes:
      order: (R,) row index of each sorted position (invalid rows last).
      keys: (R,) sorted cell keys, int32 max for invalid rows.
      cell: (R, 3) cell coordinates of the sorted rows.
    """

    order: jax.Array
    keys: jax.Array
    cell: jax.Array


def sort_cells(grid: CellGrid, local_pos, origin, valid) -> SortedCells:
    cell = grid.coords(local_pos, origin)
    keys = jnp.where(valid, grid.key(cell[:, 0], cell[:, 1], cell[:, 2]), _SENTINEL)
    order = jnp.argsort(keys)
    return SortedCells(order, keys[order], cell[order])


def segment_range(grid: CellGrid, cells: SortedCells, dx: int, dy: int, dz_lo: int, dz_hi: int):
    """For every sorted row, the range ``[start, end)`` of sorted rows in cells
    ``(cx + dx, cy + dy, cz + dz_lo .. cz + dz_hi)`` (clipped to the grid; empty off it)."""
    nx, ny, nz = grid.shape
    c = cells.cell
    cx, cy = c[:, 0] + dx, c[:, 1] + dy
    inside = (cx >= 0) & (cx < nx) & (cy >= 0) & (cy < ny) & (cells.keys != _SENTINEL)
    lo = grid.key(cx, cy, jnp.maximum(c[:, 2] + dz_lo, 0))
    hi = grid.key(cx, cy, jnp.minimum(c[:, 2] + dz_hi, nz - 1))
    start = search(cells.keys, lo, "left")
    end = search(cells.keys, hi, "right")
    return jnp.where(inside, start, 0), jnp.where(inside, end, 0)


def search(keys, queries, side):
    """``searchsorted`` with the unrolled binary search (fastest on CPU and GPU)."""
    return jnp.searchsorted(keys, queries, side=side, method="scan_unrolled").astype(int32)


def half_shell_ranges(grid: CellGrid, cells: SortedCells):
    """Ranges covering, once per unordered pair, all rows in the 27 cells around each row.

    Returns ``(starts, ends)`` of shape (R, 5): the row's own cell after itself plus the
    next z cell, then the three-cell z segments of the four (dx, dy) forward columns.
    """
    r = jnp.arange(cells.keys.shape[0], dtype=int32)
    _, nz = grid.shape[1:]
    c = cells.cell
    own_end = search(cells.keys, grid.key(c[:, 0], c[:, 1], jnp.minimum(c[:, 2] + 1, nz - 1)),
                     "right")
    own_end = jnp.where(cells.keys != _SENTINEL, own_end, 0)
    starts, ends = [jnp.minimum(r + 1, own_end)], [own_end]
    for dx, dy in ((0, 1), (1, -1), (1, 0), (1, 1)):
        s, e = segment_range(grid, cells, dx, dy, -1, 1)
        starts.append(s)
        ends.append(e)
    return jnp.stack(starts, 1), jnp.stack(ends, 1)


def for_each_pair_chunk(starts, ends, chunk: int, body, carry):
    """Visit every pair ``(i, j)`` with ``starts[i, s] <= j < ends[i, s]`` in fixed chunks.

    The ranges are flattened into one index space, so each pass does ``chunk`` pairs of
    useful work however the pairs are spread over rows: no row's range length sets a loop
    bound. ``body(carry, i, j, live) -> carry`` gets int32 arrays of shape (chunk,).
    Returns ``(carry, total_pairs)``.
    """
    rows, ranges = starts.shape
    lengths = jnp.maximum(ends - starts, 0)
    within = jnp.cumsum(lengths, axis=1, dtype=int32)  # pairs of a row up to each range
    per_row = within[:, -1]
    cum = jnp.cumsum(per_row, dtype=int32)
    first = cum - per_row
    total = cum[-1]
    row_ids = jnp.arange(rows, dtype=int32)

    def step(state):
        t0, carry = state
        t = t0 + jnp.arange(chunk, dtype=int32)
        live = t < total
        # The row of pair t: the last row that starts at or before t. Rows starting inside
        # the chunk mark their first pair; a running maximum fills in the rest.
        row0 = search(cum, t0[None], "right")[0]
        offset = first - t0
        inside = (per_row > 0) & (offset > 0) & (offset < chunk)
        marks = jnp.zeros(chunk, int32).at[jnp.where(inside, offset, chunk)].max(row_ids,
                                                                                mode="drop")
        i = jnp.minimum(jnp.maximum(lax.cummax(marks), row0), rows - 1)
        k = t - first[i]
        row_within = within[i]
        s = jnp.sum(k[:, None] >= row_within[:, :-1], axis=1)
        before = jnp.where(s > 0, jnp.take_along_axis(row_within, jnp.maximum(s - 1, 0)[:, None],
                                                      1)[:, 0], 0)
        j = jnp.take_along_axis(starts[i], s[:, None], 1)[:, 0] + (k - before)
        return t0 + chunk, body(carry, i, jnp.where(live, j, i), live)

    _, carry = lax.while_loop(lambda s: s[0] < total, step, (jnp.int32(0), carry))
    return carry, total


# ----------------------------------------------------------------------------------------
# Union-find in fixed-shape passes


def compress(parent):
    """Pointer jumping until every row points at its root."""

    def step(p):
        return p[p]

    return lax.while_loop(lambda p: jnp.any(p[p] != p), step, parent)


def union(parent, u, v, link):
    """Merge the trees of ``u[k]`` and ``v[k]`` wherever ``link[k]``.

    ``parent`` must be compressed (every entry a root) and satisfy ``parent[x] <= x``; both
    hold on return. Each pass hooks the larger of two different roots under the smaller one
    (a scatter-min, so it cannot form a cycle) and then compresses, until no link joins two
    different trees.
    """
    n = parent.shape[0]

    def step(state):
        parent, _ = state
        ru, rv = parent[u], parent[v]
        active = link & (ru != rv)
        hi = jnp.where(active, jnp.maximum(ru, rv), n)
        parent = compress(parent.at[hi].min(jnp.minimum(ru, rv), mode="drop"))
        return parent, jnp.any(active)

    parent, _ = lax.while_loop(lambda s: s[1], step, (parent, jnp.any(link)))
    return parent


# ----------------------------------------------------------------------------------------
# Morton (Z-order) keys: every octree node, at every level, is one contiguous range of the
# rows sorted by key. Used by the kNN search, whose cell size must follow the local density.

MORTON_BITS = 10  # bits per dimension: keys hold 30 bits and stay positive int32


def morton_spread(v):
    """Spread the low 10 bits of ``v`` (int32) to every third bit."""
    v = v.astype(int32) & 0x3FF
    v = (v | (v << 16)) & 0x030000FF
    v = (v | (v << 8)) & 0x0300F00F
    v = (v | (v << 4)) & 0x030C30C3
    v = (v | (v << 2)) & 0x09249249
    return v


def morton_key(cx, cy, cz):
    """Interleaved key of integer coordinates below ``2**MORTON_BITS`` (x most significant)."""
    return (morton_spread(cx) << 2) | (morton_spread(cy) << 1) | morton_spread(cz)


def search_sorted(sorted_keys, values):
    """``jnp.searchsorted(sorted_keys, values, side='left')`` as an unrolled branchless
    binary search (several times faster on CPU than the ``while`` version)."""
    n = sorted_keys.shape[0]
    pos = jnp.zeros(jnp.shape(values), int32)
    if n == 0:
        return pos
    step = 1 << (n - 1).bit_length()
    while step:
        cand = pos + step
        probe = jnp.take(sorted_keys, jnp.clip(cand - 1, 0, n - 1), mode="clip")
        pos = jnp.where((cand <= n) & (probe < values), cand, pos)
        step >>= 1
    return pos
