"""Exact distributed k-nearest neighbours and kNN density estimation.

Per device (inside ``shard_map``):

1. The particles are migrated to the pencil that holds them and receive ghost copies of
   every particle within a width ``w`` of the pencil, plus periodic images along z
   (:mod:`._domain`, :func:`._fof.z_images`). ``w`` defaults to twice the k-th neighbour
   distance of a uniform density, capped at the pencil width.
2. All rows are sorted by a Morton key of their position in the device's frame, so every
   octree node at every level is one contiguous range of rows (:mod:`._cells`).
3. Queries (the owned particles, or query points migrated to the pencil that holds them)
   are taken in key order, in batches of up to ``batch_size`` consecutive queries (a batch
   ends early at a gap, so scattered queries get batches of their own). A batch searches
   the box ``bbox(batch) + rho``, enumerated as at most 64 octree nodes of the finest level
   that covers it, nearest first: a batch's work follows its own density (fine nodes in
   clusters, coarse ones in voids). ``rho`` is estimated from the batch's own density.
   Batches are ordered by work and stepped ``group_size`` at a time through their
   candidates; each step tests a window of candidates against every query's current k-th
   distance and merges up to ``chunk_size`` of those that pass into the running k nearest
   (``lax.top_k`` with the running list first).
4. A query is exact when its k-th distance is at most its distance to the boundary of the
   region known to be complete (the searched nodes, within the ghost layer and within half
   a box of every query of its batch). Others are searched again with their k-th distance
   as radius (or twice the radius when fewer than k rows were found), in later passes of
   the same program, until every query is exact or its sphere leaves the ghost layer.
   These queries are scattered, so later passes use batches of at most 4. Every pass
   writes its results straight into the per-query state.
5. Those last ones (voids near a pencil face, or k-th neighbours beyond a narrow pencil)
   are gathered on every device; each device whose pencil their sphere reaches returns its
   own particles' k nearest (brute force over the chunks of its rows the sphere reaches),
   and the home device merges the answers. Every particle is owned once, so the merge is
   exact.

Every distance is computed by :func:`._geometry.periodic_distance2` from canonical wrapped
coordinates, so distances are bitwise identical on every mesh (ids may differ only among
neighbours at exactly equal distances, which are listed in id order). Self exclusion keeps
k + 1 neighbours and drops the query's own id. Neighbour selection runs on stopped
gradients and without reverse-mode loops; distances are then recomputed from the selected
neighbours' positions, which flow differentiably through the domain exchange, so
``jax.grad`` works with the neighbour selection held fixed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from ._cells import MORTON_BITS, morton_key, sort_rows
from ._config import KNNConfig
from ._domain import (Decomposition, decompose, domain_status, migrate, pmax_all, psum_all,
                      return_trip, selection)
from ._fof import z_images
from ._frontend import (Problem, local_fields, local_valid, prepare, program_cache,
                        row_masses, trim_padding)
from ._geometry import periodic_delta, periodic_distance2, wrap
from ._layout import Pencils, width_fraction
from ._particles import Particles
from ._status import Limit, Status, is_traced

int32 = jnp.int32
_SENTINEL = np.iinfo(np.int32).max
_NODES = 64  # most octree nodes enumerated by one batch
_LEVELS = MORTON_BITS
_PLAN_GROUPS = 8  # plans are cheap: this many groups of batches per planning step,
_PLAN_BATCHES = 64  # but at most this many batches (on accelerators: 4x _ACCELERATOR)
_GAP = 3.0  # a batch ends at a gap of this many uniform k-th neighbour distances
_TIE_BLOCK = 64  # rows whose equal distances are put in id order together
_AGAIN_BATCH = 4  # queries per batch when searched again (they are scattered)
# A GPU pays a fixed cost per loop step (kernel launches and a device-to-host read of the
# loop condition) that a CPU hardly does, so there many more batches go side by side. At
# 128^3 on an H100 this takes kNN from 4.6 s (the CPU setting) to 0.23 s.
_GROUP_SIZE = 8  # batches per step on CPU
_ACCELERATOR = 1024  # batches per step elsewhere, and 4x that per planning step


def _backend() -> str:
    return jax.default_backend()


def _chunk_for_backend(chunk: int, kk: int) -> int:
    """Candidates per merge step. XLA's GPU ``top_k`` sorts each row, padded to a power of
    two, so there the running list plus the chunk is cut to one (kNN k = 16 at 128^3 on
    an H100: 0.19 s against 0.23 s for rows of 17 + 256)."""
    if _backend() != "gpu":
        return chunk
    return max(kk, (1 << (kk + chunk).bit_length() - 1) - kk)


# ----------------------------------------------------------------------------------------
# Geometry of one device's search frame


def uniform_knn_radius(k: int, total: int, box_size: float) -> float:
    """The k-th neighbour distance in a uniform density of ``total`` particles."""
    density = total / box_size ** 3
    return (3 * k / (4 * math.pi * density)) ** (1 / 3)


def _requested_width(k: int, total: int, box_size: float, config: KNNConfig) -> float:
    if config.ghost_width is not None:
        return max(float(config.ghost_width), 0.0)
    return config.ghost_factor * uniform_knn_radius(k, total, box_size)


def ghost_width(k: int, total: int, pencils: Pencils, config: KNNConfig = KNNConfig()) -> float:
    """Ghost layer used by kNN: ``config.ghost_width`` or ``ghost_factor`` times the uniform
    k-th neighbour distance, capped at the narrower pencil side (a wider sphere is completed
    by the cross-device pass)."""
    wx, wy = pencils.widths
    return float(min(_requested_width(k, total, pencils.box_size, config), wx, wy))


@dataclasses.dataclass(frozen=True)
class _Frame:
    """Static geometry of a device's frame: the pencil plus ghost layers of ``width`` in x
    and y, the box plus images of ``width`` in z, inside a cube of side ``side``."""

    box: float
    width: float
    side: float
    margin: float

    @classmethod
    def of(cls, pencils: Pencils, width: float, dtype) -> "_Frame":
        wx, wy = pencils.widths
        box = pencils.box_size
        side = max(wx, wy, box) + 2 * width
        side *= 1 + 1e-5
        eps = float(np.finfo(dtype).eps)
        return cls(box, float(width), float(side), 32 * eps * (box + side))

    def arrays(self, pencils: Pencils, dtype):
        """Traced origin of the frame and the box the ghost layer fully covers."""
        lo, hi = pencils.bounds()
        w = jnp.asarray(self.width, dtype)
        origin = jnp.stack([lo[0].astype(dtype) - w, lo[1].astype(dtype) - w, -w])
        top = jnp.stack([hi[0].astype(dtype) + w, hi[1].astype(dtype) + w,
                         jnp.asarray(self.box, dtype) + w])
        m = jnp.asarray(self.margin, dtype)
        return origin, origin + m, top - m

    @property
    def full(self) -> float:
        """A radius that makes any batch search the whole frame."""
        return 4.0 * self.side


def _cells_of(frame: _Frame, local, origin):
    fine = frame.side / (1 << _LEVELS)
    c = jnp.floor((local - origin) / jnp.asarray(fine, local.dtype)).astype(int32)
    return jnp.clip(c, 0, (1 << _LEVELS) - 1)


class Index(NamedTuple):
    """One device's rows (owned, ghosts, z images) sorted by Morton key.

    Attributes:
      key: (R,) sorted keys, int32 max after the ``n`` valid rows.
      canon: (R, 3) canonical positions (stopped gradients), used for every distance.
      cx, cy, cz: (R,) the same, one array per coordinate (contiguous loads in the
        distance kernels).
      local: (R, 3) positions in the device's frame.
      id: (R,) global ids.
      ext_row: (R,) extended row (:class:`~._domain.Extended`) each sorted row copies.
      owned: (R,) bool: an owned row itself (not a ghost, not an image).
      n: number of valid rows.
    """

    key: jax.Array
    canon: jax.Array
    cx: jax.Array
    cy: jax.Array
    cz: jax.Array
    local: jax.Array
    id: jax.Array
    ext_row: jax.Array
    owned: jax.Array
    n: jax.Array


def build_index(frame: _Frame, ext, origin, image_rows: int):
    """Sort a device's extended rows plus z images. Returns ``(index, need_images)``."""
    local, valid, source, need_images = z_images(ext, frame.width, frame.box, image_rows)
    n_ext = ext.pos.shape[0]
    canon_ext = lax.stop_gradient(ext.pos)
    local = lax.stop_gradient(local)
    ext_row = jnp.concatenate([jnp.arange(n_ext, dtype=int32), source])
    ext_row = jnp.where(valid, ext_row, 0)
    ids = jnp.where(valid, ext.id[ext_row], _SENTINEL)
    c = _cells_of(frame, local, origin)
    key = jnp.where(valid, morton_key(c[:, 0], c[:, 1], c[:, 2]), _SENTINEL)
    key, order = sort_rows(key)
    sid = ids[order]
    owned = (order < ext.owned) & (key != _SENTINEL)
    er = ext_row[order]
    canon = canon_ext[er]
    index = Index(key, canon, canon[:, 0], canon[:, 1], canon[:, 2], local[order], sid, er, owned,
                  jnp.sum(valid, dtype=int32))
    return index, need_images


