"""Exact distributed k-nearest neighbours and kNN density estimation: one device's
pipeline (:func:`knn_device`) and its results (distances, densities).

The search is split in rooms, each with one job:

- :mod:`._frame`: the ghost width, the device's frame, and its rows (owned, ghosts of
  width ``w``, periodic images along z) sorted by Morton key, so every octree node at
  every level is one contiguous range of rows (the :class:`~._frame.Index`), each held
  as its canonical coordinates and a one-byte periodic image (its position in the frame
  is recomputed where needed, bitwise as the decomposition forms it). ``w`` defaults to
  twice the k-th neighbour distance of a uniform density, capped at the pencil width.
- :mod:`._region`: queries (owned particles, or query points migrated to the pencil
  that holds them) are taken in key order, in batches of up to ``batch_size`` consecutive
  queries (a batch ends early at a gap). A batch searches the box ``bbox(batch) + rho``,
  enumerated as at most 64 octree nodes of the finest level that covers it, nearest
  first; ``rho`` is estimated from the batch's own density.
- :mod:`._scan`: the batches of a group step through their candidates side by side,
  ``chunk_size`` at a time; each step merges them (``lax.top_k`` with the running list
  first) into the lists of the queries that some candidate is nearer to than their
  current k-th neighbour, and leaves the other lists as they are.
- :mod:`._tree`: on the CPU (``KNNConfig.search``), the first pass instead: a k-d tree
  over the index on the host, whose lists are kept where float32 rounding cannot reorder
  them; the others go on to the scanned passes below.
- :mod:`._local`: passes over the queries. Batches are ordered by work and scanned
  ``group_size`` at a time (on CPU, batches under a quarter full are left to the later
  passes). A query is exact when its k-th distance is at most its distance to the
  boundary of the region known complete; others are searched again with
  their k-th distance as radius (batches of at most 4), until every query is exact or its
  sphere leaves the ghost layer. Each batch's lists are finished at once (self dropped,
  equal distances in id order) and only the finished neighbour codes are kept per query
  (only the k-th for a density of equal masses), so the search's memory is that of one
  group of batches plus a few ints per query.
- :mod:`._remote`: the queries whose sphere leaves the ghost layer are gathered on
  every device; each device whose pencil their sphere reaches returns its own particles'
  k nearest, and the home device merges the answers (every particle is owned once, so
  the merge is exact).

Every distance is computed by :func:`jaxpm_halos.core.geometry.periodic_distance2` from canonical
wrapped coordinates, so distances are bitwise identical on every mesh (as long as XLA compiles
that function alike in every program; see its docstring). Every merge keeps the
smallest (distance, id) (:func:`._scan.merge_nearest`), so the ids chosen do not depend
on the order a device scans its candidates in, and are the same on every mesh too. Self
exclusion keeps k + 1 neighbours and drops the query's own id. Neighbour selection runs on
stopped gradients and without reverse-mode loops; distances are then recomputed from the
selected neighbours' positions, which flow differentiably through the domain exchange, so
``jax.grad`` works with the neighbour selection held fixed.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ..core.config import IMAGES, KNN_INDEX, REMOTE, KNNConfig
from ..core.errors import Limit
from ..core.geometry import periodic_distance2, safe_sqrt
from ..core.pipeline import Plan
from ..core.rows import pmax_all, sources
from ..core.status import Status
from ._frame import (  # noqa: F401
    SearchFrame,
    build_index,
    frame_share,
    ghost_width,
    requested_width,
    uniform_knn_radius,
)
from ._local import (
    EXACT,
    LocalSearch,
    SearchSettings,
    SearchState,
    first_scan_pass,
    owned_queries,
    point_queries,
    search_again,
)
from ._region import NODES as _NODES  # noqa: F401 (benchmarks/knn_candidates.py)
from ._remote import complete_remote
from ._tree import available as _tree_available
from ._tree import tree_pass

int32 = jnp.int32
_PLAN_BATCHES = 64  # most batches per planning step (on accelerators: 4x _ACCELERATOR)
_GAP = 3.0  # a batch ends at a gap of this many uniform k-th neighbour distances
_AGAIN_BATCH = 4  # queries per batch when searched again (they are scattered)
# On CPU the lists a scan step changes are merged an eighth of a group at a time (the
# fastest share measured on 2 cores). Accelerators merge every list at each step, as before: the
# cond and the loop would add host round trips per step there, and are unmeasured.
_MERGE_SHARE = 8
# On CPU the first pass leaves batches of fewer than batch_size / 4 queries (scattered
# queries, in voids) to the later passes' smaller batches (measured on 2 cores;
# unmeasured on accelerators, which keep every batch in the first pass).
_LEAST_SHARE = 4
# A GPU pays a fixed cost per loop step (kernel launches and a device-to-host read of the
# loop condition) that a CPU hardly does, so there many more batches go side by side. At
# 128^3 on an H100 this takes kNN from 4.6 s (the CPU setting) to 0.23 s.
_GROUP_SIZE = 8  # batches per step on CPU
_ACCELERATOR = 1024  # batches per step elsewhere, and 4x that per planning step


def _backend() -> str:
    return jax.default_backend()


# XLA:GPU selects with its own top-k kernel only for k <= 16 over rows of at least 1024
# values (its TopkSpecializer); any other lax.top_k becomes a sort of every row.
_GPU_TOP_K_LIMIT = 16
_GPU_TOP_K_ROWS = 1024


def _chunk_for_backend(chunk: int, kk: int) -> int:
    """Candidates per merge step. On GPUs a merge row (the running list and the chunk)
    holds a power of two values, at least ``_GPU_TOP_K_ROWS``, so that XLA selects with
    its top-k kernel rather than a sort (then each ``lax.top_k`` takes at most
    ``_GPU_TOP_K_LIMIT``: :func:`_top_k_limit`)."""
    if _backend() != "gpu":
        return chunk
    return max(_GPU_TOP_K_ROWS, 1 << (kk + chunk).bit_length() - 1) - kk


def _top_k_limit() -> int | None:
    """The most one ``lax.top_k`` call of a merge selects on this backend (None: any)."""
    return _GPU_TOP_K_LIMIT if _backend() == "gpu" else None


def _settings(k: int, self_mode: bool, kth_only: bool, config: KNNConfig, total: int, box: float):
    """The local search's static settings on this backend."""
    kk = k + 1 if self_mode else k
    cpu = _backend() == "cpu"
    group = config.group_size or (_GROUP_SIZE if cpu else _ACCELERATOR)
    # The queries searched again are scattered: smaller batches, more of them side by side.
    again_batch = min(_AGAIN_BATCH, config.batch_size)
    chunk = _chunk_for_backend(config.chunk_size, kk)
    gap = _GAP * uniform_knn_radius(k, total, box)
    lists = group * config.batch_size  # per step
    if config.search == "tree" and not _tree_available():
        raise ValueError(
            "KNNConfig(search='tree'): the host tree needs pykdtree or scipy and "
            "jax's internal callback emitter (jax._src.callback), not found; "
            "search='auto' or 'scan' uses the scan"
        )
    tree = config.search == "tree" or (config.search == "auto" and cpu and _tree_available())
    return SearchSettings(
        k,
        kk,
        1 if kth_only else k,
        self_mode,
        config.batch_size,
        max(1, config.batch_size // _LEAST_SHARE) if cpu else 1,
        group,
        again_batch,
        lists // again_batch,
        _PLAN_BATCHES if cpu else 4 * _ACCELERATOR,
        chunk,
        max(1, lists // _MERGE_SHARE) if cpu else lists,
        _top_k_limit(),
        tree,
        config.radius_factor,
        gap,
        min(0.125 * box, 4 * gap),
    )


class Neighbours(NamedTuple):
    """Per-query result on the device: neighbour ``codes`` (n, k) (or (n, 1), the k-th
    alone: :func:`knn_device`'s ``kth_only``) into the tables of
    ``[extended rows | none | remote answers]`` (global ids, differentiable positions and
    masses), and a resolved flag ``ok`` (n,). ``id``, ``pos`` and ``mass`` gather the
    (n, k, ...) values; :meth:`column` keeps one neighbour (the k-th for a density)."""

    codes: jax.Array
    ok: jax.Array
    id_table: jax.Array
    pos_table: jax.Array
    mass_table: jax.Array

    @property
    def id(self):
        return self.id_table[self.codes]

    @property
    def pos(self):
        return self.pos_table[self.codes]

    @property
    def mass(self):
        return self.mass_table[self.codes]

    def column(self, j: int) -> Neighbours:
        return self._replace(codes=self.codes[:, j : j + 1])


def _to_input_order(home, *arrays):
    """Rows of ``arrays`` (n, ...) in query order to owned-row (or input) order: query
    ``i`` goes to row ``home[i]`` (``n`` for none); rows nobody fills are -1/False."""
    n = home.shape[0]
    inverse = sources(home, n)
    filled = inverse < n
    inverse = jnp.minimum(inverse, n - 1)
    return tuple(
        jnp.where(
            filled.reshape((n,) + (1,) * (a.ndim - 1)),
            a[inverse],
            jnp.zeros((), a.dtype) if a.dtype == bool else -1,
        )
        for a in arrays
    )


def knn_device(
    plan: Plan,
    ext,
    ext_pos,
    ext_mass,
    k: int,
    config: KNNConfig,
    queries=None,
    kth_only: bool = False,
):
    """kNN on one device's extended rows.

    Args:
      plan: the decomposition's :class:`~jaxpm_halos.core.pipeline.Plan`, whose width is kNN's.
      ext: the :class:`~jaxpm_halos.core.domain.Extended` rows of a decomposition with ghosts of
        ``plan.width``.
      ext_pos, ext_mass: differentiable canonical positions and masses of the extended rows
        (the selection uses ``ext.pos`` with stopped gradients).
      queries: None for the owned particles themselves (self excluded), or
        ``(pos, valid)`` of query points that lie in this device's pencil.
      kth_only: keep only the k-th neighbour (``codes`` (n, 1)): all a density of equal
        masses needs (:func:`knn_density_of`), and n * (k - 1) ints less.

    Returns ``(neighbours, status)`` where ``neighbours`` has one row per owned row
    (or per query row), in that order, and ``status`` covers the z images and the
    cross-device pass.
    """
    pencils, n0 = plan.pencils, plan.n0
    dtype = ext.pos.dtype
    n_ext = ext.pos.shape[0]
    total = n0 * pencils.num_devices
    frame = SearchFrame.of(pencils, plan.width, dtype)
    origin, cover_lo, cover_hi = frame.arrays(pencils, dtype)
    index_limit = Limit(
        KNN_INDEX,
        config.index_rows(
            n0,
            plan.domain.capacity_factor * frame_share(pencils, plan.width),
            n_ext + 2 * plan.image_rows,
        ),
        n0,
    )
    index, need_images, need_index = build_index(
        frame, ext, origin, plan.image_rows, index_limit.rows
    )
    self_mode = queries is None
    if self_mode:
        q, home = owned_queries(index, ext.owned, frame.box)
    else:
        q, home = point_queries(frame, index, origin, lax.stop_gradient(queries[0]), queries[1])
    settings = _settings(k, self_mode, kth_only, config, total, pencils.box_size)
    search = LocalSearch(index, frame, origin, cover_lo, cover_hi, q, n_ext, settings)
    state = SearchState.start(q.valid, settings.kept, n_ext, dtype)
    first_pass = tree_pass if settings.tree else first_scan_pass
    state = search_again(search, first_pass(search, state, settings.gap), settings.gap)

    # Spheres that leave the ghost layer are completed across devices.
    capped = plan.width < requested_width(k, total, pencils.box_size, config) * (1 - 1e-6)
    capacity = min(config.remote_rows(n0, capped), q.size)
    ext_mass = jnp.broadcast_to(ext_mass, (n_ext,))
    remote = complete_remote(
        pencils,
        frame,
        index,
        ext,
        ext_pos,
        ext_mass,
        q,
        state.status,
        state.bound2,
        k,
        settings.kk,
        settings.kept,
        capacity,
        settings.chunk,
        settings.top_k_limit,
        self_mode,
    )
    codes = state.codes.at[remote.target].set(remote.codes, mode="drop")  # (n, kept)
    ok = (q.valid & (state.status == EXACT)).at[remote.target].set(remote.ok, mode="drop")
    codes, ok = _to_input_order(home, codes, ok)
    codes = jnp.where(codes < 0, n_ext, codes)
    nb = Neighbours(
        codes,
        ok,
        jnp.concatenate([ext.id, jnp.full((1,), -1, ext.id.dtype), remote.id]),
        jnp.concatenate([ext_pos, jnp.zeros((1, 3), ext_pos.dtype), remote.pos]),
        jnp.concatenate([ext_mass, jnp.zeros((1,), ext_mass.dtype), remote.mass]),
    )
    # kNN's own buffers, in pipeline order after the decomposition's z images.
    knn_status = Status(
        pmax_all(pencils, {"knn index": need_index, "knn remote": remote.needed}),
        jnp.int32(0),
        (("knn index", index_limit), ("knn remote", Limit(REMOTE, capacity, n0))),
    )
    status = plan.status({"z images": need_images}, {"z images": IMAGES})
    return nb, status.merge(knn_status)


# ----------------------------------------------------------------------------------------
# Results: distances, densities


def neighbour_distances(query_pos, nb: Neighbours, box_size: float):
    """Differentiable distances (n, k) from each query to its neighbours; NaN where the
    query was not resolved (invalid rows, or a full cross-device buffer)."""
    d2 = periodic_distance2(query_pos[:, None, :], nb.pos, box_size)  # (n, k)
    return jnp.where(nb.ok[:, None], safe_sqrt(d2), jnp.nan)


def _sum_left_to_right(columns):
    """Sum of ``(n,)`` columns added one after another. Both density paths add the k - 1
    masses this way, so a mass given once and the same mass gathered per neighbour give
    the same bits (a reduction could be reordered, and XLA turns a sum of a broadcast
    into a product, which rounds differently), without an ``(n, k)`` array of masses."""
    total = columns[0]
    for column in columns[1:]:
        total = total + column
    return total


def density_from(rk, mass_sum):
    """kNN density ``(sum of the k-1 nearest masses) / (4/3 pi r_k^3)`` per row, from the
    k-th distance ``rk`` (n,) and that sum (n,); ``(k - 1) m / V_k`` for equal masses.

    Coincident particles (``rk == 0``) give inf, or 0 when those neighbours are massless:
    no mass is no density at any radius, and NaN is kept for rows not computed (a peak
    finder reads it so). The radius is replaced only there, so other rows keep their
    values and gradients."""
    massless_point = (rk == 0) & (mass_sum == 0)
    return mass_sum / (4.0 / 3.0 * jnp.pi * jnp.where(massless_point, 1, rk) ** 3)


def overdensity(rho, total_mass, box_size: float):
    """``rho / rho_mean - 1`` with ``rho_mean`` the ``total_mass`` over ``box_size**3``:
    one expression for every caller, so offline and in-situ values are the same bits: those
    of the formula applied to the density itself. Both operands are formed apart (XLA
    would otherwise fold the divisions of the density and of the mean into one, rounded
    differently).

    Rows without a finite density (NaN for rows not computed, inf for coincident points)
    keep their value but take no derivative through the mean: the padding rows' NaN times
    their zero cotangent would otherwise make the mean's derivative, and so every mass's,
    NaN."""
    finite = jnp.isfinite(rho)
    rho, mean = lax.optimization_barrier((rho, total_mass / box_size**3))
    return jnp.where(finite, jnp.where(finite, rho, 0) / mean, rho / lax.stop_gradient(mean)) - 1


def knn_density_of(query_pos, nb: Neighbours, k: int, box_size: float):
    """:func:`density_from` of the neighbours, computing only the k-th distance (n,). With
    only the k-th neighbour kept (equal masses), its mass stands for each of the k - 1
    nearest."""
    kth = nb.column(nb.codes.shape[1] - 1)
    rk = neighbour_distances(query_pos, kth, box_size)[:, 0]  # (n,)
    if nb.codes.shape[1] == k:
        mass = nb.mass  # (n, k)
        columns = [mass[:, j] for j in range(k - 1)]
    else:
        columns = [kth.mass[:, 0]] * (k - 1)
    return density_from(rk, _sum_left_to_right(columns))
