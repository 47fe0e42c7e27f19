"""A PM grid finer than the particle lattice, for JaxPM runs on a device mesh.

JaxPM 0.1.6 paints particles on their own lattice in its distributed (displacement) mode,
and its absolute-position mode, which allows a finer grid, does not run distributed. With
the PM grid equal to the lattice, haloes below about 100 particles are under-formed and
spherical-overdensity masses are far too low, so :func:`refined_pm_ode` gives JaxPM's
equations on ``pm_nc**3`` cells for ``nc**3`` particles on any 2D device mesh, with
:func:`default_halo_size` sizing the painting halo to cover particles that stray from
their device's block. :class:`PMSetup` holds the PM choices of one
:func:`jaxpm_halos.simulation.run_simulation`: grids, halos, layout and the engine.

This module imports jaxpm, jaxdecomp and jax_cosmo when its functions are called.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple


def refined_pm_ode(nc: int, pm_nc: int, *, halo_size: int = 0, sharding=None):
    """``f(a, y, cosmo)`` for ``diffrax.ODETerm``: JaxPM's PM equations on a grid of
    ``pm_nc**3`` cells for ``nc**3`` particles whose state holds absolute positions.

    The state ``y`` is ``(2, nc, nc, nc, 3)``: ``y[0]`` the absolute position ``x`` in PM
    cells (unwrapped), ``y[1]`` the momentum ``p`` in PM cells, at the array index of each
    particle's lattice point and sharded like JaxPM's state (``P("x", "y")`` per grid). The
    equations are those of ``jaxpm.pm.make_diffrax_ode``::

        dx/da = p / (a^3 E(a)),     dp/da = 1.5 Omega_m F(x) / (a^2 E(a)),
        F = -grad invlaplace(delta),

    with ``delta + 1`` the CIC density of the particles on the PM grid, each weighing
    ``(pm_nc / nc)^3`` so that its mean is 1, and JaxPM's Fourier kernels
    (``invlaplace_kernel``, ``gradient_kernel``, ``longrange_kernel`` with ``r_split=0``)
    and distributed FFT (``fft3d``). In PM-cell units these equations have the same form
    on every grid (a length unit ``l`` rescales ``x``, ``p`` and the potential by ``l``,
    ``l`` and ``l^2``), which is why JaxPM's lattice-cell code carries over unchanged.

    Painting and reading follow JaxPM's ``cic_paint_dx``/``cic_read_dx`` on a device mesh:
    each device paints its particles into its PM block padded by ``halo_size`` cells along
    the split axes, JaxPM's ``halo_exchange`` and ``slice_unpad`` (outside ``shard_map``)
    add the padding into the neighbours, and reading pads by ``halo_size // 2``. Mass
    farther than ``halo_size / 2`` PM cells from a device's block is lost (and forces
    there read as 0): see :func:`default_halo_size`. Unsplit axes wrap periodically.

    At ``pm_nc == nc`` this is JaxPM's ODE: on one device its derivative equals
    ``make_diffrax_ode(paint_absolute_pos=False)``'s on the same particles to 8e-7 of the
    largest force, and at ``pm_nc = 2 nc`` a (2, 4) mesh follows the single-device run
    (``tests/test_pm_mesh.py``). In 32 Mpc/h at 16^3 on (2, 4), where particles strayed
    13 Mpc/h from their blocks and the halo reached 8 Mpc/h, the run ended 1.3 PM cells
    from the single-device one: the halo must cover the strays.
    """
    import jax
    import jax.numpy as jnp
    import jax_cosmo as jc
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from jaxpm.distributed import (
        autoshmap,
        fft3d,
        get_halo_size,
        halo_exchange,
        ifft3d,
        slice_pad,
        slice_unpad,
    )
    from jaxpm.kernels import fftk, gradient_kernel, invlaplace_kernel, longrange_kernel

    mesh = sharding.mesh if isinstance(sharding, NamedSharding) else None
    spec = sharding.spec if mesh is not None else P()
    pdims = mesh.devices.shape if mesh is not None else (1, 1)
    if pm_nc % pdims[0] or pm_nc % pdims[1]:
        raise ValueError(f"pm_nc = {pm_nc} is not divisible by the mesh shape {pdims}")
    pad, extents = get_halo_size(halo_size, sharding)
    read_pad = jax.tree.map(lambda h: h // 2, pad)
    block = (pm_nc // pdims[0], pm_nc // pdims[1], pm_nc)
    weight = (pm_nc / nc) ** 3

    def local_paint(pos):
        grid = None
        for idx, w, shape in _cic_corners(pos, pad, pdims, spec, block):
            if grid is None:
                grid = jnp.zeros(shape, pos.dtype)
            grid = grid.at[idx].add(w * weight, mode="drop")
        return grid

    def local_read(grid, pos):
        out = jnp.zeros(pos.shape[:-1], pos.dtype).reshape(-1)
        for idx, w, _ in _cic_corners(pos, read_pad, pdims, spec, block):
            out = out + w * grid.at[idx].get(mode="fill", fill_value=0)
        return out.reshape(pos.shape[:-1])

    def paint(pos):
        grid = autoshmap(local_paint, gpu_mesh=mesh, in_specs=(spec,), out_specs=spec)(pos)
        grid = halo_exchange(grid, halo_extents=extents, halo_periods=(True, True))
        return slice_unpad(grid, pad, sharding)

    def read(grid, pos):
        grid = slice_pad(grid, read_pad, sharding)
        grid = halo_exchange(grid, halo_extents=extents, halo_periods=(True, True))
        return autoshmap(local_read, gpu_mesh=mesh, in_specs=(spec, spec), out_specs=spec)(
            grid, pos
        )

    def ode(a, state, cosmo):
        pos, mom = state[0], state[1]
        delta_k = fft3d(paint(pos))
        kvec = fftk(delta_k)
        pot_k = delta_k * invlaplace_kernel(kvec) * longrange_kernel(kvec, r_split=0)
        forces = (
            jnp.stack(
                [read(ifft3d(-gradient_kernel(kvec, i) * pot_k), pos) for i in range(3)], axis=-1
            )
            * 1.5
            * cosmo.Omega_m
        )
        e = jnp.sqrt(jc.background.Esqr(cosmo, a))
        return jnp.stack([mom / (a**3 * e), forces / (a**2 * e)])

    ode.paint = paint  # for tests: the PM density (mean 1)
    return ode


def _cic_corners(pos, halo, pdims, spec, block):
    """CIC corners of this device's particles ``pos`` (inside ``shard_map`` over a mesh of
    shape ``pdims`` with axis names ``spec``; ``block`` the PM cells of one device): per
    corner, the index arrays into the block padded by ``halo`` along the split axes
    (out-of-range ones set to the axis length, to be dropped), the weights (0 where out of
    range) and the padded block's shape."""
    import jax
    import jax.numpy as jnp

    origin = []
    for axis in range(2):
        if pdims[axis] > 1:
            origin.append(jax.lax.axis_index(spec[axis]) * block[axis] - halo[axis][0])
        else:
            origin.append(0)
    origin.append(0)
    shape = tuple(block[d] + 2 * halo[d][0] for d in range(3))
    rel = pos.reshape(-1, 3) - jnp.stack([jnp.asarray(o, pos.dtype) for o in origin])
    base = jnp.floor(rel)
    frac = rel - base
    base = base.astype(jnp.int32)
    for c in range(8):
        offset = ((c >> 2) & 1, (c >> 1) & 1, c & 1)
        idx, w = [], jnp.ones(rel.shape[0], pos.dtype)
        for d in range(3):
            i = base[:, d] + offset[d]
            w = w * (frac[:, d] if offset[d] else 1 - frac[:, d])
            if d == 2 or pdims[d] == 1:
                i = jnp.mod(i, shape[d])  # this axis holds the whole periodic grid
            else:
                ok = (i >= 0) & (i < shape[d])
                w = jnp.where(ok, w, 0)
                i = jnp.where(ok, i, shape[d])
            idx.append(i)
        yield tuple(idx), w, shape


