"""Spherical-overdensity (SO) masses and radii about given centres, exact and distributed.

Definition (first downcrossing, over all particles, periodic): sort the particles by their
minimum-image distance ``r`` from the centre, let ``M_i`` be the mass of the ``i``
nearest, and let ``i*`` be the first ``i`` with ``M_i < density * 4/3 pi r_i^3``. Then
``M = M_{i*-1}`` and ``R = (3 M / (4 pi density))^(1/3)``, which lies in
``[r_{i*-1}, r_{i*})``; ``M = R = 0`` when the nearest particle is already below.

Every centre is handled by exactly one device; results are summed over devices, so they
are replicated. When every particle has the same mass ``m``, the mass within a radius is
the particles counted times ``m`` (one rounding), so given the same centres the results are
the same bits on every mesh; unequal masses are summed in an order that depends on the
mesh.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from .. import units
from ..core.config import SOConfig
from ..core.frontend import Problem, local_fields, local_valid, prepare, program_cache, row_masses
from ..core.layout import Pencils
from ..core.particles import _check_integer, real_floats
from ..core.pipeline import JitProgram, on_device, plan_for, run_sharded
from ..core.retry import run_growing
from ..core.status import is_traced, refuse_nonfinite_points
from ._search import largest_radius, search_width, so_step


def check_radius(radius: float, box_size: float, pencils: Pencils) -> float:
    """A search radius that the decomposition supports, or a ValueError naming the limit."""
    radius = float(radius)
    if not radius > 0 or not math.isfinite(radius):
        raise ValueError(f"SOConfig(radius={radius!r}): the SO search radius must be positive")
    if 3 * radius >= box_size:
        raise ValueError(
            f"SOConfig(radius={radius:g}): the SO search radius must stay below a "
            f"third of the box ({box_size:g})"
        )
    narrowest = min(pencils.widths)
    if search_width(radius, box_size) > narrowest:
        raise ValueError(
            f"SOConfig(radius={radius:g}): the SO search radius is the ghost layer "
            f"and must fit in a pencil ({narrowest:g}) of the ({pencils.px}, "
            f"{pencils.py}) mesh; use fewer devices along that axis"
        )
    return radius


def resolve_radius(config: SOConfig, mean_separation: float, pencils: Pencils) -> float:
    """``config.radius``, checked, or the default: 4 mean particle separations, within
    what the mesh supports (the narrower pencil side, a third of the box)."""
    box = pencils.box_size
    _check_integer("SOConfig(levels=...): levels", config.levels, 1)
    if config.radius is not None:
        return check_radius(config.radius, box, pencils)
    return check_radius(min(4 * mean_separation, largest_radius(pencils)), box, pencils)


# ----------------------------------------------------------------------------------------
# Public API


@program_cache(32)
def _so_program(
    problem: Problem,
    in_specs,
    config: SOConfig,
    radius: float,
    empty: bool,
    smoothing: float | None,
):
    """``empty``: no centres were given; the program gets one placeholder centre, marked
    invalid (nothing is searched about it, and it cannot fail the status)."""
    layout = problem.layout
    plan = plan_for(problem, config.domain, search_width(radius, problem.box_size))

    def device(*blocks):
        *blocks, centres, density = blocks
        fields, shape = local_fields(problem, *blocks)
        fields["mass"] = row_masses(problem, fields)
        valid = local_valid(problem, fields["pos"].shape[0])
        centre_valid = jnp.full(centres.shape[0], not empty)
        step = so_step(plan, centres, centre_valid, density, config, radius, smoothing)
        return on_device(plan, fields, valid, shape, {"so": step})

    specs = tuple(in_specs) + (P(), P())
    return JitProgram(lambda *args: run_sharded(layout, device, args, specs)["so"])


def check_densities(density):
    """Thresholds as a (D,) float array and whether a scalar was given."""
    d = jnp.asarray(density)
    if d.ndim > 1 or d.size == 0:
        raise ValueError(f"density must be a scalar or a non-empty (D,) array, got shape {d.shape}")
    if not jnp.issubdtype(d.dtype, jnp.floating):
        d = d.astype(jnp.float32)
    if not is_traced(d) and not bool(jnp.all(jnp.isfinite(d) & (d > 0))):
        raise ValueError(f"density thresholds must be positive and finite, got {density!r}")
    return d.reshape(-1), d.ndim == 0


def named_densities(density, omega_m, a):
    """``(names, density)``: the definition names in ``density`` (``"200c"`` or a list of
    them; ``()`` for thresholds) and their thresholds, by
    :func:`~jaxpm_halos.units.so_density` with ``omega_m`` and ``a``."""
    names = (density,) if isinstance(density, str) else density
    if isinstance(names, (list, tuple)) and any(isinstance(n, str) for n in names):
        values = units.definition_densities(
            names,
            density,
            omega_m=omega_m,
            a=a,
            argument="density",
            instead="a threshold density: jaxpm_halos.units.so_density(name, omega_m=..., a=...)",
        )
        return tuple(names), values[0] if isinstance(density, str) else values
    if omega_m is not None:
        raise ValueError(
            f"omega_m= (and a=) resolve definition names such as density='200c'; "
            f"density={density!r} is a threshold already: leave omega_m out"
        )
    return (), density


# Named thresholds lie within ~1e4 of the mean density (Delta / Omega_m(a) at most). A
# million times it means masses or positions in other units than Msun/h and Mpc/h.
_MOST_OVER_MEAN = 1e6


def check_definition_units(names, densities, problem: Problem, args, given, instead) -> None:
    """Named SO definitions are in Msun/h per (Mpc/h)^3. Masses in another unit (unit
    masses by default) would put every threshold far above the data's mean density and
    give M = R = 0 for every halo: refuse that outside ``jit``. ``given`` spells the
    caller's argument (``so=('200c',)``), ``instead`` what to pass in other units."""
    # Inside jit nothing can be raised. (Outside it a scalar mass is "static": only traced
    # scalars are "scalar".)
    if is_traced(args, densities):
        return
    if problem.mass_kind == "static":
        total_mass = problem.static_mass * problem.total
    else:  # per-row masses, the last input (padding rows hold 0)
        total_mass = float(jnp.sum(args[-1]))
    mean = total_mass / problem.box_size**3
    if not mean > 0:
        return
    for name, density in zip(names, densities):
        if not float(density) <= _MOST_OVER_MEAN * mean:
            raise ValueError(
                f"{given}: the {name!r} threshold {float(density):.3g} is "
                f"{float(density) / mean:.3g} times the data's mean density {mean:.3g} "
                "(total mass / box_size**3), so every M and R would be 0. Named "
                "definitions are in Msun/h per (Mpc/h)^3: pass mass= in Msun/h "
                "(units.particle_mass(omega_m, box_size, nc) for a JaxPM run) with positions "
                f"in Mpc/h, or {instead} in your units."
            )


