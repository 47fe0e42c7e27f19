"""Spatial indexes local to one device, and fixed-shape loops over their pairs.

* :class:`Columns` (FoF): rows sorted by x-y column, then by z. A neighbour window is one
  contiguous range per column, found by a binary search as deep as log2 of the column's
  length, so no search depends on how full the densest cell is.
* Morton keys (kNN): rows sorted along a space-filling curve.
* :func:`for_each_pair_chunk` flattens ranges of candidate partners into fixed-size
  chunks; :func:`union` merges links into a union-find forest in fixed-shape passes.

The frame is a device's extended pencil: ``x, y`` over the pencil plus its ghost layers,
``z`` over the box plus periodic images.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from . import control

int32 = jnp.int32
_MAX_CELLS = 1 << 30


def _x64():
    """A context that traces under x64 (``jax.enable_x64`` from jax 0.8 on)."""
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64

    return enable_x64()


def sort_rows(key):
    """Stable sort of an int32 ``key``: returns ``(sorted key, order)``.

    XLA sorts a single array of scalars several times faster than a key with a payload
    (on CPU ~70 against ~300 ns per row), so key and row travel packed in one int64,
    traced under x64 whatever the global setting.
    """
    with _x64():
        rows = jnp.arange(key.shape[0], dtype=jnp.int64)
        packed = lax.sort(jnp.left_shift(key.astype(jnp.int64), 32) | rows)
        return (jnp.right_shift(packed, 32).astype(int32), (packed & 0xFFFFFFFF).astype(int32))


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
    def covering(cls, lengths, min_side: float) -> CellGrid:
        min_side = float(min_side) * (1 + 1e-4)
        while True:
            shape = tuple(max(1, int(length // min_side)) for length in lengths)
            if math.prod(shape) < _MAX_CELLS:
                return cls(shape, tuple(length / n for length, n in zip(lengths, shape)))
            min_side *= 1.25


# Running counts of candidate pairs saturate just above this, so they never wrap int32:
# a device holding ~10^8 particles in dense haloes tests more than 2**31 pairs. Two
# saturated counts still add below 2**31.
PAIR_COUNT_CAP = 2**30 - 2


def saturating_cumsum(values, cap: int):
    """Inclusive running sums of non-negative int32 ``values`` (each at most ``cap``),
    exact up to ``cap`` and ``cap + 1`` beyond: never wrapping, unlike ``jnp.cumsum``.

    ``min(a + b, cap + 1)`` is associative for non-negative ``a, b``."""
    if not 0 < cap <= PAIR_COUNT_CAP:
        raise ValueError(f"cap must be in [1, {PAIR_COUNT_CAP}], got {cap}")
    return lax.associative_scan(lambda a, b: jnp.minimum(a + b, cap + 1), values.astype(int32))


def for_each_pair_chunk(starts, ends, chunk: int, body, carry, cap: int | None = None):
    """Visit every pair ``(i, j)`` with ``starts[i, s] <= j < ends[i, s]`` in fixed chunks.

    The ranges are flattened into one index space, so each pass does ``chunk`` pairs of
    useful work however the pairs are spread over rows: no row's range length sets a loop
    bound. ``body(carry, i, j, live) -> carry`` gets int32 arrays of shape (chunk,).
    Returns ``carry``. Rows are taken in spans of at most ``cap`` pairs, so a device's
    total may pass int32 (one span unless it does); each row's ranges must be disjoint,
    so that one row's pairs (at most ``rows``) fit in a span.
    """
    rows = starts.shape[0]
    cap = PAIR_COUNT_CAP if cap is None else cap  # read when traced: tests lower it
    if rows > cap:
        raise ValueError(
            f"{rows} rows exceed the {cap} pairs of one span; spread the "
            "particles over more devices"
        )
    lengths = jnp.maximum(ends - starts, 0)
    within = jnp.cumsum(lengths, axis=1, dtype=int32)  # (R, S) pairs of a row up to each range
    per_row = within[:, -1]  # (R,)
    row_ids = jnp.arange(rows, dtype=int32)

    def span(state):
        r0, carry = state
        # Rows r0.. whose pairs fit in cap; rows before r0 have none, rows after the span
        # are given none, so the span's pairs are numbered from 0.
        cum = saturating_cumsum(jnp.where(row_ids >= r0, per_row, 0), cap)  # (R,)
        fits = cum <= cap
        total = jnp.max(jnp.where(fits, cum, 0))
        mine = jnp.where(fits & (row_ids >= r0), per_row, 0)
        carry = _pairs_of_span(
            starts, within, mine, jnp.minimum(cum, total), total, chunk, body, carry
        )
        return jnp.sum(fits, dtype=int32), carry  # cum is monotone: the span ends there

    return control.while_loop(lambda s: s[0] < rows, span, (jnp.int32(0), carry))[1]


def _pairs_of_span(starts, within, per_row, cum, total, chunk: int, body, carry):
    """The chunk loop of :func:`for_each_pair_chunk` over one span: ``per_row`` (R,) pairs
    of each row in it (0 elsewhere), ``cum`` (R,) their running sum, ``total`` its last."""
    rows = per_row.shape[0]
    first = cum - per_row
    row_ids = jnp.arange(rows, dtype=int32)

    def step(state):
        t0, carry = state
        t = t0 + jnp.arange(chunk, dtype=int32)
        live = t < total
        # The row of pair t: the last row that starts at or before t. Rows starting inside
        # the chunk mark their first pair; a running maximum fills in the rest.
        row0 = jnp.searchsorted(cum, t0, side="right").astype(int32)  # row holding pair t0
        offset = first - t0
        inside = (per_row > 0) & (offset > 0) & (offset < chunk)
        marks = (
            jnp.zeros(chunk, int32).at[jnp.where(inside, offset, chunk)].max(row_ids, mode="drop")
        )
        i = jnp.minimum(jnp.maximum(lax.cummax(marks), row0), rows - 1)
        k = t - first[i]
        row_within = within[i]
        s = jnp.sum(k[:, None] >= row_within[:, :-1], axis=1)
        before = jnp.where(
            s > 0, jnp.take_along_axis(row_within, jnp.maximum(s - 1, 0)[:, None], 1)[:, 0], 0
        )
        j = jnp.take_along_axis(starts[i], s[:, None], 1)[:, 0] + (k - before)
        return t0 + chunk, body(carry, i, jnp.where(live, j, i), live)

    return control.while_loop(lambda s: s[0] < total, step, (jnp.int32(0), carry))[1]


# ----------------------------------------------------------------------------------------
# Union-find in fixed-shape passes


def compress(parent):
    """Pointer jumping until every row points at its root."""

    def step(state):
        parent, _ = state
        jumped = parent[parent]
        return jumped, jnp.any(jumped != parent)

    # The test rides on the jump itself: one gather per pass, not a second in the test.
    return control.while_loop(lambda s: s[1], step, (parent, jnp.bool_(True)))[0]


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

    parent, _ = control.while_loop(lambda s: s[1], step, (parent, jnp.any(link)))
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


# ----------------------------------------------------------------------------------------
# Columns sorted along z: the FoF index


class Columns(NamedTuple):
    """Rows sorted by x-y column, then by z.

    Columns are cells of the x-y plane (sides >= the search radius); within a column the
    rows are ordered by their z coordinate, so a z window is found by a binary search
    bounded by the column's length rather than the whole array.

    The index of where each column starts is a histogram over buckets of ``2**shift``
    consecutive column keys, with ``shift`` the smallest that leaves at most one bucket per
    row: one bucket per column (``shift == 0``, a direct look-up) whenever there are no
    more columns than rows, and never more memory than the rows need when a linking length
    tiny against the box makes columns far outnumber particles.

    Attributes:
      order: (R,) row index of each sorted position (invalid rows last).
      column: (R,) sorted column key ``cx * ny + cy`` (``nx * ny`` for invalid rows).
      z: (R,) sorted z coordinates.
      start: (B + 2,) first sorted position of each bucket (B buckets of valid keys, then
        the invalid rows, then R).
      depth: () binary search steps that resolve the fullest bucket (0 when ``shift == 0``).
      cx, cy: (R,) column coordinates of the sorted rows.
      shape: (nx, ny), static.
      shift: static.
    """

    order: jax.Array
    column: jax.Array
    z: jax.Array
    start: jax.Array
    depth: jax.Array
    cx: jax.Array
    cy: jax.Array
    shape: tuple
    shift: int


def _bucket_shift(columns: int, rows: int) -> int:
    """Smallest ``shift`` with at most ``rows`` buckets of ``2**shift`` column keys."""
    shift = 0
    while -(-columns // (1 << shift)) > max(rows, 1):
        shift += 1
    return shift


def z_order(local_pos, valid):
    """Rows sorted by z (invalid rows last): the first of :func:`sort_columns`' two sorts,
    the same for every column size."""
    z = jnp.where(valid, local_pos[:, 2], jnp.inf)
    if z.dtype != jnp.float32:  # float64 positions (jax_enable_x64): sort with a payload
        rows = jnp.arange(z.shape[0], dtype=int32)
        return lax.sort((z, rows), num_keys=1, is_stable=True)[1]
    bits = lax.bitcast_convert_type(z, int32)  # int32 bits that order like the floats
    return sort_rows(jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits))[1]


def sort_columns(lengths, min_side: float, local_pos, origin, valid, by_z=None) -> Columns:
    """Sort rows into x-y columns of side >= ``min_side`` covering ``lengths`` (x, y).
    ``by_z``: the rows' :func:`z_order`, when already known."""
    grid = CellGrid.covering((lengths[0], lengths[1], 0.0), min_side)
    nx, ny, _ = grid.shape
    side = jnp.asarray(grid.side[:2], local_pos.dtype)
    c = jnp.clip(
        jnp.floor((local_pos[:, :2] - origin[:2]) / side).astype(int32),
        0,
        jnp.asarray([nx - 1, ny - 1], int32),
    )
    columns = nx * ny
    column = jnp.where(valid, c[:, 0] * ny + c[:, 1], columns)
    z = jnp.where(valid, local_pos[:, 2], jnp.inf)
    # By column, then z: two stable single-key sorts, z first.
    if by_z is None:
        by_z = z_order(local_pos, valid)
    column, at = sort_rows(column[by_z])
    order = by_z[at]
    z = z[order]
    rows = column.shape[0]
    shift = _bucket_shift(columns, rows)
    buckets = -(-columns // (1 << shift))  # B <= R
    bucket = jnp.where(column < columns, column >> shift, buckets)  # (R,)
    counts = jnp.zeros(buckets + 1, int32).at[bucket].add(1)  # (B + 1,)
    start = jnp.concatenate([jnp.zeros(1, int32), jnp.cumsum(counts, dtype=int32)])  # (B + 2,)
    depth = jnp.int32(0) if shift == 0 else search_depth(jnp.max(counts[:buckets]))
    cc = jnp.minimum(column, columns - 1)
    return Columns(order, column, z, start, depth, cc // ny, cc % ny, (nx, ny), shift)


def column_start(cols: Columns, key):
    """(R,) first sorted position with a column key >= ``key`` (R,), for keys up to
    ``nx * ny``: the bucket's start, then a search inside the bucket when buckets hold
    several columns."""
    lo = cols.start[key >> cols.shift]
    if cols.shift == 0:
        return lo
    hi = cols.start[(key >> cols.shift) + 1]
    return search_columns(cols.column, lo, hi, key, False, cols.depth)


def search_depth(longest):
    """Binary search steps that resolve any range of at most ``longest`` positions."""
    return jnp.ceil(jnp.log2(jnp.asarray(longest).astype(jnp.float32) + 1)).astype(int32)


def search_columns(z, lo, hi, target, right, depth=None):
    """First position in ``[lo, hi)`` with ``z > target`` where ``right``, else ``z >= target``.

    One binary search for all queries, as deep as log2 of the longest range (or ``depth``
    steps, which must cover it): columns are short, so this is far shallower than a search
    of the whole array.
    """
    if depth is None:
        depth = search_depth(jnp.max(hi - lo))
    last = z.shape[0] - 1

    # The answer is built from the largest step down: a step of 2^s is taken when the row
    # it would pass over last still lies before the answer. Only the position is carried
    # (hi is fixed), so XLA updates it in place; carrying (lo, hi), each pass read both to
    # write both and XLA copied them first (seen in the XLA:CPU profile).
    def step(i, pos):
        ahead = pos + jnp.left_shift(jnp.int32(1), depth - 1 - i)
        zm = z[jnp.minimum(ahead - 1, last)]
        before = jnp.where(right, zm <= target, zm < target)
        return jnp.where((ahead <= hi) & before, ahead, pos)

    return control.fori_loop(0, depth, step, lo)


_FORWARD_COLUMNS = ((0, 1), (1, -1), (1, 0), (1, 1))


def half_shell_windows(cols: Columns, reach):
    """Ranges covering, once per unordered pair, every row within ``reach`` in z and in the
    3x3 neighbouring columns of each row.

    Returns ``(starts, ends)`` of shape (R, 5): the row's own column after itself up to
    ``z + reach``, then the windows ``[z - reach, z + reach]`` of the four forward
    columns (dx, dy) = (0, 1), (1, -1), (1, 0), (1, 1).
    """
    nx, ny = cols.shape
    rows = cols.order.shape[0]
    live = cols.column < nx * ny

    def column_range(dx, dy):
        cx, cy = cols.cx + dx, cols.cy + dy
        inside = live & (cx < nx) & (cy >= 0) & (cy < ny)
        col = jnp.where(inside, cx * ny + cy, nx * ny)
        return (
            jnp.where(inside, column_start(cols, col), 0),
            jnp.where(inside, column_start(cols, col + 1), 0),
        )

    _, own_hi = column_range(0, 0)
    own_lo = jnp.minimum(jnp.arange(rows, dtype=int32) + 1, own_hi)
    starts = [own_lo]
    ends = [search_columns(cols.z, own_lo, own_hi, cols.z + reach, True)]
    # One search per bound rather than one over all nine: a search's working arrays are the
    # largest temporaries of FoF, and this keeps one search's arrays alive at a time.
    for dx, dy in _FORWARD_COLUMNS:
        lo, hi = column_range(dx, dy)
        starts.append(search_columns(cols.z, lo, hi, cols.z - reach, False))
        ends.append(search_columns(cols.z, lo, hi, cols.z + reach, True))
    starts = jnp.stack(starts, 1)
    return starts, jnp.maximum(jnp.stack(ends, 1), starts)
