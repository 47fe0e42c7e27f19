"""The halo catalogue: FoF groups, with density-peak centres and spherical-overdensity
masses when asked, from one decomposition; and the public :func:`fof`.

The catalogue's extras run on the decomposition FoF shares with them:

* ``centre="peak"``: the kNN density of every particle (:mod:`jaxpm_halos.knn._search`), from which
  the catalogue picks each group's densest member (ties to the smallest id);
* ``so=...``: SO masses and radii (:mod:`jaxpm_halos.so.so`) about each halo's centre (the peak, or
  the centre of mass), over all particles, on the decomposition's ghost layer, which is
  as wide as the largest SO radius searched.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from .. import units
from ..core.catalogue import CATALOGUE_FIELDS
from ..core.config import MAX_HALOS, DomainConfig, FoFConfig, KNNConfig
from ..core.domain import Decomposition
from ..core.errors import Limit, spell_config
from ..core.frontend import (
    Problem,
    local_fields,
    local_valid,
    particle_fields,
    particles_of,
    prepare,
    program_cache,
    row_masses,
    trim_padding,
)
from ..core.ghosts import ghost_width
from ..core.layout import Pencils
from ..core.particles import Particles, _check_integer
from ..core.pipeline import JitProgram, Plan, Step, analyse, on_device, plan_for, run_sharded
from ..core.retry import run_growing
from ..core.rows import psum_all
from ..core.status import is_traced
from ..knn._search import ghost_width as knn_width
from ..knn._steps import knn_density_on_plan
from ..knn.knn import check_k
from ..so._search import search_width, so_on_decomposition
from ..so.so import check_definition_units, check_densities, check_smoothing, resolve_radius
from ._kernel import check_linking_length, fof_step

CENTRES = ("com", "peak")


@dataclasses.dataclass(frozen=True)
class Extras:
    """What the catalogue adds to FoF's own fields (static).

    Attributes:
      so: names of the SO definitions (``"200c"``: fields ``m200c``, ``r200c``).
      centre: ``"com"`` or ``"peak"`` (the SO centre; ``"peak"`` also fills ``peak``).
      k: neighbours of the kNN density that locates the peak.
      so_radius: the largest SO radius searched (resolved from the config).
      so_smoothing: the smooth SO definition's relative width, or None for the hard one.
    """

    so: tuple[str, ...] = ()
    centre: str = "com"
    k: int = 16
    so_radius: float = 0.0
    so_smoothing: float | None = None

    def width(self, linking_length: float, total: int, pencils, knn: KNNConfig) -> float:
        """The ghost layer every part needs."""
        box = pencils.box_size
        width = ghost_width(linking_length, box)
        if self.centre == "peak":
            width = max(width, knn_width(self.k, total, pencils, knn))
        if self.so:
            width = max(width, search_width(self.so_radius, box))
        return width


def peak_density(plan: Plan, k: int, total: int, config: KNNConfig, equal_masses: bool):
    """``fn(decomposition) -> (density, status)``: kNN density of the owned rows, for the
    catalogue's density peaks."""
    knn_plan = plan.with_width(knn_width(k, total, plan.pencils, config))

    def density(decomposition: Decomposition):
        return peak_densities(
            *knn_density_on_plan(knn_plan, decomposition, k, config, equal_masses)
        )

    return density


def peak_densities(density, knn_status):
    """``(density, status)`` for the peaks: the kNN status's names apart from FoF's own
    (both have "z images")."""
    return density, knn_status.renamed("peak ")


def with_so(
    plan: Plan,
    decomposition: Decomposition,
    catalogue,
    extras: Extras,
    densities,
    config: FoFConfig,
):
    """``catalogue`` (this device's rows) with SO masses and radii about its centres.

    Every device's centres are gathered (a psum of disjoint blocks), each is searched by
    the device whose pencil holds it, and each device keeps the results of its own rows.
    """
    pencils = plan.pencils
    rows = catalogue.id.shape[0]
    centre = catalogue.peak if extras.centre == "peak" else catalogue.pos
    mine = pencils.device_index()
    block = lambda a: psum_all(
        pencils, jnp.zeros((pencils.num_devices,) + a.shape, a.dtype).at[mine].set(a)
    ).reshape((-1,) + a.shape[1:])
    centres, valid = block(centre), block((catalogue.id >= 0).astype(jnp.int32)) > 0
    limit = Limit(MAX_HALOS, config.halo_rows(plan.n0))
    mass, radius, status = so_on_decomposition(
        plan,
        decomposition,
        centres,
        valid,
        densities,
        config.so,
        extras.so_radius,
        centre_limit=limit,
        smoothing=extras.so_smoothing,
    )
    own = lambda a: jax.lax.dynamic_slice_in_dim(a, mine * rows, rows)
    so = {}
    for d, name in enumerate(extras.so):
        so["m" + name], so["r" + name] = own(mass[:, d]), own(radius[:, d])
    return dataclasses.replace(
        catalogue, so=so, centre=extras.centre, status=catalogue.status.merge(status)
    )