# ----------------------------------------------------------------------------------------
# Batched search


class Queries(NamedTuple):
    """Query rows packed in two arrays (fewer arrays to move, smaller programs).

    ``f`` (n, 6) holds the position in the device's frame and the canonical position;
    ``i`` (n, 3) the global id excluded from the query's neighbours (-2 for none), a valid
    flag, and the sorted row where the query's key sits (its own row for owned particles).
    """

    f: jax.Array
    i: jax.Array

    @classmethod
    def make(cls, local, canon, ids, valid, p):
        return cls(jnp.concatenate([local, canon], axis=-1),
                   jnp.stack([ids, valid.astype(int32), p], axis=-1))

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
    def p(self):
        return self.i[..., 2]


def _distance2_cols(ax, ay, az, bx, by, bz, box):
    """:func:`~._geometry.periodic_distance2` from separate coordinate arrays (broadcast),
    which keeps every operation vectorised along the candidates (same values bitwise)."""
    dx, dy, dz = (periodic_delta(a, b, box) for a, b in ((ax, bx), (ay, by), (az, bz)))
    return dx * dx + dy * dy + dz * dz


def _batch_slots(local, valid, batch: int, gap: float, span: float):
    """Slots of queries (in key order, valid first) in batches of ``batch``: a batch ends
    early where the next query is farther than ``gap`` from the previous one (so scattered
    queries, e.g. the few searched again, get small batches of their own) or farther than
    ``span`` from the batch's first query. Returns the slot of each query (``n`` where none
    is left) and the number of slots used."""
    n = local.shape[0]
    i = jnp.arange(n, dtype=int32)

    def runs(brk):
        start = lax.cummax(jnp.where(brk, i, 0))
        in_run = i - start
        return brk | (in_run % batch == 0), in_run

    step = jnp.max(jnp.abs(local - jnp.roll(local, 1, axis=0)), axis=1)
    brk, _ = runs((i == 0) | (step > gap))
    first = lax.cummax(jnp.where(brk, i, 0))
    brk = brk | (jnp.max(jnp.abs(local - local[first]), axis=1) > span)
    brk, in_run = runs(brk)
    slot = (jnp.cumsum(brk.astype(int32)) - 1) * batch + in_run % batch
    slot = jnp.where(valid & (slot < n), slot, n)
    used = jnp.max(jnp.where(slot < n, slot + 1, 0))
    return slot, used


class _Plan(NamedTuple):
    """Where one batch searches: candidate row ranges (one per octree node) covering the
    box ``[lo, hi]`` (local frame) whose rows are candidates, and the distance from each
    query to the boundary of the region known to be complete."""

    start: jax.Array
    count: jax.Array
    lo: jax.Array
    hi: jax.Array
    coverage: jax.Array
    rho: jax.Array


def _plan_batch(index: Index, frame: _Frame, origin, cover_lo, cover_hi, q: Queries, rho_q,
                k: int, radius_factor: float) -> _Plan:
    """The region of one batch: its bounding box grown by a radius ``rho``, enumerated as
    at most ``_NODES**3`` octree nodes of the finest level that covers it."""
    dtype = q.canon.dtype
    R = index.key.shape[0]
    big = jnp.asarray(jnp.inf, dtype)
    any_valid = jnp.any(q.valid)
    qmin = jnp.min(jnp.where(q.valid[:, None], q.local, big), axis=0)
    qmax = jnp.max(jnp.where(q.valid[:, None], q.local, -big), axis=0)
    qmin = jnp.where(any_valid, qmin, origin)
    qmax = jnp.where(any_valid, qmax, origin)
    full = jnp.asarray(frame.full, dtype)
    # A negative radius asks for an estimate: the rows between the batch's first and last
    # query in key order, over the volume of the batch's bounding box, give the density.
    p_lo = jnp.min(jnp.where(q.valid, q.p, R))
    p_hi = jnp.max(jnp.where(q.valid, q.p, -1))
    rows_in = jnp.maximum(p_hi - p_lo + 1, 1).astype(dtype)
    extent = qmax - qmin
    extent = jnp.maximum(extent, jnp.max(extent) / 4)
    volume = jnp.prod(extent)
    r_est = (3 * k * volume / (4 * np.pi * rows_in)) ** (1 / 3)
    estimate = jnp.where(volume > 0, radius_factor * r_est, 0)
    given = jnp.max(jnp.where(q.valid, rho_q, 0))
    rho = jnp.where(jnp.any(q.valid & (rho_q < 0)), jnp.maximum(estimate, given), given)
    rho = jnp.minimum(rho, full).astype(dtype)

    side = jnp.asarray(frame.side, dtype)
    lo = jnp.clip(qmin - rho - origin, 0, side)
    hi = jnp.clip(qmax + rho - origin, 0, side)
    # The finest level at which the region spans at most _NODES nodes.
    levels = jnp.arange(_LEVELS + 1, dtype=int32)
    scales = jnp.left_shift(1, levels)
    sides = side / scales.astype(dtype)
    lo_n = jnp.clip(jnp.floor(lo[None, :] / sides[:, None]).astype(int32), 0, scales[:, None] - 1)
    hi_n = jnp.clip(jnp.floor(hi[None, :] / sides[:, None]).astype(int32), lo_n,
                    scales[:, None] - 1)
    spans = hi_n - lo_n + 1
    fits = jnp.prod(spans, axis=1) <= _NODES
    level = jnp.max(jnp.where(fits, levels, 0))
    scale, node_side = scales[level], sides[level]
    n_lo, n_hi, span = lo_n[level], hi_n[level], spans[level]
    i = jnp.arange(_NODES, dtype=int32)
    nodes = n_lo[None, :] + jnp.stack([i // (span[1] * span[2]), (i // span[2]) % span[1],
                                       i % span[2]], axis=1)
    node_ok = (i < jnp.prod(span)) & any_valid
    nodes = jnp.where(node_ok[:, None], nodes, 0)
    prefix = morton_key(nodes[:, 0], nodes[:, 1], nodes[:, 2])
    shift = 3 * (_LEVELS - level)
    bounds = jnp.searchsorted(index.key, jnp.concatenate([jnp.left_shift(prefix, shift),
                                                          jnp.left_shift(prefix + 1, shift)]))
    start, end = bounds[:_NODES].astype(int32), bounds[_NODES:].astype(int32)
    count = jnp.where(node_ok, end - start, 0)
    # Nearest nodes first: the running k nearest become good early, which makes the
    # later merges cheap.
    centre = (qmin + qmax) / 2 - origin
    mid = (nodes.astype(dtype) + 0.5) * node_side
    dist = jnp.where(node_ok, jnp.sum((mid - centre) ** 2, axis=1), big)
    # Ranks from all pairwise comparisons: far cheaper than XLA:CPU's comparison sort.
    before = (dist[None, :] < dist[:, None]) | ((dist[None, :] == dist[:, None])
                                                & (i[None, :] < i[:, None]))
    # XLA materialises the comparisons: count them in the narrowest type a rank fits.
    rank = jnp.sum(before, axis=1, dtype=jnp.int8 if _NODES <= 128 else int32).astype(int32)
    start = jnp.zeros_like(start).at[rank].set(start, unique_indices=True)
    count = jnp.zeros_like(count).at[rank].set(count, unique_indices=True)

    # Complete region: the node box (unbounded at the frame's edges) within the ghost cover
    # and within half a box of every query of the batch; candidates outside that window are
    # dropped, so a row is never a second periodic image of a particle.
    half = jnp.asarray(0.5 * frame.box - frame.margin, dtype)
    f_lo = qmax - half
    f_hi = qmin + half
    box_lo = jnp.where(n_lo == 0, -big, origin + n_lo.astype(dtype) * node_side)
    box_hi = jnp.where(n_hi == scale - 1, big, origin + (n_hi + 1).astype(dtype) * node_side)
    c_lo = jnp.maximum(jnp.maximum(box_lo, cover_lo), f_lo)
    c_hi = jnp.minimum(jnp.minimum(box_hi, cover_hi), f_hi)
    coverage = jnp.min(jnp.minimum(q.local - c_lo, c_hi - q.local), axis=1)
    return _Plan(start, count, f_lo, f_hi, coverage, rho)


