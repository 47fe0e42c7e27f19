"""Turn a JaxPM simulation state into :class:`~jaxpm_halos.Particles`.

This module never imports jaxpm or jaxdecomp: it only reads the arrays JaxPM produces.

JaxPM's multi-device state (``particles=None``, ``paint_absolute_pos=False``) holds, per
particle, a displacement ``d`` in grid cells from the particle's lattice point ``q`` (its
grid index ``(ix, iy, iz)``), never wrapped, and a momentum ``p`` in grid units with
``dx/da = p / (a^3 E(a))``. Both are ``(nc, nc, nc, 3)`` grids, usually sharded
``P("x", "y")`` over a 2D device mesh; the diffrax state stacks them as ``(2, nc, nc, nc, 3)``.

Absolute-position states (``paint_absolute_pos=True``) hold instead, at the array index of
the particle's lattice point, its absolute position ``x`` in cells of a particle-mesh grid
of ``pm_nc`` cells per side (unwrapped), and the momentum in the same units
(``dx/da = p / (a^3 E(a))``). In JaxPM 0.1.6 that is ``make_diffrax_ode(...,
paint_absolute_pos=True)`` with ``lpt(cosmo, field, particles)`` and ``y0 = [particles + dx,
p]``, on one device and with ``pm_nc == nc`` only (its ``cic_paint``/``cic_read`` reshape
the particles to the mesh shape, and its absolute painting is wrong on a device mesh);
``jaxpm_halos.simulation.run_simulation(pm_nc=...)`` makes such states with a finer mesh,
also distributed. See :func:`check_state_positions`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..core.geometry import grid_to_box
from ..core.particles import Particles, _check_box_size, check_row_count


def from_jaxpm(
    state_or_disp,
    mom=None,
    box_size=None,
    *,
    mass=1.0,
    paint_absolute_pos: bool = False,
    pm_nc: int | None = None,
) -> Particles:
    """Particles of a JaxPM lattice run, keeping its ``(nc, nc, nc)`` layout and sharding.

    Args:
      state_or_disp: either JaxPM's displacement grid ``disp`` of shape ``(nc, nc, nc, 3)``,
        in grid cells from each particle's lattice point (unwrapped), or the stacked diffrax
        state ``y`` of shape ``(2, nc, nc, nc, 3)`` with ``y[0] = disp`` and ``y[1] = mom``.
      mom: optional momentum grid ``(nc, nc, nc, 3)``; only with the ``disp`` form.
      box_size: side of the periodic box (e.g. in Mpc/h). Required.
      mass: scalar or ``(nc, nc, nc)`` particle mass, stored as given (see
        :func:`jaxpm_halos.units.particle_mass` for the mass in Msun/h).
      paint_absolute_pos: the state holds absolute positions in cells of a particle-mesh
        grid of ``pm_nc`` cells per side (JaxPM's ``paint_absolute_pos=True``) instead of
        displacements in lattice cells.
      pm_nc: cells per side of that particle-mesh grid (default: ``nc``). Only with
        ``paint_absolute_pos=True``; it may differ from the lattice's ``nc``.

    Returns:
      :class:`~jaxpm_halos.Particles` with leading shape ``(nc, nc, nc)``:

      - ``pos = wrap(q + disp, nc) * box_size / nc``, wrapped into ``[0, box_size)``
        (a value that rounds to ``box_size`` becomes 0); with ``paint_absolute_pos``,
        ``pos = wrap(x, pm_nc) * box_size / pm_nc``;
      - ``id = (ix * nc + iy) * nc + iz``, the C-order lattice index (int32);
      - ``vel = mom`` exactly as given, i.e. JaxPM's momentum in grid units (``None`` if
        no momentum is given). Convert it with
        :func:`jaxpm_halos.units.momentum_to_velocity` (peculiar velocity in km/s; pass
        ``pm_nc`` as its ``nc`` for an absolute-position state, whose momentum is in PM
        cells);
      - ``num = nc**3``, ``mass`` as given, ``box_size`` static.

    ``pos`` and ``id`` keep the sharding of ``disp`` (e.g. ``P("x", "y")`` over JaxPM's
    mesh, or one device), outside or inside ``jit``: no axis name is assumed, the arrays
    are derived element-wise from ``disp`` so that sharding propagation carries its layout.

    Raises:
      ValueError: on a shape that is not ``(nc, nc, nc, 3)`` or ``(2, nc, nc, nc, 3)``, a
        ``mom`` whose shape differs from ``disp``'s, ``mom`` given with a stacked state, a
        bad ``mass`` shape, a non-floating ``disp``, or ``box_size`` that is missing,
        not positive or not finite; a ``pm_nc`` that is not a positive integer, or that
        differs from ``nc`` without ``paint_absolute_pos``; a concrete state whose mean
        position contradicts the mode (see :func:`check_state_positions`).
    """
    if box_size is None:
        raise ValueError("from_jaxpm needs box_size, the side of the simulation box")
    box_size = _check_box_size(box_size)
    if not isinstance(state_or_disp, jax.Array):
        state_or_disp = jnp.asarray(state_or_disp)
    shape = tuple(state_or_disp.shape)
    if len(shape) == 5:
        if shape[0] != 2:
            raise ValueError(
                f"a stacked JaxPM state must have shape (2, nc, nc, nc, 3), got {shape}"
            )
        if mom is not None:
            raise ValueError(
                "mom must not be given with a stacked (2, nc, nc, nc, 3) state, "
                "which already holds the momentum in y[1]"
            )
        stacked = True
        disp = jax.ShapeDtypeStruct(shape[1:], state_or_disp.dtype)
    elif len(shape) == 4:
        stacked = False
        disp = state_or_disp
    else:
        raise ValueError(
            "expected a displacement grid (nc, nc, nc, 3) or a stacked JaxPM "
            f"state (2, nc, nc, nc, 3), got shape {shape}"
        )
    nc = disp.shape[0]
    if disp.shape != (nc, nc, nc, 3) or nc < 1:
        raise ValueError(f"the displacement grid must have shape (nc, nc, nc, 3), got {disp.shape}")
    check_row_count(nc**3)
    if not jnp.issubdtype(disp.dtype, jnp.floating):
        raise ValueError(f"the displacement grid must be floating point, got {disp.dtype}")
    if mom is not None:
        if not isinstance(mom, jax.Array):
            mom = jnp.asarray(mom)
        if tuple(mom.shape) != tuple(disp.shape):
            raise ValueError(
                f"mom has shape {tuple(mom.shape)}, but the displacement grid "
                f"has shape {tuple(disp.shape)}"
            )
    if jnp.ndim(mass) not in (0, 3) or (
        jnp.ndim(mass) == 3 and tuple(jnp.shape(mass)) != (nc,) * 3
    ):
        raise ValueError(
            f"mass must be a scalar or have shape {(nc,) * 3}, got shape {jnp.shape(mass)}"
        )

    pm_nc = resolve_pm_nc(nc, pm_nc, paint_absolute_pos)
    check_state_positions(
        state_or_disp[0] if stacked else state_or_disp, nc, pm_nc, paint_absolute_pos
    )
    out = _converter(
        box_size,
        stacked,
        _grid_sharding(state_or_disp, stacked),
        pm_nc if paint_absolute_pos else None,
    )(state_or_disp)
    pos, ids, vel = out if stacked else (*out, mom)
    return Particles(
        pos=pos, id=ids, num=jnp.asarray(nc**3, jnp.int32), vel=vel, mass=mass, box_size=box_size
    )


def _grid_sharding(array, stacked):
    """The NamedSharding of the ``(nc, nc, nc, 3)`` grid, read off a concrete input.

    None for traced inputs (inside ``jit`` the layout follows from sharding propagation),
    for single-device inputs and for a stacked state whose stacking axis is sharded.
    """
    if isinstance(array, jax.core.Tracer):
        return None
    sharding = getattr(array, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return None
    spec = tuple(sharding.spec) + (None,) * (array.ndim - len(sharding.spec))
    if stacked:
        if spec[0] is not None:
            return None
        spec = spec[1:]
    while spec and spec[-1] is None:
        spec = spec[:-1]
    return NamedSharding(sharding.mesh, P(*spec))


@functools.cache
def _converter(box_size, stacked, sharding, absolute_pm_nc=None):
    """A jitted conversion; with ``sharding`` its outputs get exactly that layout.
    ``absolute_pm_nc``: the state holds absolute positions in cells of that PM grid."""

    def convert(state):
        disp, mom = (state[0], state[1]) if stacked else (state, None)
        if absolute_pm_nc is None:
            pos, ids = _lattice_positions(disp, box_size)
        else:
            pos, ids = _absolute_positions(disp, box_size, absolute_pm_nc)
        return (pos, ids, mom) if stacked else (pos, ids)

    if sharding is None:
        return jax.jit(convert)
    id_sharding = NamedSharding(sharding.mesh, P(*tuple(sharding.spec)[:3]))
    out = (sharding, id_sharding, sharding) if stacked else (sharding, id_sharding)
    return jax.jit(convert, out_shardings=out)


def _lattice_positions(disp, box_size):
    """Wrapped positions and lattice ids; both follow ``disp``'s sharding."""
    nc = disp.shape[0]
    dtype = disp.dtype
    axes = [jax.lax.broadcasted_iota(jnp.int32, (nc, nc, nc), dim) for dim in range(3)]
    q = jnp.stack(axes, axis=-1).astype(dtype)
    pos = grid_to_box(q + disp, nc, box_size)
    # The ids are a function of the lattice alone. Tie them to disp with a term that is
    # zero for every input (|d| < 0 is False even for NaN) so that XLA's sharding
    # propagation gives them disp's layout instead of replicating them.
    tie = (jnp.abs(disp[..., 0]) < 0).astype(jnp.int32)
    ids = (axes[0] * nc + axes[1]) * nc + axes[2] + tie
    return pos, ids


