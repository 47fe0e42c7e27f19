"""The running k nearest of a group of query batches over their regions' candidate rows.

Shapes in comments: ``G`` batches of ``B`` queries, ``P = G * B`` lists, ``kk`` list length
(k, or k + 1 when the query itself is among the rows), ``C`` candidates per step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ..core import control
from ..core.geometry import periodic_delta, squared_norm
from ..core.rows import selection
from ._frame import Index, SearchFrame, in_frame
from ._region import Queries, Region

int32 = jnp.int32
# Lists redone at a time where a merge meets a tie: ties are rare, and a GPU step merges
# thousands of lists, whose full sort (rows of 1024 values) would cost many steps.
TIE_BLOCK = 128


def distance2_columns(ax, ay, az, bx, by, bz, box):
    """:func:`~jaxpm_halos.core.geometry.periodic_distance2` from separate coordinate arrays
    (broadcast), which keeps every operation vectorised along the candidates (same values
    bitwise)."""
    return squared_norm(*(periodic_delta(a, b, box) for a, b in ((ax, bx), (ay, by), (az, bz))))


def _take_merged(run, cand, pick):
    """Values (P, m) at merged positions ``pick`` (P, m) of ``[run (P, kk) | cand]``, where
    ``cand`` is (C,) (shared by every list) or (P, C)."""
    kk = run.shape[-1]
    prev = jnp.take_along_axis(run, jnp.minimum(pick, kk - 1), axis=-1)
    c = jnp.maximum(pick - kk, 0)
    new = cand[c] if cand.ndim == 1 else jnp.take_along_axis(cand, c, axis=-1)
    return jnp.where(pick < kk, prev, new)


def _nearest_by_id(run_d2, run_row, cand_d2, cand_row, id_of):
    """The ``kk`` nearest by (squared distance, global id): a full sort of each list with
    its candidates (P, kk + C), for the rare steps where ``top_k`` meets a tie."""
    kk = run_d2.shape[-1]
    d2 = jnp.concatenate([run_d2, cand_d2], axis=-1)
    rows = jnp.concatenate([run_row, jnp.broadcast_to(cand_row, cand_d2.shape)], axis=-1)
    d2, _, rows = lax.sort((d2, id_of(rows), rows), dimension=d2.ndim - 1, num_keys=2)
    return d2[..., :kk], rows[..., :kk]


def update_selected(pick, count, block: int, new_values, arrays):
    """``arrays`` (P, ...) with the rows ``pick[:count]`` replaced, ``block`` at a time, by
    ``new_values(rows)`` for rows (block,) (``pick``, ``count``: a
    :func:`~jaxpm_halos.core.rows.selection` of the P rows).

    The last block's start is clamped to fit, so a row may be computed twice: as both
    computations read the rows given, never the updated ones, they give the same values."""
    P = pick.shape[0]

    def update_block(i, out):
        take = lax.dynamic_slice_in_dim(pick, i * block, block)  # (block,)
        new = new_values(jnp.minimum(take, P - 1))
        return tuple(a.at[take].set(b, mode="drop") for a, b in zip(out, new))

    return control.fori_loop(0, (count + block - 1) // block, update_block, tuple(arrays))


def _redo_tied(tied, d2, rows, run_d2, run_row, cand_d2, cand_row, id_of):
    """Merged lists ``d2``, ``rows`` (P, kk) with the ``tied`` (P,) ones redone by
    :func:`_nearest_by_id`, all at once up to ``TIE_BLOCK`` lists and otherwise
    ``TIE_BLOCK`` tied lists at a time."""
    P = d2.shape[0]
    if P <= TIE_BLOCK:
        return _nearest_by_id(run_d2, run_row, cand_d2, cand_row, id_of)

    def redo(lists):  # (TIE_BLOCK,)
        c_row = cand_row if cand_row.ndim == 1 else cand_row[lists]
        return _nearest_by_id(run_d2[lists], run_row[lists], cand_d2[lists], c_row, id_of)

    return update_selected(*selection(tied, P), TIE_BLOCK, redo, (d2, rows))


def largest(x, n: int, top_k_limit: int | None):
    """``lax.top_k(x, n)`` of rows ``x`` (P, W) by calls that each take at most ``top_k_limit``
    (None: one call), each after the positions taken before it are set to -inf.

    XLA:GPU selects with its top-k kernel only when k <= 16 and rows hold at least 1024
    values (its ``TopkSpecializer``), and otherwise sorts every row. Where a row has fewer
    than ``n`` values above -inf, the positions returned with -inf may repeat."""
    if top_k_limit is None or n <= top_k_limit:
        return lax.top_k(x, n)
    lists = jnp.arange(x.shape[0])[:, None]
    values, picks = [], []
    for start in range(0, n, top_k_limit):
        if picks:
            x = x.at[lists, picks[-1]].set(-jnp.inf)
        v, p = lax.top_k(x, min(top_k_limit, n - start))  # (P, <= top_k_limit)
        values.append(v)
        picks.append(p)
    return jnp.concatenate(values, axis=-1), jnp.concatenate(picks, axis=-1)


def merge_nearest(run_d2, run_row, cand_d2, cand_row, id_of, top_k_limit: int | None = None):
    """The ``kk`` nearest by (squared distance, global id) of running lists ``(P, kk)``
    (ascending squared distances and their rows) and candidates ``(P, C)`` (inf where
    absent) with rows ``(C,)`` (shared by every list) or ``(P, C)``, in ascending order of
    distance; ``id_of`` maps rows to global ids (absent rows included). ``top_k_limit``:
    the most one ``lax.top_k`` call selects (:func:`largest`).

    Which of equal distances a list keeps must not depend on the order candidates are
    scanned in (it differs between meshes), so selection is by (distance, id): ``top_k``
    takes one more than the list holds, and only when the last kept and the first dropped
    are equal is that list redone by a sort on both keys. Each step so keeps the ``kk``
    smallest (distance, id) of everything seen.
    """
    kk = run_d2.shape[-1]
    # The running list goes first: top_k then starts from a good heap and is cheap.
    vals, pick = largest(jnp.concatenate([-run_d2, -cand_d2], axis=-1), kk + 1, top_k_limit)
    # Both outputs are used whole and cut afterwards: used in parts of different widths,
    # they make XLA:CPU lower top_k to a full sort of every row (8x slower kNN).
    d2, rows = -vals, _take_merged(run_row, cand_row, pick)
    tied = (d2[..., kk - 1] == d2[..., kk]) & jnp.isfinite(d2[..., kk])
    kept = lambda: (d2[..., :kk], rows[..., :kk])
    return control.cond(
        jnp.any(tied),
        lambda: _redo_tied(tied, *kept(), run_d2, run_row, cand_d2, cand_row, id_of),
        kept,
    )


def merge_where_needed(
    run_d2, run_row, distances, cand_row, id_of, wanted, block: int, top_k_limit: int | None
):
    """:func:`merge_nearest` of the lists ``(P, kk)`` with their candidates (rows ``(P, C)``),
    computed only for the ``wanted`` (P,) lists, ``block`` lists at a time, or for all at
    once when most are wanted (or when ``block >= P``). ``distances(lists)`` gives the
    candidates' squared distances (m, C) from the lists ``lists`` (m,), or (P, C) from
    every list for None: only the lists merged need them. ``top_k_limit``: as
    :func:`merge_nearest`'s.

    The caller leaves out of ``wanted`` the lists that no candidate can enter
    (:func:`may_enter`). After the first candidates most lists are final, and the merge
    (``lax.top_k``, the most expensive step) then runs on the few that are not.
    """
    P = run_d2.shape[0]

    def all_lists():
        d2, row = merge_nearest(run_d2, run_row, distances(None), cand_row, id_of, top_k_limit)
        return jnp.where(wanted[:, None], d2, run_d2), jnp.where(wanted[:, None], row, run_row)

    if block >= P:
        return all_lists()
    pick, count = selection(wanted, P)  # (P,) the lists to merge, P past the end

    def merge_some(lists):  # (block,)
        d2, rows = run_d2[lists], run_row[lists]
        return merge_nearest(d2, rows, distances(lists), cand_row[lists], id_of, top_k_limit)

    some = lambda: update_selected(pick, count, block, merge_some, (run_d2, run_row))
    return control.cond(count > P // 2, all_lists, some)


def may_enter(query, cand, live, last, box):
    """Whether some ``live`` candidate (G, C) may be as near to a query (G, B) as its list's
    last squared distance ``last`` (G, B), or nearer: true for every list a candidate can
    enter (one at exactly the last distance still may, by a lower id).

    The test uses plainly rounded squared distances, cheaper than the exact ones the
    merge compares (:func:`distance2_columns`: 14% off the accelerator path's kNN density
    on 8 CPU devices, where XLA otherwise computed the exact ones twice). Both come from
    the same differences and round at most four times, so they differ by a few ulps: the
    margin is 64 ulps. XLA also flushes squares below the smallest normal number to zero,
    and may flush one form's and not the other's (a fused multiply-add keeps its
    product), so each of the three squares may differ by up to that number too: the
    margin adds four times it. ``query`` and ``cand`` are (x, y, z) arrays (G, B, 1) and
    (G, 1, C)."""
    dx, dy, dz = (periodic_delta(a, b, box) for a, b in zip(query, cand))
    approx = dx * dx + dy * dy + dz * dz  # (G, B, C)
    info = jnp.finfo(approx.dtype)
    bound = last * (1 + 64 * info.eps) + 4 * info.tiny  # inf for lists not yet full
    return jnp.any(live[:, None] & (approx <= bound[..., None]), axis=-1)


def _window_rows(region: Region, cum, first, total, t0, window: int):
    """Sorted rows (W,) of candidates ``t0 .. t0 + W - 1`` of the region's node ranges
    (laid end to end; ``cum``, ``first`` (NODES,) their cumulative ends and starts), and
    whether each is a candidate at all (``t < total``)."""
    t = t0 + jnp.arange(window, dtype=int32)
    # Range of each slot: ranges ending at or before t0, plus the ends inside the window.
    ends = jnp.zeros((window,), int32).at[jnp.where(cum > t0, cum - t0, window)].add(1, mode="drop")
    node = jnp.minimum(jnp.sum(cum <= t0, dtype=int32) + jnp.cumsum(ends), cum.shape[0] - 1)
    in_range = t < total
    return jnp.where(in_range, region.start[node] + t - first[node], 0), in_range


def scan_group(
    index: Index,
    frame: SearchFrame,
    q: Queries,
    region: Region,
    kk: int,
    chunk: int,
    merge_block: int,
    top_k_limit: int | None,
):
    """The ``kk`` nearest rows of each query of G batches of B queries (``q`` (G, B, ...))
    among its batch's region rows (``region`` (G, ...)); a query's own row is not excluded
    here: self mode keeps ``k + 1`` and drops it at the end.

    The batches step side by side through their candidates, ``chunk`` at a time: each step
    merges its batch's next ``chunk`` rows into the query lists (:func:`merge_where_needed`).
    Where that is ``merge_block`` lists at a time (CPUs), only the lists some candidate can
    enter are merged (:func:`may_enter`). Nodes come nearest first, so after the first
    steps few lists change. ``top_k_limit``: as :func:`merge_nearest`'s.

    Returns (G, B, kk) squared distances (ascending, inf where fewer were found) and sorted
    rows (``R`` where none).
    """
    G, B = q.valid.shape
    P = G * B
    R = index.rows
    box = frame.box
    cum = jnp.cumsum(region.count, axis=1)  # (G, NODES)
    first = cum - region.count
    total = cum[:, -1]  # (G,)
    qx, qy, qz = (q.canon[..., d][..., None] for d in range(3))  # (G, B, 1) each
    query = tuple(q.canon[..., d].reshape(P) for d in range(3))  # (P,) each
    window_rows = jax.vmap(_window_rows, in_axes=(0, 0, 0, 0, None, None))
    valid = q.valid.reshape(P)
    id_of = lambda rows: index.id(jnp.minimum(rows, R - 1))  # absent rows have d2 = inf

    def step(state):
        t0, run_d2, run_row = state
        row, in_range = window_rows(region, cum, first, total, t0, chunk)  # (G, C)
        cx, cy, cz = index.cx[row], index.cy[row], index.cz[row]  # (G, C) each
        local = in_frame(cx, cy, cz, index.image[row], box)  # (G, C, 3)
        live = in_range & jnp.all(
            (local >= region.lo[:, None]) & (local <= region.hi[:, None]), axis=-1
        )
        # Materialise the gathered candidates: fused into the distance kernel, the gather
        # would be repeated for every query and the kernel would not vectorise.
        live, cx, cy, cz = lax.optimization_barrier((live, cx, cy, cz))

        def distances(lists):  # (m, C) from the lists ``lists`` (m,); (P, C) for None
            if lists is None:
                d2 = distance2_columns(qx, qy, qz, cx[:, None], cy[:, None], cz[:, None], box)
                return jnp.where(live[:, None], d2, jnp.inf).reshape(P, chunk)
            g = lists // B  # (m,) their batches
            d2 = distance2_columns(*(a[lists, None] for a in query), cx[g], cy[g], cz[g], box)
            return jnp.where(live[g], d2, jnp.inf)

        wanted = valid
        if merge_block < P:  # merged a block at a time: only lists a candidate can enter
            cand = (cx[:, None], cy[:, None], cz[:, None])
            last = run_d2[:, -1].reshape(G, B)
            wanted = valid & may_enter((qx, qy, qz), cand, live, last, box).reshape(P)
        rows = jnp.broadcast_to(row[:, None], (G, B, chunk)).reshape(P, chunk)
        run_d2, run_row = merge_where_needed(
            run_d2, run_row, distances, rows, id_of, wanted, merge_block, top_k_limit
        )
        return t0 + chunk, run_d2, run_row

    init = (jnp.int32(0), jnp.full((P, kk), jnp.inf, q.canon.dtype), jnp.full((P, kk), R, int32))
    _, run_d2, run_row = control.while_loop(lambda s: s[0] < jnp.max(total), step, init)
    return run_d2.reshape(G, B, kk), run_row.reshape(G, B, kk)