def _merge_nearest(run_d2, run_row, cand_d2, cand_row):
    """The ``kk`` nearest of a running list ``(B, kk)`` (ascending squared distances and
    their rows) and a chunk of candidates ``(B, C)`` (inf where absent) with rows ``(C,)``,
    in ascending order. Equal distances keep the running list first, then candidate order.
    """
    kk = run_d2.shape[-1]
    # The running list goes first: top_k then starts from a good heap and is cheap.
    vals, pick = lax.top_k(jnp.concatenate([-run_d2, -cand_d2], axis=-1), kk)
    prev = jnp.take_along_axis(run_row, jnp.minimum(pick, kk - 1), axis=-1)
    return -vals, jnp.where(pick < kk, prev, cand_row[jnp.maximum(pick - kk, 0)])


def _scan_batch(index: Index, frame: _Frame, q: Queries, plan: _Plan, kk: int, chunk: int,
                window: int):
    """The ``kk`` nearest rows of one batch of B queries among its plan's rows (a query's
    own row is not excluded here: self mode keeps ``k + 1`` and drops it at the end).

    Each step computes the distances from every query to the next ``window`` candidate
    rows, keeps the candidates nearer to some query than that query's current k-th
    neighbour, and merges the first ``chunk`` of those into the running lists (the step
    ends after them when more were kept). Nodes come nearest first, so after the first
    steps few candidates are kept and a step covers a whole window: the merge, the
    expensive part, then runs once per window rather than once per ``chunk`` candidates.
    With ``window == chunk`` there is nothing to select, and each window is merged whole.

    Returns (B, kk) squared distances (ascending, inf where fewer were found) and sorted
    rows.
    """
    B = q.canon.shape[0]
    R = index.key.shape[0]
    box = frame.box
    count = plan.count
    cum = jnp.cumsum(count)
    first = cum - count
    total = cum[-1]
    slots = jnp.arange(window, dtype=int32)

    qx, qy, qz = (q.canon[:, d][:, None] for d in range(3))

    def step(state):
        t0, run_d2, run_row = state
        t = t0 + slots
        # Range of each slot: ranges ending at or before t0, plus the ends inside the window.
        ends = jnp.zeros((window,), int32).at[jnp.where(cum > t0, cum - t0, window)].add(
            1, mode="drop")
        seg = jnp.minimum(jnp.sum(cum <= t0, dtype=int32) + jnp.cumsum(ends),
                          count.shape[0] - 1)
        row = jnp.where(t < total, plan.start[seg] + t - first[seg], 0)
        local = index.local[row]
        live = (t < total) & jnp.all((local >= plan.lo) & (local <= plan.hi), axis=1)
        # Materialise the gathered candidates: fused into the distance kernel, the gather
        # would be repeated for every query and the kernel would not vectorise.
        live, cx, cy, cz = lax.optimization_barrier((live, index.cx[row], index.cy[row],
                                                     index.cz[row]))
        d2 = _distance2_cols(qx, qy, qz, cx[None, :], cy[None, :], cz[None, :], box)
        d2 = jnp.where(live[None, :], d2, jnp.inf)
        if window == chunk:  # nothing to select: the merge takes the whole window
            return (t0 + window,) + _merge_nearest(run_d2, run_row, d2, row)
        # A candidate no nearer than a query's k-th cannot enter its list (ties keep the
        # running list first); empty query slots want none.
        kth = jnp.where(q.valid, run_d2[:, -1], -jnp.inf)
        keep = jnp.any(d2 < kth[:, None], axis=0)
        rank = jnp.cumsum(keep.astype(int32)) - 1
        take = jnp.where(keep & (rank < chunk), rank, chunk)
        pick = jnp.full((chunk,), window, int32).at[take].set(slots, mode="drop")
        has = pick < window
        pc = jnp.minimum(pick, window - 1)
        # Recomputed (same values bitwise): a column gather from d2 costs a transpose.
        crow = row[pc]
        cand_d2 = _distance2_cols(qx, qy, qz, index.cx[crow][None, :], index.cy[crow][None, :],
                                  index.cz[crow][None, :], box)
        cand_d2 = jnp.where(has[None, :], cand_d2, jnp.inf)
        run_d2, run_row = _merge_nearest(run_d2, run_row, cand_d2, jnp.where(has, crow, R))
        # Resume after the last merged candidate when the window kept more than a chunk.
        over = rank[-1] >= chunk
        next_t0 = jnp.where(over, t0 + pick[chunk - 1] + 1, t0 + window)
        return next_t0, run_d2, run_row

    init = (jnp.int32(0), jnp.full((B, kk), jnp.inf, q.canon.dtype), jnp.full((B, kk), R, int32))
    _, run_d2, run_row = lax.while_loop(lambda s: s[0] < total, step, init)
    return run_d2, run_row


