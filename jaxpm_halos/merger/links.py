"""Merger links between two snapshots of one run: each halo's descendant and main progenitor.

A particle keeps its index from snapshot to snapshot (JaxPM's state is a Lagrangian grid),
so the FoF labels of two snapshots pair the haloes a particle belonged to. Per device, the
particles in a catalogued halo at both snapshots give the distinct pairs (earlier row, later
row) and how many particles each pair shares (a sort of the device's particles). Those
pairs, at most ``max_pairs`` per device, are gathered on every device with a ``lax``
collective and summed; the descendants and main progenitors are then computed the same way
on every device. No particle leaves its device: the collective moves pairs, whose number
follows the haloes.

Rows are the catalogue's valid ids sorted, so the smallest row is the smallest id, which
breaks every tie.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from ..core.catalogue import Catalogue
from ..core.config import MAX_PAIRS, MergerConfig
from ..core.errors import Limit
from ..core.frontend import program_cache
from ..core.layout import Layout, leading_layout
from ..core.pipeline import JitProgram
from ..core.retry import run_growing
from ..core.rows import pmax_all, selection
from ..core.status import Status, check_catalogue_status, is_traced

int32 = jnp.int32
_BIG = jnp.iinfo(jnp.int32).max
PAIRS = "merger pairs"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MergerLinks:
    """Descendants of the earlier catalogue's haloes and main progenitors of the later's.

    Every array is replicated, with one row per catalogue row of its snapshot: the valid
    haloes first, sorted by id, then padding (``id == -1``).

    Attributes:
      id: (Ha,) the earlier haloes' ids.
      descendant: (Ha,) the id of the later halo that holds most of each earlier halo's
        particles (ties to the smallest id), or -1 when none of them is in a later halo.
      shared: (Ha,) the particles the halo gives its descendant (0 without one).
      later_id: (Hb,) the later haloes' ids.
      main_progenitor: (Hb,) among the earlier haloes whose descendant this is, the one
        that gives it most particles (ties to the smallest id), or -1.
      n_progenitors: (Hb,) how many earlier haloes have this one as their descendant.
      status: the pair buffer's need, with both catalogues' statuses (their buffer names
        prefixed ``"earlier "`` and ``"later "``).
    """

    id: jax.Array
    descendant: jax.Array
    shared: jax.Array
    later_id: jax.Array
    main_progenitor: jax.Array
    n_progenitors: jax.Array
    status: Status

    def to_numpy(self, *, throw: bool = True) -> tuple[dict, dict]:
        """Host-side ``(forward, backward)``: ``forward`` over the earlier catalogue's valid
        haloes, sorted by id (``id``, ``descendant``, ``shared``); ``backward`` over the
        later one's (``id``, ``main_progenitor``, ``n_progenitors``). ``throw``: raise the
        status's error when it failed (``False``: take the rows anyway)."""
        if np.ndim(self.id) != 1:
            raise ValueError(
                "these links are stacked over snapshot pairs: take pair i with "
                "jax.tree.map(lambda x: x[i], links)"
            )
        if throw:
            check_catalogue_status(self.status)
        earlier, later = np.asarray(self.id) >= 0, np.asarray(self.later_id) >= 0
        pick = lambda a, keep: np.asarray(a)[keep]
        forward = {
            "id": pick(self.id, earlier),
            "descendant": pick(self.descendant, earlier),
            "shared": pick(self.shared, earlier),
        }
        backward = {
            "id": pick(self.later_id, later),
            "main_progenitor": pick(self.main_progenitor, later),
            "n_progenitors": pick(self.n_progenitors, later),
        }
        return forward, backward


def merger_links(
    labels_a,
    catalogue_a: Catalogue,
    labels_b,
    catalogue_b: Catalogue,
    *,
    mesh=None,
    config: MergerConfig = MergerConfig(),
    grow: bool = True,
) -> MergerLinks:
    """Descendants and main progenitors between two snapshots of one run (a earlier).

    Args:
      labels_a, labels_b: the FoF labels of the two snapshots, as :func:`~jaxpm_halos.fof`
        or :class:`~jaxpm_halos.InSitu` return them (``(N,)`` or ``(nc, nc, nc)``, sharded
        like the state): the same particle at the same index in both, as in a JaxPM run.
      catalogue_a, catalogue_b: their catalogues (one snapshot each: take snapshot ``i`` of
        an in-situ output with ``jax.tree.map(lambda x: x[i], catalogue)``).
      mesh: device mesh; default: the labels' sharding (or the abstract mesh under ``jit``).
      config: the pair buffer (:class:`~jaxpm_halos.MergerConfig`).
      grow: outside ``jit``, grow the pair buffer when it overflows and run again;
        ``False`` raises :class:`~jaxpm_halos.CapacityError` instead.

    Returns:
      :class:`MergerLinks`. Outside ``jit``, a catalogue whose status failed raises its
      error; inside ``jit``, read ``links.status``.

    Examples:
        Two snapshots of 3 particles: particles 0 and 1 form halo 0 at both, and particle 2
        joins it later.

        >>> import numpy as np, jaxpm_halos
        >>> pos_a = np.array([[1.0, 1, 1], [1.1, 1, 1], [5, 5, 5]], np.float32)
        >>> pos_b = np.array([[1.0, 1, 1], [1.1, 1, 1], [1.2, 1, 1]], np.float32)
        >>> la, ca = jaxpm_halos.fof(pos_a, box_size=10.0, linking_length=0.15, min_members=1)
        >>> lb, cb = jaxpm_halos.fof(pos_b, box_size=10.0, linking_length=0.15, min_members=1)
        >>> forward, backward = jaxpm_halos.merger_links(la, ca, lb, cb).to_numpy()
        >>> forward["id"].tolist(), forward["descendant"].tolist(), forward["shared"].tolist()
        ([0, 2], [0, 0], [2, 1])
        >>> backward["main_progenitor"].tolist(), backward["n_progenitors"].tolist()
        ([0], [2])
    """
    args = (labels_a, catalogue_a, labels_b, catalogue_b)
    return links_and_config(*args, mesh=mesh, config=config, grow=grow)[0]