def check_smoothing(smoothing, problem: Problem | None = None) -> float | None:
    """``smoothing`` as a positive float (or None), refused with per-particle masses (the
    smooth definition counts equal masses)."""
    if smoothing is None:
        return None
    if isinstance(smoothing, bool) or not isinstance(smoothing, (int, float)):
        raise ValueError(
            f"smoothing={smoothing!r}: the SO smoothing width is a Python number (relative "
            "to the radius, e.g. 0.1), fixed when the program is compiled"
        )
    if not (math.isfinite(smoothing) and smoothing > 0):
        raise ValueError(f"smoothing={smoothing!r}: the SO smoothing width must be positive")
    if problem is not None and problem.mass_kind == "rows":
        raise ValueError(
            "smoothing=: the smooth SO definition needs equal particle masses; pass mass= "
            "as a scalar (JaxPM's particles have one mass), or leave smoothing out"
        )
    return float(smoothing)


def _centres(centres, dtype):
    c = jnp.asarray(real_floats(centres, "SO centres"))
    if c.ndim != 2 or c.shape[-1] != 3:
        raise ValueError(f"centres must have shape (H, 3), got {c.shape}")
    refuse_nonfinite_points(c, "SO centres", "centres must be finite")
    return c.astype(dtype)


def _count_nonfinite_centres(out: dict, centres) -> dict:
    """Inside jit a non-finite centre's values are NaN (:func:`so_on_decomposition`); the
    status counts it as non-finite input."""
    bad = ~jnp.all(jnp.isfinite(centres), axis=1)  # (H,)
    status = out["status"]
    return dict(
        out,
        status=dataclasses.replace(
            status, nonfinite=status.nonfinite + jnp.sum(bad, dtype=jnp.int32)
        ),
    )