def _search(index: Index, frame: _Frame, origin, cover_lo, cover_hi, q: Queries, rho_q, target,
            count, state, k: int, cfg: KNNConfig, batch: int, group: int, self_mode: bool,
            scale: float):
    """Search every valid query (the first ``count`` rows of ``q``) in batches of
    ``batch`` consecutive queries, and write each query's result to its row ``target``
    of the per-query ``state`` (see :func:`knn_device`).

    First every batch plans its region; then the batches are taken in order of decreasing
    work, ``group`` side by side, so that batches stepping through their candidate chunks
    together have about as many chunks each. Only batches holding valid queries are
    planned and scanned. ``scale`` is the radius from which a query that found fewer than
    k rows starts growing (:func:`_classify`).
    """
    n = q.canon.shape[0]
    dtype = q.canon.dtype
    g = group
    per_group = g * batch
    padded = -(-n // per_group) * per_group
    nb = padded // batch
    pad = padded - n

    def padq(a, fill):
        return jnp.concatenate([a, jnp.full((pad,) + a.shape[1:], fill, a.dtype)]) if pad else a

    qb = Queries(padq(q.f, 0), padq(q.i, 0))
    qb = jax.tree.map(lambda a: a.reshape((nb, batch) + a.shape[1:]), qb)
    rb = padq(rho_q, 0).reshape(nb, batch)
    tb = padq(target, state[0].shape[0]).reshape(nb, batch)
    n_groups = (count + per_group - 1) // per_group
    plan_fn = jax.vmap(functools.partial(_plan_batch, index, frame, origin, cover_lo, cover_hi,
                                         k=k, radius_factor=cfg.radius_factor))
    nodes = _NODES
    plans = _Plan(jnp.zeros((nb, nodes), int32), jnp.zeros((nb, nodes), int32),
                  jnp.zeros((nb, 3), dtype), jnp.zeros((nb, 3), dtype),
                  jnp.zeros((nb, batch), dtype), jnp.zeros((nb,), dtype))

    # Plans are cheap: many batches per step (fewer loop iterations, less overhead), but
    # each batch's planning temporaries grow with _NODES**2.
    pg = min(g * _PLAN_GROUPS, _PLAN_BATCHES if _backend() == "cpu" else 4 * _ACCELERATOR)
    while nb % pg:
        pg //= 2

    def plan_body(carry):
        gi, plans = carry
        s = gi * pg
        cut = lambda a: lax.dynamic_slice_in_dim(a, s, pg)
        new = plan_fn(jax.tree.map(cut, qb), cut(rb))
        return gi + 1, jax.tree.map(lambda buf, v: lax.dynamic_update_slice_in_dim(buf, v, s, 0),
                                    plans, new)

    n_plan = (count + pg * batch - 1) // (pg * batch)
    _, plans = lax.while_loop(lambda s: s[0] < n_plan, plan_body, (jnp.int32(0), plans))
    work = jnp.sum(plans.count, axis=1)
    _, order = sort_rows(-work)
    kk = k + 1 if self_mode else k
    chunk = _chunk_for_backend(cfg.chunk_size, kk)
    # Testing candidates is cheap and merging them costs more as kk grows, so long lists
    # test several chunks per merge (k = 32 at 128^3: 6% faster; k = 8: 5% slower); short
    # ones merge every chunk as it comes.
    window = chunk * max(1, kk // 16)
    scan_fn = jax.vmap(functools.partial(_scan_batch, index, frame, kk=kk, chunk=chunk,
                                         window=window))

    def scan_body(carry):
        gi, fs, is_ = carry
        ids = lax.dynamic_slice_in_dim(order, gi * g, g)
        plan = jax.tree.map(lambda a: a[ids], plans)
        d2, row = scan_fn(jax.tree.map(lambda a: a[ids], qb), plan)
        d2, row = d2.reshape(per_group, kk), row.reshape(per_group, kk)
        rho = jnp.broadcast_to(plan.rho[:, None], (g, batch)).reshape(per_group)
        status, new_rho = _classify(frame, d2, plan.coverage.reshape(per_group), rho, scale)
        t = tb[ids].reshape(per_group)
        fs = fs.at[t].set(jnp.concatenate([d2, new_rho[:, None]], 1), mode="drop")
        is_ = is_.at[t].set(jnp.concatenate([row, status[:, None]], 1), mode="drop")
        return gi + 1, fs, is_

    _, fs, is_ = lax.while_loop(lambda s: s[0] < n_groups, scan_body, (jnp.int32(0),) + state)
    return fs, is_


def _classify(frame: _Frame, d2, coverage, rho, scale: float):
    """0: exact, 1: search again with radius ``new_rho``, 2: needs the cross-device pass.
    The last column of ``d2`` is the distance that must be covered. A query that found
    fewer than k rows doubles its radius (starting from ``scale``)."""
    dtype = d2.dtype
    rk2 = d2[:, -1]
    found = jnp.isfinite(rk2)
    rk = jnp.sqrt(rk2)
    m = jnp.asarray(frame.margin, dtype)
    half = jnp.asarray(0.5 * frame.box, dtype) - m
    cov = coverage - m
    exact = found & (cov > 0) & (rk <= cov) & (rk < half)
    full = jnp.asarray(frame.full, dtype)
    grow = jnp.minimum(jnp.maximum(2 * rho, jnp.asarray(scale, dtype)), full)
    new_rho = jnp.where(found, rk * (1 + 1e-5) + m, grow)
    again = jnp.where(found, rho < rk, rho < full)
    status = jnp.where(exact, 0, jnp.where(again, 1, 2)).astype(int32)
    return status, new_rho


# ----------------------------------------------------------------------------------------
# Cross-device pass for spheres that leave the ghost layer


def _devices(pencils: Pencils):
    return tuple(a for a in (pencils.x_axis, pencils.y_axis) if a)


def _all_gather(pencils: Pencils, x):
    """Stack ``x`` from every device, in device order ``i * py + j``: (D, ...)."""
    if pencils.y_axis:
        x = lax.all_gather(x, pencils.y_axis)
    else:
        x = x[None]
    if pencils.x_axis:
        x = lax.all_gather(x, pencils.x_axis)
    else:
        x = x[None]
    return x.reshape((pencils.num_devices,) + x.shape[2:])


def _all_to_all(pencils: Pencils, x):
    """``x`` (D, ...): send ``x[d]`` to device ``d``; returns what each device sent here."""
    shape = x.shape
    x = x.reshape((pencils.px, pencils.py) + shape[1:])
    if pencils.x_axis:
        x = lax.all_to_all(x, pencils.x_axis, 0, 0)
    if pencils.y_axis:
        x = lax.all_to_all(x, pencils.y_axis, 1, 1)
    return x.reshape(shape)


def _interval_gap(q, lo, hi, box):
    """Periodic distance from coordinate ``q`` to the interval [lo, hi] (hi - lo < box)."""
    gaps = [jnp.maximum(jnp.maximum(lo - (q + s), (q + s) - hi), 0) for s in (-box, 0.0, box)]
    return jnp.minimum(jnp.minimum(gaps[0], gaps[1]), gaps[2])


def _remote_search(pencils: Pencils, frame: _Frame, index: Index, own_rows, own_count, qc, qid,
                   bound2, kk: int, chunk: int, block: int):
    """The ``kk`` nearest owned particles of this device for every device's remote queries.

    ``own_rows`` are this device's owned sorted rows in key order, cut into chunks of
    ``chunk`` rows with bounding boxes. Only the queries whose sphere (radius
    ``sqrt(bound2)``) reaches this pencil are searched, ``block`` at a time, and only
    against the chunks their spheres reach. Returns (Q, kk) squared distances and sorted
    rows (``R`` where none).
    """
    dtype = qc.dtype
    box = frame.box
    R = index.key.shape[0]
    Q = qc.shape[0]
    m = jnp.asarray(frame.margin, dtype)
    reach = jnp.sqrt(bound2) + m  # inf stays inf
    lo, hi = pencils.bounds()
    gap = [_interval_gap(qc[:, d], lo[d].astype(dtype), hi[d].astype(dtype), box) if n > 1
           else jnp.zeros((Q,), dtype) for d, n in ((0, pencils.px), (1, pencils.py))]
    relevant = (jnp.sqrt(gap[0] ** 2 + gap[1] ** 2) <= reach) & (qid != -3)
    rel, n_rel = selection(relevant, Q)

    n_own = own_rows.shape[0]
    n_chunks = -(-n_own // chunk)
    rows_all = jnp.concatenate([own_rows, jnp.full((n_chunks * chunk - n_own,), R, int32)])
    rows_all = rows_all.reshape(n_chunks, chunk)
    live_all = (rows_all < R) & (jnp.arange(n_chunks * chunk).reshape(n_chunks, chunk) < own_count)
    cpos = index.canon[jnp.clip(rows_all, 0, R - 1)]
    big = jnp.asarray(jnp.inf, dtype)
    cmin = jnp.min(jnp.where(live_all[..., None], cpos, big), axis=1)
    cmax = jnp.max(jnp.where(live_all[..., None], cpos, -big), axis=1)

    out_d2 = jnp.full((Q + 1, kk), jnp.inf, dtype)
    out_row = jnp.full((Q + 1, kk), R, int32)

    def block_body(state):
        b, out_d2, out_row = state
        sel = lax.dynamic_slice_in_dim(jnp.concatenate([rel, jnp.full((block,), Q, int32)]),
                                       b * block, block)
        on = sel < Q
        sc = jnp.clip(sel, 0, Q - 1)
        bq, breach = qc[sc], jnp.where(on, reach[sc], -1)
        g = [_interval_gap(bq[:, None, d], cmin[None, :, d], cmax[None, :, d], box)
             for d in range(3)]
        near = jnp.sqrt(g[0] ** 2 + g[1] ** 2 + g[2] ** 2) <= breach[:, None]
        todo, n_todo = selection(jnp.any(near, axis=0), n_chunks)

        def chunk_body(state):
            i, run_d2, run_row = state
            c = todo[i]
            rows = rows_all[c]
            rc = jnp.clip(rows, 0, R - 1)
            d2 = periodic_distance2(bq[:, None, :], index.canon[rc][None, :, :], box)
            ok = live_all[c][None, :] & near[:, c][:, None]
            return (i + 1,) + _merge_nearest(run_d2, run_row, jnp.where(ok, d2, jnp.inf), rows)

        init = (jnp.int32(0), jnp.full((block, kk), jnp.inf, dtype),
                jnp.full((block, kk), R, int32))
        _, d2, row = lax.while_loop(lambda s: s[0] < n_todo, chunk_body, init)
        return b + 1, out_d2.at[sel].set(d2), out_row.at[sel].set(row)

    n_blocks = (n_rel + block - 1) // block
    _, out_d2, out_row = lax.while_loop(lambda s: s[0] < n_blocks, block_body,
                                        (jnp.int32(0), out_d2, out_row))
    return out_d2[:Q], out_row[:Q]


# ----------------------------------------------------------------------------------------
# One device


class Neighbours(NamedTuple):
    """Per-query result on the device: squared distances used for the selection, global
    ids, neighbour positions (differentiable) and masses, and a resolved flag."""

    d2: jax.Array
    id: jax.Array
    pos: jax.Array
    mass: jax.Array
    ok: jax.Array


def _sort_ties(d2, ids, codes):
    """Order each row by (d2, id): fixes the order of equal distances. Rows are already
    sorted by d2 and exact ties are rare, so only the rows holding one are sorted,
    ``_TIE_BLOCK`` at a time."""
    n, k = d2.shape
    if k < 2:
        return d2, ids, codes
    tied = jnp.any((d2[:, 1:] == d2[:, :-1]) & jnp.isfinite(d2[:, 1:]), axis=1)
    block = min(n, _TIE_BLOCK)
    rows, count = selection(tied, n)
    rows = jnp.concatenate([rows, jnp.full((block,), n, int32)])

    def sort_block(state):
        b, d2, ids, codes = state
        r = lax.dynamic_slice_in_dim(rows, b * block, block)
        rc = jnp.minimum(r, n - 1)
        ordered = lax.sort((d2[rc], ids[rc], codes[rc]), dimension=1, num_keys=2)
        d2, ids, codes = (a.at[r].set(v, mode="drop") for a, v in zip((d2, ids, codes), ordered))
        return b + 1, d2, ids, codes

    _, d2, ids, codes = lax.while_loop(lambda s: s[0] * block < count, sort_block,
                                       (jnp.int32(0), d2, ids, codes))
    return d2, ids, codes


def _drop_self(d2, ids, codes, self_id, k: int):
    """From lists of k + 1 that may hold the query itself, the k nearest others."""
    kk = d2.shape[1]
    is_self = ids == self_id[:, None]
    where_self = jnp.min(jnp.where(is_self, jnp.arange(kk), kk), axis=1)
    before = jnp.arange(k)[None, :] < where_self[:, None]
    take = lambda a: jnp.where(before, a[:, :k], a[:, 1:])
    return take(d2), take(ids), take(codes)


def knn_device(pencils: Pencils, ext, ext_pos, ext_mass, k: int, width: float,
               config: KNNConfig, n0: int, queries=None):
    """kNN on one device's extended rows.

    Args:
      ext: the :class:`~._domain.Extended` rows of a decomposition with ghosts of ``width``.
      ext_pos, ext_mass: differentiable canonical positions and masses of the extended rows
        (the selection uses ``ext.pos`` with stopped gradients).
      queries: None for the owned particles themselves (self excluded), or
        ``(pos, valid)`` of query points that lie in this device's pencil.

    Returns ``(neighbours, needs, limits)`` where ``neighbours`` has one row per owned row
    (or per query row), in that order.
    """
    dtype = ext.pos.dtype
    frame = _Frame.of(pencils, width, dtype)
    dom = config.domain
    image_rows = dom.image_rows(n0, width_fraction(pencils, width), width / pencils.box_size)
    origin, cover_lo, cover_hi = frame.arrays(pencils, dtype)
    index, need_images = build_index(frame, ext, origin, image_rows)
    R = index.key.shape[0]
    E = ext.pos.shape[0]
    self_mode = queries is None
    kk = k + 1 if self_mode else k

    if self_mode:
        n_q = ext.owned
        sel, count = selection(index.owned, n_q)
        qvalid = jnp.arange(n_q) < count
        sc = jnp.clip(sel, 0, R - 1)
        q = Queries.make(index.local[sc], index.canon[sc], jnp.where(qvalid, index.id[sc], -2),
                    qvalid, sc)
        home = jnp.where(qvalid, index.ext_row[sc], n_q)  # owned row of each query
    else:
        qpos, qv = queries
        qpos = lax.stop_gradient(qpos)
        n_q = qpos.shape[0]
        c = _cells_of(frame, qpos, origin)
        qkey = jnp.where(qv, morton_key(c[:, 0], c[:, 1], c[:, 2]), _SENTINEL)
        qkey, order = sort_rows(qkey)
        count = jnp.sum(qv, dtype=int32)
        qvalid = jnp.arange(n_q) < count
        qs = qpos[order]
        q = Queries.make(qs, qs, jnp.full((n_q,), -2, int32), qvalid,
                         jnp.searchsorted(index.key, qkey).astype(int32))
        home = jnp.where(qvalid, order, n_q)

    # Searches: first every query with an estimated radius, then the queries whose k-th
    # neighbour lay beyond the region they searched, with that distance as radius, until
    # every query is exact or needs the cross-device pass. Passes reuse one program.
    gap = _GAP * uniform_knn_radius(k, n0 * pencils.num_devices, pencils.box_size)
    span = min(0.125 * pencils.box_size, 4 * gap)

    # Per query: [d2 (kk) | next radius] and [rows (kk) | status] (packed: fewer arrays).
    def search_pass(state, batch, group):
        fs, is_ = state
        pick, cnt = selection(is_[:, kk] == 1, n_q)
        pc = jnp.clip(pick, 0, n_q - 1)
        live = jnp.arange(n_q) < cnt
        qf, qi = q.f[pc], q.i[pc]
        slot, used = _batch_slots(qf[:, :3], live, batch, gap, span)
        put = lambda a, fill=0: jnp.full(a.shape, fill, a.dtype).at[slot].set(a, mode="drop")
        sub = Queries(put(qf), put(jnp.stack([qi[:, 0], live.astype(int32), qi[:, 2]], 1)))
        # Queries that found no slot this pass stay for the next one.
        return _search(index, frame, origin, cover_lo, cover_hi, sub, put(fs[pc, kk]),
                       put(jnp.where(live, pick, n_q), n_q), used, state, k, config, batch,
                       group, self_mode, gap)

    init = (jnp.concatenate([jnp.full((n_q, kk), jnp.inf, dtype),
                             jnp.full((n_q, 1), -1, dtype)], 1),
            jnp.concatenate([jnp.full((n_q, kk), R, int32), qvalid.astype(int32)[:, None]], 1))
    group = config.group_size or (_GROUP_SIZE if _backend() == "cpu" else _ACCELERATOR)
    state = search_pass(init, config.batch_size, group)
    # The queries searched again are scattered: smaller batches, more of them side by side.
    batch = min(_AGAIN_BATCH, config.batch_size)
    group = group * config.batch_size // batch
    fs, is_ = lax.while_loop(lambda s: jnp.any(s[1][:, kk] == 1),
                             lambda s: search_pass(s, batch, group), state)
    d2, rows, status = fs[:, :kk], is_[:, :kk], is_[:, kk]

    # Cross-device pass for spheres that leave the ghost layer.
    D = pencils.num_devices
    capped = width < _requested_width(k, n0 * pencils.num_devices, pencils.box_size,
                                      config) * (1 - 1e-6)
    F3 = min(config.remote_rows(n0, capped), n_q)
    rpick, n_far = selection(status == 2, F3)
    rpc = jnp.clip(rpick, 0, n_q - 1)
    r_live = jnp.arange(F3) < n_far
    rq_canon = q.canon[rpc]
    rq_id = jnp.where(r_live, q.id[rpc], -3)
    rbound = jnp.where(r_live, d2[rpc, kk - 1], 0)
    any_far = psum_all(pencils, n_far) > 0
    own_sel, own_count = selection(index.owned, ext.owned)
    ext_mass = jnp.broadcast_to(ext_mass, ext.pos.shape[:1])

    def remote(_):
        gq = _all_gather(pencils, rq_canon).reshape(-1, 3)
        gid = _all_gather(pencils, rq_id).reshape(-1)
        gb = _all_gather(pencils, rbound).reshape(-1)
        return _remote_search(pencils, frame, index, own_sel, own_count, gq, gid, gb, kk,
                              _chunk_for_backend(config.chunk_size, kk), min(64, D * F3))

    rd2, rrows = lax.cond(any_far, remote,
                          lambda _: (jnp.full((D * F3, kk), jnp.inf, dtype),
                                     jnp.full((D * F3, kk), R, int32)), None)
    # The answers go back to the asking devices with differentiable positions.
    rr = jnp.clip(rrows, 0, R - 1)
    rext = index.ext_row[rr]
    r_payload = (rd2, jnp.where(rrows < R, index.id[rr], -1), ext_pos[rext], ext_mass[rext])
    r_payload = jax.tree.map(lambda a: _all_to_all(pencils, a.reshape((D, F3) + a.shape[1:])),
                             r_payload)
    md2 = jnp.moveaxis(r_payload[0], 0, 1).reshape(F3, D * kk)
    vals, pickm = lax.top_k(-md2, kk)

    def merged(a):
        a = jnp.moveaxis(a, 0, 1).reshape((F3, D * kk) + a.shape[3:])
        idx = pickm.reshape(pickm.shape + (1,) * (a.ndim - 2))
        return jnp.take_along_axis(a, idx, axis=1)

    m_d2, m_id = -vals, merged(r_payload[1])
    r_pos, r_mass = merged(r_payload[2]), merged(r_payload[3])

    # Each neighbour is a code into [extended rows | remote answers].
    found = rows < R
    lr = jnp.clip(rows, 0, R - 1)
    codes = jnp.where(found, index.ext_row[lr], E)
    nb_id = jnp.where(found, index.id[lr], -1)
    ok = qvalid & (status == 0)
    target = jnp.where(r_live, rpick, n_q)
    r_codes = E + 1 + jnp.arange(F3 * kk, dtype=int32).reshape(F3, kk)
    d2 = d2.at[target].set(m_d2, mode="drop")
    nb_id = nb_id.at[target].set(jnp.where(jnp.isfinite(m_d2), m_id, -1), mode="drop")
    codes = codes.at[target].set(jnp.where(jnp.isfinite(m_d2), r_codes, E), mode="drop")
    ok = ok.at[target].set(jnp.isfinite(m_d2[:, kk - 1]), mode="drop")

    # To owned-row (or query-row) order.
    inv = jnp.full((n_q,), n_q, int32).at[home].set(jnp.arange(n_q, dtype=int32), mode="drop")
    inv_ok = inv < n_q
    inv_c = jnp.minimum(inv, n_q - 1)

    def back(a, fill):
        mask = inv_ok.reshape(inv_ok.shape + (1,) * (a.ndim - 1))
        return jnp.where(mask, a[inv_c], fill)

    d2, nb_id, codes, ok = back(d2, jnp.inf), back(nb_id, -1), back(codes, E), back(ok, False)
    if self_mode:
        own_id = jnp.where(jnp.arange(n_q) < ext.owned, ext.id[:n_q], -2)
        d2, nb_id, codes = _drop_self(d2, nb_id, codes, own_id, k)
    d2, nb_id, codes = _sort_ties(d2, nb_id, codes)

    pos_table = jnp.concatenate([ext_pos, jnp.zeros((1, 3), ext_pos.dtype),
                                 r_pos.reshape(-1, 3)])
    mass_table = jnp.concatenate([ext_mass, jnp.zeros((1,), ext_mass.dtype),
                                  r_mass.reshape(-1)])
    nb = Neighbours(d2, nb_id, pos_table[codes], mass_table[codes], ok)
    needs = {"z images": need_images, "knn remote": n_far}
    limits = (("z images", Limit("DomainConfig.image_factor", image_rows, n0)),
              ("knn remote", Limit("KNNConfig.remote_factor", F3, n0)))
    return nb, needs, limits


# ----------------------------------------------------------------------------------------
# Results: distances, densities, the reduce hook


def _safe_norm(d2):
    """sqrt with a zero (not NaN) gradient at zero distance (duplicate positions)."""
    positive = d2 > 0
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, d2, 1)), 0)