def links_and_config(
    labels_a, catalogue_a, labels_b, catalogue_b, *, mesh, config: MergerConfig, grow: bool
):
    """:func:`merger_links` and the config it ran with (grown outside ``jit`` if needed)."""
    labels_a, labels_b = jnp.asarray(labels_a), jnp.asarray(labels_b)
    if labels_a.shape != labels_b.shape or labels_a.ndim not in (1, 3):
        raise ValueError(
            "labels_a and labels_b must be one snapshot's labels each, of the same shape "
            f"(N,) or (nc, nc, nc); got {labels_a.shape} and {labels_b.shape}"
        )
    for name, catalogue in (("catalogue_a", catalogue_a), ("catalogue_b", catalogue_b)):
        if not isinstance(catalogue, Catalogue) or np.ndim(catalogue.id) != 1:
            raise ValueError(f"{name} must be one snapshot's Catalogue")
    layout = leading_layout(labels_a, tuple(labels_a.shape), 1.0, mesh)
    labels = [_padded(layout, la) for la in (labels_a, labels_b)]
    args = (*labels, catalogue_a.id, catalogue_b.id, catalogue_a.status, catalogue_b.status)
    devices = layout.pencils.num_devices
    halo_rows = max(catalogue_a.id.shape[0], catalogue_b.id.shape[0]) // devices

    def run(cfg):
        return _links_program(layout, cfg.pair_rows(halo_rows))(*args)

    if is_traced(args):
        return run(config), config
    check_catalogue_status(catalogue_a.status)
    check_catalogue_status(catalogue_b.status)
    return run_growing(run, config, lambda out: out.status.failure(), grow=grow, stacklevel=4)


def _padded(layout: Layout, labels):
    """Flat labels padded with -1 (no halo) to the layout's multiple of the devices."""
    if layout.num_particles is None:
        return labels
    return jnp.pad(labels, (0, layout.shape[0] - labels.shape[0]), constant_values=-1)


@program_cache(16)
def _links_program(layout: Layout, pair_rows: int):
    axes = tuple(a for a in (layout.pencils.x_axis, layout.pencils.y_axis) if a)

    def device(labels_a, labels_b, ids_a, ids_b, status_a, status_b):
        order_a, order_b = _sorted_ids(ids_a), _sorted_ids(ids_b)
        earlier, later, shared, need = _device_pairs(
            labels_a.ravel(), labels_b.ravel(), order_a, order_b, pair_rows
        )
        if axes:  # every device's pairs on every device
            gather = lambda x: lax.all_gather(x, axes, tiled=True)
            earlier, later, shared = gather(earlier), gather(later), gather(shared)
        links = _links(order_a, order_b, earlier, later, shared)
        need = pmax_all(layout.pencils, need)
        pairs = Status({PAIRS: need}, jnp.int32(0), ((PAIRS, Limit(MAX_PAIRS, pair_rows)),))
        status = pairs.merge(status_a.renamed("earlier ")).merge(status_b.renamed("later "))
        return dataclasses.replace(links, status=status)

    def run(*args):
        # The catalogues' ids (one per halo) are replicated; the labels stay sharded.
        specs = (layout.spec, layout.spec, P(), P(), P(), P())
        return layout.run(device, args, specs, P())

    return JitProgram(run)


def _sorted_ids(ids):
    """(H,) the catalogue's valid ids sorted, padding (``_BIG``) last."""
    return jnp.sort(jnp.where(ids >= 0, ids, _BIG))


def _rows(labels, order):
    """Each label's row in ``order`` and whether it is a catalogued halo."""
    row = jnp.searchsorted(order, labels, method="scan_unrolled")  # (n,)
    row = jnp.minimum(row, order.shape[0] - 1)
    return row, (labels >= 0) & (order[row] == labels)


