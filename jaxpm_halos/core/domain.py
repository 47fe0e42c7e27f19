"""Pencil-domain exchange, run per device inside ``shard_map``.

* :func:`migrate` sends every particle to the device whose pencil holds its position,
  in two all-to-all stages (along the x mesh axis, then along y). Particles that stay are
  never copied into a send buffer.
* :func:`build_ghosts` gives each device copies ("ghosts") of every particle within a width
  ``w`` of its pencil, periodic images included, through two ppermute stages: x faces first,
  then y faces of owned particles and x-ghosts together, which fills the corners.
* :class:`Ghosts` moves per-particle values from owners to their ghosts (``forward``) and
  reduces values from ghosts back onto their owners (``reverse``).
* :func:`return_trip` routes per-particle results back to the input layout. It runs the
  migration stages in reverse order, so each stage moves exactly as many rows as the
  mirrored forward stage did and fits the same buffers.

Only ``jax.lax`` collectives are used (jaxdecomp's operations are silently wrong inside a
user ``shard_map``, and ``ragged_all_to_all`` does not exist on CPU). Every buffer has a
fixed number of rows; the rows each one needed are returned for :class:`~.status.Status`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from . import control
from .cells import sort_rows
from .layout import Pencils
from .rows import (
    after,
    by_dtype,
    compact,
    pmax_all,
    selection,
    sources,
    take,
)

int32 = jnp.int32


# ----------------------------------------------------------------------------------------
# All-to-all routing


def _rank_within_key(key, blocks: int):
    """Per row, the number of earlier rows with the same ``key`` (keys in ``[0, blocks]``).

    One running count per key: ``blocks`` linear passes beat a comparison sort, which is
    slow on XLA:CPU, until meshes have tens of blocks along an axis.
    """
    if blocks > 32:
        sorted_key, order = sort_rows(key)
        counts = jnp.zeros(blocks + 1, int32).at[key].add(1)
        first = jnp.cumsum(counts) - counts
        sorted_rank = jnp.arange(key.shape[0], dtype=int32) - first[sorted_key]
        return jnp.zeros_like(key).at[order].set(sorted_rank)

    def count(d, rank):
        mine = key == d
        return jnp.where(mine, jnp.cumsum(mine, dtype=int32) - 1, rank)

    return control.fori_loop(0, blocks, count, jnp.zeros_like(key))


def _exchange(axis, blocks, dest, valid, payload, pair_rows, out_rows):
    """One all-to-all stage: send each valid row to block ``dest`` along ``axis``.

    Returns the new payload (``out_rows`` rows, valid first) and its valid row count.
    """
    if axis is None:
        out, count = compact(valid, payload, out_rows)
        return out, jnp.minimum(count, out_rows)
    me = lax.axis_index(axis)
    send = valid & (dest != me)
    key = jnp.where(send, dest, blocks)
    counts = jnp.zeros(blocks + 1, int32).at[key].add(1)[:blocks]
    rank = _rank_within_key(key, blocks)
    slot = jnp.where(send & (rank < pair_rows), key * pair_rows + rank, blocks * pair_rows)

    def send_leaf(buf):
        per_block = buf.reshape((blocks, pair_rows) + buf.shape[1:])
        return lax.all_to_all(per_block, axis, 0, 0).reshape(buf.shape)

    received = jax.tree.map(send_leaf, take(payload, sources(slot, blocks * pair_rows)))
    arrived = lax.all_to_all(jnp.minimum(counts, pair_rows)[:, None], axis, 0, 0)[:, 0]
    recv_valid = (jnp.arange(pair_rows)[None, :] < arrived[:, None]).reshape(-1)
    merged = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), payload, received)
    out, count = compact(jnp.concatenate([valid & ~send, recv_valid]), merged, out_rows)
    return out, jnp.minimum(count, out_rows)


def route(
    pencils: Pencils,
    payload,
    valid,
    dest_fn: Callable,
    pair_rows: int,
    mid_rows: int,
    out_rows: int,
    order: str = "xy",
):
    """Send rows to the pencils ``dest_fn(payload) -> (i, j)`` in two all-to-all stages
    (along x then y, or the reverse). Returns the routed rows (``out_rows`` of them, valid
    first) and their count. Size the buffers with :func:`route_needs`."""
    packed, unpack = by_dtype(payload)
    for stage, rows in zip(order, (mid_rows, out_rows)):
        di, dj = dest_fn(unpack(packed))
        axis, blocks, dest = (
            (pencils.x_axis, pencils.px, di) if stage == "x" else (pencils.y_axis, pencils.py, dj)
        )
        packed, count = _exchange(axis, blocks, dest, valid, packed, pair_rows, rows)
        valid = jnp.arange(rows) < count
    return unpack(packed), count


def route_needs(pencils: Pencils, di, dj, valid):
    """Exact buffer needs of an x-then-y :func:`route` of the rows ``valid`` to pencils
    ``(di, dj)``, from a histogram of destinations, before anything moves.

    Returns ``(pair, rows)``: the most rows one device sends to another in either stage,
    and the most rows a device holds after either stage (both maxima over all devices),
    so that buffers of these sizes never truncate.
    """
    px, py = pencils.px, pencils.py
    i, j = pencils.coords()
    hist = jnp.zeros((px, py), int32).at[di, dj].add(valid.astype(int32))
    psum = lambda v, axis: lax.psum(v, axis) if axis else v
    column = psum(hist, pencils.x_axis)  # rows of column j bound for each (i', j')
    others = lambda counts, me: jnp.max(jnp.where(jnp.arange(counts.shape[0]) == me, 0, counts))
    pair = jnp.maximum(others(hist.sum(1), i), others(column[i], j))
    rows = jnp.maximum(column[i].sum(), psum(column, pencils.y_axis)[i, j])
    return pmax_all(pencils, pair), pmax_all(pencils, rows)


class Migrated(NamedTuple):
    """One device's pencil after migration (all arrays have ``rows`` rows, valid first).

    ``payload`` holds ``pos`` (canonical wrapped positions), ``id``, ``origin`` (the row in
    the flattened global input, for the return trip) and any extra per-particle fields.
    """

    payload: dict
    count: jax.Array
    need_transfer: jax.Array
    need_capacity: jax.Array
    nonfinite: jax.Array

    @property
    def valid(self):
        return jnp.arange(self.payload["id"].shape[0]) < self.count


def migrate(pencils: Pencils, fields: dict, valid, transfer_rows: int, capacity_rows: int):
    """Send every valid particle to the device whose pencil contains ``fields['pos']``.

    ``fields`` maps names to per-row arrays of one device's input block; it must hold
    ``pos`` (wrapped into the box) and ``id``. An ``origin`` field (global input row) is
    added. Non-finite positions are excluded and counted.
    """
    n = valid.shape[0]
    finite = jnp.all(jnp.isfinite(fields["pos"]), axis=-1)
    nonfinite = jnp.sum(valid & ~finite, dtype=int32)
    valid = valid & finite
    payload = dict(fields)
    payload["pos"] = jnp.where(valid[:, None], fields["pos"], 0)
    payload["origin"] = pencils.device_index() * n + jnp.arange(n, dtype=int32)
    need_pair, need_rows = route_needs(pencils, *pencils.block_of(payload["pos"]), valid)
    routed, count = route(
        pencils,
        payload,
        valid,
        lambda p: pencils.block_of(p["pos"]),
        transfer_rows,
        capacity_rows,
        capacity_rows,
    )
    routed["id"] = jnp.where(jnp.arange(capacity_rows) < count, routed["id"], -1)
    return Migrated(routed, count, need_pair, need_rows, nonfinite)


def return_trip(
    pencils: Pencils, values, origin, count, input_rows: int, transfer_rows: int, capacity_rows: int
):
    """Route per-particle ``values`` (rows matching ``origin``) back to the input layout.

    Returns arrays of ``input_rows`` rows in the input block's own order.
    """
    valid = jnp.arange(origin.shape[0]) < count

    def home(p):
        device = p["origin"] // input_rows
        return device // pencils.py, device % pencils.py

    routed, n_back = route(
        pencils,
        {"v": values, "origin": origin},
        valid,
        home,
        transfer_rows,
        capacity_rows,
        input_rows,
        order="yx",
    )
    back = jnp.arange(input_rows) < n_back
    slot = jnp.where(back, routed["origin"] % input_rows, input_rows)  # distinct where back
    return take(routed["v"], sources(slot, input_rows))


# ----------------------------------------------------------------------------------------
# Ghost layers


def _swap(axis, blocks, to_low, to_high):
    """Send ``to_low`` to the previous device along ``axis`` and ``to_high`` to the next.

    Returns ``(from_high, from_low)``: what the next device sent down and what the previous
    device sent up. With one device along the axis both come back to this device.
    """
    if axis is None:
        return to_low, to_high
    down = [(s, (s - 1) % blocks) for s in range(blocks)]
    up = [(s, (s + 1) % blocks) for s in range(blocks)]
    from_high = jax.tree.map(lambda a: lax.ppermute(a, axis, down), to_low)
    from_low = jax.tree.map(lambda a: lax.ppermute(a, axis, up), to_high)
    return from_high, from_low


def _swap_rows(axis, blocks, values, low, high):
    """:func:`_swap` of the rows ``low`` and ``high`` (padded with an out-of-range index)
    of the per-row ``values``, moved packed by dtype."""
    packed, unpack = by_dtype(values)
    from_high, from_low = _swap(axis, blocks, take(packed, low), take(packed, high))
    return unpack(from_high), unpack(from_low)


class Ghosts(NamedTuple):
    """The ghost exchange of one device, reusable for any per-particle value.

    The extended row order is ``[owned | x low side | x high side | y low side | y high side]``
    with ``rows`` rows in each ghost block; ``sends[s]`` are the rows sent down and up in
    stage ``s`` (padded with an out-of-range index).
    """

    sends: tuple

    def forward(self, pencils: Pencils, values):
        """Extend per-owned-row ``values`` to every extended row (ghosts get their owner's)."""
        for (axis, blocks), (low, high) in zip(_stage_axes(pencils), self.sends):
            from_high, from_low = _swap_rows(axis, blocks, values, low, high)
            values = jax.tree.map(
                lambda a, b, c: jnp.concatenate([a, b, c]), values, from_low, from_high
            )
        return values

    def reverse_min(self, pencils: Pencils, values):
        """Reduce per-extended-row ``values`` onto owned rows: each owner takes the minimum
        over itself and all its ghost copies."""
        for (axis, blocks), (low, high) in reversed(list(zip(_stage_axes(pencils), self.sends))):
            rows = low.shape[0]
            base = values.shape[0] - 2 * rows
            on_low, on_high = values[base : base + rows], values[base + rows :]
            from_high, from_low = _swap(axis, blocks, on_low, on_high)
            values = (
                values[:base]
                .at[low]
                .min(from_low, mode="drop")
                .at[high]
                .min(from_high, mode="drop")
            )
        return values


def _stage_axes(pencils: Pencils):
    return ((pencils.x_axis, pencils.px), (pencils.y_axis, pencils.py))


class Extended(NamedTuple):
    """Owned particles plus ghosts, as seen by one device.

    Attributes:
      pos: (E, 3) canonical positions in ``[0, L)``; use these for every distance.
      image: (E, 2) int32 periodic image of each row along x and y: the row sits at
        ``pos + L * image`` in this device's frame, next to its pencil.
      id: (E,) int32 global ids (-1 in padding).
      valid: (E,) bool.
      owned: number of leading owned rows (static).
    """

    pos: jax.Array
    image: jax.Array
    id: jax.Array
    valid: jax.Array
    owned: int

    def local_pos(self, box_size):
        """Positions in this device's unwrapped frame (x, y continuous across its faces)."""
        shift = jnp.concatenate([self.image, jnp.zeros_like(self.image[:, :1])], 1)
        return self.pos + box_size * shift.astype(self.pos.dtype)


def build_ghosts(pencils: Pencils, pos, ids, valid, width: float, ghost_rows: int):
    """Copy every particle within ``width`` of this device's pencil onto it.

    ``pos``/``ids``/``valid`` describe the owned rows (after :func:`migrate`). ``width`` may
    be as large as the narrower pencil side. Returns ``(extended, ghosts, need)`` where
    ``need`` is the largest ghost block that was needed.
    """
    wx, wy = pencils.widths
    if not 0 <= width <= min(wx, wy):
        raise ValueError(
            f"ghost width {width} must lie in [0, {min(wx, wy)}] (the narrower pencil "
            f"side of a ({pencils.px}, {pencils.py}) decomposition of a box of "
            f"{pencils.box_size})"
        )
    lo, hi = pencils.bounds()
    coords = pencils.coords()
    width = jnp.float32(width)
    owned = pos.shape[0]
    values = {"pos": pos, "id": ids, "image": jnp.zeros((owned, 2), int32), "valid": valid}

    def faces(dim, rows_valid, coord):
        return rows_valid & (coord < lo[dim] + width), rows_valid & (coord >= hi[dim] - width)

    def y_counts(mask):
        down, up = faces(1, mask, values["pos"][:, 1])
        return jnp.stack([jnp.sum(down, dtype=int32), jnp.sum(up, dtype=int32)])

    sends = []
    # Stage x also tells each receiver how many of the rows it was sent (before any
    # truncation) it will pass on in stage y, so the need of stage y is exact too.
    need = jnp.int32(0)
    y_need = y_counts(valid)
    for dim, (axis, blocks) in enumerate(_stage_axes(pencils)):
        to_low, to_high = faces(dim, values["valid"], values["pos"][:, dim])
        low, n_low = selection(to_low, ghost_rows)
        high, n_high = selection(after(low, to_high), ghost_rows)
        if dim == 0:
            (from_high_y, from_low_y) = _swap(axis, blocks, y_counts(to_low), y_counts(to_high))
            y_need = y_need + from_high_y + from_low_y
            need = jnp.maximum(n_low, n_high)
        from_high, from_low = _swap_rows(axis, blocks, values, low, high)
        # Rows that crossed the periodic seam sit one box away in this device's frame.
        at_high_end = coords[dim] == blocks - 1
        at_low_end = coords[dim] == 0
        from_high["image"] = from_high["image"].at[:, dim].add(jnp.where(at_high_end, 1, 0))
        from_low["image"] = from_low["image"].at[:, dim].add(jnp.where(at_low_end, -1, 0))
        values = jax.tree.map(
            lambda a, b, c: jnp.concatenate([a, b, c]), values, from_low, from_high
        )
        sends.append((low, high))
    need = jnp.maximum(need, jnp.max(y_need))
    ext = Extended(
        values["pos"],
        values["image"],
        jnp.where(values["valid"], values["id"], -1),
        values["valid"],
        owned,
    )
    return ext, Ghosts(tuple(sends)), need


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["migrated", "ext", "ghosts", "need_ghosts", "fits"],
    meta_fields=["width"],
)
@dataclasses.dataclass(frozen=True)
class Decomposition:
    """One device's share of a snapshot: its migrated particles, plus ghosts of width
    ``width`` (box units, static: an analysis that needs a wider layer is refused while
    it is traced, not answered wrong).

    Computed once per snapshot and shared by every analysis (FoF, kNN, user analyses).
    ``ext`` rows ``[:capacity]`` are the owned rows of ``migrated`` in the same order.
    ``fits`` (scalar bool, the same on every device) is False when one of its buffers
    overflowed on some device (set by :meth:`~.pipeline.Plan.decompose`, which knows the
    capacities; True when built here): an analysis then marks its rows unresolved rather
    than return values computed on truncated data.
    """

    migrated: Migrated
    ext: Extended
    ghosts: Ghosts
    need_ghosts: jax.Array
    width: float
    fits: jax.Array = dataclasses.field(default_factory=lambda: jnp.bool_(True))


def decompose(
    pencils: Pencils,
    fields: dict,
    valid,
    width: float,
    transfer_rows: int,
    capacity_rows: int,
    ghost_rows: int,
) -> Decomposition:
    """:func:`migrate`, then :func:`with_ghosts` of the given width."""
    migrated = migrate(pencils, fields, valid, transfer_rows, capacity_rows)
    return with_ghosts(pencils, migrated, width, ghost_rows)


def with_ghosts(
    pencils: Pencils, migrated: Migrated, width: float, ghost_rows: int
) -> Decomposition:
    """The decomposition of already migrated particles with ghosts of the given width."""
    ext, ghosts, need = build_ghosts(
        pencils, migrated.payload["pos"], migrated.payload["id"], migrated.valid, width, ghost_rows
    )
    return Decomposition(migrated, ext, ghosts, need, float(width))