def neighbour_distances(query_pos, nb: Neighbours, box_size: float):
    """Differentiable distances (n, k) from each query to its neighbours; NaN where the
    query was not resolved (invalid rows, or a full cross-device buffer)."""
    d2 = periodic_distance2(query_pos[:, None, :], nb.pos, box_size)
    return jnp.where(nb.ok[:, None], _safe_norm(d2), jnp.nan)


def density_from(dist, nb_mass, k: int):
    """kNN density ``(sum of the k-1 nearest masses) / (4/3 pi r_k^3)`` per row; equals
    ``(k - 1) m / V_k`` for equal masses."""
    rk = dist[:, k - 1]
    mass = jnp.sum(nb_mass[:, :k - 1], axis=1)
    return mass / (4.0 / 3.0 * jnp.pi * rk ** 3)


def _check_k(k, total: int, self_mode: bool) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise ValueError(f"k must be a positive integer, got {k!r}")
    k = int(k)
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    if self_mode and k >= total:
        raise ValueError(f"k = {k} neighbours need at least k + 1 particles; there are {total}")
    if not self_mode and k > total:
        raise ValueError(f"k = {k} neighbours need at least k particles; there are {total}")
    return k


def _query_rows(query, devices: int):
    """Flatten query points to (M, 3) and pad them to a multiple of the device count."""
    if not hasattr(query, "shape"):
        query = jnp.asarray(query)
    if not jnp.issubdtype(query.dtype, jnp.floating):
        query = jnp.asarray(query, jnp.float32)
    if query.ndim < 1 or query.shape[-1] != 3:
        raise ValueError(f"query points must have a trailing axis of size 3, got {query.shape}")
    lead = tuple(query.shape[:-1])
    flat = query.reshape(-1, 3)
    m = flat.shape[0]
    if m == 0:
        raise ValueError("query holds no points")
    pad = -m % devices
    if pad:
        flat = jnp.concatenate([flat, jnp.zeros((pad, 3), flat.dtype)])
    return flat, lead, m