def _absolute_positions(x, box_size, pm_nc):
    """Wrapped positions from absolute PM-cell positions, and the lattice ids of the array
    indices; both follow ``x``'s sharding."""
    nc = x.shape[0]
    pos = grid_to_box(x, pm_nc, box_size)
    axes = [jax.lax.broadcasted_iota(jnp.int32, (nc, nc, nc), dim) for dim in range(3)]
    tie = (jnp.abs(x[..., 0]) < 0).astype(jnp.int32)  # see _lattice_positions
    ids = (axes[0] * nc + axes[1]) * nc + axes[2] + tie
    return pos, ids


def resolve_pm_nc(nc: int, pm_nc, paint_absolute_pos: bool) -> int:
    """The PM grid's cells per side: ``pm_nc``, or ``nc`` when None. Raises ValueError on
    a ``pm_nc`` that is not a positive integer, or that differs from ``nc`` for a
    displacement state (JaxPM's displacement mode paints on the particle lattice)."""
    if not isinstance(paint_absolute_pos, (bool, np.bool_)):
        raise ValueError(f"paint_absolute_pos must be True or False, got {paint_absolute_pos!r}")
    if pm_nc is None:
        return nc
    if isinstance(pm_nc, bool) or not isinstance(pm_nc, (int, np.integer)) or pm_nc < 1:
        raise ValueError(f"pm_nc must be a positive integer (PM cells per side), got {pm_nc!r}")
    if not paint_absolute_pos and pm_nc != nc:
        raise ValueError(
            f"pm_nc = {pm_nc} differs from the lattice's nc = {nc}, but the state "
            "holds displacements in lattice cells (paint_absolute_pos=False); a "
            "PM mesh other than the lattice needs an absolute-position state: pass "
            "paint_absolute_pos=True"
        )
    return int(pm_nc)


