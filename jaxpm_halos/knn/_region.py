"""Where a batch of kNN queries searches: query batches in key order, and each batch's
region (its bounding box grown by a radius, enumerated as octree node row ranges, nearest
first) with the distance from each query to the boundary of the region known complete.

Shapes in comments: ``B`` queries of a batch, ``NODES`` octree nodes of a region,
``L`` octree levels + 1.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..core.cells import morton_key
from ._frame import LEVELS, Index, SearchFrame

int32 = jnp.int32
NODES = 64  # most octree nodes enumerated by one batch


class Queries(NamedTuple):
    """Query rows packed in two arrays (fewer arrays to move, smaller programs).

    ``f`` (..., 6) holds the position in the device's frame and the canonical position;
    ``i`` (..., 3) the global id excluded from the query's neighbours (-2 for none), a valid
    flag, and the sorted row where the query's key sits (its own row for owned particles).
    """

    f: jax.Array
    i: jax.Array

    @classmethod
    def make(cls, local, canon, ids, valid, sorted_row):
        return cls(
            jnp.concatenate([local, canon], axis=-1),
            jnp.stack([ids, valid.astype(int32), sorted_row], axis=-1),
        )

    @property
    def local(self):
        return self.f[..., :3]

    @property
    def canon(self):
        return self.f[..., 3:]

    @property
    def id(self):
        return self.i[..., 0]

    @property
    def valid(self):
        return self.i[..., 1] > 0

    @property
    def sorted_row(self):
        return self.i[..., 2]


def batch_slots(local, valid, batch: int, gap: float, span: float):
    """Slots of queries (in key order, valid first) in batches of ``batch``: a batch ends
    early where the next query is farther than ``gap`` from the previous one (so scattered
    queries, e.g. the few searched again, get small batches of their own) or farther than
    ``span`` from the batch's first query.

    Args: ``local`` (n, 3) frame positions, ``valid`` (n,).
    Returns the slot (n,) of each query (``n`` where none is left) and the slots used.
    """
    n = local.shape[0]
    i = jnp.arange(n, dtype=int32)

    def runs(brk):
        start = lax.cummax(jnp.where(brk, i, 0))
        in_run = i - start
        return brk | (in_run % batch == 0), in_run

    step = jnp.max(jnp.abs(local - jnp.roll(local, 1, axis=0)), axis=1)  # (n,)
    brk, _ = runs((i == 0) | (step > gap))
    first = lax.cummax(jnp.where(brk, i, 0))
    brk = brk | (jnp.max(jnp.abs(local - local[first]), axis=1) > span)
    brk, in_run = runs(brk)
    run = jnp.cumsum(brk.astype(int32)) - 1
    # Runs past the last whole batch get no slot. They are told by the run, not by
    # run * batch, which wraps int32 for them from ~10^8 queries on.
    slot = jnp.where(run <= (n - 1) // batch, run * batch + in_run % batch, n)
    slot = jnp.where(valid & (slot < n), slot, n)
    used = jnp.max(jnp.where(slot < n, slot + 1, 0))
    return slot, used


class Region(NamedTuple):
    """Where one batch searches: candidate row ranges ``start``, ``count`` (NODES,) (one
    per octree node, nearest first), the window ``[lo, hi]`` (3,) (frame) whose rows are
    candidates, the distance ``coverage`` (B,) from each query to the boundary of the
    region known complete, and the search radius ``rho``."""

    start: jax.Array
    count: jax.Array
    lo: jax.Array
    hi: jax.Array
    coverage: jax.Array
    rho: jax.Array


def _search_radius(
    frame: SearchFrame, q: Queries, rho_q, qmin, qmax, rows: int, k: int, radius_factor: float
):
    """The batch's radius: the largest one asked (``rho_q`` (B,)), or where some query asks
    for an estimate (a negative radius), at least ``radius_factor`` times the k-th
    neighbour distance of the batch's own density (the sorted rows between its first and
    last query, over the volume of its bounding box)."""
    dtype = qmin.dtype
    first = jnp.min(jnp.where(q.valid, q.sorted_row, rows))
    last = jnp.max(jnp.where(q.valid, q.sorted_row, -1))
    rows_in = jnp.maximum(last - first + 1, 1).astype(dtype)
    extent = qmax - qmin
    extent = jnp.maximum(extent, jnp.max(extent) / 4)
    volume = jnp.prod(extent)
    r_est = (3 * k * volume / (4 * np.pi * rows_in)) ** (1 / 3)
    estimate = jnp.where(volume > 0, radius_factor * r_est, 0)
    given = jnp.max(jnp.where(q.valid, rho_q, 0))
    rho = jnp.where(jnp.any(q.valid & (rho_q < 0)), jnp.maximum(estimate, given), given)
    return jnp.minimum(rho, jnp.asarray(frame.full, dtype)).astype(dtype)


def _node_level(frame: SearchFrame, lo, hi):
    """The finest octree level at which the box ``[lo, hi]`` (3,) (frame offsets) spans at
    most NODES nodes. Returns ``(level, scale, node_side, first_node (3,), last_node (3,))``."""
    dtype = lo.dtype
    levels = jnp.arange(LEVELS + 1, dtype=int32)  # (L,)
    scales = jnp.left_shift(1, levels)
    sides = jnp.asarray(frame.side, dtype) / scales.astype(dtype)
    first = jnp.clip(
        jnp.floor(lo[None, :] / sides[:, None]).astype(int32), 0, scales[:, None] - 1
    )  # (L, 3)
    last = jnp.clip(
        jnp.floor(hi[None, :] / sides[:, None]).astype(int32), first, scales[:, None] - 1
    )
    fits = jnp.prod(last - first + 1, axis=1) <= NODES
    level = jnp.max(jnp.where(fits, levels, 0))
    return level, scales[level], sides[level], first[level], last[level]


def _nearest_first(distance, values):
    """Reorder ``values`` (each (NODES,)) by ascending ``distance`` (NODES,), ties by index.
    Ranks come from all pairwise comparisons: far cheaper than XLA:CPU's comparison sort."""
    i = jnp.arange(NODES, dtype=int32)
    before = (distance[None, :] < distance[:, None]) | (
        (distance[None, :] == distance[:, None]) & (i[None, :] < i[:, None])
    )
    # XLA materialises the comparisons (NODES, NODES): count them in the narrowest type.
    rank = jnp.sum(before, axis=1, dtype=jnp.int8 if NODES <= 128 else int32).astype(int32)
    return tuple(jnp.zeros_like(v).at[rank].set(v, unique_indices=True) for v in values)


