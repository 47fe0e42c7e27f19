"""Padded halo catalogues, built per device from FoF labels.

The owned members of each group on a device contribute one row of partial sums, taken about
an anchor (their member with the smallest id) with minimum-image offsets. Rows of
groups that are complete on the device and too small are dropped there; all other rows
travel to the group's home device, ``label % n_devices``, where they are combined: the
partial row that holds the group's own smallest-id particle supplies the common anchor,
and the others are aligned to it by minimum image. Groups are assumed smaller than half
the box, as the periodic centre of mass requires; a group that reaches half the box or
more along any axis (a percolating one, typically) is flagged ``percolates``.

Anchors are held out of autodiff, so the centre of mass and mean velocity are exact
weighted means whose gradients with respect to positions and velocities are ``m_i / M``
(membership held fixed).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .cells import sort_rows
from .domain import route, route_needs
from .geometry import periodic_delta, wrap
from .layout import Pencils
from .rows import common_mass, pmax_all, selection, valued_with_derivative_of
from .status import Status, check_catalogue_status

int32 = jnp.int32
_BIG = jnp.iinfo(jnp.int32).max
# A catalogue's own per-halo fields (SO quantities come after them, by their names).
CATALOGUE_FIELDS = ("id", "count", "mass", "pos", "vel", "vel_disp", "radius", "percolates", "peak")


INSITU_UNITS = {
    "id": "smallest particle id in the group: the Particles' own ids when given, else the "
    "C-order input row (the lattice index (ix * nc + iy) * nc + iz on a JaxPM grid)",
    "count": "particles",
    "mass": "Msun/h",
    "pos": "Mpc/h",
    "vel": "km/s",
    "vel_disp": "km/s",
    "radius": "Mpc/h",
    "percolates": "flag: spans half the box or more along some axis",
    "box_size": "Mpc/h",
    "linking_length": "Mpc/h",
    "peak": "Mpc/h",
}
"""Units of a catalogue from :class:`jaxpm_halos.InSitu` with ``omega_m`` given (without
``omega_m``, ``mass`` counts particles)."""


DESCRIPTIONS = {
    "id": "halo id: the smallest particle id among its members",
    "count": "number of member particles",
    "mass": "total mass of the members",
    "pos": "periodic centre of mass of the members, wrapped into [0, box_size)",
    "vel": "mass-weighted mean peculiar velocity of the members",
    "vel_disp": "1D velocity dispersion of the members, sqrt(<|v - vel|^2> / 3)",
    "radius": "rms distance of the members from the centre of mass",
    "percolates": "the members span half the box or more along some axis (pos not physical)",
    "peak": "position of the member with the highest kNN density",
}
"""What each catalogue field is, written beside its unit in the files."""


def insitu_units(msun: bool, so=()) -> dict:
    """The units of an in-situ catalogue's fields: :data:`INSITU_UNITS`, with masses in
    particles when ``msun`` is False (no ``omega_m``), and those of the SO masses and radii
    of the definitions ``so``."""
    out = dict(INSITU_UNITS, **({} if msun else {"mass": "particles"}))
    for name in so:
        out.update({"m" + name: "Msun/h", "r" + name: "Mpc/h (comoving)"})
    return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Catalogue:
    """FoF groups with at least ``min_members`` members, padded per device.

    Per device there are ``max_halos`` rows, sorted by id, of which the first ``num`` are
    valid. Globally (from :func:`jaxpm_halos.fof`) the rows of all devices are stacked along
    axis 0 (``n_devices * max_halos`` rows, sharded over the mesh) and ``num`` has one entry
    per device. Padding rows have ``id == -1`` and ``count == 0``.

    Attributes:
      id: group label, the smallest particle id in the group.
      count: number of members.
      mass: total mass (units of the input masses; 1 per particle by default). When every
        particle has the same mass ``m`` (JaxPM's do), ``count * m`` (one rounding below
        2**24 members), the same bits on every mesh; otherwise a float sum, whose rounding
        depends on the mesh.
      pos: (…, 3) periodic centre of mass, wrapped into ``[0, L)``.
      vel: (…, 3) mass-weighted mean velocity (units of the input velocities), or None.
      vel_disp: 1D velocity dispersion ``sqrt(<|v - vmean|^2> / 3)``, or None.
      radius: rms distance of the members from the centre of mass.
        ``pos``, ``vel``, ``vel_disp`` and ``radius`` are mass-weighted: for a group whose
        members are all massless (``mass == 0``) they are NaN, and so are SO values
        about its ``pos``.
      percolates: the members span at least half the box along some axis (measured as the
        spread of their minimum-image offsets from the group's first particle). Such a
        group has no well-defined periodic centre: its ``pos`` and ``radius`` are then the
        mass-weighted mean and rms of those offsets, not a physical centre and size.
      num: valid rows per device.
      status: buffer needs of the whole computation (see :class:`~jaxpm_halos.Status`).
      peak: (…, 3) density-peak centre, the position of the member with the highest kNN
        density (ties to the smallest id), or None (``centre="peak"`` computes it). Its
        gradient is that member's position's, the choice of member held fixed. NaN (and
        SO about it NaN) where some member's density was not computed: a kNN buffer
        overflowed inside ``jit``, which the status reports.
      so: spherical-overdensity masses and radii about the catalogue's SO centre (``peak``
        with ``centre="peak"``, else ``pos``), e.g. ``{"m200c": …, "r200c": …}``, or
        None. See :func:`jaxpm_halos.spherical_overdensity` for the definition; masses
        in the unit of the input masses, radii in the unit of the positions.
      centre: ``"com"`` or ``"peak"``, the centre the SO quantities are measured about
        (static).
      units: ``((field, unit), ...)`` where the producer knows them (static): set by
        :class:`~jaxpm_halos.InSitu`; None from :func:`~jaxpm_halos.fof`, whose fields are
        in the units of its inputs. :func:`~jaxpm_halos.write_catalogue` labels the
        file's datasets with them.
    """

    id: jax.Array
    count: jax.Array
    mass: jax.Array
    pos: jax.Array
    vel: jax.Array | None
    vel_disp: jax.Array | None
    radius: jax.Array
    percolates: jax.Array
    num: jax.Array
    status: Status
    peak: jax.Array | None = None
    so: dict | None = None
    centre: str = dataclasses.field(default="com", metadata=dict(static=True))
    units: tuple[tuple[str, str], ...] | None = dataclasses.field(
        default=None, metadata=dict(static=True)
    )

    def fields(self) -> dict:
        """The per-halo arrays by name (SO quantities flattened: ``m200c``, ``r200c``, …),
        the absent ones left out."""
        out = {f: getattr(self, f) for f in CATALOGUE_FIELDS if getattr(self, f) is not None}
        out.update(self.so or {})
        return out

    def to_numpy(self, *, throw: bool = True) -> dict:
        """Host-side: the valid halos of all devices as numpy arrays, sorted by id (one
        process; :func:`jaxpm_halos.gather_catalogue` also takes a catalogue stacked over
        snapshots, and several processes).

        ``throw``: raise the status's error (:class:`~jaxpm_halos.CapacityError`, naming a
        setting that fits, or :class:`~jaxpm_halos.InvalidInputError`) when the status
        failed (a buffer overflowed inside ``jit`` or with ``grow=False``): halos may be
        missing or wrong. ``False``: take the rows anyway."""
        if np.ndim(self.num) == 2:  # (snapshots, devices): the rows would be misread
            raise ValueError(
                "this catalogue is stacked over snapshots (as InSitu.saveat "
                "returns it): take one with jaxpm_halos.gather_catalogue(cat, "
                "snapshot=i)"
            )
        if throw:
            check_catalogue_status(self.status)
        num = np.atleast_1d(np.asarray(self.num))
        rows = np.asarray(self.id).shape[0] // num.shape[0]
        keep = (np.arange(num.shape[0] * rows) % rows) < np.repeat(num, rows)
        fields = {f: np.asarray(a)[keep] for f, a in self.fields().items()}
        order = np.argsort(fields["id"], kind="stable")
        return {k: v[order] for k, v in fields.items()}


def catalogue_rows(
    pencils: Pencils,
    *,
    pos,
    vel,
    mass,
    ids,
    owned,
    group,
    segments,
    labels,
    has_ghost,
    min_members: int,
    halo_rows: int,
    density=None,
):
    """Per-device catalogue of the groups whose home is this device.

    ``group`` (per row, in ``[0, segments)``) is one index per global label on the device and
    ``has_ghost`` (per group) whether any ghost carries that label, so the group may have
    members elsewhere. With a per-row ``density``, each group's density peak (``peak``) is
    found too.

    Returns ``(fields, num, need_rows, repeated)``; ``fields`` maps catalogue field names
    to arrays of ``halo_rows`` rows, and ``repeated`` counts this device's groups with more
    than one member holding the group's label as its id (repeated ids that merged groups).
    """
    box = pencils.box_size
    dtype = pos.dtype
    seg_sum = lambda v: jax.ops.segment_sum(v, group, num_segments=segments)
    seg_min = lambda v: jax.ops.segment_min(v, group, num_segments=segments)
    members = seg_sum(owned.astype(int32))
    first_id = seg_min(jnp.where(owned, ids, _BIG))
    label = seg_min(jnp.where(owned, labels, _BIG))
    is_anchor = owned & (ids == first_id[group])
    anchor = _put(jax.lax.stop_gradient(pos), is_anchor, group, segments)
    rel = jnp.where(owned[:, None], periodic_delta(pos, anchor[group], box), 0)
    m = jnp.where(owned, mass, 0).astype(dtype)
    # The members' spread along each axis, to flag groups that reach half the box.
    spread = jax.lax.stop_gradient(rel)
    sums = {
        "count": members,
        "mass": seg_sum(m),
        "s": seg_sum(m[:, None] * rel),
        "q": seg_sum(m * jnp.sum(rel * rel, 1)),
        "lo": jax.ops.segment_min(
            jnp.where(owned[:, None], spread, jnp.inf), group, num_segments=segments
        ),
        "hi": jax.ops.segment_max(
            jnp.where(owned[:, None], spread, -jnp.inf), group, num_segments=segments
        ),
    }
    if vel is not None:
        # About the anchor's velocity, as positions are about its position: moments about
        # zero cancel catastrophically for a fast group with a small dispersion (|v| sqrt(eps)).
        anchor_vel = _put(jax.lax.stop_gradient(vel), is_anchor, group, segments)
        v = jnp.where(owned[:, None], vel - anchor_vel[group], 0)
        sums["v"] = seg_sum(m[:, None] * v)
        sums["w"] = seg_sum(m * jnp.sum(v * v, 1))
        sums["anchor_vel"] = anchor_vel
    if density is not None:
        sums.update(_peaks(owned, density, ids, pos, group, segments))
    report = (members > 0) & (has_ghost | (members >= min_members))
    rows, n_rows = selection(report, halo_rows)
    payload = {k: jnp.take(v, rows, axis=0, mode="fill", fill_value=0) for k, v in sums.items()}
    payload["label"] = jnp.take(label, rows, mode="fill", fill_value=0)
    # Members holding the label as id: exactly one per group when ids are unique, so a
    # combined row with more found groups that a repeated id merged.
    roots = jnp.where(first_id == label, seg_sum(is_anchor.astype(int32)), 0)
    payload["root"] = jnp.take(roots, rows, mode="fill", fill_value=0)
    payload["anchor"] = jnp.take(anchor, rows, axis=0, mode="fill", fill_value=0)

    ndev = pencils.num_devices
    home = lambda label: ((label % ndev) // pencils.py, (label % ndev) % pencils.py)
    need_pair, need_routed = route_needs(pencils, *home(jnp.where(report, label, 0)), report)
    routed, n_routed = route(
        pencils,
        payload,
        jnp.arange(halo_rows) < n_rows,
        lambda p: home(p["label"]),
        halo_rows,
        halo_rows,
        halo_rows,
    )
    fields, num, repeated = _combine(
        routed, n_routed, box, min_members, halo_rows, common_mass(pencils, mass, owned)
    )
    # Once the routed rows fit, the halos (at most one per routed row) fit too.
    need = jnp.maximum(pmax_all(pencils, n_rows), jnp.maximum(need_pair, need_routed))
    # Groups dropped here (complete and too small) are counted here, the others at home.
    return fields, num, need, repeated + jnp.sum((roots > 1) & ~report, dtype=int32)


def _put(values, rows, group, segments: int):
    """``(segments, 3)``: each group's value from its row where ``rows`` is set (0 where none)."""
    return (
        jnp.zeros((segments,) + values.shape[1:], values.dtype)
        .at[jnp.where(rows, group, segments)]
        .set(values, mode="drop")
    )