def _pack_rows(tree):
    """Pack per-row arrays into one float32 (n, a) and one int32 (n, b) array, so that
    moving them costs one set of operations each (floats stay floats: gradients flow);
    other dtypes travel as they are. Returns ``(packed, unpack)``."""
    leaves, treedef = jax.tree.flatten(tree)
    n = leaves[0].shape[0]
    floats, ints, other, layout = [], [], [], []
    for leaf in leaves:
        if leaf.dtype == jnp.float32:
            layout.append(("f", leaf.shape, leaf.dtype, sum(c.shape[1] for c in floats)))
            floats.append(leaf.reshape(n, -1))
        elif leaf.dtype == jnp.bool_ or leaf.dtype in (jnp.int32, jnp.uint32):
            layout.append(("i", leaf.shape, leaf.dtype, sum(c.shape[1] for c in ints)))
            ints.append(leaf.reshape(n, -1).astype(int32))
        else:
            layout.append(("o", leaf.shape, leaf.dtype, len(other)))
            other.append(leaf)
    cat = lambda cols, dtype: (jnp.concatenate(cols, axis=1) if cols
                               else jnp.zeros((n, 0), dtype))
    packed = (cat(floats, jnp.float32), cat(ints, int32), other)

    def unpack(moved):
        fblock, iblock, rest = moved
        out = []
        for kind, shape, dtype, start in layout:
            if kind == "o":
                out.append(rest[start])
                continue
            width = int(np.prod(shape[1:], dtype=int))
            block = fblock if kind == "f" else iblock
            flat = block[:, start:start + width]
            if kind == "i":
                flat = flat > 0 if dtype == jnp.bool_ else flat.astype(dtype)
            out.append(flat.reshape((block.shape[0],) + shape[1:]))
        return jax.tree.unflatten(treedef, out)

    return packed, unpack


class _Spec(NamedTuple):
    """Static settings of one kNN computation."""

    k: int
    width: float
    config: KNNConfig
    output: str  # "neighbours", "density" or "reduce"
    reduce_fn: Callable | None
    overdensity: bool