def default_halo_size(nc: int, box: float, block: int, stray_mpc: float = 20.0) -> int:
    """JaxPM ``halo_size`` (cells) for particles straying up to ``stray_mpc`` Mpc/h.

    JaxPM's painting pads each device's block by ``halo_size`` cells but exchanges only the
    inner ``halo_size // 2`` of that padding with the neighbours, so mass deposited farther
    than ``halo_size / 2`` from its lattice block is lost. By z=0 particles stray up to
    ~7 Mpc/h (32^3 in 32 Mpc/h), ~10 Mpc/h (64^3 in 64 Mpc/h) and ~16 Mpc/h (64^3 in
    128 Mpc/h) from their block on a (2, 4) mesh; larger boxes have larger bulk flows.
    The default is ``2 * ceil(stray_mpc / cell) + 4`` cells, capped at twice the smallest
    block side ``block`` (the exchange cannot reach past the neighbour).

    Measured against single-device runs from the same initial field on a (2, 4) mesh
    (max |difference| of the final displacements): 32^3 in 32 Mpc/h, 10 steps: 1.5 cells
    with ``halo_size`` 8, 1e-5 with 16 (the cap); 64^3 in 64 Mpc/h, 5 steps: 0.44 cells
    with 16, 5e-5 with 24 or 32; 64^3 in 128 Mpc/h, 20 steps: 0.38 cells with 8, 1e-5 with 14.
    Over 20 steps at 64^3 in 64 Mpc/h, rounding differences alone grow to ~0.1 cells for a
    few particles (leapfrog on a chaotic system).
    """
    cells = 2 * math.ceil(stray_mpc * nc / box) + 4
    return max(2, min(cells, 2 * block))


