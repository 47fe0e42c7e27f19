"""The distributed SO search behind :func:`jaxpm_halos.spherical_overdensity`.

Per device (inside ``shard_map``):

1. the particles are decomposed with ghosts as wide as the largest radius searched
   (``SOConfig.radius``), so every particle within that radius of a centre in the pencil
   is on the pencil's device, and periodic images along z are appended;
2. the device takes the centres inside its pencil. For each search level ``r_l`` (the
   radius halved ``levels - 1`` times, then doubled back up) the rows are sorted into
   x-y columns of side ``r_l / 2``, and a pending centre's candidates are the z windows
   ``[z - r_l, z + r_l]`` of the 5 x 5 columns around it;
3. pending centres are handled in batches whose candidates fit the pair buffer: exact
   canonical distances, one sort by (centre, distance), running masses, the first
   downcrossing of every threshold;
4. a centre whose profile has not fallen below some threshold within ``r_l`` is searched
   at the next level, unless the particles within ``r_l`` already prove the next one
   falls below (their mass plus the heaviest particle's is below the threshold mass at
   ``r_l``). Centres left after the last level are reported through the status (NaN).

Every centre is handled by exactly one device; results are summed over devices, so they
are replicated. When every particle has the same mass ``m``, the mass within a radius is
the particles counted times ``m`` (one rounding), so given the same centres the results are
the same bits on every mesh; unequal masses are summed in an order that depends on the
mesh.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ..core import control
from ..core.cells import (
    CellGrid,
    _x64,
    column_start,
    saturating_cumsum,
    search_columns,
    sort_columns,
    z_order,
)
from ..core.config import IMAGES, SO_PAIRS, SO_RADIUS, SO_SMOOTH, SOConfig
from ..core.domain import Decomposition
from ..core.errors import Limit
from ..core.geometry import periodic_distance2, wrap
from ..core.ghosts import ghost_width, widest_linking_length, z_images
from ..core.layout import Pencils
from ..core.pipeline import Plan, Step
from ..core.rows import (
    after,
    common_mass,
    pmax_all,
    psum_all,
    selection,
    valued_with_derivative_of,
)
from ..core.status import Status
from ._soft import FOUR_THIRDS_PI, Record, segment_scan, soft_batch, soft_mass_derivative

int32 = jnp.int32


_REACH = 2  # columns of side r / 2 on each side of a centre's column cover the radius r


def search_width(radius: float, box_size: float) -> float:
    """Ghost layer for searches up to ``radius``, with FoF's margin for rounding at faces."""
    return ghost_width(radius, box_size)


def radius_limit(radius: float, pencils: Pencils) -> Limit:
    """The search radius as a :class:`Limit`: "rows" are thousandths of the box, and at
    most :func:`largest_radius`."""
    box = pencils.box_size
    scale = 1000.0 / box
    return Limit(
        SO_RADIUS,
        math.ceil(radius * scale),
        scale,
        most=largest_radius(pencils),
        searched=True,
        beyond="a third of the box and the narrower pencil side of the mesh. Some "
        "centre's enclosed density is still above the threshold there: a threshold "
        "at or below the mean density may never be reached (SO thresholds are densities "
        "in mass per volume, e.g. 200 times the mean: see jaxpm_halos.units), or the "
        "halo is too large for this box (on a mesh, fewer devices along its narrow "
        "axis allow a larger radius)",
    )


def largest_radius(pencils: Pencils) -> float:
    """The largest SO search radius the box and the mesh support: below a third of the
    box, and the ghost layer it needs within the narrower pencil side."""
    return min(widest_linking_length(pencils) * (1 - 1e-6), pencils.box_size / 3.01)


class _Frame(NamedTuple):
    """One device's rows for the search: extended rows plus z images (R rows)."""

    local: jax.Array  # (R, 3) positions in the device's unwrapped frame
    canon: jax.Array  # (R, 3) canonical positions in [0, L): every distance uses these
    moved: jax.Array  # (R, 3) the same, with their derivative (``canon`` has none)
    mass: jax.Array  # (R,)
    valid: jax.Array  # (R,)
    origin: jax.Array  # (3,) lower corner of the frame
    by_z: jax.Array  # (R,) rows sorted by z, shared by every level's columns
    lengths: tuple  # (lx, ly) of the frame, static