def _finish(pencils: Pencils, spec: _Spec, nb: Neighbours, qpos, data, total_mass):
    """Per-row outputs from the neighbours, on the device."""
    k = spec.k
    dist = neighbour_distances(qpos, nb, pencils.box_size)
    if spec.output == "neighbours":
        return {"dist": dist, "idx": jnp.where(nb.ok[:, None], nb.id, -1)}
    if spec.output == "density":
        rho = density_from(dist, nb.mass, k)
        if spec.overdensity:
            rho = rho / (total_mass / pencils.box_size ** 3) - 1
        return {"rho": rho}
    data = dict(data)
    data["neighbour_mass"] = nb.mass
    return {"value": spec.reduce_fn(dist, jnp.where(nb.ok[:, None], nb.id, -1), data)}


def _domain_buffers(pencils: Pencils, config: KNNConfig, width: float, n0: int, grid: bool):
    dom = config.domain
    return (dom.transfer_rows(n0, grid), dom.capacity_rows(n0),
            dom.ghost_rows(n0, width_fraction(pencils, width)))


def _device_knn(pencils: Pencils, spec: _Spec, fields, valid, n0: int, grid: bool,
                queries=None, qn0: int = 0, trip: bool = True):
    """Migrate, build ghosts and run kNN for one device's rows.

    ``fields`` hold ``pos``, ``id`` and ``mass`` (and optionally ``vel``) of this device's
    input rows. ``queries`` is None (the particles themselves) or ``(pos, valid)`` rows of
    query points. With ``trip`` the per-row outputs are routed back to the input rows (the
    query rows for queries); otherwise self-mode outputs stay in domain order.

    Returns ``(values, status, migrated)``.
    """
    k, width, config = spec.k, spec.width, spec.config
    box = pencils.box_size
    transfer, capacity, ghost_rows = _domain_buffers(pencils, config, width, n0, grid)
    n = fields["pos"].shape[0]
    dec = decompose(pencils, fields, valid, width, transfer, capacity, ghost_rows)
    mig = dec.migrated
    ext_mass = dec.ghosts.forward(pencils, mig.payload["mass"])
    domain = domain_status(pencils, dec, transfer, capacity, ghost_rows, n0)
    needs, limits, query_nonfinite = {}, (), jnp.int32(0)
    total_mass = None
    if spec.overdensity:
        total_mass = psum_all(pencils, jnp.sum(jnp.where(mig.valid, mig.payload["mass"], 0)))
    if queries is not None:
        qpos_in, qvalid = queries
        nq = qpos_in.shape[0]
        dom = config.domain
        q_transfer, q_capacity = dom.transfer_rows(qn0, False), dom.capacity_rows(qn0)
        qfields = {"pos": wrap(qpos_in.reshape(-1, 3), box),
                   "id": pencils.device_index() * nq + jnp.arange(nq, dtype=int32)}
        qmig = migrate(pencils, qfields, qvalid, q_transfer, q_capacity)
        nb, kneeds, klimits = knn_device(pencils, dec.ext, dec.ext.pos, ext_mass, k, width,
                                         config, n0, queries=(qmig.payload["pos"], qmig.valid))
        needs.update({"query transfer": qmig.need_transfer,
                      "query capacity": qmig.need_capacity})
        limits += (("query transfer", Limit("DomainConfig.transfer_factor", q_transfer, qn0)),
                   ("query capacity", Limit("DomainConfig.capacity_factor", q_capacity, qn0)))
        query_nonfinite = qmig.nonfinite
        qpos = qmig.payload["pos"]
        values = _finish(pencils, spec, nb, qpos, {"pos": qpos}, total_mass)
        origin, count, rows_in, buffers = qmig.payload["origin"], qmig.count, nq, (q_transfer,
                                                                                  q_capacity)
        trip = True
    else:
        nb, kneeds, klimits = knn_device(pencils, dec.ext, dec.ext.pos, ext_mass, k, width,
                                         config, n0)
        data = {key: mig.payload[key] for key in ("pos", "id", "mass", "vel")
                if key in mig.payload}
        values = _finish(pencils, spec, nb, mig.payload["pos"], data, total_mass)
        origin, count, rows_in, buffers = mig.payload["origin"], mig.count, n, (transfer,
                                                                               capacity)
    needs.update(kneeds)
    status = Status({**domain.needed, **pmax_all(pencils, needs)},
                    domain.nonfinite + psum_all(pencils, query_nonfinite),
                    domain.limits + limits + klimits)
    if not trip:
        return values, status, mig
    values["ok"] = jnp.ones(nb.ok.shape, bool)
    packed, unpack = _pack_rows(values)
    values = unpack(return_trip(pencils, packed, origin, count, rows_in, *buffers))
    back = values.pop("ok")
    if spec.output == "neighbours":
        values["dist"] = jnp.where(back[:, None], values["dist"], jnp.nan)
        values["idx"] = jnp.where(back[:, None], values["idx"], -1)
    elif spec.output == "density":
        values["rho"] = jnp.where(back, values["rho"], jnp.nan)
    return values, status, mig


