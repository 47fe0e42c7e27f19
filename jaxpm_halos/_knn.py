"""Exact distributed k-nearest neighbours and kNN density estimation.

Per device (inside ``shard_map``):

1. The particles are migrated to the pencil that holds them and receive ghost copies of
   every particle within a width ``w`` of the pencil, plus periodic images along z
   (:mod:`._domain`, :func:`._fof.z_images`). ``w`` defaults to twice the k-th neighbour
   distance of a uniform density.
2. All rows are sorted by a Morton key of their position in the device's frame, so every
   octree node at every level is one contiguous range of rows (:mod:`._cells`).
3. Queries (the owned particles, or query points migrated to the pencil that holds them)
   are taken in key order, in batches of spatially consecutive queries. A batch searches
   the box ``bbox(batch) + rho``, enumerated as at most 4 x 4 x 4 octree nodes of the level
   that fits it, so a batch's work follows its own density: fine nodes in clusters,
   coarse ones in voids. ``rho`` is estimated from the nearest rows in key order, which
   also seed the running k nearest. Candidates are merged in fixed-size chunks, each batch
   looping over its own chunks only.
4. A query is exact when its k-th distance is at most its distance to the boundary of the
   searched region (and of the ghost layer). Others are searched again with their k-th
   distance as radius, which is then exact unless the sphere leaves the ghost layer.
5. Those last ones (voids near a pencil face) are sent to every device whose pencil their
   sphere reaches; each returns its own particles' k nearest, and the home device merges.

Every distance is computed by :func:`._geometry.periodic_distance2` from canonical wrapped
coordinates, so results are bitwise identical on every mesh. Neighbour selection runs on
stopped gradients; distances are then recomputed from the selected neighbours' positions,
which flow differentiably through the domain exchange, so ``jax.grad`` works with the
neighbour selection held fixed.
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

from ._cells import MORTON_BITS, morton_key, search_sorted
from ._config import KNNConfig
from ._domain import (Decomposition, decompose, migrate, pmax_all, psum_all, return_trip,
                      selection)
from ._fof import z_images
from ._frontend import Problem, local_fields, prepare, row_masses
from ._geometry import periodic_distance2, wrap
from ._layout import Pencils, layout_of, width_fraction
from ._particles import Particles, _check_box_size
from ._status import Limit, Status, is_traced

int32 = jnp.int32
_SENTINEL = np.iinfo(np.int32).max
_NODES = 4  # octree nodes per dimension enumerated by one batch
_LEVELS = MORTON_BITS


# ----------------------------------------------------------------------------------------
# Geometry of one device's search frame


def uniform_knn_radius(k: int, total: int, box_size: float) -> float:
    """The k-th neighbour distance in a uniform density of ``total`` particles."""
    density = total / box_size ** 3
    return (3 * k / (4 * math.pi * density)) ** (1 / 3)


def ghost_width(k: int, total: int, pencils: Pencils, config: KNNConfig = KNNConfig()) -> float:
    """Ghost layer used by kNN: ``config.ghost_width`` or ``ghost_factor`` times the uniform
    k-th neighbour distance, capped at the narrower pencil side (a wider sphere is completed
    by the cross-device pass)."""
    wx, wy = pencils.widths
    width = config.ghost_width
    if width is None:
        width = config.ghost_factor * uniform_knn_radius(k, total, pencils.box_size)
    return float(min(max(float(width), 0.0), wx, wy))


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
      local: (R, 3) positions in the device's frame.
      id: (R,) global ids.
      ext_row: (R,) extended row (:class:`~._domain.Extended`) each sorted row copies.
      owned: (R,) bool: an owned row itself (not a ghost, not an image).
      n: number of valid rows.
    """

    key: jax.Array
    canon: jax.Array
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
    rows = jnp.arange(key.shape[0], dtype=int32)
    key, sid, order = lax.sort((key, ids, rows), num_keys=2)
    owned = (order < ext.owned) & (key != _SENTINEL)
    er = ext_row[order]
    index = Index(key, canon_ext[er], local[order], sid, er, owned,
                  jnp.sum(valid, dtype=int32))
    return index, need_images