def _frame(plan: Plan, decomposition: Decomposition, mass):
    """The search frame and the rows the z images needed."""
    pencils, ext, width = plan.pencils, decomposition.ext, plan.width
    ext_mass = decomposition.ghosts.forward(pencils, mass)
    local, valid, source, need_images = z_images(ext, width, pencils.box_size, plan.image_rows)
    pick = lambda a: jnp.concatenate([a, jnp.take(a, source, axis=0, mode="fill", fill_value=0)])
    lo, _ = pencils.bounds()
    origin = jnp.stack([lo[0] - width, lo[1] - width, jnp.float32(-width)]).astype(local.dtype)
    wx, wy = pencils.widths
    frame = _Frame(
        local,
        jax.lax.stop_gradient(pick(ext.pos)),
        pick(ext.pos),
        pick(ext_mass),
        valid,
        origin,
        z_order(local, valid),
        (wx + 2 * width, wy + 2 * width),
    )
    return frame, need_images


def _windows(frame: _Frame, centres, reach: float):
    """Candidate ranges of each centre: ``(cols, starts, ends)`` with (H, 25) ranges of
    sorted positions, the z windows ``[z - reach, z + reach]`` of the 5 x 5 columns of side
    ``reach / 2`` around the centre's column."""
    side = reach / _REACH
    cols = sort_columns(frame.lengths, side, frame.local, frame.origin, frame.valid, frame.by_z)
    grid = CellGrid.covering((frame.lengths[0], frame.lengths[1], 0.0), side)  # as sort_columns
    nx, ny = cols.shape
    sides = jnp.asarray(grid.side[:2], centres.dtype)
    c = jnp.floor((centres[:, :2] - frame.origin[:2]) / sides).astype(int32)  # (H, 2)
    offsets = jnp.arange(-_REACH, _REACH + 1, dtype=int32)
    dx, dy = (a.reshape(-1) for a in jnp.meshgrid(offsets, offsets, indexing="ij"))  # (25,)
    cx, cy = c[:, :1] + dx, c[:, 1:] + dy  # (H, 25)
    inside = (cx >= 0) & (cx < nx) & (cy >= 0) & (cy < ny)
    key = jnp.where(inside, cx * ny + cy, nx * ny).reshape(-1)  # (H * 25,)
    z = jnp.repeat(centres[:, 2], dx.shape[0])  # (H * 25,)
    lo, hi = column_start(cols, key), column_start(cols, key + 1)
    start = search_columns(cols.z, lo, hi, z - reach, False)
    end = jnp.maximum(search_columns(cols.z, lo, hi, z + reach, True), start)
    shape = cx.shape
    return (
        cols,
        jnp.where(inside, start.reshape(shape), 0),
        jnp.where(inside, end.reshape(shape), 0),
    )


class _Batch(NamedTuple):
    """Downcrossings of one batch of centres at one search radius."""

    mass: jax.Array  # (H, D) mass within the downcrossing (batch centres)
    found: jax.Array  # (H, D) the downcrossing lies within the searched radius (or just past)


class _Level(NamedTuple):
    """One search radius: its constants and every centre's candidate windows."""

    radius: jax.Array  # () the radius, in the frame's dtype
    radius2: jax.Array  # () its square
    volume: jax.Array  # () 4/3 pi radius^3
    order: jax.Array  # (R,) frame rows in column order
    starts: jax.Array  # (C, 25) first sorted position of each window
    ends: jax.Array  # (C, 25) one past its last


def _by_centre_and_distance(centre, d2, *payload):
    """Pairs sorted by centre, then distance: for float32 distances one sort of an int64
    key (the centre above the bits of ``d2``, which order like non-negative floats) with the
    ``payload`` arrays, faster than a sort on two keys; float64 distances (``jax_enable_x64``)
    leave no room for the centre in 64 bits and take the sort on two keys."""
    if d2.dtype.itemsize > 4:
        return lax.sort((centre, d2, *payload), num_keys=2)
    with _x64():
        bits = lax.bitcast_convert_type(d2, int32).astype(jnp.int64)
        packed, *payload = lax.sort(
            (jnp.left_shift(centre.astype(jnp.int64), 32) | bits, *payload), num_keys=1
        )
        low = (packed & 0xFFFFFFFF).astype(int32)  # non-negative float bits: below 2**31
        return (
            jnp.right_shift(packed, 32).astype(int32),
            lax.bitcast_convert_type(low, d2.dtype),
            *payload,
        )