def halo_step(
    plan: Plan,
    linking_length: float,
    min_members: int,
    config: FoFConfig,
    extras: Extras,
    densities=None,
    density=None,
    total: int = 0,
    equal_masses: bool = False,
    check_ids: bool = False,
) -> Step:
    """FoF with the catalogue's extras as one pipeline step. ``density(decomposition) ->
    (density, status)`` supplies the peak's densities (default: :func:`peak_density` with
    ``config.knn`` and ``total`` particles); ``densities`` (D,) the SO thresholds;
    ``check_ids``: count repeated ids (ids the caller gave)."""
    if extras.centre == "peak" and density is None:
        density = peak_density(plan, extras.k, total, config.knn, equal_masses)
    peak = density if extras.centre == "peak" else None
    fof = fof_step(plan, linking_length, min_members, config, peak, check_ids)

    def run(decomposition: Decomposition):
        out = fof.run(decomposition)
        if extras.so:
            out["catalogue"] = with_so(
                plan, decomposition, out["catalogue"], extras, densities, config
            )
        return out

    return Step(run, fof.outputs)


def so_request(so, omega_m=None, a=1.0):
    """``(names, densities)`` of an ``so=`` argument: definition names (with ``omega_m``),
    or a mapping of names to threshold densities. ``densities`` is a list of numbers or
    a traced array."""
    if so is None or (not isinstance(so, str) and len(so) == 0):
        return (), None
    if isinstance(so, Mapping):
        names = _so_names(tuple(str(n) for n in so))
        return names, [so[n] for n in so]
    names = _so_names((so,) if isinstance(so, str) else tuple(so))
    return names, units.definition_densities(
        names, names, omega_m=omega_m, a=a, argument="so", instead="so={name: density}"
    )


def _so_names(names: tuple) -> tuple:
    """SO names whose fields ``m<name>``, ``r<name>`` are new catalogue columns."""
    if len(set(names)) != len(names):
        raise ValueError(f"so={names!r} names a definition twice")
    for name in names:
        if not name:
            raise ValueError("an SO name must not be empty (its fields are m<name>, r<name>)")
        if "/" in name:  # HDF5 would write the fields as nested groups
            raise ValueError(
                f"so name {name!r} holds '/', which separates groups in the "
                "catalogue files: pick another name, e.g. "
                f"{name.replace('/', '_')!r}"
            )
        clash = {"m" + name, "r" + name} & set(CATALOGUE_FIELDS)
        if clash:
            raise ValueError(
                f"so name {name!r} gives the fields m{name}, r{name}, which would "
                f"replace the catalogue's {sorted(clash)}: pick another name"
            )
    return names


def _refuse_nested_domains(config: FoFConfig) -> None:
    """``config.domain`` sizes fof's one decomposition; a ``domain`` set in its ``so`` or
    ``knn`` (e.g. pasted from a ``spherical_overdensity`` or ``knn`` message) is never
    used, and ignoring it silently would undo the fix it was meant to be."""
    for name in ("so", "knn"):
        inner = getattr(config, name).domain
        if inner != DomainConfig():
            raise ValueError(
                f"fof sizes its one decomposition with config.domain; pass "
                f"config=FoFConfig(domain={spell_config(inner)}, ...) instead of "
                f"{name}=...(domain=...)"
            )


def check_centre(centre: str) -> str:
    if centre not in CENTRES:
        raise ValueError(f"centre must be one of {CENTRES}, got {centre!r}")
    return centre


def _linking_length(problem: Problem, linking_length, b) -> float:
    if (linking_length is None) == (b is None):
        raise ValueError(
            "give exactly one of linking_length (a length) or b (in units of the "
            "mean particle separation)"
        )
    l = float(linking_length) if b is None else float(b) * problem.mean_separation
    if not l > 0 or l != l:
        raise ValueError(f"the linking length must be positive, got {l}")
    check_linking_length(l, problem.pencils)
    return l