# ----------------------------------------------------------------------------------------
# The PM setup of one run_simulation


def distribution(mesh, nc: int, pm_nc: int):
    """``(mesh, sharding, block)``: the mesh (None for one device), the sharding of the
    ``(nc, nc, nc, ...)`` grids and the smallest lattice block side of a device."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    if mesh is None or mesh.size == 1:
        return None, None, nc
    if len(mesh.axis_names) != 2:
        raise ValueError(f"JaxPM needs a 2D device mesh, got axes {mesh.axis_names}")
    px, py = mesh.devices.shape
    for name, n in (("nc", nc), ("pm_nc", pm_nc)):
        if n % px or n % py:
            raise ValueError(f"{name} = {n} is not divisible by the mesh shape {(px, py)}")
    block = min(nc // px if px > 1 else nc, nc // py if py > 1 else nc)
    return mesh, NamedSharding(mesh, P(*mesh.axis_names)), block


class PMSetup(NamedTuple):
    """The static choices of one :func:`run_simulation`: grids, painting halos (PM grid:
    ``halo_size``; 2LPT on the particle lattice: ``lpt_halo``), layout, and the engine
    (``"jaxpm"``: JaxPM's displacement mode; ``"jaxpm_absolute"``: its absolute-position
    mode on one device; ``"refined"``: :func:`refined_pm_ode`)."""

    nc: int
    pm_nc: int
    box: float
    a_init: float
    lpt_order: int
    halo_size: int
    lpt_halo: int
    sharding: Any
    mesh: Any
    engine: str

    def linear_field(self, seed, initial_field, omega_c: float, sigma8: float):
        """The Gaussian linear field drawn from ``seed``, or ``initial_field`` laid out
        like it."""
        import jax
        import jax.numpy as jnp
        import jax_cosmo as jc
        from jaxpm.kernels import interpolate_power_spectrum
        from jaxpm.pm import linear_field

        if initial_field is not None:
            return (
                initial_field
                if self.sharding is None
                else jax.lax.with_sharding_constraint(initial_field, self.sharding)
            )
        # A Cosmology object of its own: jax_cosmo caches its background in the object, and
        # sharing one between the power spectrum and lpt fails (KeyError: 'h').
        k = jnp.logspace(-4, 1, 128)
        pk = jc.power.linear_matter_power(jc.Planck15(Omega_c=omega_c, sigma8=sigma8), k)
        pk_fn = lambda x: interpolate_power_spectrum(x, k, pk, self.sharding)  # noqa: E731
        return linear_field(
            (self.nc,) * 3,
            [self.box] * 3,
            pk_fn,
            seed=jax.random.PRNGKey(seed),
            sharding=self.sharding,
        )

    def initial_state(self, cosmo, field):
        """``(y0, ode)``: the LPT state at ``a_init`` (stacked ``(2, nc, nc, nc, 3)``) in
        the engine's units, and its ``diffrax.ODETerm``."""
        import diffrax
        import jax.numpy as jnp
        from jaxpm.distributed import uniform_particles
        from jaxpm.pm import lpt, make_diffrax_ode

        mesh_shape = (self.nc,) * 3
        if self.engine == "jaxpm":
            dx, p, _ = lpt(
                cosmo,
                field,
                a=self.a_init,
                order=self.lpt_order,
                halo_size=self.halo_size,
                sharding=self.sharding,
            )
            return jnp.stack([dx, p], axis=0), diffrax.ODETerm(
                make_diffrax_ode(
                    mesh_shape,
                    paint_absolute_pos=False,
                    halo_size=self.halo_size,
                    sharding=self.sharding,
                )
            )
        if self.engine == "jaxpm_absolute":
            q = uniform_particles(mesh_shape).astype(field.dtype)
            dx, p, _ = lpt(cosmo, field, q, a=self.a_init, order=self.lpt_order)
            return (
                jnp.stack([q + dx, p], axis=0),
                diffrax.ODETerm(make_diffrax_ode(mesh_shape, paint_absolute_pos=True)),
            )
        # 2LPT on the particle lattice (JaxPM's displacement mode), then PM cells
        dx, p, _ = lpt(
            cosmo,
            field,
            a=self.a_init,
            order=self.lpt_order,
            halo_size=self.lpt_halo,
            sharding=self.sharding,
        )
        q = uniform_particles(mesh_shape, self.sharding).astype(dx.dtype)
        factor = jnp.asarray(self.pm_nc / self.nc, dx.dtype)
        return (
            jnp.stack([factor * (q + dx), factor * p], axis=0),
            diffrax.ODETerm(
                refined_pm_ode(
                    self.nc, self.pm_nc, halo_size=self.halo_size, sharding=self.sharding
                )
            ),
        )