@program_cache(32)
def _knn_program(problem: Problem, in_specs, spec: _Spec, query_rows: int):
    """Jitted shard_map program; ``query_rows`` > 0 for query points (padded total)."""
    layout, pencils = problem.layout, problem.pencils
    n0 = layout.local_size
    D = pencils.num_devices
    dev_axes = _devices(pencils)

    def device(*blocks):
        blocks = list(blocks)
        queries = None
        if query_rows:
            qvalid = blocks.pop()
            queries = (blocks.pop(), qvalid)
        fields, shape = local_fields(problem, *blocks)
        n = fields["pos"].shape[0]
        fields["mass"] = row_masses(problem, fields)
        values, status, _ = _device_knn(pencils, spec, fields, local_valid(problem, n), n0,
                                        layout.grid, queries, query_rows // D)
        if not query_rows:
            values = jax.tree.map(lambda a: a.reshape(shape + a.shape[1:]), values)
        return values, status

    if query_rows:
        lead = P(dev_axes if dev_axes else None)
        in_specs = tuple(in_specs) + (P(dev_axes if dev_axes else None, None), lead)
    else:
        lead = layout.spec

    def run(*args):
        return layout.run(device, args, in_specs, (lead, P()))

    return jax.jit(run)


def _run(pos, box_size, k, mass, mesh, query, config, output, reduce_fn, overdensity,
         with_status):
    problem, args, in_specs = prepare(pos, box_size, None, mass, mesh)
    pencils = problem.pencils
    self_mode = query is None
    k = _check_k(k, problem.total, self_mode)
    width = ghost_width(k, problem.total, pencils, config)
    query_rows, lead, m = 0, None, 0
    if not self_mode:
        flat, lead, m = _query_rows(query, pencils.num_devices)
        query_rows = flat.shape[0]
        args = args + (flat.astype(args[0].dtype), jnp.arange(query_rows) < m)
    traced = is_traced(args)
    while True:
        spec = _Spec(k, width, config, output, reduce_fn, bool(overdensity))
        values, status = _knn_program(problem, in_specs, spec, query_rows)(*args)
        if traced:
            break
        needs = {name: int(np.max(np.asarray(v))) for name, v in status.needed.items()}
        limits = dict(status.limits)
        if any(needs[name] > lim.rows for name, lim in limits.items() if name != "knn remote"):
            break  # status.check() names the buffer
        needed, limit = needs["knn remote"], limits["knn remote"]
        capacity = config.domain.capacity_rows(problem.layout.local_size)
        if needed <= limit.rows or limit.rows >= capacity:
            break
        # Too many spheres left the ghost layers: rerun with room for all of them.
        factor = math.ceil(needed * 1.25 / limit.scale * 1000) / 1000
        config = dataclasses.replace(config, remote_factor=factor)
    if not traced:
        status.check(config, "config={}")
    key = {"neighbours": None, "density": "rho", "reduce": "value"}[output]
    if key is None:
        result = (values["dist"], values["idx"])
    else:
        result = values[key]
    if self_mode:
        result = trim_padding(problem, result)
    else:
        result = jax.tree.map(lambda a: a[:m].reshape(lead + a.shape[1:]), result)
    return (result, status) if with_status else result


def knn(pos, box_size=None, k: int = 8, *, mesh=None, query=None, reduce: Callable | None = None,
        config: KNNConfig = KNNConfig(), with_status: bool = False):
    """Exact k nearest neighbours in a periodic box, distributed over the input's mesh.

    Args:
      pos: positions ``(N, 3)`` (sharded along axis 0 over the mesh axes, or unsharded:
        then any N, padded inside to a multiple of the device count), a JaxPM-layout grid
        ``(nc, nc, nc, 3)`` sharded over its first two axes, or the
        :class:`~jaxpm_halos.Particles` from :func:`~jaxpm_halos.from_jaxpm`. Integer
        and half-precision (float16, bfloat16) positions and masses are computed in float32.
      box_size: periodic box side (taken from Particles).
      k: number of neighbours, ``1 <= k < N`` (``k <= N`` with ``query``).
      mesh: device mesh; default: the input's sharding (or the abstract mesh under ``jit``).
      query: optional points ``(..., 3)``, sharded along axis 0 or not. Then the result is
        for these points, with no particle excluded, in the query's leading shape.
      reduce: optional ``fn(dist, idx, data) -> pytree`` run on each device while the
        particles are in their domains, on ``(n, k)`` distances and ids of ``n`` rows and
        ``data``, a dict of ``(n, ...)`` arrays: ``pos``, ``id``, ``mass`` (and ``vel``) of
        the particles (``pos`` only for query points) and ``neighbour_mass`` ``(n, k)``. Its
        per-row outputs (leading axis ``n``) are returned instead of ``(dist, idx)``; rows
        of NaN positions carry zeros.
      config: :class:`~jaxpm_halos.KNNConfig`.
      with_status: also return the :class:`~jaxpm_halos.Status`.

    Returns:
      ``(dist, idx)``: ``(..., k)`` distances (ascending, periodic minimum image) to the k
      nearest *other* particles and their global ids (input index, or lattice index for
      JaxPM grids), in the input's leading shape and sharding; or the ``reduce`` output.
      Distances are bitwise identical on every mesh; among neighbours at exactly equal
      distances the lower id comes first. ``jax.grad`` of a function of ``dist`` flows to
      the positions with the neighbour selection held fixed.

    Outside ``jit``, a buffer overflow or a non-finite position raises an error naming the
    knob to change; inside ``jit``, rows that could not be completed are NaN (ids -1)
    and ``with_status=True`` gives the status to check.
    """
    output = "neighbours" if reduce is None else "reduce"
    return _run(pos, box_size, k, None, mesh, query, config, output, reduce, False, with_status)


def knn_density(pos, box_size=None, k: int = 8, *, mass=None, mesh=None, overdensity: bool = False,
                query=None, config: KNNConfig = KNNConfig(), with_status: bool = False):
    """kNN density ``rho = (k - 1) m / (4/3 pi r_k^3)`` at each particle (or query point).

    ``r_k`` is the distance to the k-th nearest other particle (nearest particle for query
    points). With per-particle masses, ``(k - 1) m`` is the mass of the k - 1 nearest
    neighbours. ``overdensity=True`` returns ``rho / rho_mean - 1`` with ``rho_mean`` the
    total mass over ``box_size**3``. Needs ``k >= 2``. Masses must be finite and >= 0:
    outside ``jit`` others raise :class:`~jaxpm_halos.InvalidInputError`; inside, their
    particles are excluded and counted like non-finite positions. Other arguments as
    :func:`knn`.
    """
    if isinstance(k, (int, np.integer)) and not isinstance(k, bool) and int(k) < 2:
        raise ValueError(f"knn_density needs k >= 2 (the estimator uses k - 1), got {k}")
    return _run(pos, box_size, k, mass, mesh, query, config, "density", None, overdensity,
                with_status)


def _pencils_from_axes(axes, box_size: float) -> Pencils:
    x_axis, y_axis = axes
    px = jax.lax.axis_size(x_axis) if x_axis else 1
    py = jax.lax.axis_size(y_axis) if y_axis else 1
    return Pencils(x_axis if px > 1 else None, y_axis if py > 1 else None, px, py, box_size)


def knn_local(particles: Particles, k: int, *, axes=(None, None), total: int | None = None,
              query=None, query_valid=None, reduce: Callable | None = None,
              config: KNNConfig = KNNConfig(), n0: int | None = None):
    """kNN on one device's particles, for use inside the caller's own ``shard_map``.

    Args:
      particles: this device's padded :class:`~jaxpm_halos.Particles` (rows, valid first);
        ids must be global and unique.
      k: number of neighbours.
      axes: the caller's mesh axis names that cut the box along x and y (None for an axis
        that is not cut). Device ``(i, j)`` of those axes owns pencil ``(i, j)``.
      total: the global number of particles (sets the default ghost width; default: the
        rows of ``particles`` times the number of devices).
      query: optional ``(m, 3)`` query points held by this device (any positions), with
        ``query_valid`` (m,) marking the real ones (default all).
      reduce: optional ``fn(dist, idx, data)`` as in :func:`knn`.
      n0: the mean particles per device that the capacity factors refer to (default: the
        number of rows of ``particles``).

    Returns:
      Without ``query``: ``(domain, result, status)``: the particles this device owns after
      migration (padded, valid first), the result for them in that order (``(dist, idx)``
      or the ``reduce`` output), and the :class:`~jaxpm_halos.Status`. With ``query``:
      ``(result, status)`` for the query rows in the caller's order. No error is raised
      inside ``shard_map``: check ``status.ok`` (rows that could not be completed are NaN).
    """
    pencils = _pencils_from_axes(axes, particles.box_size)
    n0 = particles.size if n0 is None else int(n0)
    total = n0 * pencils.num_devices if total is None else int(total)
    k = _check_k(k, total, query is None)
    width = ghost_width(k, total, pencils, config)
    output = "neighbours" if reduce is None else "reduce"
    spec = _Spec(k, width, config, output, reduce, False)
    fields = {"pos": wrap(particles.pos.reshape(-1, 3), particles.box_size),
              "id": particles.id.reshape(-1), "mass": particles.masses()}
    if particles.vel is not None:
        fields["vel"] = particles.vel.reshape(-1, 3)
    queries = None
    if query is not None:
        query = jnp.asarray(query).reshape(-1, 3)
        qv = (jnp.ones(query.shape[0], bool) if query_valid is None
              else jnp.asarray(query_valid, bool).reshape(-1))
        queries = (query.astype(fields["pos"].dtype), qv)
    values, status, mig = _device_knn(pencils, spec, fields, particles.valid(), n0, False,
                                      queries, query.shape[0] if query is not None else 0,
                                      trip=False)
    result = (values["dist"], values["idx"]) if reduce is None else values["value"]
    if query is not None:
        return result, status
    payload = mig.payload
    domain = Particles(payload["pos"], payload["id"], mig.count, payload.get("vel"),
                       payload["mass"], particles.box_size)
    return domain, result, status


def knn_on_decomposition(pencils: Pencils, decomposition: Decomposition, k: int, width: float,
                         *, mass=None, config: KNNConfig = KNNConfig(), n0: int):
    """kNN of the owned particles of a shared :class:`~._domain.Decomposition`.

    The decomposition's ghost layer must be at least ``width`` wide, with ``width`` at most
    the layer it was built with (use :func:`ghost_width` for the default). ``mass`` gives
    per-owned-row masses (default: the migrated ``mass`` field, else 1).

    Returns ``(result, status)``: ``result`` holds, per owned row in the decomposition's
    order, ``dist`` (rows, k) (differentiable, NaN in padding), ``idx`` (global ids, -1 in
    padding), ``neighbour_mass`` (rows, k) and ``ok`` (rows,).
    """
    mig = decomposition.migrated
    if mass is None:
        mass = mig.payload.get("mass", jnp.ones(mig.payload["id"].shape, decomposition.ext.pos.dtype))
    mass = jnp.broadcast_to(jnp.asarray(mass, decomposition.ext.pos.dtype),
                            mig.payload["id"].shape)
    ext_mass = decomposition.ghosts.forward(pencils, mass)
    nb, needs, limits = knn_device(pencils, decomposition.ext, decomposition.ext.pos, ext_mass,
                                   int(k), float(width), config, n0)
    dist = neighbour_distances(mig.payload["pos"], nb, pencils.box_size)
    result = {"dist": dist, "idx": jnp.where(nb.ok[:, None], nb.id, -1),
              "neighbour_mass": nb.mass, "ok": nb.ok}
    return result, Status(pmax_all(pencils, needs), jnp.int32(0), limits)