def check_state_positions(x, nc: int, pm_nc: int, paint_absolute_pos: bool) -> None:
    """Raise ValueError when a concrete state's ``y[0]`` contradicts the declared mode.

    Traced states (inside ``jit``), multi-process states and states of fewer than 2
    particles per side are not checked. The test uses the mean position per axis in units of
    the lattice spacing,
    ``s = mean(y[0][..., i]) * nc / pm_nc / ((nc - 1) / 2)``. It is about 1 for absolute
    positions in ``pm_nc`` cells (lattice points ``q pm_nc / nc`` plus displacements whose
    mean is ~0), ``pm_nc' / pm_nc`` for positions in cells of another grid ``pm_nc'``, and
    about 0 for displacements.
    It raises only when all three axes disagree with the mode: ``|s - 1| > 0.3`` for an
    absolute state (a displacement state, or positions in cells of another grid), and
    ``s > 0.75`` for a displacement state (absolute positions). A state that has
    collapsed far from the box centre can trip it; that is the price of catching a wrong
    mode or ``pm_nc`` before it gives plausible wrong halos.
    """
    if isinstance(x, jax.core.Tracer) or nc < 2 or not getattr(x, "is_fully_addressable", True):
        return
    mean = np.asarray(jnp.mean(jnp.asarray(x, jnp.float32).reshape(-1, 3), axis=0), np.float64)
    s = mean * (nc / pm_nc) / ((nc - 1) / 2)
    if paint_absolute_pos and np.all(np.abs(s - 1) > 0.3):
        guess = (
            "displacements (paint_absolute_pos=False)"
            if np.all(np.abs(s) < 0.5)
            else f"absolute positions in cells of a grid of about {pm_nc * float(np.mean(s)):.3g} "
            "cells per side"
        )
        raise ValueError(
            f"the state was declared as absolute positions in cells of a {pm_nc}^3 "
            f"PM grid (mean position {mean.round(3).tolist()}, expected about "
            f"{pm_nc * (nc - 1) / (2 * nc):g} on each axis), but it looks like "
            f"{guess}. Check paint_absolute_pos and pm_nc"
        )
    if not paint_absolute_pos and np.all(s > 0.75):
        raise ValueError(
            f"the state was declared as displacements in lattice cells "
            f"(paint_absolute_pos=False), but its mean {mean.round(3).tolist()} "
            f"is that of absolute positions (about {(nc - 1) / 2:g} cells on each "
            "axis for pm_nc = nc). Pass paint_absolute_pos=True (and pm_nc)"
        )