@program_cache(32)
def _fof_program(
    problem: Problem,
    in_specs,
    linking_length: float,
    min_members: int,
    config: FoFConfig,
    extras: Extras,
):
    layout = problem.layout
    width = extras.width(linking_length, problem.total, problem.pencils, config.knn)
    plan = plan_for(problem, config.domain, width)
    if extras.so:
        in_specs = tuple(in_specs) + (P(),)

    def device(*blocks):
        densities = None
        if extras.so:
            *blocks, densities = blocks
        steps = {
            "fof": halo_step(
                plan,
                linking_length,
                min_members,
                config,
                extras,
                densities,
                total=problem.total,
                equal_masses=problem.mass_kind != "rows",
                # A JaxPM grid's ids are its lattice indices: unique by construction.
                check_ids=problem.has_ids and not problem.layout.grid,
            )
        }
        fields, shape = local_fields(problem, *blocks)
        fields["mass"] = row_masses(problem, fields)
        valid = local_valid(problem, fields["pos"].shape[0])
        return on_device(plan, fields, valid, shape, steps)

    def run(*args):
        out = run_sharded(layout, device, args, in_specs)["fof"]
        return out["labels"], out["catalogue"]

    return JitProgram(run)


def fof(
    pos,
    box_size=None,
    linking_length=None,
    *,
    b=None,
    vel=None,
    mass=None,
    min_members: int = 20,
    so=None,
    omega_m=None,
    a=1.0,
    so_smoothing: float | None = None,
    centre: str = "com",
    k: int = 16,
    mesh=None,
    config: FoFConfig = FoFConfig(),
    grow: bool = True,
):
    """Friends-of-friends groups and their catalogue, distributed over the input's mesh.

    Args:
      pos: positions ``(N, 3)`` (sharded along axis 0 over the mesh axes, or unsharded:
        then any N, padded inside to a multiple of the device count), a JaxPM-layout grid
        ``(nc, nc, nc, 3)`` sharded over its first two axes, or the
        :class:`~jaxpm_halos.Particles` from :func:`~jaxpm_halos.from_jaxpm`. Integer
        and half-precision (float16, bfloat16) positions, velocities and masses are
        computed in float32.
      box_size: periodic box side, in the unit of ``pos`` (taken from Particles; a
        different value raises).
      linking_length: two particles are friends when their minimum-image distance is at
        most this length.
      b: alternatively, the linking length in units of the mean separation ``L / N^(1/3)``
        (``L / nc`` for grids).
      vel, mass: optional velocities (same shape as ``pos``) and masses (scalar or per
        particle, finite and >= 0) for the catalogue; taken from Particles when left
        out (one given here is used instead of the Particles' own).
        Inside ``jit``, particles with a bad mass are excluded and counted like non-finite
        positions.
      min_members: smallest group that enters the catalogue (an integer >= 1).
      so: spherical-overdensity masses and radii to add, about each halo's centre and
        over all particles (:func:`~jaxpm_halos.spherical_overdensity`): definitions such
        as ``("200c", "200m", "vir")`` (:func:`~jaxpm_halos.units.so_density` with
        ``omega_m`` and ``a``; positions in Mpc/h and masses in Msun/h), or a mapping of
        names to threshold densities in the input's units (``{"200": 200 * rho_mean}``).
        The catalogue's ``so`` then holds ``m<name>`` and ``r<name>``. The largest radius
        searched is ``config.so.radius``.
      omega_m, a: the cosmology and scale factor of the ``so`` definitions.
      so_smoothing: the smooth SO definition's relative width
        (:func:`~jaxpm_halos.spherical_overdensity`'s ``smoothing``): SO masses and radii
        differentiable with respect to the positions (through the centres, membership
        held fixed, and the particles about them) and a scalar mass. None: the hard
        definition.
      centre: ``"com"`` (the centre of mass) or ``"peak"`` (the member with the highest
        kNN density of ``k`` neighbours, ties to the smallest id; stored as ``peak``):
        the centre the SO quantities are measured about.
      k: neighbours of the density that locates the peak (``config.knn`` sizes it).
      mesh: device mesh; default: the input's sharding (or the abstract mesh under ``jit``).
      config: buffer sizes (:class:`~jaxpm_halos.FoFConfig`).
      grow: outside ``jit``, when a buffer overflows, grow it and run again (a few rounds
        at most, then a :class:`~jaxpm_halos.GrowthWarning` names the config that fitted).
        ``False`` raises :class:`~jaxpm_halos.CapacityError` instead, naming a setting
        that fits.

    Returns:
      ``(labels, catalogue)``. ``labels`` has the input's leading shape and sharding; a
      particle's label is the smallest id in its group (input index, or lattice index for
      grids), so labels are identical on every mesh; particles excluded for a non-finite
      position have label -1. ``catalogue`` is a padded :class:`~jaxpm_halos.Catalogue`.
      Outside ``jit`` a non-finite position, or ids that repeat and merge groups
      (``status.repeated_ids``), raise :class:`~jaxpm_halos.InvalidInputError`; inside
      ``jit``, read ``catalogue.status``
      (it covers every buffer the result depends on), or thread a runtime check with
      ``labels = catalogue.status.error_if(labels, config)``.

    Examples:
        Two clumps of 25 particles among 462 uniform ones in a 10 Mpc/h box, sharded over
        a ``(2, 4)`` mesh (on a CPU, give Python 8 devices first with
        ``XLA_FLAGS=--xla_force_host_platform_device_count=8``):

        >>> import jax, numpy as np
        >>> import jaxpm_halos
        >>> from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
        >>> mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
        >>> rng = np.random.default_rng(0)
        >>> clumps = [c + 0.05 * rng.standard_normal((25, 3)) for c in (2.0, 6.0)]
        >>> pos = np.concatenate(clumps + [rng.uniform(0, 10, (462, 3))]).astype(np.float32)
        >>> pos = jax.device_put(pos, NamedSharding(mesh, P(("x", "y"))))
        >>> labels, catalogue = jaxpm_halos.fof(pos, box_size=10.0, linking_length=0.2)
        >>> int(labels[0]), int(labels[30]), int(labels[100])  # group ids: smallest member
        (0, 25, 100)
        >>> halos = catalogue.to_numpy()  # the valid rows, sorted by id
        >>> halos["count"].tolist(), halos["pos"].round(1).tolist()
        ([25, 25], [[2.0, 2.0, 2.0], [6.0, 6.0, 6.0]])
    """
    _refuse_nested_domains(config)
    problem, args, in_specs = prepare(pos, box_size, vel, mass, mesh)
    l = _linking_length(problem, linking_length, b)
    min_members = _check_integer("min_members", min_members, 1)
    names, densities = so_request(so, omega_m, a)
    so_smoothing = check_smoothing(so_smoothing, problem)
    if so_smoothing is not None and not names:
        raise ValueError("so_smoothing= smooths the SO masses of so=...: pass so= as well")
    centre = check_centre(centre)
    if centre == "peak":
        k = check_k(k, problem.total, True, least=2)
    if names:
        thresholds = check_densities(densities)[0]
        if not isinstance(so, Mapping):
            check_definition_units(
                names, thresholds, problem, args, f"so={names!r}", "so={name: density}"
            )
        args = args + (thresholds.astype(args[0].dtype),)

    def run(cfg):
        extras = Extras(
            names,
            centre,
            int(k),
            resolve_radius(cfg.so, problem.mean_separation, problem.pencils) if names else 0.0,
            so_smoothing,
        )
        return _fof_program(problem, in_specs, l, min_members, cfg, extras)(*args)

    if is_traced(args):
        labels, catalogue = run(config)
    else:
        (labels, catalogue), _ = run_growing(
            run, config, lambda out: out[1].status.failure(), grow=grow
        )
    return trim_padding(problem, labels), catalogue