def _batch(
    frame: _Frame,
    level: _Level,
    batch,
    centres,
    density,
    common,
    box: float,
    pairs: int,
    smoothing: float | None = None,
    record: Record | None = None,
):
    """Profiles of the ``batch`` centres from their candidates at ``level`` (at most
    ``pairs``); ``common`` is :func:`~jaxpm_halos.core.domain.common_mass` of the particles.
    Returns ``(_Batch, record)``: with ``smoothing``, the smooth masses (:mod:`._soft`) and
    ``record`` with the windows of the centres resolved."""
    order, starts, ends = level.order, level.starts, level.ends
    h = centres.shape[0]
    lengths = jnp.where(batch[:, None], ends - starts, 0).reshape(-1)  # (H * 25,)
    cum = jnp.cumsum(lengths, dtype=int32)
    t = jnp.arange(pairs, dtype=int32)
    live = t < cum[-1]
    flat = jnp.minimum(jnp.searchsorted(cum, t, side="right").astype(int32), cum.shape[0] - 1)
    centre = flat // starts.shape[1]
    row = order[
        jnp.minimum(starts.reshape(-1)[flat] + t - (cum[flat] - lengths[flat]), order.shape[0] - 1)
    ]
    d2 = periodic_distance2(frame.canon[row], centres[centre], box)  # (P,)
    inside = live & frame.valid[row] & (d2 <= level.radius2)
    # The frame rows ride along only where windows are recorded.
    key, d2, m, *row = _by_centre_and_distance(
        jnp.where(inside, centre, h), d2, frame.mass[row], *([row] if smoothing else [])
    )
    inside = key < h
    m = jnp.where(inside, m, 0)
    first = inside & jnp.concatenate([jnp.ones(1, bool), key[1:] != key[:-1]])
    if smoothing is not None:  # equal masses (the API refuses others)
        count = segment_scan(jnp.add, inside.astype(int32), first)  # (P,)
        soft = soft_batch(
            record, batch, key, row[0], inside, first, count, jnp.sqrt(d2), density,
            jnp.maximum(common[1], 0).astype(m.dtype), level.radius, smoothing,
        )  # fmt: skip
        return _Batch(soft.mass, soft.found), soft.record
    # Equal masses are counted and the count scaled once: the same bits on every mesh (a
    # running float sum rounds differently where the pairs sit elsewhere in the buffer).
    equal, heaviest = common
    heaviest = jnp.maximum(heaviest, 0).astype(m.dtype)
    weight, scale = jnp.where(equal, inside.astype(m.dtype), m), jnp.where(equal, heaviest, 1)
    within = segment_scan(jnp.add, weight, first) * scale  # (P,) mass of the i nearest
    before = jnp.where(first, 0, jnp.concatenate([jnp.zeros(1, m.dtype), within[:-1]]))
    r = jnp.sqrt(d2)
    volume = FOUR_THIRDS_PI * r * r * r
    below = inside[:, None] & (within[:, None] < density[None, :] * volume[:, None])  # (P, D)
    position = jnp.where(below, t[:, None], pairs)
    crossing = jax.ops.segment_min(position, key, num_segments=h + 1)[:h]  # (H, D)
    found = crossing < pairs
    total = jax.ops.segment_sum(weight, key, num_segments=h + 1)[:h] * scale  # (H,)
    mass = jnp.where(found, before[jnp.minimum(crossing, pairs - 1)], total[:, None])
    # The next particle lies beyond the radius: it is below when even the heaviest one
    # added to the mass within the radius stays under the threshold mass there.
    edge = density * level.volume
    found = found | (total[:, None] + heaviest < edge[None, :])
    return _Batch(mass, found), record


def _levels(frame: _Frame, centres, radius: float, levels: int, box: float) -> _Level:
    """Every level's :class:`_Level`, stacked along a leading axis of ``levels``.

    The column sorts differ in shape from level to level and are done here, once each;
    everything after them has one shape for all levels, so the search below is one loop
    over a level index, compiled once, not once per level."""
    dtype = frame.canon.dtype
    stacked = []
    for level in range(levels):
        r = radius / 2 ** (levels - 1 - level)
        if stacked:
            # One level's column sort at a time: a plain jit's scheduler would otherwise
            # form every level's int64 keys at once.
            frame = frame._replace(origin=after(stacked[-1].order, frame.origin))
        cols, starts, ends = _windows(frame, centres, search_width(r, box))
        # Python float64 constants rounded once to the frame's dtype, as a literal would be.
        volume = FOUR_THIRDS_PI * r**3
        stacked.append(
            _Level(
                jnp.asarray(r, dtype),
                jnp.asarray(r * r, dtype),
                jnp.asarray(volume, dtype),
                cols.order,
                starts,
                ends,
            )
        )
    return jax.tree.map(lambda *a: jnp.stack(a), *stacked)  # (L, ...)


