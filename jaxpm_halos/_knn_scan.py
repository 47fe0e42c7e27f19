"""The running k nearest of one batch of queries over its region's candidate rows.

Shapes in comments: ``B`` queries of the batch, ``kk`` list length (k, or k + 1 when the
query itself is among the rows), ``W`` candidates tested per step, ``C`` merged per step.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ._geometry import periodic_delta
from ._knn_frame import Index, SearchFrame
from ._knn_region import Queries, Region

int32 = jnp.int32


def distance2_columns(ax, ay, az, bx, by, bz, box):
    """:func:`~._geometry.periodic_distance2` from separate coordinate arrays (broadcast),
    which keeps every operation vectorised along the candidates (same values bitwise)."""
    dx, dy, dz = (periodic_delta(a, b, box) for a, b in ((ax, bx), (ay, by), (az, bz)))
    return dx * dx + dy * dy + dz * dz


def merge_nearest(run_d2, run_row, cand_d2, cand_row):
    """The ``kk`` nearest of a running list ``(B, kk)`` (ascending squared distances and
    their rows) and a chunk of candidates ``(B, C)`` (inf where absent) with rows ``(C,)``,
    in ascending order. Equal distances keep the running list first, then candidate order.
    """
    kk = run_d2.shape[-1]
    # The running list goes first: top_k then starts from a good heap and is cheap.
    vals, pick = lax.top_k(jnp.concatenate([-run_d2, -cand_d2], axis=-1), kk)  # (B, kk)
    prev = jnp.take_along_axis(run_row, jnp.minimum(pick, kk - 1), axis=-1)
    return -vals, jnp.where(pick < kk, prev, cand_row[jnp.maximum(pick - kk, 0)])


def _window_rows(region: Region, cum, first, total, t0, window: int):
    """Sorted rows (W,) of candidates ``t0 .. t0 + W - 1`` of the region's node ranges
    (laid end to end; ``cum``, ``first`` (NODES,) their cumulative ends and starts), and
    whether each is a candidate at all (``t < total``)."""
    t = t0 + jnp.arange(window, dtype=int32)
    # Range of each slot: ranges ending at or before t0, plus the ends inside the window.
    ends = jnp.zeros((window,), int32).at[jnp.where(cum > t0, cum - t0, window)].add(
        1, mode="drop")
    node = jnp.minimum(jnp.sum(cum <= t0, dtype=int32) + jnp.cumsum(ends), cum.shape[0] - 1)
    in_range = t < total
    return jnp.where(in_range, region.start[node] + t - first[node], 0), in_range


def _first_passing(passing, chunk: int):
    """Positions (C,) of the first ``chunk`` True entries of ``passing`` (W,) (W where
    fewer), and whether more than ``chunk`` passed."""
    window = passing.shape[0]
    rank = jnp.cumsum(passing.astype(int32)) - 1
    take = jnp.where(passing & (rank < chunk), rank, chunk)
    picked = jnp.full((chunk,), window, int32).at[take].set(
        jnp.arange(window, dtype=int32), mode="drop")
    return picked, rank[-1] >= chunk


def scan_batch(index: Index, frame: SearchFrame, q: Queries, region: Region, kk: int, chunk: int,
               window: int):
    """The ``kk`` nearest rows of one batch of B queries among its region's rows (a query's
    own row is not excluded here: self mode keeps ``k + 1`` and drops it at the end).

    Each step computes the distances from every query to the next ``window`` candidate
    rows, keeps the candidates nearer to some query than that query's current k-th
    neighbour, and merges the first ``chunk`` of those into the running lists (the step
    ends after them when more were kept). Nodes come nearest first, so after the first
    steps few candidates are kept and a step covers a whole window: the merge, the
    expensive part, then runs once per window rather than once per ``chunk`` candidates.
    With ``window == chunk`` there is nothing to select, and each window is merged whole.

    Returns (B, kk) squared distances (ascending, inf where fewer were found) and sorted
    rows (``R`` where none).
    """
    B = q.canon.shape[0]
    R = index.rows
    box = frame.box
    cum = jnp.cumsum(region.count)  # (NODES,)
    first = cum - region.count
    total = cum[-1]
    qx, qy, qz = (q.canon[:, d][:, None] for d in range(3))  # (B, 1) each

    def distances(rows):
        return distance2_columns(qx, qy, qz, index.cx[rows][None, :], index.cy[rows][None, :],
                                 index.cz[rows][None, :], box)

    def step(state):
        t0, run_d2, run_row = state
        row, in_range = _window_rows(region, cum, first, total, t0, window)  # (W,)
        local = index.local[row]  # (W, 3)
        live = in_range & jnp.all((local >= region.lo) & (local <= region.hi), axis=1)
        # Materialise the gathered candidates: fused into the distance kernel, the gather
        # would be repeated for every query and the kernel would not vectorise.
        live, cx, cy, cz = lax.optimization_barrier((live, index.cx[row], index.cy[row],
                                                     index.cz[row]))
        d2 = distance2_columns(qx, qy, qz, cx[None, :], cy[None, :], cz[None, :], box)
        d2 = jnp.where(live[None, :], d2, jnp.inf)  # (B, W)
        if window == chunk:  # nothing to select: the merge takes the whole window
            return (t0 + window,) + merge_nearest(run_d2, run_row, d2, row)
        # A candidate no nearer than a query's k-th cannot enter its list (ties keep the
        # running list first); empty query slots want none.
        kth = jnp.where(q.valid, run_d2[:, -1], -jnp.inf)
        picked, more = _first_passing(jnp.any(d2 < kth[:, None], axis=0), chunk)  # (C,)
        has = picked < window
        cand_row = row[jnp.minimum(picked, window - 1)]
        # Recomputed (same values bitwise): a column gather from d2 costs a transpose.
        cand_d2 = jnp.where(has[None, :], distances(cand_row), jnp.inf)  # (B, C)
        run_d2, run_row = merge_nearest(run_d2, run_row, cand_d2, jnp.where(has, cand_row, R))
        # Resume after the last merged candidate when the window kept more than a chunk.
        next_t0 = jnp.where(more, t0 + picked[chunk - 1] + 1, t0 + window)
        return next_t0, run_d2, run_row

    init = (jnp.int32(0), jnp.full((B, kk), jnp.inf, q.canon.dtype), jnp.full((B, kk), R, int32))
    _, run_d2, run_row = lax.while_loop(lambda s: s[0] < total, step, init)
    return run_d2, run_row