# ----------------------------------------------------------------------------------------
# Batched search


class Queries(NamedTuple):
    """Queries in key order (padding after the valid ones).

    ``id`` is the global id excluded from the query's neighbours (-2 for none); ``p`` is
    the sorted row where the query's key sits (its own row for owned particles).
    """

    local: jax.Array
    canon: jax.Array
    id: jax.Array
    valid: jax.Array
    p: jax.Array


def _seed_offsets(k: int, self_mode: bool):
    h = k // 2
    if self_mode:
        offs = list(range(-h, 0)) + list(range(1, k - h + 1))
    else:
        offs = list(range(-h, k - h))
    return np.asarray(offs, np.int32)


def _half_box(delta, box):
    half = 0.5 * box
    return jnp.all((delta >= -half) & (delta < half), axis=-1)


def _search_batch(index: Index, frame: _Frame, origin, cover_lo, cover_hi, q: Queries, rho_q,
                  k: int, chunk: int, self_mode: bool, radius_factor: float):
    """k nearest rows of one batch of B queries.

    Returns ``(d2, rows, coverage, rho)``: (B, k) squared distances (inf where fewer than
    k were found) and sorted rows, the distance from each query to the boundary of the
    region known to be complete, and the search radius the batch used.
    """
    dtype = q.canon.dtype
    B = q.canon.shape[0]
    R = index.key.shape[0]
    box = frame.box
    offs_np = _seed_offsets(k, self_mode)
    lo_off, hi_off = int(offs_np.min()), int(offs_np.max())
    offs = jnp.asarray(offs_np)

    # Seed: the k nearest rows in key order.
    rows = q.p[:, None] + offs[None, :]
    inside = (rows >= 0) & (rows < index.n)
    rows_c = jnp.clip(rows, 0, R - 1)
    c_canon, c_local, c_id = index.canon[rows_c], index.local[rows_c], index.id[rows_c]
    ok = (inside & q.valid[:, None] & (c_id != q.id[:, None])
          & _half_box(c_local - q.local[:, None, :], box))
    run_d2 = jnp.where(ok, periodic_distance2(q.canon[:, None, :], c_canon, box), jnp.inf)
    run_row = jnp.where(ok, rows, R)

    # Search radius of the batch.
    full = jnp.asarray(frame.full, dtype)
    if rho_q is None:
        bound = jnp.sqrt(jnp.max(run_d2, axis=1))
        bound = jnp.where(q.valid, bound, jnp.inf)
        nvalid = jnp.sum(q.valid, dtype=int32)
        median = jnp.sort(bound)[jnp.maximum(nvalid - 1, 0) // 2]
        rho = jnp.where(jnp.isfinite(median), radius_factor * median, full)
    else:
        rho = jnp.max(jnp.where(q.valid, rho_q, 0))
    rho = jnp.minimum(rho, full).astype(dtype)

    # Region: the batch's bounding box grown by rho, as at most _NODES^3 octree nodes.
    big = jnp.asarray(jnp.inf, dtype)
    qmin = jnp.min(jnp.where(q.valid[:, None], q.local, big), axis=0)
    qmax = jnp.max(jnp.where(q.valid[:, None], q.local, -big), axis=0)
    any_valid = jnp.any(q.valid)
    qmin = jnp.where(any_valid, qmin, origin)
    qmax = jnp.where(any_valid, qmax, origin)
    side = jnp.asarray(frame.side, dtype)
    lo = jnp.clip(qmin - rho - origin, 0, side)
    hi = jnp.clip(qmax + rho - origin, 0, side)
    span = jnp.maximum(jnp.max(hi - lo), side * 2.0 ** -(_LEVELS + 1))
    level = jnp.floor(jnp.log2(side * (_NODES - 1) / span)).astype(int32)
    level = jnp.clip(level, 0, _LEVELS)
    scale = jnp.left_shift(1, level)
    node_side = side / scale.astype(dtype)
    n_lo = jnp.clip(jnp.floor(lo / node_side).astype(int32), 0, scale - 1)
    n_hi = jnp.clip(jnp.floor(hi / node_side).astype(int32), n_lo,
                    jnp.minimum(n_lo + _NODES - 1, scale - 1))
    grid = np.stack(np.meshgrid(*[np.arange(_NODES)] * 3, indexing="ij"), -1).reshape(-1, 3)
    nodes = n_lo[None, :] + jnp.asarray(grid, int32)
    node_ok = jnp.all(nodes <= n_hi[None, :], axis=1) & any_valid
    prefix = morton_key(nodes[:, 0], nodes[:, 1], nodes[:, 2])
    shift = 3 * (_LEVELS - level)
    start = search_sorted(index.key, jnp.left_shift(prefix, shift))
    end = search_sorted(index.key, jnp.left_shift(prefix + 1, shift))
    counts = jnp.where(node_ok, end - start, 0)
    cum = jnp.cumsum(counts)
    first = cum - counts
    total = cum[-1]

    # Complete region: the node box (unbounded at the frame's edges) within the ghost cover.
    box_lo = jnp.where(n_lo == 0, -big, origin + n_lo.astype(dtype) * node_side)
    box_hi = jnp.where(n_hi == scale - 1, big, origin + (n_hi + 1).astype(dtype) * node_side)
    c_lo = jnp.maximum(box_lo, cover_lo)
    c_hi = jnp.minimum(box_hi, cover_hi)
    coverage = jnp.min(jnp.minimum(q.local - c_lo, c_hi - q.local), axis=1)

    w_lo = q.p + lo_off
    w_hi = q.p + hi_off

    def step(state):
        j, run_d2, run_row = state
        t = j * chunk + jnp.arange(chunk, dtype=int32)
        live = t < total
        seg = jnp.minimum(search_sorted(cum, t + 1), counts.shape[0] - 1)
        row = jnp.where(live, start[seg] + t - first[seg], 0)
        cc, cl, ci = index.canon[row], index.local[row], index.id[row]
        d2 = periodic_distance2(q.canon[:, None, :], cc[None, :, :], box)
        in_window = (row[None, :] >= w_lo[:, None]) & (row[None, :] <= w_hi[:, None])
        ok = (live[None, :] & (ci[None, :] != q.id[:, None]) & ~in_window
              & _half_box(cl[None, :, :] - q.local[:, None, :], box))
        d2 = jnp.where(ok, d2, jnp.inf)
        vals, pick = lax.top_k(jnp.concatenate([-run_d2, -d2], axis=1), k)
        all_rows = jnp.concatenate([run_row, jnp.broadcast_to(row, (B, chunk))], axis=1)
        return j + 1, -vals, jnp.take_along_axis(all_rows, pick, axis=1)

    n_chunks = (total + chunk - 1) // chunk
    _, run_d2, run_row = lax.while_loop(lambda s: s[0] < n_chunks, step,
                                        (jnp.int32(0), run_d2, run_row))
    # Make the seed-only result sorted as well (top_k sorts; seeds may be unsorted).
    vals, pick = lax.top_k(-run_d2, k)
    run_d2, run_row = -vals, jnp.take_along_axis(run_row, pick, axis=1)
    return run_d2, run_row, coverage, jnp.broadcast_to(rho, (B,))


def _search(index: Index, frame: _Frame, origin, cover_lo, cover_hi, q: Queries, rho_q,
            count, k: int, cfg: KNNConfig, batch: int, self_mode: bool):
    """Search every valid query (the first ``count`` rows of ``q``) in batches.

    Groups of ``cfg.group_size`` batches are processed side by side, and only as many
    groups as hold valid queries are run.
    """
    n = q.canon.shape[0]
    g = cfg.group_size
    per_group = g * batch
    padded = -(-n // per_group) * per_group
    pad = padded - n

    def padq(a, fill):
        return jnp.concatenate([a, jnp.full((pad,) + a.shape[1:], fill, a.dtype)]) if pad else a

    qp = Queries(padq(q.local, 0), padq(q.canon, 0), padq(q.id, -2), padq(q.valid, False),
                 padq(q.p, 0))
    rp = None if rho_q is None else padq(rho_q, 0)
    out_d2 = jnp.full((padded, k), jnp.inf, q.canon.dtype)
    out_row = jnp.zeros((padded, k), int32)
    out_cov = jnp.zeros((padded,), q.canon.dtype)
    out_rho = jnp.zeros((padded,), q.canon.dtype)
    search = jax.vmap(functools.partial(_search_batch, index, frame, origin, cover_lo, cover_hi,
                                        k=k, chunk=cfg.chunk_size, self_mode=self_mode,
                                        radius_factor=cfg.radius_factor))
    n_groups = (count + per_group - 1) // per_group

    def body(state):
        gi, d2s, rows, covs, rhos = state
        s = gi * per_group

        def cut(a):
            a = lax.dynamic_slice_in_dim(a, s, per_group)
            return a.reshape((g, batch) + a.shape[1:])

        qg = Queries(*(cut(a) for a in qp))
        rg = None if rp is None else cut(rp)
        d2, row, cov, rho = search(qg, rg)

        def put(buf, val):
            return lax.dynamic_update_slice_in_dim(buf, val.reshape((per_group,) + val.shape[2:]),
                                                   s, 0)

        return gi + 1, put(d2s, d2), put(rows, row), put(covs, cov), put(rhos, rho)

    _, d2s, rows, covs, rhos = lax.while_loop(lambda s: s[0] < n_groups, body,
                                              (jnp.int32(0), out_d2, out_row, out_cov, out_rho))
    return d2s[:n], rows[:n], covs[:n], rhos[:n]


def _classify(frame: _Frame, d2, coverage, rho, k):
    """0: exact, 1: search again with radius ``new_rho``, 2: needs the cross-device pass."""
    dtype = d2.dtype
    rk2 = d2[:, k - 1]
    found = jnp.isfinite(rk2)
    rk = jnp.sqrt(rk2)
    m = jnp.asarray(frame.margin, dtype)
    half = jnp.asarray(0.5 * frame.box, dtype) - m
    cov = coverage - m
    exact = found & (cov > 0) & (rk <= cov) & (rk < half)
    full = jnp.asarray(frame.full, dtype)
    new_rho = jnp.where(found, rk * (1 + 1e-5) + m, full)
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
                   bound2, k: int, chunk: int):
    """k nearest owned particles of this device for every device's remote queries.

    ``own_rows`` are this device's owned sorted rows in key order. Returns (Q, k) squared
    distances and sorted rows (``R`` where none).
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
    n_own = own_rows.shape[0]
    n_chunks = (own_count + chunk - 1) // chunk
    padded = -(-n_own // chunk) * chunk
    rows_all = jnp.concatenate([own_rows, jnp.full((padded - n_own,), R, int32)])

    def compute(_):
        def step(state):
            j, run_d2, run_row = state
            rows = lax.dynamic_slice_in_dim(rows_all, j * chunk, chunk)
            live = rows < R
            rc = jnp.clip(rows, 0, R - 1)
            cc, ci = index.canon[rc], index.id[rc]
            big = jnp.asarray(jnp.inf, dtype)
            cmin = jnp.min(jnp.where(live[:, None], cc, big), axis=0)
            cmax = jnp.max(jnp.where(live[:, None], cc, -big), axis=0)
            g = [_interval_gap(qc[:, d], cmin[d], cmax[d], box) for d in range(3)]
            near = relevant & (jnp.sqrt(g[0] ** 2 + g[1] ** 2 + g[2] ** 2) <= reach)

            def merge(_):
                d2 = periodic_distance2(qc[:, None, :], cc[None, :, :], box)
                ok = live[None, :] & (ci[None, :] != qid[:, None]) & near[:, None]
                d2 = jnp.where(ok, d2, jnp.inf)
                vals, pick = lax.top_k(jnp.concatenate([-run_d2, -d2], axis=1), k)
                allr = jnp.concatenate([run_row, jnp.broadcast_to(rows, (Q, chunk))], axis=1)
                return -vals, jnp.take_along_axis(allr, pick, axis=1)

            run_d2, run_row = lax.cond(jnp.any(near), merge, lambda _: (run_d2, run_row), None)
            return j + 1, run_d2, run_row

        init = (jnp.int32(0), jnp.full((Q, k), jnp.inf, dtype), jnp.full((Q, k), R, int32))
        _, d2, rows = lax.while_loop(lambda s: s[0] < n_chunks, step, init)
        return d2, rows

    def skip(_):
        return jnp.full((Q, k), jnp.inf, dtype), jnp.full((Q, k), R, int32)

    return lax.cond(jnp.any(relevant), compute, skip, None)


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


def _sort_ties(d2, ids, *extra):
    """Order each row by (d2, id): fixes the order of equal distances (odd-even
    transposition; rows are already sorted by d2)."""
    k = d2.shape[1]
    cols = [list(a.T) if a.ndim == 2 else [a[:, i] for i in range(k)] for a in (d2, ids) + extra]
    for rnd in range(k):
        for i in range(rnd % 2, k - 1, 2):
            a, b = cols[0][i], cols[0][i + 1]
            swap = (b < a) | ((b == a) & (cols[1][i + 1] < cols[1][i]))
            for col in cols:
                x, y = col[i], col[i + 1]
                sw = swap if x.ndim == 1 else swap[:, None]
                col[i], col[i + 1] = jnp.where(sw, y, x), jnp.where(sw, x, y)
    return tuple(jnp.stack(col, 1) for col in cols)


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
    self_mode = queries is None
    B = config.batch_size

    if self_mode:
        n_q = ext.owned
        sel, count = selection(index.owned, n_q)
        qvalid = jnp.arange(n_q) < count
        sc = jnp.clip(sel, 0, R - 1)
        q = Queries(index.local[sc], index.canon[sc], jnp.where(qvalid, index.id[sc], -2),
                    qvalid, sc)
        home = jnp.where(qvalid, index.ext_row[sc], n_q)  # owned row of each query
    else:
        qpos, qv = queries
        qpos = lax.stop_gradient(qpos)
        n_q = qpos.shape[0]
        c = _cells_of(frame, qpos, origin)
        qkey = jnp.where(qv, morton_key(c[:, 0], c[:, 1], c[:, 2]), _SENTINEL)
        qkey, order = lax.sort((qkey, jnp.arange(n_q, dtype=int32)), num_keys=1)
        count = jnp.sum(qv, dtype=int32)
        qvalid = jnp.arange(n_q) < count
        qs = qpos[order]
        q = Queries(qs, qs, jnp.full((n_q,), -2, int32), qvalid, search_sorted(index.key, qkey))
        home = jnp.where(qvalid, order, n_q)

    d2, rows, cov, rho = _search(index, frame, origin, cover_lo, cover_hi, q, None, count, k,
                                 config, B, self_mode)
    status, new_rho = _classify(frame, d2, cov, rho, k)
    status = jnp.where(qvalid, status, 0)

    # Second searches, F queries at a time, until none is left.
    F = min(config.retry_rows(n0), n_q)

    def retry_body(state):
        d2, rows, status, rho_next, passes = state
        pick, cnt = selection(status == 1, F)
        pc = jnp.clip(pick, 0, n_q - 1)
        sub = Queries(q.local[pc], q.canon[pc], q.id[pc], jnp.arange(F) < cnt, q.p[pc])
        sd2, srows, scov, srho = _search(index, frame, origin, cover_lo, cover_hi, sub,
                                         rho_next[pc], cnt, k, config, B, self_mode)
        sstat, snew = _classify(frame, sd2, scov, srho, k)
        d2 = d2.at[pick].set(sd2, mode="drop")
        rows = rows.at[pick].set(srows, mode="drop")
        status = status.at[pick].set(sstat, mode="drop")
        rho_next = rho_next.at[pick].set(snew, mode="drop")
        return d2, rows, status, rho_next, passes + 1

    d2, rows, status, _, _ = lax.while_loop(lambda s: jnp.any(s[2] == 1), retry_body,
                                            (d2, rows, status, new_rho, jnp.int32(0)))

    # Cross-device pass.
    F3 = min(config.remote_rows(n0), n_q)
    far = status == 2
    rpick, n_far = selection(far, F3)
    rpc = jnp.clip(rpick, 0, n_q - 1)
    r_live = jnp.arange(F3) < n_far
    rq_canon = q.canon[rpc]
    rq_id = jnp.where(r_live, q.id[rpc], -3)
    rbound = jnp.where(r_live, d2[rpc, k - 1], 0)
    any_far = psum_all(pencils, n_far) > 0

    own_sel, own_count = selection(index.owned, ext.owned)
    ext_mass = jnp.broadcast_to(ext_mass, ext.pos.shape[:1])

    def remote(_):
        gq = _all_gather(pencils, rq_canon).reshape(-1, 3)
        gid = _all_gather(pencils, rq_id).reshape(-1)
        gb = _all_gather(pencils, rbound).reshape(-1)
        rd2, rrows = _remote_search(pencils, frame, index, own_sel, own_count, gq, gid, gb, k,
                                    config.chunk_size)
        return rd2, rrows

    D = pencils.num_devices
    rd2, rrows = lax.cond(any_far, remote,
                          lambda _: (jnp.full((D * F3, k), jnp.inf, dtype),
                                     jnp.full((D * F3, k), R, int32)), None)
    # Differentiable payload of the remote answers, sent back to the asking devices.
    rr = jnp.clip(rrows, 0, R - 1)
    rext = index.ext_row[rr]
    r_payload = (rd2, jnp.where(rrows < R, index.id[rr], -1), ext_pos[rext], ext_mass[rext])
    r_payload = jax.tree.map(lambda a: _all_to_all(pencils, a.reshape((D, F3) + a.shape[1:])),
                             r_payload)
    # Merge the D answers of each remote query.
    md2 = jnp.moveaxis(r_payload[0], 0, 1).reshape(F3, D * k)
    vals, pickm = lax.top_k(-md2, k)

    def merged(a):
        a = jnp.moveaxis(a, 0, 1).reshape((F3, D * k) + a.shape[3:])
        idx = pickm.reshape(pickm.shape + (1,) * (a.ndim - 2))
        return jnp.take_along_axis(a, idx, axis=1)

    m_d2, m_id, m_pos, m_mass = (-vals,) + tuple(merged(a) for a in r_payload[1:])

    # Assemble per query.
    lr = jnp.clip(rows, 0, R - 1)
    l_ext = index.ext_row[lr]
    found = rows < R
    nb_id = jnp.where(found, index.id[lr], -1)
    nb_pos = ext_pos[l_ext]
    nb_mass = ext_mass[l_ext]
    ok = qvalid & (status == 0)
    target = jnp.where(r_live, rpick, n_q)
    d2 = d2.at[target].set(m_d2, mode="drop")
    nb_id = nb_id.at[target].set(m_id, mode="drop")
    nb_pos = nb_pos.at[target].set(m_pos, mode="drop")
    nb_mass = nb_mass.at[target].set(m_mass, mode="drop")
    ok = ok.at[target].set(jnp.isfinite(m_d2[:, k - 1]), mode="drop")
    d2, nb_id, nb_pos, nb_mass = _sort_ties(d2, nb_id, nb_pos, nb_mass)

    # Back to owned-row (or query-row) order.
    def to_home(a, fill):
        buf = jnp.full((n_q,) + a.shape[1:], fill, a.dtype)
        return buf.at[home].set(a, mode="drop")

    nb = Neighbours(to_home(d2, jnp.inf), to_home(nb_id, -1), to_home(nb_pos, 0),
                    to_home(nb_mass, 0), to_home(ok, False))
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


@functools.lru_cache(maxsize=32)
def _knn_program(problem: Problem, in_specs, k: int, width: float, config: KNNConfig,
                 output: str, reduce_fn, overdensity: bool, query_rows: int):
    """Jitted shard_map program. ``output``: "neighbours", "density" or "reduce";
    ``query_rows`` > 0 for query points (padded total), 0 for the particles themselves."""
    layout, pencils = problem.layout, problem.pencils
    n0 = layout.local_size
    dom = config.domain
    transfer, capacity = dom.transfer_rows(n0, layout.grid), dom.capacity_rows(n0)
    ghost_rows = dom.ghost_rows(n0, width_fraction(pencils, width))
    D = pencils.num_devices
    box = problem.box_size
    qn0 = query_rows // D
    q_transfer, q_capacity = dom.transfer_rows(qn0, False), dom.capacity_rows(qn0)
    dev_axes = _devices(pencils)

    def device(*blocks):
        blocks = list(blocks)
        query_block = query_valid = None
        if query_rows:
            query_valid = blocks.pop()
            query_block = blocks.pop()
        fields, shape = local_fields(problem, *blocks)
        n = fields["pos"].shape[0]
        fields["mass"] = row_masses(problem, fields)
        dec = decompose(pencils, fields, jnp.ones(n, bool), width, transfer, capacity, ghost_rows)
        mig = dec.migrated
        ext_mass = dec.ghosts.forward(pencils, mig.payload["mass"])
        needs = {"transfer": mig.need_transfer, "capacity": mig.need_capacity,
                 "ghosts": dec.need_ghosts}
        limits = (("transfer", Limit("DomainConfig.transfer_factor", transfer, n0)),
                  ("capacity", Limit("DomainConfig.capacity_factor", capacity, n0)),
                  ("ghosts", Limit("DomainConfig.ghost_factor", ghost_rows, n0)))
        nonfinite = mig.nonfinite
        if query_rows:
            nq = query_block.shape[0]
            qfields = {"pos": wrap(query_block, box),
                       "id": pencils.device_index() * nq + jnp.arange(nq, dtype=int32)}
            qmig = migrate(pencils, qfields, query_valid, q_transfer, q_capacity)
            nb, kneeds, klimits = knn_device(pencils, dec.ext, dec.ext.pos, ext_mass, k, width,
                                             config, n0,
                                             queries=(qmig.payload["pos"], qmig.valid))
            needs.update({"query transfer": qmig.need_transfer,
                          "query capacity": qmig.need_capacity})
            limits += (("query transfer", Limit("DomainConfig.transfer_factor", q_transfer, qn0)),
                       ("query capacity", Limit("DomainConfig.capacity_factor", q_capacity, qn0)))
            nonfinite = nonfinite + qmig.nonfinite
            qpos = qmig.payload["pos"]
            data = {"pos": qpos}
            origin, count, rows_in = qmig.payload["origin"], qmig.count, nq
            trip = (q_transfer, q_capacity)
        else:
            nb, kneeds, klimits = knn_device(pencils, dec.ext, dec.ext.pos, ext_mass, k, width,
                                             config, n0)
            qpos = mig.payload["pos"]
            data = {key: mig.payload[key] for key in ("pos", "id", "mass", "vel")
                    if key in mig.payload}
            origin, count, rows_in = mig.payload["origin"], mig.count, n
            trip = (transfer, capacity)
        needs.update(kneeds)
        limits += klimits
        dist = neighbour_distances(qpos, nb, box)
        if output == "neighbours":
            values = {"dist": dist, "idx": nb.id}
        elif output == "density":
            rho = density_from(dist, nb.mass, k)
            if overdensity:
                total = psum_all(pencils, jnp.sum(jnp.where(mig.valid, mig.payload["mass"], 0)))
                rho = rho / (total / box ** 3) - 1
            values = {"rho": rho}
        else:
            data["neighbour_mass"] = nb.mass
            values = {"value": reduce_fn(dist, nb.id, data)}
        values["ok"] = jnp.ones(nb.ok.shape, bool)
        values = return_trip(pencils, values, origin, count, rows_in, *trip)
        back = values.pop("ok")
        if output == "neighbours":
            values["dist"] = jnp.where(back[:, None], values["dist"], jnp.nan)
            values["idx"] = jnp.where(back[:, None], values["idx"], -1)
        elif output == "density":
            values["rho"] = jnp.where(back, values["rho"], jnp.nan)
        if not query_rows:
            values = jax.tree.map(lambda a: a.reshape(shape + a.shape[1:]), values)
        status = Status(pmax_all(pencils, needs), psum_all(pencils, nonfinite), limits)
        return values, status

    if query_rows:
        qspec = P(dev_axes if dev_axes else None, None)
        vspec = P(dev_axes if dev_axes else None)
        in_specs = tuple(in_specs) + (qspec, vspec)
        out_lead = vspec
    else:
        out_lead = layout.spec

    def run(*args):
        out_specs = (jax.tree.map(lambda _: out_lead, _output_structure(output)), P())
        if output == "reduce":
            out_specs = (out_lead, P())
        return layout.run(device, args, in_specs, out_specs)

    return jax.jit(run)


def _output_structure(output: str):
    if output == "neighbours":
        return {"dist": 0, "idx": 0}
    if output == "density":
        return {"rho": 0}
    return {"value": 0}


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
        program = _knn_program(problem, in_specs, k, width, config, output, reduce_fn,
                               bool(overdensity), query_rows)
        values, status = program(*args)
        if traced:
            break
        needed = int(np.max(np.asarray(status.needed["knn remote"])))
        limit = dict(status.limits)["knn remote"]
        if needed <= limit.rows or limit.rows >= _max_remote(problem):
            break
        # Too many spheres left the ghost layers: rerun with room for all of them.
        factor = math.ceil(needed * 1.25 / limit.scale * 1000) / 1000
        config = dataclasses.replace(config, remote_factor=factor)
    if not traced:
        status.check()
    key = {"neighbours": None, "density": "rho", "reduce": "value"}[output]
    if key is None:
        result = (values["dist"], values["idx"])
    else:
        result = values[key]
    if not self_mode:
        result = jax.tree.map(lambda a: a[:m].reshape(lead + a.shape[1:]), result)
    return (result, status) if with_status else result


def _max_remote(problem: Problem) -> int:
    return problem.layout.local_size * 2 * problem.pencils.num_devices


def knn(pos, box_size=None, k: int = 8, *, mesh=None, query=None, reduce: Callable | None = None,
        config: KNNConfig = KNNConfig(), with_status: bool = False):
    """Exact k nearest neighbours in a periodic box, distributed over the input's mesh.

    Args:
      pos: positions ``(N, 3)`` (sharded along axis 0 over the mesh axes, or unsharded), a
        JaxPM-layout grid ``(nc, nc, nc, 3)`` sharded over its first two axes, or the
        :class:`~jaxpm_halos.Particles` from :func:`~jaxpm_halos.from_jaxpm`.
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
    total mass over ``box_size**3``. Needs ``k >= 2``. Other arguments as :func:`knn`.
    """
    if isinstance(k, (int, np.integer)) and not isinstance(k, bool) and int(k) < 2:
        raise ValueError(f"knn_density needs k >= 2 (the estimator uses k - 1), got {k}")
    return _run(pos, box_size, k, mass, mesh, query, config, "density", None, overdensity,
                with_status)