def _search(
    frame: _Frame,
    level: _Level,
    centres,
    pending,
    density,
    common,
    box: float,
    pairs: int,
    mass,
    smoothing: float | None,
    record: Record | None,
):
    """One search radius for the ``pending`` centres, in batches that fit ``pairs``.

    Returns ``(mass, done, need_pairs, record)``: masses updated where resolved, the
    centres resolved at this level, the most candidates one centre needed, and (with
    ``smoothing``) ``record`` with their windows.
    """
    counts = jnp.sum(level.ends - level.starts, axis=1, dtype=int32)  # (C,)
    need = jnp.max(jnp.where(pending, counts, 0))
    # A centre whose candidates alone overflow the buffer cannot be handled: it stays
    # unresolved (and the status says how many rows it needed).
    todo = pending & (counts <= pairs)

    small = max(pairs // 16, 1)

    def body(state):
        todo, mass, done, record = state
        cum = saturating_cumsum(jnp.where(todo, counts, 0), pairs)  # never wraps int32
        batch = todo & (cum <= pairs)
        args = (frame, level, batch, centres, density, common, box)
        # Most batches are a few small haloes: a buffer 16 times smaller sorts them faster.
        result, record = control.cond(
            jnp.max(jnp.where(batch, cum, 0)) <= small,
            lambda: _batch(*args, small, smoothing, record),
            lambda: _batch(*args, pairs, smoothing, record),
        )
        resolved = batch & jnp.all(result.found, axis=1)
        mass = jnp.where(resolved[:, None], result.mass, mass)
        return todo & ~batch, mass, done | resolved, record

    _, mass, done, record = control.while_loop(
        lambda s: jnp.any(s[0]), body, (todo, mass, jnp.zeros_like(pending), record)
    )
    return mass, done, need, record


def so_on_decomposition(
    plan: Plan,
    decomposition: Decomposition,
    centres,
    centre_valid,
    density,
    config: SOConfig,
    radius: float,
    mass=None,
    centre_limit: Limit | None = None,
    smoothing: float | None = None,
):
    """SO masses and radii about ``centres`` (H, 3), replicated on every device.

    ``plan.width`` must be at least :func:`search_width` of ``radius``; ``density`` is
    (D,). Each device searches about the centres in its pencil, compacted into
    ``centre_limit.rows`` rows (buffer "so centres"; default: all H, which cannot
    overflow). Returns ``(mass, radius, status)``, masses and radii (H, D), replicated;
    0 for invalid centres, NaN for valid but non-finite ones (e.g. the centre of mass of
    massless members) and where the profile had not fallen below the threshold within
    ``radius``.

    With ``smoothing`` (a width relative to the radius), the smooth definition of
    :mod:`._soft` for equal masses, differentiable with respect to the particles'
    positions, ``centres`` and the common mass; otherwise the hard one, whose derivative
    is zero.
    """
    pencils, box = plan.pencils, plan.pencils.box_size
    migrated = decomposition.migrated
    if mass is None:
        mass = migrated.payload["mass"]
    # The search runs on stopped values: membership is a discrete choice, and reverse mode
    # cannot differentiate the level loops (dynamic trip counts). The smooth masses take
    # their derivative afterwards, from the rows recorded (soft_mass_derivative).
    moved_centres, moved_mass = centres, mass
    mass, density = jax.lax.stop_gradient((mass, density))
    frame, need_images = _frame(plan, decomposition, mass)
    common = common_mass(pencils, mass, migrated.valid)
    finite = jnp.all(jnp.isfinite(centres), axis=1)  # (H,)
    centres = wrap(jax.lax.stop_gradient(centres), box)
    i, j = pencils.block_of(centres)
    ci, cj = pencils.coords()
    mine = centre_valid & finite & (i == ci) & (j == cj)
    rows = centres.shape[0] if centre_limit is None else centre_limit.rows
    picked, need_centres = selection(mine, rows)  # (C,) indices into the H centres
    local = jnp.take(centres, picked, axis=0, mode="fill", fill_value=0)  # (C, 3)
    # At run time in every program: a threshold XLA could see as a constant (in situ) would
    # be folded into the profile test and the radius differently from an argument (offline).
    density = jax.lax.optimization_barrier(jnp.asarray(density, frame.canon.dtype))
    pairs = config.pair_rows(plan.n0)
    result = jnp.zeros((rows, density.shape[0]), frame.canon.dtype)  # (C, D)
    levels = _levels(frame, local, radius, config.levels, box)  # (L, ...)
    window_rows = config.smooth_rows(plan.n0)
    record = None
    if smoothing is not None:
        record = Record.empty(window_rows, rows, density.shape[0])

    def search(index, state):
        result, pending, need_pairs, record = state
        level = jax.tree.map(lambda a: a[index], levels)
        result, done, need, record = _search(
            frame, level, local, pending, density, common, box, pairs, result, smoothing, record
        )
        return result, pending & ~done, jnp.maximum(need_pairs, need), record

    result, pending, need_pairs, record = control.fori_loop(
        0,
        config.levels,
        search,
        (result, jnp.arange(rows) < need_centres, jnp.int32(0), record),
    )
    if smoothing is not None:
        centre_rows = jnp.take(wrap(moved_centres, box), picked, axis=0, mode="fill", fill_value=0)
        common_diff = _common_mass_with_derivative(pencils, moved_mass, migrated.valid)
        derivative = soft_mass_derivative(
            record, frame.moved, centre_rows, common_diff, density, smoothing, box
        )
        result = valued_with_derivative_of(result, derivative)
    result = jnp.where(pending[:, None], jnp.nan, result)
    scattered = (
        jnp.zeros((centres.shape[0], density.shape[0]), result.dtype)
        .at[picked]
        .set(result, mode="drop")
    )
    # A non-finite centre is searched by no device: NaN, not M = R = 0, which would read as
    # "below the threshold at once".
    so_mass = jnp.where((centre_valid & ~finite)[:, None], jnp.nan, psum_all(pencils, scattered))
    so_radius = jnp.cbrt(3 * so_mass / (4 * math.pi * density[None, :]))
    unresolved = psum_all(pencils, jnp.sum(pending, dtype=int32))
    status = _status(plan, config, radius, need_images, need_pairs, unresolved)
    if smoothing is not None:
        status = status.merge(
            Status(
                pmax_all(pencils, {"so smooth": record.fill}),
                jnp.int32(0),
                (("so smooth", Limit(SO_SMOOTH, window_rows, plan.n0)),),
            )
        )
    if centre_limit is not None:
        status = Status(
            pmax_all(pencils, {"so centres": need_centres}),
            jnp.int32(0),
            (("so centres", centre_limit),),
        ).merge(status)
    return so_mass, so_radius, status


def _status(plan: Plan, config: SOConfig, radius: float, need_images, need_pairs, unresolved):
    reach = radius_limit(radius, plan.pencils)
    # Unresolved profiles need a wider search: twice the radius is the suggestion.
    need_radius = jnp.where(unresolved > 0, 2 * reach.rows, reach.rows).astype(int32)
    images = plan.status({"so z images": need_images}, {"so z images": IMAGES})
    pairs = Limit(SO_PAIRS, config.pair_rows(plan.n0), plan.n0)
    own = Status(
        pmax_all(plan.pencils, {"so pairs": need_pairs, "so radius": need_radius}),
        jnp.int32(0),
        (("so pairs", pairs), ("so radius", reach)),
    )
    return images.merge(own)


def _common_mass_with_derivative(pencils: Pencils, mass, valid):
    """The mean particle mass (the common one where masses are equal) with its derivative:
    a scalar mass broadcast to the rows takes it back whole (the mean's derivative is
    1/N per row)."""
    total = psum_all(pencils, jnp.sum(jnp.where(valid, mass, 0)))
    count = psum_all(pencils, jnp.sum(valid, dtype=int32))
    return total / jnp.maximum(count, 1).astype(total.dtype)


def so_step(
    plan: Plan,
    centres,
    centre_valid,
    density,
    config: SOConfig,
    radius: float,
    smoothing: float | None = None,
) -> Step:
    """The SO primitive as a pipeline step (replicated outputs)."""

    def run(decomposition):
        mass, so_radius, status = so_on_decomposition(
            plan,
            decomposition,
            centres,
            centre_valid,
            density,
            config,
            radius,
            smoothing=smoothing,
        )
        return {"mass": mass, "radius": so_radius, "status": status}

    return Step(run, "replicated")
