"""Local kNN search on one device: queries in key order, searched in batches and passes
until each is exact or needs the cross-device pass, each finished (self dropped, equal
distances in id order) as soon as its batch is searched.

Memory is bounded by a group of batches, not by the queries: batches are taken from a
slot table (one int per slot), their regions are recomputed where they are scanned (only
each batch's work is kept to order them), and the per-query state holds the finished
neighbour codes, not running lists.

Shapes in comments: ``n`` query rows, ``R`` sorted index rows, ``S`` slots (``n`` padded
to whole groups), ``G`` batches per group, ``B`` queries per batch, ``P = G * B``,
``kk`` list length while searching (k + 1 in self mode), ``k`` neighbours kept.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ..core import control
from ..core.cells import sort_rows
from ..core.rows import selection
from ._frame import Index, SearchFrame, morton_of
from ._region import Queries, batch_slots, plan_region
from ._scan import scan_group

int32 = jnp.int32
EXACT, AGAIN, REMOTE = 0, 1, 2  # query status: exact (or no query), search again, cross-device
PLAN_GROUPS = 8  # plans are cheap: this many groups of batches per planning step


class SearchSettings(NamedTuple):
    """Static settings of the local search (picked per backend by :mod:`._search`)."""

    k: int
    kk: int
    kept: int  # neighbours kept per query: k, or 1 (the k-th) for a density of equal masses
    self_mode: bool
    batch: int  # queries per batch, first pass
    least: int  # fewest queries of a batch in the first pass (fewer: left to the later)
    group: int  # batches scanned side by side, first pass
    again_batch: int  # the same for the later passes (scattered queries)
    again_group: int
    plan_batches: int  # most batches planned per planning step (and PLAN_GROUPS groups)
    chunk: int  # candidates per step
    merge_block: int  # lists merged together when few of a group's change (all: P)
    top_k_limit: int | None  # the most one lax.top_k call selects (None: any number)
    tree: bool  # the first pass from the host k-d tree (:mod:`._tree`), not the scan
    radius_factor: float
    gap: float  # a batch ends at a gap this wide between consecutive queries
    span: float  # or this far from its first query


class SearchState(NamedTuple):
    """Per query row: ``radius`` (n,) of its next search (negative: estimate it),
    ``bound2`` (n,) the squared distance of the kk-th row found (the cross-device pass's
    radius), ``status`` (n,) (``AGAIN`` while it must be searched), and ``codes`` (n, k)
    its finished neighbours (the last ``kept`` of the k nearest) as extended rows (``E``
    where none)."""

    radius: jax.Array
    bound2: jax.Array
    status: jax.Array
    codes: jax.Array

    @classmethod
    def start(cls, valid, kept: int, n_ext: int, dtype):
        n = valid.shape[0]
        return cls(
            jnp.full((n,), -1, dtype),
            jnp.full((n,), jnp.inf, dtype),
            jnp.where(valid, AGAIN, EXACT).astype(int32),
            jnp.full((n, kept), n_ext, int32),
        )


class QueryTable(NamedTuple):
    """The queries in key order: ``rows`` (n,) the sorted index row where each query's key
    sits (its own row for owned particles), ``valid`` (n,), and for query points their
    ``points`` (n, 3) (None for the owned particles: read from the index, so the table
    holds one int per query); ``box`` the box size."""

    index: Index
    rows: jax.Array
    valid: jax.Array
    points: jax.Array | None
    box: float

    @property
    def size(self) -> int:
        return self.rows.shape[0]

    def local(self, i):
        """Frame positions (..., 3) of queries ``i`` (...,)."""
        if self.points is not None:
            return self.points[i]
        return self.index.local(self.rows[i], self.box)

    def canon(self, i):
        """Canonical positions (..., 3) of queries ``i``."""
        return self.index.canon(self.rows[i]) if self.points is None else self.points[i]

    def id(self, i):
        """Global id excluded from the neighbours of queries ``i`` (-2 for none)."""
        if self.points is None:
            return jnp.where(self.valid[i], self.index.id(self.rows[i]), -2)
        return jnp.full(i.shape, -2, int32)

    def take(self, i, on):
        """:class:`~._region.Queries` (..., ...) of queries ``i`` (...,), valid where
        ``on``."""
        return Queries.make(self.local(i), self.canon(i), self.id(i), on, self.rows[i])


def owned_queries(index: Index, n_q: int, box: float):
    """The owned rows as queries, in key order. Returns ``(queries, home)``: ``home`` (n,)
    the owned row of each query (``n`` for padding)."""
    rows, count = selection(index.owned, n_q)  # (n,)
    valid = jnp.arange(n_q) < count
    rows = jnp.clip(rows, 0, index.rows - 1)
    return QueryTable(index, rows, valid, None, box), jnp.where(valid, index.ext_row[rows], n_q)


def point_queries(frame: SearchFrame, index: Index, origin, qpos, qvalid):
    """Query points ``qpos`` (n, 3) (valid ``qvalid``, in this pencil) in key order.
    Returns ``(queries, home)``: ``home`` (n,) the input row of each query."""
    n_q = qpos.shape[0]
    key, order = sort_rows(morton_of(frame, qpos, origin, qvalid))
    valid = jnp.arange(n_q) < jnp.sum(qvalid, dtype=int32)
    table = QueryTable(
        index, jnp.searchsorted(index.key, key).astype(int32), valid, qpos[order], frame.box
    )
    return table, jnp.where(valid, order, n_q)


def drop_self(d2, ids, codes, self_id, k: int):
    """From lists (P, k + 1) that may hold the query itself, the k nearest others."""
    kk = d2.shape[1]
    where_self = jnp.min(jnp.where(ids == self_id[:, None], jnp.arange(kk), kk), axis=1)
    before = jnp.arange(k)[None, :] < where_self[:, None]  # (P, k)
    take = lambda a: jnp.where(before, a[:, :k], a[:, 1:])
    return take(d2), take(ids), take(codes)


def order_ties(d2, ids, codes):
    """Order each row (P, k) by (d2, id): fixes the order of equal distances. Rows are
    sorted by d2 and exact ties are rare, so the rows are sorted only when one holds a
    tie (sorting a row without one leaves it as it is)."""
    if d2.shape[1] < 2:
        return codes
    tied = jnp.any((d2[:, 1:] == d2[:, :-1]) & jnp.isfinite(d2[:, 1:]))
    return control.cond(
        tied, lambda: lax.sort((d2, ids, codes), dimension=1, num_keys=2)[2], lambda: codes
    )


def finish_lists(d2, ids, codes, self_id, k: int, self_mode: bool, kept: int):
    """Neighbour codes (P, kept) from searched lists (P, kk): self dropped, ties in id
    order, the last ``kept`` of the k nearest."""
    if self_mode:
        d2, ids, codes = drop_self(d2, ids, codes, self_id, k)
    return order_ties(d2, ids, codes)[:, k - kept :]


def classify(frame: SearchFrame, d2, coverage, rho, scale: float):
    """0: exact, 1: search again with radius ``new_rho``, 2: needs the cross-device pass.
    The last column of ``d2`` (P, kk) is the distance that must be covered. A query that
    found fewer than kk rows doubles its radius (starting from ``scale``)."""
    dtype = d2.dtype
    last2 = d2[:, -1]  # (P,)
    found = jnp.isfinite(last2)
    last = jnp.sqrt(last2)
    margin = jnp.asarray(frame.margin, dtype)
    half = jnp.asarray(0.5 * frame.box, dtype) - margin
    clearance = coverage - margin
    exact = found & (clearance > 0) & (last <= clearance) & (last < half)
    full = jnp.asarray(frame.full, dtype)
    grow = jnp.minimum(jnp.maximum(2 * rho, jnp.asarray(scale, dtype)), full)
    new_rho = jnp.where(found, last * (1 + 1e-5) + margin, grow)
    again = jnp.where(found, rho < last, rho < full)
    status = jnp.where(exact, EXACT, jnp.where(again, AGAIN, REMOTE)).astype(int32)
    return status, new_rho


class LocalSearch(NamedTuple):
    """What every pass reads: the index, frame arrays and the queries (n, ...)."""

    index: Index
    frame: SearchFrame
    origin: jax.Array
    cover_lo: jax.Array
    cover_hi: jax.Array
    queries: QueryTable
    n_ext: int
    settings: SearchSettings

    def batch_queries(self, slot_query, radius):
        """Queries (G, B, ...) and their radii (G, B) of slot table rows ``slot_query``
        (G, B) (``n`` for empty slots)."""
        n = self.queries.size
        i = jnp.minimum(slot_query, n - 1)
        return self.queries.take(i, slot_query < n), radius[i]

    def plan(self, q: Queries, rho):
        s = self.settings
        return jax.vmap(
            functools.partial(
                plan_region,
                self.index,
                self.frame,
                self.origin,
                self.cover_lo,
                self.cover_hi,
                k=s.k,
                radius_factor=s.radius_factor,
            )
        )(q, rho)


def _batch_work(search: LocalSearch, slots, used, radius, batch: int, plan_batches: int):
    """Candidate rows (S / B,) of each batch of the slot table ``slots`` (S / B, B)."""
    n_batches = slots.shape[0]
    per_step = plan_batches
    while n_batches % per_step:
        per_step //= 2

    def step(carry):
        i, work = carry
        cut = lax.dynamic_slice_in_dim(slots, i * per_step, per_step)  # (per_step, B)
        region = search.plan(*search.batch_queries(cut, radius))
        count = jnp.sum(region.count, axis=1, dtype=int32)  # int32 under x64 too
        return i + 1, lax.dynamic_update_slice_in_dim(work, count, i * per_step, 0)

    steps = (used + per_step * batch - 1) // (per_step * batch)
    _, work = control.while_loop(
        lambda c: c[0] < steps, step, (jnp.int32(0), jnp.zeros((n_batches,), int32))
    )
    return work


def _search_group(search: LocalSearch, state: SearchState, slot_query, scale: float):
    """Search the batches ``slot_query`` (G, B) side by side and write each query's
    finished result into ``state``."""
    s = search.settings
    index = search.index
    q, rho_q = search.batch_queries(slot_query, state.radius)  # (G, B, ...)
    region = search.plan(q, rho_q)
    d2, rows = scan_group(
        index, search.frame, q, region, s.kk, s.chunk, s.merge_block, s.top_k_limit
    )  # (G, B, kk)
    P = slot_query.size
    d2, rows = d2.reshape(P, s.kk), rows.reshape(P, s.kk)
    rho = jnp.broadcast_to(region.rho[:, None], slot_query.shape).reshape(P)
    status, radius = classify(search.frame, d2, region.coverage.reshape(P), rho, scale)
    found = rows < index.rows
    safe = jnp.minimum(rows, index.rows - 1)
    codes = finish_lists(
        d2,
        jnp.where(found, index.id(safe), -1),
        jnp.where(found, index.ext_row[safe], search.n_ext),
        q.id.reshape(P),
        s.k,
        s.self_mode,
        s.kept,
    )  # (P, kept)
    target = slot_query.reshape(P)
    put = lambda a, v: a.at[target].set(v, mode="drop")
    return SearchState(
        put(state.radius, radius),
        put(state.bound2, d2[:, -1]),
        put(state.status, status),
        put(state.codes, codes),
    )


def _fill(slot, n: int, batch: int):
    """Queries (n,) in the batch of each query's slot (``slot`` (n,), ``n`` for none)."""
    n_batches = -(-n // batch)
    of_batch = jnp.where(slot < n, slot // batch, n_batches)
    per_batch = jnp.zeros((n_batches + 1,), int32).at[of_batch].add(1)
    return per_batch[of_batch]


def search_pass(
    search: LocalSearch, state: SearchState, batch: int, group: int, scale: float, least: int = 1
) -> SearchState:
    """Search every query whose status is ``AGAIN``, in batches of up to ``batch``
    consecutive queries, ``group`` batches side by side in order of decreasing work (so
    batches stepping together have about as many candidates). Queries that found no slot
    stay ``AGAIN`` for the next pass, and so do those in batches of fewer than ``least``
    (scattered queries, in voids: most of the batch's lists would be empty), which the
    next pass searches in smaller batches."""
    n = state.status.shape[0]
    pick, count = selection(state.status == AGAIN, n)  # (n,)
    live = jnp.arange(n) < count
    slot, used = batch_slots(
        search.queries.local(jnp.minimum(pick, n - 1)),
        live,
        batch,
        search.settings.gap,
        search.settings.span,
    )
    if least > 1:
        slot = jnp.where(_fill(slot, n, batch) >= least, slot, n)
    per_group = group * batch
    n_slots = -(-n // per_group) * per_group
    slots = jnp.full((n_slots,), n, int32).at[slot].set(jnp.where(live, pick, n), mode="drop")
    slots = slots.reshape(n_slots // batch, batch)  # (S / B, B)
    plan_batches = min(group * PLAN_GROUPS, search.settings.plan_batches)
    work = _batch_work(search, slots, used, state.radius, batch, plan_batches)
    # Batches with queries first (a batch left empty has no work either), most work first.
    filled = jnp.any(slots < n, axis=1)  # (S / B,)
    _, order = sort_rows(jnp.where(filled, -work, 1))
    used = jnp.sum(filled, dtype=int32) * batch

    def step(carry):
        i, state = carry
        ids = lax.dynamic_slice_in_dim(order, i * group, group)
        return i + 1, _search_group(search, state, slots[ids], scale)

    n_groups = (used + per_group - 1) // per_group
    _, state = control.while_loop(lambda c: c[0] < n_groups, step, (jnp.int32(0), state))
    return state


def first_scan_pass(search: LocalSearch, state: SearchState, scale: float) -> SearchState:
    """Every query with an estimated radius, in the first pass's batches."""
    s = search.settings
    return search_pass(search, state, s.batch, s.group, scale, least=s.least)


def search_again(search: LocalSearch, state: SearchState, scale: float) -> SearchState:
    """The queries still ``AGAIN`` (their k-th neighbour lay beyond the region they searched,
    or they have no result yet), with that distance as radius (or an estimate), until every
    query is exact or needs the cross-device pass. Later passes reuse one program."""
    s = search.settings
    return control.while_loop(
        lambda st: jnp.any(st.status == AGAIN),
        lambda st: search_pass(search, st, s.again_batch, s.again_group, scale),
        state,
    )