def _highest(value, ids, segment, segments: int):
    """Per segment, whether each row holds the highest ``value`` of its segment, ties to
    the smallest id (exactly one row per non-empty segment)."""
    top = jax.ops.segment_max(value, segment, num_segments=segments)
    tied = value == top[jnp.minimum(segment, segments - 1)]
    first = jax.ops.segment_min(jnp.where(tied, ids, _BIG), segment, num_segments=segments)
    return tied & (ids == first[jnp.minimum(segment, segments - 1)])


def _peaks(owned, density, ids, pos, group, segments: int):
    """Each group's densest owned member: its density, id and position, and the number of
    owned members without a density (NaN: their kNN row was not completed) (partial rows)."""
    members = owned & ~jnp.isnan(density)
    unknown = jax.ops.segment_sum((owned & ~members).astype(int32), group, num_segments=segments)
    value = jnp.where(members, density, -jnp.inf)
    peak = members & _highest(value, ids, jnp.where(members, group, segments), segments)
    slot = jnp.where(peak, group, segments)
    put = lambda a, fill: (
        jnp.full((segments,) + a.shape[1:], fill, a.dtype).at[slot].set(a, mode="drop")
    )
    return {
        "peak_density": put(value, -jnp.inf),
        "peak_id": put(ids, _BIG),
        "peak_pos": put(pos, 0),
        "peak_unknown": unknown,
    }