# Pairs sort as one uint32 key ``row_a * (Hb + 1) + row_b`` while it fits: XLA:CPU sorts one
# operand about 6x faster than two keys.
_ONE_KEY_LIMIT = 2**32


def _sorted_pairs(row_a, row_b, rows_a: int, rows_b: int, *payload):
    """``(row_a, row_b, *payload)`` sorted by both rows; padding (``rows_a``, ``rows_b``)
    sorts last."""
    width = rows_b + 1
    if (rows_a + 1) * width > _ONE_KEY_LIMIT:
        return lax.sort((row_a, row_b, *payload), num_keys=2)
    key = row_a.astype(jnp.uint32) * width + row_b.astype(jnp.uint32)
    key, *payload = lax.sort((key, *payload), num_keys=1) if payload else (jnp.sort(key),)
    return ((key // width).astype(int32), (key % width).astype(int32), *payload)


def _device_pairs(labels_a, labels_b, order_a, order_b, pair_rows: int):
    """This device's distinct (earlier row, later row) pairs and the particles each
    shares, in ``pair_rows`` rows (padding: row ``Ha``, 0 particles), and how many rows
    they needed."""
    rows_a, rows_b = order_a.shape[0], order_b.shape[0]
    row_a, in_a = _rows(labels_a, order_a)
    row_b, in_b = _rows(labels_b, order_b)
    both = in_a & in_b
    row_a, row_b = _sorted_pairs(
        jnp.where(both, row_a, rows_a), jnp.where(both, row_b, rows_b), rows_a, rows_b
    )
    valid = row_a < rows_a  # sorted first
    starts = valid & _new_pair(row_a, row_b)
    picked, need = selection(starts, pair_rows)  # (pair_rows,)
    slot = jnp.maximum(jnp.cumsum(starts, dtype=int32) - 1, 0)
    shared = jax.ops.segment_sum(valid.astype(int32), slot, num_segments=pair_rows)
    take = lambda a, fill: jnp.take(a, picked, mode="fill", fill_value=fill)
    shared = jnp.where(picked < row_a.shape[0], shared, 0)
    return take(row_a, rows_a), take(row_b, rows_b), shared, need


def _new_pair(first, second):
    """Where a sorted run of equal ``(first, second)`` starts."""
    differs = (first[1:] != first[:-1]) | (second[1:] != second[:-1])
    return jnp.concatenate([jnp.ones((1,), bool), differs])


def _links(order_a, order_b, earlier, later, shared) -> MergerLinks:
    """The links from every device's pairs (the same pair may come from several)."""
    rows_a, rows_b = order_a.shape[0], order_b.shape[0]
    earlier, later, shared = _sorted_pairs(earlier, later, rows_a, rows_b, shared)  # (U,)
    valid = earlier < rows_a
    starts = valid & _new_pair(earlier, later)
    slot = jnp.maximum(jnp.cumsum(starts, dtype=int32) - 1, 0)
    total = jax.ops.segment_sum(jnp.where(valid, shared, 0), slot, num_segments=slot.shape[0])
    total, earlier = total[slot], jnp.where(starts, earlier, rows_a)  # one entry per pair
    # Descendants: per earlier row, the most particles, then the smallest later row.
    given = jnp.zeros((rows_a,), int32).at[earlier].max(total, mode="drop")  # (Ha,)
    best = (earlier < rows_a) & (total == given[jnp.minimum(earlier, rows_a - 1)])
    to = jnp.where(best, earlier, rows_a)
    descendant = jnp.full((rows_a,), rows_b, int32).at[to].min(later, mode="drop")
    descendant = jnp.where(descendant < rows_b, descendant, -1)
    # Main progenitors: per later row, the earlier row giving most, then the smallest.
    target = jnp.where(descendant >= 0, descendant, rows_b)  # (Ha,)
    count = jnp.zeros((rows_b,), int32).at[target].add(1, mode="drop")  # (Hb,)
    most = jnp.zeros((rows_b,), int32).at[target].max(given, mode="drop")
    main = (target < rows_b) & (given == most[jnp.minimum(target, rows_b - 1)])
    main = (
        jnp.full((rows_b,), rows_a, int32)
        .at[jnp.where(main, target, rows_b)]
        .min(jnp.arange(rows_a, dtype=int32), mode="drop")
    )
    ids = lambda order, row: jnp.where(
        (row >= 0) & (row < order.shape[0]), order[jnp.clip(row, 0, order.shape[0] - 1)], -1
    )
    valid_rows = lambda order: jnp.where(order < _BIG, jnp.arange(order.shape[0]), -1)
    return MergerLinks(
        id=ids(order_a, valid_rows(order_a)),
        descendant=ids(order_b, descendant),
        shared=given,
        later_id=ids(order_b, valid_rows(order_b)),
        main_progenitor=ids(order_a, main),
        n_progenitors=count,
        status=None,
    )
