"""Turn a JaxPM simulation state into :class:`~jaxpm_halos.Particles`.

This module never imports jaxpm or jaxdecomp: it only reads the arrays JaxPM produces.

JaxPM's multi-device state (``particles=None``, ``paint_absolute_pos=False``) holds, per
particle, a displacement ``d`` in grid cells from the particle's lattice point ``q`` (its
grid index ``(ix, iy, iz)``), never wrapped, and a momentum ``p`` in grid units with
``dx/da = p / (a^3 E(a))``. Both are ``(nc, nc, nc, 3)`` grids, usually sharded
``P("x", "y")`` over a 2D device mesh; the diffrax state stacks them as ``(2, nc, nc, nc, 3)``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from ._geometry import grid_to_box
from ._particles import Particles, _check_box_size


def from_jaxpm(state_or_disp, mom=None, box_size=None, *, mass=1.0) -> Particles:
    """Particles of a JaxPM lattice run, keeping its ``(nc, nc, nc)`` layout and sharding.

    Args:
      state_or_disp: either JaxPM's displacement grid ``disp`` of shape ``(nc, nc, nc, 3)``,
        in grid cells from each particle's lattice point (unwrapped), or the stacked diffrax
        state ``y`` of shape ``(2, nc, nc, nc, 3)`` with ``y[0] = disp`` and ``y[1] = mom``.
      mom: optional momentum grid ``(nc, nc, nc, 3)``; only with the ``disp`` form.
      box_size: side of the periodic box (e.g. in Mpc/h). Required.
      mass: scalar or ``(nc, nc, nc)`` particle mass, stored as given (see
        :func:`jaxpm_halos.units.particle_mass` for the mass in Msun/h).

    Returns:
      :class:`~jaxpm_halos.Particles` with leading shape ``(nc, nc, nc)``:

      - ``pos = wrap(q + disp, nc) * box_size / nc``, wrapped into ``[0, box_size)``
        (a value that rounds to ``box_size`` becomes 0);
      - ``id = (ix * nc + iy) * nc + iz``, the C-order lattice index (int32);
      - ``vel = mom`` exactly as given, i.e. JaxPM's momentum in grid units (``None`` if
        no momentum is given). Convert it with
        :func:`jaxpm_halos.units.momentum_to_velocity` (peculiar velocity in km/s) and
        positions with :func:`jaxpm_halos.units.grid_to_mpc`;
      - ``num = nc**3``, ``mass`` as given, ``box_size`` static.

    ``pos`` and ``id`` keep the sharding of ``disp`` (e.g. ``P("x", "y")`` over JaxPM's
    mesh, or one device), outside or inside ``jit``: no axis name is assumed, the arrays
    are derived element-wise from ``disp`` so that sharding propagation carries its layout.

    Raises:
      ValueError: on a shape that is not ``(nc, nc, nc, 3)`` or ``(2, nc, nc, nc, 3)``, a
        ``mom`` whose shape differs from ``disp``'s, ``mom`` given with a stacked state, a
        bad ``mass`` shape, a non-floating ``disp``, or ``box_size`` that is missing,
        not positive or not finite.
    """
    if box_size is None:
        raise ValueError("from_jaxpm needs box_size, the side of the simulation box")
    box_size = _check_box_size(box_size)
    if not isinstance(state_or_disp, jax.Array):
        state_or_disp = jnp.asarray(state_or_disp)
    shape = tuple(state_or_disp.shape)
    if len(shape) == 5:
        if shape[0] != 2:
            raise ValueError(f"a stacked JaxPM state must have shape (2, nc, nc, nc, 3), got {shape}")
        if mom is not None:
            raise ValueError("mom must not be given with a stacked (2, nc, nc, nc, 3) state, "
                             "which already holds the momentum in y[1]")
        stacked = True
        disp = jax.ShapeDtypeStruct(shape[1:], state_or_disp.dtype)
    elif len(shape) == 4:
        stacked = False
        disp = state_or_disp
    else:
        raise ValueError("expected a displacement grid (nc, nc, nc, 3) or a stacked JaxPM "
                         f"state (2, nc, nc, nc, 3), got shape {shape}")
    nc = disp.shape[0]
    if disp.shape != (nc, nc, nc, 3) or nc < 1:
        raise ValueError(f"the displacement grid must have shape (nc, nc, nc, 3), got {disp.shape}")
    if nc**3 > np.iinfo(np.int32).max:
        raise ValueError(f"nc = {nc}: nc**3 particle ids do not fit in int32")
    if not jnp.issubdtype(disp.dtype, jnp.floating):
        raise ValueError(f"the displacement grid must be floating point, got {disp.dtype}")
    if mom is not None:
        if not isinstance(mom, jax.Array):
            mom = jnp.asarray(mom)
        if tuple(mom.shape) != tuple(disp.shape):
            raise ValueError(f"mom has shape {tuple(mom.shape)}, but the displacement grid "
                             f"has shape {tuple(disp.shape)}")
    if jnp.ndim(mass) not in (0, 3) or (jnp.ndim(mass) == 3 and tuple(jnp.shape(mass)) != (nc,) * 3):
        raise ValueError(f"mass must be a scalar or have shape {(nc,) * 3}, got shape {jnp.shape(mass)}")

    out = _converter(box_size, stacked, _grid_sharding(state_or_disp, stacked))(state_or_disp)
    pos, ids, vel = out if stacked else (*out, mom)
    return Particles(pos=pos, id=ids, num=jnp.asarray(nc**3, jnp.int32), vel=vel, mass=mass,
                     box_size=box_size)


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


@functools.lru_cache(maxsize=None)
def _converter(box_size, stacked, sharding):
    """A jitted conversion; with ``sharding`` its outputs get exactly that layout."""

    def convert(state):
        disp, mom = (state[0], state[1]) if stacked else (state, None)
        pos, ids = _lattice_positions(disp, box_size)
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