def _combine(rows, n, box, min_members, halo_rows, common):
    """Combine partial rows of the same label into catalogue rows (sorted by label).
    ``common``: :func:`~.domain.common_mass` of the particles. Also returns the number of
    labels whose rows hold more than one root member (repeated ids)."""
    valid = jnp.arange(halo_rows) < n
    _, order = sort_rows(jnp.where(valid, rows["label"], _BIG))
    rows = jax.tree.map(lambda a: a[order], rows)
    valid = valid[order]
    label = rows["label"]
    starts = valid & jnp.concatenate([jnp.ones(1, bool), label[1:] != label[:-1]])
    seg = jnp.cumsum(starts, dtype=int32) - 1
    seg = jnp.where(valid, seg, halo_rows)
    total = lambda v: jax.ops.segment_sum(v, seg, num_segments=halo_rows)
    at_seg = lambda per_halo: per_halo[jnp.minimum(seg, halo_rows - 1)]
    roots = total(rows["root"])
    # The root row's anchor, the reference every row's sums are moved to.
    reference = lambda anchors: total(jnp.where(rows["root"][:, None] > 0, anchors, 0))
    ref = reference(rows["anchor"])
    delta = periodic_delta(rows["anchor"], at_seg(ref), box)
    mass_row = rows["mass"]
    count = total(rows["count"])
    mass = total(mass_row)
    safe = jnp.where(mass > 0, mass, 1)

    def pooled(delta, first, second):
        """Mass-weighted mean offset from the reference, and the sum of m |x - mean|^2, of
        rows holding sums of m dx and m |dx|^2 about anchors ``delta`` from it."""
        mean = total(mass_row[:, None] * delta + first) / safe[:, None]
        off = delta - at_seg(mean)
        return mean, total(second + 2 * jnp.sum(off * first, 1) + mass_row * jnp.sum(off * off, 1))

    com, q = pooled(delta, rows["s"], rows["q"])
    # (H, 3) extent along each axis, with every piece placed at its anchor's offset.
    extent = jax.ops.segment_max(
        delta + rows["hi"], seg, num_segments=halo_rows
    ) - jax.ops.segment_min(delta + rows["lo"], seg, num_segments=halo_rows)
    # A group of massless members has no mass-weighted centre, velocity or radius (0 / 0).
    undefined = lambda a: jnp.where((mass > 0).reshape((-1,) + (1,) * (a.ndim - 1)), a, jnp.nan)
    # Equal masses: the reported mass is count * m, the same bits on every mesh (a float
    # sum rounds in an order that depends on the mesh), with the sum's derivative (each
    # member's mass counts once).
    equal, each = common
    exact = count.astype(mass.dtype) * each.astype(mass.dtype)
    reported = jnp.where(equal, valued_with_derivative_of(exact, mass), mass)
    fields = {
        "id": jax.ops.segment_max(jnp.where(valid, label, -1), seg, num_segments=halo_rows),
        "count": count,
        "mass": reported,
        "pos": undefined(wrap(ref + com, box)),
        "radius": undefined(jnp.sqrt(jnp.maximum(q / safe, 0))),
        "percolates": jnp.any(extent >= box / 2, axis=1),
    }
    if "v" in rows:
        ref_vel = reference(rows["anchor_vel"])
        relative, w = pooled(rows["anchor_vel"] - at_seg(ref_vel), rows["v"], rows["w"])
        fields["vel"] = undefined(ref_vel + relative)
        fields["vel_disp"] = undefined(jnp.sqrt(jnp.maximum(w / safe, 0) / 3))
    if "peak_pos" in rows:
        complete = at_seg(total(rows["peak_unknown"])) == 0
        densest = (
            valid
            & complete
            & (rows["peak_density"] > -jnp.inf)
            & _highest(rows["peak_density"], rows["peak_id"], seg, halo_rows)
        )
        # A group with a member whose density is unknown (its kNN row overflowed inside
        # jit) has no peak: the densest of the rest may not be the densest. NaN, not a
        # plausible member or the origin, so SO about it is NaN too (the status says why).
        fields["peak"] = (
            jnp.full((halo_rows, 3), jnp.nan, rows["peak_pos"].dtype)
            .at[jnp.where(densest, seg, halo_rows)]
            .set(rows["peak_pos"], mode="drop")
        )
    keep = count >= min_members
    picked, num = selection(keep, halo_rows)
    out = {k: jnp.take(v, picked, axis=0, mode="fill", fill_value=0) for k, v in fields.items()}
    out["id"] = jnp.where(jnp.arange(halo_rows) < num, out["id"], -1)
    return out, num, jnp.sum(roots > 1, dtype=int32)
