"""Exact distributed friends-of-friends.

Per device (inside ``shard_map``):

1. the particles are migrated to the pencil that holds them and receive ghost copies of
   every particle within the linking length of the pencil (:mod:`jaxpm_halos.core.domain`);
2. periodic images along z are appended, and the rows are sorted into cells of side >= l
   (:mod:`jaxpm_halos.core.cells`);
3. candidate pairs over each cell and its forward neighbours are tested in fixed-size
   chunks (by float32 squared distance; the few within its rounding of ``l`` exactly, as
   scipy's float64 decides them: :func:`near_links`), and linked pairs are merged at once
   into a union-find forest (hook the larger root under the smaller, then pointer-jump);
4. groups that cross pencils are merged: each local component takes the smallest id among
   its rows, owners take the minimum over their ghost copies, ghosts receive it back, and
   this repeats until a ``psum`` says no label changed.

Every link is found on the device that owns one of its ends (a partner within ``l`` of an
owned particle is always an owned row or a ghost there), and all distances use the
canonical wrapped coordinates, so the groups are those of a serial FoF on every mesh.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from ..core import control
from ..core.catalogue import Catalogue, catalogue_rows
from ..core.cells import for_each_pair_chunk, half_shell_windows, sort_columns, sort_rows, union
from ..core.config import CAPACITY, IMAGES, MAX_HALOS, FoFConfig
from ..core.domain import Decomposition, Extended, Ghosts, route, route_needs
from ..core.errors import Limit
from ..core.geometry import exactly_within, periodic_distance2, squared_length_limits
from ..core.ghosts import ghost_width, widest_linking_length, z_images
from ..core.layout import Pencils
from ..core.pipeline import Plan, Step
from ..core.rows import pmax_all, psum_all, selection, sources
from ..core.status import Status

int32 = jnp.int32
_BIG = jnp.iinfo(jnp.int32).max


def local_components(
    ext: Extended,
    pencils: Pencils,
    linking_length: float,
    width: float,
    image_rows: int,
    chunk: int | None,
):
    """Connected components of the friends graph among one device's extended rows.

    Returns ``(component, segments, need_images)``: for each extended row a component
    index below ``segments`` (the sorted position of its root, shared by exactly the rows of
    one local component), and the rows the z images needed.
    """
    # Components are integers, so no derivative flows through them; without this,
    # jax.hessian of a catalogue field failed in JAX's forward mode of the binary searches.
    ext = ext._replace(pos=lax.stop_gradient(ext.pos))
    box = pencils.box_size
    l = float(linking_length)
    wx, wy = pencils.widths
    lo, _ = pencils.bounds()
    origin = jnp.stack([lo[0] - width, lo[1] - width, jnp.float32(-width)]).astype(ext.pos.dtype)

    pos, valid, source, need_images = z_images(ext, width, box, image_rows)
    canon = jnp.concatenate([ext.pos, jnp.take(ext.pos, source, axis=0, mode="fill", fill_value=0)])
    cols = sort_columns((wx + 2 * width, wy + 2 * width), l, pos, origin, valid)
    sorted_pos = canon[cols.order]
    rows = cols.order.shape[0]
    rank = sources(cols.order, rows)  # a permutation: every slot is filled

    # Each image is the same particle as the row it copies.
    n_ext = ext.pos.shape[0]
    image_of = rank[n_ext:]
    image_src = jnp.take(rank, source, mode="fill", fill_value=0)
    parent = union(jnp.arange(rows, dtype=int32), image_of, image_src, valid[n_ext:])

    certain, upper = squared_length_limits(l * l, ext.pos.dtype)
    exact_near = ext.pos.dtype == jnp.float32  # float64 positions keep the plain test
    # Links are appended to a buffer and merged into the forest only when the buffer is
    # full: each union pass costs O(rows), and there are about links / chunk of them.
    chunk = max(chunk or 0, rows // 2)
    buffer = 2 * chunk

    def flush(state):
        parent, u, v, count = state
        parent = union(parent, u, v, jnp.arange(buffer) < count)
        return parent, u, v, jnp.int32(0)

    def link_chunk(state, i, j, live):
        parent, u, v, count = state
        a, b = sorted_pos[i], sorted_pos[j]
        d2 = periodic_distance2(a, b, box)
        link = live & (d2 <= certain)
        if exact_near:  # pairs within float32's rounding of l, decided as scipy's float64
            near = live & (d2 > certain) & (d2 <= upper)
            link = link | near_links(near, a, b, box, l * l)
        slot = jnp.where(link, count + jnp.cumsum(link, dtype=int32) - 1, buffer)
        u, v = u.at[slot].set(i, mode="drop"), v.at[slot].set(j, mode="drop")
        state = parent, u, v, count + jnp.sum(link, dtype=int32)
        return control.cond(state[3] > buffer - chunk, flush, lambda s: s, state)

    # The z windows reach a little beyond l: local z carries image shifts, and the exact
    # test below uses canonical coordinates.
    starts, ends = half_shell_windows(cols, jnp.asarray(width, pos.dtype))
    empty = jnp.zeros(buffer, int32)
    state = for_each_pair_chunk(
        starts, ends, chunk, link_chunk, (parent, empty, empty, jnp.int32(0))
    )
    parent = flush(state)[0]
    return parent[rank[:n_ext]], rows, need_images


def near_links(near, a, b, box: float, squared_length: float, block: int = 64):
    """(P,) which of the pairs flagged ``near`` (P,) of rows ``a``, ``b`` (P, 3) are within
    ``squared_length`` exactly (:func:`~jaxpm_halos.core.geometry.exactly_within`), ``block`` at a
    time: they are few, so the exact test runs on them alone (no pass at all where none is)."""
    P = near.shape[0]

    def decide(state):
        todo, links = state
        (pick,) = jnp.nonzero(todo, size=block, fill_value=P)  # (block,)
        take = functools.partial(jnp.take, axis=0, mode="fill", fill_value=0)
        within = exactly_within(take(a, pick), take(b, pick), box, squared_length)
        return (todo.at[pick].set(False, mode="drop"), links.at[pick].set(within, mode="drop"))

    return control.while_loop(
        lambda state: jnp.any(state[0]), decide, (near, jnp.zeros_like(near))
    )[1]


def merge_labels(ext: Extended, ghosts: Ghosts, pencils: Pencils, component, segments: int):
    """Global FoF labels (smallest particle id of the group) for every extended row.

    Iterates min-label exchange between local components and the ghost copies of each
    particle until no label changes on any device. Returns ``(labels, iterations)``.
    """
    ids = jnp.where(ext.valid, ext.id, _BIG)

    def spread(values):
        return jax.ops.segment_min(values, component, num_segments=segments)[component]

    def step(state):
        labels, _, iterations = state
        owned = ghosts.reverse_min(pencils, labels)
        new = spread(jnp.where(ext.valid, ghosts.forward(pencils, owned), _BIG))
        changed = psum_all(pencils, jnp.sum(new != labels, dtype=int32))
        return new, changed, iterations + 1

    labels, _, iterations = control.while_loop(
        lambda s: s[1] > 0, step, (spread(ids), jnp.int32(1), jnp.int32(0))
    )
    return jnp.where(ext.valid, labels, -1), iterations


def _group_by_label(labels, component, segments: int, is_ghost, ghost_rows: int):
    """Per row, the smallest local component that carries the row's global label, and per
    such group whether any ghost carries its label.

    Ghosts can join owned pieces of one group into a single local component, so local
    components depend on the ghost width; groups keyed by global label do not. Catalogue
    sums over them then add the same owned rows in the same order whatever ghost layer
    the decomposition was built with (FoF alone, or shared with kNN's wider one). A
    component without ghost rows is a whole group, so only the components with ghosts
    (at most one per ghost row) need their labels compared.
    """
    has_ghost = jax.ops.segment_max(is_ghost, component, num_segments=segments)
    component_label = jax.ops.segment_min(
        jnp.where(labels >= 0, labels, _BIG), component, num_segments=segments
    )
    edge, _ = selection(has_ghost, ghost_rows)
    edge_label = jnp.take(component_label, edge, mode="fill", fill_value=_BIG)
    sorted_label, at = sort_rows(edge_label)  # edges are ascending: ties stay in edge order
    sorted_component = edge[at]
    starts = jnp.concatenate([jnp.ones(1, bool), sorted_label[1:] != sorted_label[:-1]])
    first = lax.cummax(jnp.where(starts, jnp.arange(ghost_rows, dtype=int32), 0))
    representative = (
        jnp.arange(segments, dtype=int32)
        .at[sorted_component]
        .set(sorted_component[first], mode="drop")
    )
    group = representative[component]
    return group, jax.ops.segment_max(is_ghost, group, num_segments=segments)


# ----------------------------------------------------------------------------------------
# Device kernel and public API


def linking_length_misfit(linking_length: float, pencils: Pencils) -> str | None:
    """Why FoF cannot link at ``linking_length`` on ``pencils``' mesh, or None:
    ``"box"`` when it is not below a third of the box (checked first: fewer devices cannot
    help there), ``"pencil"`` when its ghost layer is wider than the narrowest pencil."""
    box = pencils.box_size
    if 3 * linking_length > box:
        return "box"
    return "pencil" if ghost_width(linking_length, box) > min(pencils.widths) else None


def _floor_significant(x: float, digits: int) -> float:
    """``x > 0`` rounded down to ``digits`` significant digits (a value that still fits)."""
    shift = digits - 1 - math.floor(math.log10(x))  # decimals kept (negative: tens, ...)
    return math.floor(x * 10.0**shift) / 10.0**shift


def check_linking_length(l: float, pencils: Pencils) -> None:
    """Raise a ValueError naming the limit, and a linking length that fits, unless FoF
    can link at ``l`` on ``pencils``' mesh (:func:`linking_length_misfit`)."""
    box = pencils.box_size
    misfit = linking_length_misfit(l, pencils)
    widest = _floor_significant(widest_linking_length(pencils), 5)
    if misfit == "box":  # with a length that fits the pencils too
        fits = f"< {box:g} / 3" if widest >= box / 3 else f"<= {widest}"
        raise ValueError(
            f"linking length {l} must be below a third of the box {box}: use a "
            f"linking length {fits}"
        )
    if misfit == "pencil":
        raise ValueError(
            f"linking length {l} needs a ghost layer of {ghost_width(l, box):.7g} "
            f"(a margin for float rounding), wider than a pencil "
            f"({min(pencils.widths)}) of the ({pencils.px}, {pencils.py}) mesh; "
            f"use a linking length <= {widest} or fewer devices along that axis"
        )


def fof_step(
    plan: Plan,
    linking_length: float,
    min_members: int,
    config: FoFConfig,
    peak_density=None,
    check_ids: bool = False,
) -> Step:
    """FoF as a pipeline :class:`~jaxpm_halos.core.pipeline.Step`: labels per particle and the
    catalogue.

    ``plan`` is the decomposition's; when its ghost layer is wider than FoF needs (kNN's,
    in situ), FoF rebuilds ghosts of its own width from the migrated particles: the wider
    layer would only add rows to sort and scan. ``peak_density(decomposition)``, when
    given, returns ``(density, status)`` per owned row: the catalogue then finds each
    group's density peak. ``check_ids``: count repeated ids among all particles
    (:func:`repeated_ids`), for ids a caller gave.
    """
    own = plan.with_width(ghost_width(linking_length, plan.pencils.box_size))

    def run(decomposition: Decomposition):
        density = density_status = ghost_status = None
        if peak_density is not None:
            density, density_status = peak_density(decomposition)
        if plan.width > own.width * (1 + 1e-6):
            decomposition, ghost_status = own.reghost(decomposition, "fof ghosts")
        labels, catalogue = fof_on_decomposition(
            own, decomposition, linking_length, min_members, config, density
        )
        if density_status is not None:
            catalogue = dataclasses.replace(
                catalogue, status=density_status.merge(catalogue.status)
            )
        if ghost_status is not None:
            catalogue = dataclasses.replace(catalogue, status=ghost_status.merge(catalogue.status))
        if check_ids:
            migrated = decomposition.migrated
            ids = repeated_ids(plan, migrated.payload["id"], migrated.valid)
            catalogue = dataclasses.replace(catalogue, status=catalogue.status.merge(ids))
        return {
            "labels": labels,
            "catalogue": dataclasses.replace(catalogue, num=catalogue.num[None]),
        }

    return Step(run, {"labels": "particle", "catalogue": "device"})


def repeated_ids(plan: Plan, ids, valid) -> Status:
    """A status whose ``repeated_ids`` counts the ids held by more than one particle, over
    all devices, whatever groups they are in.

    Each id goes to the device its hash names (two all-to-all stages, in buffers of the
    domain's capacity: hashed ids spread evenly whatever their values), where a sort finds
    repeats. Only ids a caller gave need it: lattice and row ids are unique by construction.
    """
    pencils = plan.pencils
    hashed = ids.astype(jnp.uint32) * jnp.uint32(2654435761)  # Knuth's multiplicative hash
    device = ((hashed >> 16) % jnp.uint32(pencils.num_devices)).astype(int32)
    home = lambda device: (device // pencils.py, device % pencils.py)
    rows = plan.capacity_rows
    need_pair, need_rows = route_needs(pencils, *home(device), valid)
    routed, count = route(
        pencils, {"id": ids, "device": device}, valid, lambda p: home(p["device"]), rows, rows, rows
    )
    mine = jnp.sort(jnp.where(jnp.arange(rows) < count, routed["id"], _BIG))  # (rows,)
    repeats = jnp.sum((mine[1:] == mine[:-1]) & (mine[1:] < _BIG), dtype=int32)
    status = plan.status({"id check": jnp.maximum(need_pair, need_rows)}, {"id check": CAPACITY})
    return dataclasses.replace(status, repeated_ids=psum_all(pencils, repeats))


def fof_on_decomposition(
    plan: Plan,
    decomposition: Decomposition,
    linking_length: float,
    min_members: int,
    config: FoFConfig,
    density=None,
):
    """FoF labels of the owned rows and this device's catalogue, from a decomposition whose
    ghost layer is ``plan.width`` (:func:`ghost_width` of the linking length) wide. With a
    per-owned-row ``density``, the catalogue holds each group's density peak.

    The catalogue's status covers the buffers FoF adds (z images and halo rows).
    """
    pencils = plan.pencils
    ext, migrated = decomposition.ext, decomposition.migrated
    capacity = ext.owned
    halo_rows = config.halo_rows(plan.n0)
    component, segments, need_images = local_components(
        ext, pencils, linking_length, plan.width, plan.image_rows, config.chunk_size
    )
    labels, _ = merge_labels(ext, decomposition.ghosts, pencils, component, segments)
    is_ghost = ext.valid & (jnp.arange(ext.pos.shape[0]) >= capacity)
    group, has_ghost = _group_by_label(
        labels, component, segments, is_ghost, ext.pos.shape[0] - capacity
    )
    payload = migrated.payload
    cat, num, need_halos, repeated = catalogue_rows(
        pencils,
        pos=payload["pos"],
        vel=payload.get("vel"),
        mass=payload["mass"],
        ids=payload["id"],
        owned=migrated.valid,
        group=group[:capacity],
        segments=segments,
        labels=labels[:capacity],
        has_ghost=has_ghost,
        min_members=min_members,
        halo_rows=halo_rows,
        density=density,
    )
    status = plan.status({"z images": need_images}, {"z images": IMAGES}).merge(
        Status(
            pmax_all(pencils, {"halos": need_halos}),
            jnp.int32(0),
            (("halos", Limit(MAX_HALOS, halo_rows)),),
            repeated_ids=psum_all(pencils, repeated),
        )
    )
    catalogue = Catalogue(
        id=cat["id"],
        count=cat["count"],
        mass=cat["mass"],
        pos=cat["pos"],
        vel=cat.get("vel"),
        vel_disp=cat.get("vel_disp"),
        radius=cat["radius"],
        percolates=cat["percolates"],
        num=num,
        status=status,
        peak=cat.get("peak"),
        centre="com" if density is None else "peak",
    )
    return labels[:capacity], catalogue