def spherical_overdensity(
    pos,
    centres,
    *,
    box_size=None,
    density,
    omega_m=None,
    a=1.0,
    mass=None,
    mesh=None,
    config: SOConfig | None = None,
    smoothing: float | None = None,
    with_status: bool = False,
    grow: bool = True,
):
    """Spherical-overdensity radii and masses about given centres, periodic and exact.

    For each centre, the particles (all of them, not only a group's members) are sorted by
    minimum-image distance ``r``; with ``M_i`` the mass of the ``i`` nearest, ``i*`` is
    the first ``i`` with ``M_i / (4/3 pi r_i^3) < density`` (the first downcrossing), and
    ``M = M_{i*-1}``, ``R = (3 M / (4 pi density))^(1/3)``, which lies in
    ``[r_{i*-1}, r_{i*})``. ``M = R = 0`` when the nearest particle is already below.
    With equal masses the mass within a radius is the particles counted times their mass
    (one rounding): the same bits on every mesh. Unequal masses are summed in an order that
    depends on the mesh, and particles at exactly the same distance are taken in the
    sort's order, which can differ between meshes, so a crossing among them can differ.

    Args:
      pos: every input form :func:`~jaxpm_halos.fof` accepts (``(N, 3)`` positions,
        sharded or not, a JaxPM grid, or :class:`~jaxpm_halos.Particles`).
      centres: ``(H, 3)`` centres in the unit of ``pos`` (any H; wrapped into the box).
      box_size: periodic box side (taken from Particles; a different value raises).
      density: threshold mean density, a scalar or a ``(D,)`` array, in the unit of
        ``mass`` per unit of ``pos`` cubed (e.g. :func:`jaxpm_halos.units.so_density`, in
        (Msun/h) / (Mpc/h)^3, with masses in Msun/h and positions in Mpc/h). Or a
        definition name (``"200c"``, ``"200m"``, ``"vir"``) or a list of them, with
        ``omega_m`` (and ``a``): their ``so_density`` thresholds.
      omega_m, a: matter density parameter today and scale factor, for definition names.
      mass: particle masses, scalar or per particle (default 1; taken from Particles).
      mesh: device mesh; default: the input's sharding (or the abstract mesh under ``jit``).
      config: :class:`~jaxpm_halos.SOConfig`; its ``radius`` bounds the radii that can be
        measured.
      smoothing: ``None`` (the definition above) or a relative width ``h`` (e.g. 0.1):
        the smooth definition, differentiable (below). Needs equal particle masses (a
        scalar ``mass``, as JaxPM's).
      with_status: return ``(radius, mass, status)``, the
        :class:`~jaxpm_halos.Status` third.
      grow: outside ``jit``, a profile that has not fallen below the threshold within
        ``config.radius`` (or a buffer that overflowed) makes the call run again with a
        larger value; ``False`` raises :class:`~jaxpm_halos.CapacityError` naming one.

    Returns:
      ``(radius, mass)`` (with ``with_status``, ``(radius, mass, status)``), each
      ``(H,)`` for a scalar ``density`` or ``(H, D)``,
      replicated. Inside ``jit`` an unresolved profile is NaN and reported by the status;
      so is a non-finite centre (counted in ``status.nonfinite``; outside ``jit`` it raises
      :class:`~jaxpm_halos.InvalidInputError`).
      Without ``smoothing``, not differentiable: membership of a sphere is a discrete
      choice (gradients are zero with respect to positions, masses, ``density`` and
      ``centres``).

    Smooth masses: with ``R_i = (3 M_i / (4 pi density))^(1/3)``, the radius at which the
    ``i`` nearest would sit at the threshold, the hard definition keeps particles while
    ``r_i <= R_i``. The smooth one gives each particle the weight
    ``w_i = S((1 - r_i / R_i) / h)`` (``S`` the C1 cubic step from 0 at -1 to 1 at 1: full
    weight within ``(1 - h) R_i``, none beyond ``(1 + h) R_i``) and keeps it as far as
    every nearer one passed: ``M = m sum_j prod_{i <= j} w_i``,
    ``R = (3 M / (4 pi density))^(1/3)``. It is the hard mass when ``h`` is below every
    ``|1 - r_i / R_i|`` up to the crossing, and continuously differentiable with respect
    to the positions, the ``centres`` (e.g. a catalogue's, its membership held fixed) and
    a scalar ``mass`` wherever no two distances swap; not with respect to ``density``. It
    is biased low against the hard mass, as a weight below 1 discounts the farther
    particles: choose ``h`` with docs/statistics.md, which measures it on JaxPM haloes
    (median 0.995 of the hard m200m at ``h = 0.02``, 0.95 at 0.05, 0.85 at 0.1). The
    particles whose weight lies strictly between 0 and 1 are kept for the derivative in the
    buffer ``'so smooth'`` (``SOConfig(smooth_factor=...)``).

    Examples:
        M200 about the centre of a clump of 50 unit masses, among 462 uniform ones in a
        10 Mpc/h box:

        >>> import jax, numpy as np
        >>> import jaxpm_halos
        >>> from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
        >>> mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
        >>> rng = np.random.default_rng(0)
        >>> clump = 5.0 + 0.1 * rng.standard_normal((50, 3))
        >>> pos = np.concatenate([clump, rng.uniform(0, 10, (462, 3))]).astype(np.float32)
        >>> pos = jax.device_put(pos, NamedSharding(mesh, P(("x", "y"))))
        >>> mean_density = 512 / 10.0**3
        >>> radius, mass = jaxpm_halos.spherical_overdensity(
        ...     pos, np.array([[5.0, 5.0, 5.0]]), box_size=10.0, density=200 * mean_density)
        >>> print(f"R200 = {float(radius[0]):.2f} Mpc/h, M200 = {float(mass[0]):g} particles")
        R200 = 0.49 Mpc/h, M200 = 50 particles
    """
    problem, args, in_specs = prepare(pos, box_size, None, mass, mesh)
    config = SOConfig() if config is None else config
    smoothing = check_smoothing(smoothing, problem)
    names, density = named_densities(density, omega_m, a)
    density, scalar = check_densities(density)
    if names:
        given = f"density={names[0] if scalar else names!r}"
        check_definition_units(names, density, problem, args, given, "density=<threshold>")
    centres = _centres(centres, args[0].dtype)
    empty = centres.shape[0] == 0
    placeholder = jnp.zeros((1, 3), centres.dtype) if empty else centres  # (max(H, 1), 3)
    args = args + (placeholder, density.astype(args[0].dtype))

    def run(cfg):
        radius = resolve_radius(cfg, problem.mean_separation, problem.pencils)
        return _so_program(problem, in_specs, cfg, radius, empty, smoothing)(*args)

    if is_traced(args):
        out = _count_nonfinite_centres(run(config), centres)
    else:  # _centres refused non-finite centres
        out, _ = run_growing(run, config, lambda o: o["status"].failure(), grow=grow)
    radius, so_mass, status = out["radius"], out["mass"], out["status"]
    if empty:
        radius, so_mass = radius[:0], so_mass[:0]
    if scalar:
        radius, so_mass = radius[:, 0], so_mass[:, 0]
    return (radius, so_mass, status) if with_status else (radius, so_mass)