def fof_local(
    particles: Particles,
    linking_length: float,
    *,
    axes=(None, None),
    min_members: int = 20,
    config: FoFConfig = FoFConfig(),
    n0: int | None = None,
    independent_axes=(),
):
    """FoF on one device's particles, for use inside the caller's own ``shard_map``.

    Args:
      particles: this device's padded :class:`~jaxpm_halos.Particles` (rows, valid first);
        ids must be global and unique.
      linking_length: in the unit of the positions.
      axes: the caller's mesh axis names that cut the box along x and y (None for an axis
        that is not cut). Device ``(i, j)`` of those axes owns pencil ``(i, j)``.
      n0: the mean particles per device that the capacity factors refer to (default: the
        number of rows of ``particles``).
      independent_axes: the ``shard_map``'s other manual axes, along which each index
        holds a separate simulation (an ensemble). A manual axis of size > 1 in neither
        ``axes`` nor here raises ``ValueError``: the particles would be split over it
        unseen, and groups cut.

    Returns:
      ``(domain, labels, catalogue)``: the particles this device owns after migration
      (padded, valid first), their labels in that order (-1 in padding), and this device's
      padded catalogue (``num`` is a scalar). No return trip is made.
    """
    min_members = _check_integer("min_members", min_members, 1)
    pencils = Pencils.from_axes(axes, particles.box_size, independent_axes)
    n0 = particles.size if n0 is None else int(n0)
    l = float(linking_length)
    check_linking_length(l, pencils)
    plan = Plan(pencils, config.domain, n0, ghost_width(l, particles.box_size))
    decomposition, domain = plan.decompose(particle_fields(particles), particles.valid())
    step = fof_step(plan, l, min_members, config, check_ids=True)
    outputs, _ = analyse(decomposition, domain, {"fof": step})
    catalogue = outputs["fof"]["catalogue"]
    migrated = decomposition.migrated
    return (
        particles_of(migrated, particles.box_size),
        outputs["fof"]["labels"],
        dataclasses.replace(catalogue, num=catalogue.num[0]),
    )