def plan_region(
    index: Index,
    frame: SearchFrame,
    origin,
    cover_lo,
    cover_hi,
    q: Queries,
    rho_q,
    k: int,
    radius_factor: float,
) -> Region:
    """The region of one batch (``q`` (B, ...), ``rho_q`` (B,)): its bounding box grown by
    a radius, enumerated as at most NODES octree nodes of the finest level that covers it,
    nearest first (the running k nearest become good early, which makes later merges
    cheap)."""
    dtype = q.canon.dtype
    big = jnp.asarray(jnp.inf, dtype)
    any_valid = jnp.any(q.valid)
    qmin = jnp.min(jnp.where(q.valid[:, None], q.local, big), axis=0)  # (3,)
    qmax = jnp.max(jnp.where(q.valid[:, None], q.local, -big), axis=0)
    qmin = jnp.where(any_valid, qmin, origin)
    qmax = jnp.where(any_valid, qmax, origin)
    rho = _search_radius(frame, q, rho_q, qmin, qmax, index.rows, k, radius_factor)

    side = jnp.asarray(frame.side, dtype)
    level, scale, node_side, first, last = _node_level(
        frame, jnp.clip(qmin - rho - origin, 0, side), jnp.clip(qmax + rho - origin, 0, side)
    )
    span = last - first + 1
    i = jnp.arange(NODES, dtype=int32)
    nodes = first[None, :] + jnp.stack(
        [i // (span[1] * span[2]), (i // span[2]) % span[1], i % span[2]], axis=1
    )  # (NODES, 3)
    node_ok = (i < jnp.prod(span)) & any_valid
    nodes = jnp.where(node_ok[:, None], nodes, 0)
    prefix = morton_key(nodes[:, 0], nodes[:, 1], nodes[:, 2])
    shift = 3 * (LEVELS - level)
    bounds = jnp.searchsorted(
        index.key,
        jnp.concatenate([jnp.left_shift(prefix, shift), jnp.left_shift(prefix + 1, shift)]),
    )
    start, end = bounds[:NODES].astype(int32), bounds[NODES:].astype(int32)
    count = jnp.where(node_ok, end - start, 0)
    centre = (qmin + qmax) / 2 - origin
    mid = (nodes.astype(dtype) + 0.5) * node_side  # (NODES, 3)
    distance = jnp.where(node_ok, jnp.sum((mid - centre) ** 2, axis=1), big)
    start, count = _nearest_first(distance, (start, count))

    # Complete region: the node box (unbounded at the frame's edges) within the ghost cover
    # and within half a box of every query of the batch; candidates outside that window are
    # dropped, so a row is never a second periodic image of a particle.
    half = jnp.asarray(0.5 * frame.box - frame.margin, dtype)
    window_lo, window_hi = qmax - half, qmin + half
    box_lo = jnp.where(first == 0, -big, origin + first.astype(dtype) * node_side)
    box_hi = jnp.where(last == scale - 1, big, origin + (last + 1).astype(dtype) * node_side)
    complete_lo = jnp.maximum(jnp.maximum(box_lo, cover_lo), window_lo)
    complete_hi = jnp.minimum(jnp.minimum(box_hi, cover_hi), window_hi)
    coverage = jnp.min(jnp.minimum(q.local - complete_lo, complete_hi - q.local), axis=1)  # (B,)
    return Region(start, count, window_lo, window_hi, coverage, rho)
