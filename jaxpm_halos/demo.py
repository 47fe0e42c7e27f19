"""The main job: a distributed JaxPM run with in-situ halo finding and kNN density.

Run it with::

    python -m jaxpm_halos.demo [--nc 64] [--box 128] [--steps 20] [--snapshots 0.5,1.0]
        [--mesh 2,4] [--pm-factor 2] [--no-m200m] [--centre peak] [--b 0.2] [--min-members 20]
        [--k 16] [--out halos_out]

On a machine with only a CPU, the run is spread over 8 XLA host devices (a ``(2, 4)``
mesh) unless ``XLA_FLAGS`` already chooses a device count; otherwise it uses all local
devices. The simulation follows JaxPM's distributed recipe: a linear field, 2LPT to
``a = 0.1``, then ``--steps`` PM steps with diffrax's ``LeapfrogMidpoint`` (with diffrax's
text progress meter) to the last snapshot, on a PM grid of ``--pm-factor`` cells per
particle spacing (:func:`refined_pm_ode` when above 1). At each snapshot, inside the jitted solve
(``diffrax.SaveAt(ts=snapshots, fn=...)``), :class:`jaxpm_halos.extension.InSitu` runs FoF
(``--b``, ``--min-members``) and the kNN density (``--k``) on the sharded state.

At the end it prints, per snapshot, the number of halos, the largest masses (Msun/h), the
median kNN density, and the time of the analyses against one PM step: the compiled solve
is run again with the analyses switched off by a traced flag (``lax.cond``), and once per
snapshot with them on at that snapshot only (``--timing``). It writes one HDF5 catalogue
per snapshot (``halos_a1.0000.h5``, see :mod:`jaxpm_halos.io`), ``mass_function.png``
(FoF masses against the Watson et al. 2013 FoF fit and, unless ``--no-m200m``, beside
them the in-situ spherical-overdensity M200m of the same haloes, about their density peaks or
centres of mass (``--centre``), against Tinker et al. 2008) and
``density_slice.png`` to ``--out``, and prints the counts above 100 particles against
the fits.

:func:`run_simulation` is the reusable part: in-situ analyses plug in as ``saveat_fn``,
which diffrax evaluates inside the jitted solve at each requested scale factor.

This module imports jaxpm, jaxdecomp, jax_cosmo and diffrax; ``import jaxpm_halos`` does not.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import io
import math
import os
import sys
import time
import warnings
from typing import Any, Callable, NamedTuple, Sequence

HOST_DEVICES = 8
PM_FACTOR = 2  # the demo's default --pm-factor (README: Demo)


def use_host_devices(n: int = HOST_DEVICES) -> None:
    """Ask XLA for ``n`` host (CPU) devices, unless ``XLA_FLAGS`` already sets a count.

    Must run before jax initialises its backends (importing jax is fine; creating an array
    or listing devices is not). It only affects the CPU platform: on a GPU machine the GPU
    stays the default backend.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


@dataclasses.dataclass
class SimulationResult:
    """What :func:`run_simulation` returns.

    Attributes:
      state: the final diffrax state at ``a = a_final``: ``(2, nc, nc, nc, 3)``, sharded over
        the mesh: displacement (lattice cells) and momentum (lattice units), or with
        ``paint_absolute_pos`` absolute position and momentum in PM cells (``pm_nc`` per
        side; see :func:`run_simulation`).
      snapshots: the scale factors at which ``saved`` was taken (may be empty).
      saved: ``saveat_fn``'s outputs stacked over ``snapshots`` (the states themselves if
        ``saveat_fn`` is None), or None if no snapshots were requested.
      a_final: the final scale factor.
      mesh: the device mesh (None for a single device).
      sharding: the ``NamedSharding`` of the ``(nc, nc, nc, ...)`` grids, or None.
      box_size, nc, omega_m: the run's parameters (``omega_m = Omega_c + Omega_b``).
      halo_size: the painting halo, in PM cells.
      pm_nc, paint_absolute_pos: the PM grid's cells per side and the state's mode; pass
        both to :class:`jaxpm_halos.InSitu` and :func:`jaxpm_halos.from_jaxpm`.
      compile_s, run_s: seconds spent compiling and running the jitted simulation.
      rerun: ``rerun(saveat_inputs) -> (state, saved, seconds)`` runs the compiled
        simulation again (same seed and initial field) with other ``saveat_inputs``.
      compiled: the compiled simulation (``jax.stages.Compiled``; ``.as_text()`` is its
        optimised HLO).
    """

    state: Any
    snapshots: tuple
    saved: Any
    a_final: float
    mesh: Any
    sharding: Any
    box_size: float
    nc: int
    omega_m: float
    halo_size: int
    compile_s: float
    run_s: float
    rerun: Callable = dataclasses.field(default=None, repr=False)
    compiled: Any = dataclasses.field(default=None, repr=False)
    pm_nc: int | None = None
    paint_absolute_pos: bool = False


def run_simulation(nc: int, box: float, steps: int, snapshots: Sequence[float] = (), mesh=None,
                   saveat_fn: Callable | None = None, *, seed: int = 0, a_init: float = 0.1,
                   a_final: float = 1.0, omega_c: float = 0.25, sigma8: float = 0.8,
                   lpt_order: int = 2, halo_size: int | None = None,
                   progress: bool = False, initial_field=None,
                   saveat_inputs=None, pm_nc: int | None = None,
                   paint_absolute_pos: bool | None = None) -> SimulationResult:
    """Run a JaxPM particle-mesh simulation of ``nc**3`` particles in a box of side ``box`` Mpc/h.

    Initial conditions: a Gaussian linear field for ``jax_cosmo.Planck15(Omega_c=omega_c,
    sigma8=sigma8)``, displaced with LPT of order ``lpt_order`` at ``a_init``. The PM
    integration takes ``steps`` equal steps in ``a`` up to ``a_final`` with diffrax's
    ``LeapfrogMidpoint``. Everything runs in one ``jit``.

    The PM grid: by default it is the particle lattice (``pm_nc = nc``) and the state holds
    JaxPM's displacements (``make_diffrax_ode(paint_absolute_pos=False)``, distributed).
    With ``pm_nc`` other than ``nc`` (e.g. ``2 * nc``: 8 PM cells per particle) the state
    holds absolute positions and momenta in PM cells, and the forces come from
    :func:`refined_pm_ode`, this module's PM step on the finer grid (JaxPM 0.1.6 cannot do
    it: its absolute-position ``cic_paint``/``cic_read`` reshape the particles to the mesh
    shape, so ``pm_nc != nc`` fails with a ``TypeError``, and on a device mesh they index
    the local block with global positions: 5 cells off a single-device run after 5 steps
    at 16^3). The initial conditions are the same in both cases: the linear field on the
    particle lattice and JaxPM's 2LPT there, converted to PM cells (``x = (pm_nc / nc)
    (q + dx)``, ``p_pm = (pm_nc / nc) p``), so a finer mesh changes only the forces.

    Args:
      nc: particles per side.
      box: box side in Mpc/h.
      steps: number of PM steps.
      snapshots: scale factors in ``[a_init, a_final]`` at which to evaluate ``saveat_fn``.
      mesh: a 2D ``jax.sharding.Mesh`` with Auto axes (its two axes split the grid's x and y,
        in that order; names are taken from the mesh), or None to run on one device.
      saveat_fn: ``fn(a, y, cosmo) -> pytree`` run inside the solve at each snapshot, where
        ``y`` is the stacked ``(2, nc, nc, nc, 3)`` state; e.g.
        ``lambda a, y, cosmo: jaxpm_halos.from_jaxpm(y, box_size=box).pos``. None saves ``y``.
        An :class:`~jaxpm_halos.InSitu` here is called as ``insitu(y, a, times=snapshots)``
        (``a`` is traced), so that its SO thresholds are ``fof``'s at those times; it takes
        no ``saveat_inputs`` (:func:`switchable_saveat_fn` wraps one that does).
      seed: seed of the initial conditions.
      halo_size: the painting halo in PM cells (see :func:`default_halo_size`).
      progress: show diffrax's text progress meter during the solve.
      initial_field: optional ``(nc, nc, nc)`` linear density field to start from instead
        of drawing one from ``seed``. JaxPM draws different random numbers on different
        meshes, so this is how to compare runs on different meshes.
      saveat_inputs: optional pytree of arrays passed to the jitted solve as arguments and
        to ``saveat_fn`` as a fourth argument, ``saveat_fn(a, y, cosmo, saveat_inputs)``.
        :meth:`SimulationResult.rerun` runs the same compiled program again with other
        values (e.g. flags switching analyses on and off) without recompiling.
      pm_nc: PM grid cells per side (default ``nc``); divisible by the mesh shape.
      paint_absolute_pos: the state's mode. Default: absolute positions exactly when
        ``pm_nc != nc``. ``True`` with ``pm_nc == nc`` runs JaxPM's own absolute-position
        ODE (``make_diffrax_ode(paint_absolute_pos=True)``, ``lpt(..., particles)``) on one
        device, and :func:`refined_pm_ode` on a device mesh. ``False`` needs ``pm_nc == nc``.

    Raises:
      ValueError: on a mesh that is not 2D, ``nc`` or ``pm_nc`` not divisible by the mesh
        shape, ``pm_nc`` not a positive integer or given with ``paint_absolute_pos=False``,
        snapshots outside ``[a_init, a_final]``, a bad ``initial_field`` shape.
    """
    import jax
    import jax.numpy as jnp
    import jax_cosmo as jc

    from .insitu.jaxpm import resolve_pm_nc

    mesh_shape = (nc, nc, nc)
    if paint_absolute_pos is None:
        paint_absolute_pos = pm_nc is not None and pm_nc != nc
    pm_nc = resolve_pm_nc(nc, pm_nc, paint_absolute_pos)
    mesh, sharding, block = _distribution(mesh, nc, pm_nc)
    if halo_size is None:
        halo_size = default_halo_size(pm_nc, box, block * pm_nc // nc)
    pm = _PMSetup(nc, pm_nc, box, a_init, lpt_order, halo_size, default_halo_size(nc, box, block),
                  sharding, mesh,
                  "jaxpm" if not paint_absolute_pos else
                  "jaxpm_absolute" if pm_nc == nc and sharding is None else "refined")
    snapshots = tuple(float(a) for a in snapshots)
    if any(not a_init <= a <= a_final for a in snapshots):
        raise ValueError(f"snapshots {snapshots} must lie in [{a_init}, {a_final}]")
    omega_m = omega_c + float(jc.Planck15().Omega_b)
    saveat_fn = _saveat_of(saveat_fn, snapshots, saveat_inputs)

    def simulate(seed, initial_field, saveat_inputs):
        cosmo = jc.Planck15(Omega_c=omega_c, sigma8=sigma8)
        field = pm.linear_field(seed, initial_field, omega_c, sigma8)
        y0, ode = pm.initial_state(cosmo, field)
        return _solve(pm, ode, y0, cosmo, a_final, steps, snapshots, saveat_fn, saveat_inputs,
                      progress)

    t = time.perf_counter()
    with warnings.catch_warnings():
        # jax_cosmo's growth ODE asks for int64 indices, which jax truncates to int32.
        warnings.filterwarnings("ignore", "Explicitly requested dtype.*int64", UserWarning)
        # diffrax fills its output buffers with inf; integer outputs of saveat_fn (ids,
        # labels) make numpy warn about that cast. The buffers are overwritten.
        warnings.filterwarnings("ignore", "invalid value encountered in cast", RuntimeWarning)
        if initial_field is not None:
            initial_field = jnp.asarray(initial_field, jnp.float32)
            if initial_field.shape != mesh_shape:
                raise ValueError(f"initial_field must have shape {mesh_shape}")
            if sharding is not None:
                initial_field = jax.device_put(initial_field, sharding)
        if saveat_inputs is not None and saveat_fn is None:
            raise ValueError("saveat_inputs needs a saveat_fn")
        compiled = jax.jit(simulate).lower(seed, initial_field, saveat_inputs).compile()
    compile_s = time.perf_counter() - t

    def rerun(inputs=saveat_inputs):
        t = time.perf_counter()
        final, saved, ok = jax.block_until_ready(compiled(seed, initial_field, inputs))
        seconds = time.perf_counter() - t
        if not bool(ok):
            raise RuntimeError("the diffrax solve did not finish successfully")
        return final, saved, seconds

    final, saved, run_s = rerun()
    return SimulationResult(final, snapshots, saved, a_final, mesh, sharding, float(box), nc,
                            omega_m, halo_size, compile_s, run_s, rerun, compiled,
                            pm_nc=pm_nc, paint_absolute_pos=bool(paint_absolute_pos))


def _distribution(mesh, nc: int, pm_nc: int):
    """``(mesh, sharding, block)``: the mesh (None for one device), the sharding of the
    ``(nc, nc, nc, ...)`` grids and the smallest lattice block side of a device."""
    from jax.sharding import NamedSharding, PartitionSpec as P

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


class _PMSetup(NamedTuple):
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
            return (initial_field if self.sharding is None
                    else jax.lax.with_sharding_constraint(initial_field, self.sharding))
        # A Cosmology object of its own: jax_cosmo caches its background in the object, and
        # sharing one between the power spectrum and lpt fails (KeyError: 'h').
        k = jnp.logspace(-4, 1, 128)
        pk = jc.power.linear_matter_power(jc.Planck15(Omega_c=omega_c, sigma8=sigma8), k)
        pk_fn = lambda x: interpolate_power_spectrum(x, k, pk, self.sharding)  # noqa: E731
        return linear_field((self.nc,) * 3, [self.box] * 3, pk_fn, seed=jax.random.PRNGKey(seed),
                            sharding=self.sharding)

    def initial_state(self, cosmo, field):
        """``(y0, ode)``: the LPT state at ``a_init`` (stacked ``(2, nc, nc, nc, 3)``) in
        the engine's units, and its ``diffrax.ODETerm``."""
        import diffrax
        import jax.numpy as jnp
        from jaxpm.distributed import uniform_particles
        from jaxpm.pm import lpt, make_diffrax_ode

        mesh_shape = (self.nc,) * 3
        if self.engine == "jaxpm":
            dx, p, _ = lpt(cosmo, field, a=self.a_init, order=self.lpt_order,
                           halo_size=self.halo_size, sharding=self.sharding)
            return jnp.stack([dx, p], axis=0), diffrax.ODETerm(make_diffrax_ode(
                mesh_shape, paint_absolute_pos=False, halo_size=self.halo_size,
                sharding=self.sharding))
        if self.engine == "jaxpm_absolute":
            q = uniform_particles(mesh_shape).astype(field.dtype)
            dx, p, _ = lpt(cosmo, field, q, a=self.a_init, order=self.lpt_order)
            return (jnp.stack([q + dx, p], axis=0),
                    diffrax.ODETerm(make_diffrax_ode(mesh_shape, paint_absolute_pos=True)))
        # 2LPT on the particle lattice (JaxPM's displacement mode), then PM cells
        dx, p, _ = lpt(cosmo, field, a=self.a_init, order=self.lpt_order,
                       halo_size=self.lpt_halo, sharding=self.sharding)
        q = uniform_particles(mesh_shape, self.sharding).astype(dx.dtype)
        factor = jnp.asarray(self.pm_nc / self.nc, dx.dtype)
        return (jnp.stack([factor * (q + dx), factor * p], axis=0),
                diffrax.ODETerm(refined_pm_ode(self.nc, self.pm_nc, halo_size=self.halo_size,
                                               sharding=self.sharding)))


def _saveat_of(saveat_fn, snapshots: tuple, saveat_inputs):
    """``saveat_fn`` as diffrax calls it, ``fn(a, y, cosmo[, inputs])``: an
    :class:`~jaxpm_halos.InSitu` takes the state first and the save times."""
    from .insitu import InSitu

    if not isinstance(saveat_fn, InSitu):
        return saveat_fn
    if saveat_inputs is not None:
        raise ValueError("an InSitu saveat_fn takes no saveat_inputs; to switch its analyses "
                         "on and off pass saveat_fn=switchable_saveat_fn(insitu, snapshots)")
    insitu = saveat_fn
    return lambda a, y, cosmo: insitu(y, a, times=snapshots)  # noqa: E731


def _solve(pm: _PMSetup, ode, y0, cosmo, a_final: float, steps: int, snapshots: tuple,
           saveat_fn, saveat_inputs, progress: bool):
    """``(final state, saved, ok)``: ``steps`` equal LeapfrogMidpoint steps in ``a`` from
    ``y0``, with ``saveat_fn`` (or the state) at ``snapshots``."""
    import diffrax
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    subs = [diffrax.SubSaveAt(t1=True)]
    if snapshots:
        fn = saveat_fn or _identity
        if saveat_inputs is not None:
            fn = lambda t, y, args: saveat_fn(t, y, args, saveat_inputs)  # noqa: E731
        subs.append(diffrax.SubSaveAt(ts=jnp.asarray(snapshots), fn=_pinned(fn)))
    sol = diffrax.diffeqsolve(
        ode, diffrax.LeapfrogMidpoint(), t0=pm.a_init, t1=a_final, dt0=None,
        y0=y0, args=cosmo, saveat=diffrax.SaveAt(subs=subs),
        stepsize_controller=diffrax.StepTo(ts=jnp.linspace(pm.a_init, a_final, steps + 1)),
        max_steps=steps,
        # throw=True would route the whole solution through an equinox error check, a
        # host callback on device 0: the state gets gathered there and comes back
        # replicated. Check the result ourselves instead.
        throw=False,
        progress_meter=diffrax.TextProgressMeter() if progress else diffrax.NoProgressMeter())
    final, saved = sol.ys[0][0], (sol.ys[1] if snapshots else None)
    if pm.sharding is not None:
        # Keep JaxPM's layout: left alone, XLA may replicate the outputs.
        axes = pm.mesh.axis_names
        final = jax.lax.with_sharding_constraint(final, NamedSharding(pm.mesh, P(None, *axes)))
        if snapshots and saveat_fn is None:
            saved = jax.lax.with_sharding_constraint(
                saved, NamedSharding(pm.mesh, P(None, None, *axes)))
    return final, saved, sol.result == diffrax.RESULTS.successful


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
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jaxpm.distributed import (autoshmap, fft3d, get_halo_size, halo_exchange, ifft3d,
                                   slice_pad, slice_unpad)
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
        return autoshmap(local_read, gpu_mesh=mesh, in_specs=(spec, spec),
                         out_specs=spec)(grid, pos)

    def ode(a, state, cosmo):
        pos, mom = state[0], state[1]
        delta_k = fft3d(paint(pos))
        kvec = fftk(delta_k)
        pot_k = delta_k * invlaplace_kernel(kvec) * longrange_kernel(kvec, r_split=0)
        forces = jnp.stack([read(ifft3d(-gradient_kernel(kvec, i) * pot_k), pos)
                            for i in range(3)], axis=-1) * 1.5 * cosmo.Omega_m
        e = jnp.sqrt(jc.background.Esqr(cosmo, a))
        return jnp.stack([mom / (a ** 3 * e), forces / (a ** 2 * e)])

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


def _identity(t, y, args):
    return y


def _pinned(fn):
    """``fn`` reading the state through :func:`jaxpm_halos.insitu.saveloop.pin_to_save_loop`:
    with one snapshot, XLA would otherwise hoist ``fn`` out of diffrax's save loop and run
    it at every PM step. Analyses are not compiled a second time for diffrax's ``t0 == t1``
    case (``skip_no_step_save``)."""
    from .insitu.saveloop import pin_to_save_loop, skip_no_step_save

    return skip_no_step_save(lambda t, y, args: fn(t, pin_to_save_loop(y), args))


def default_mesh_shape(n_devices: int) -> tuple[int, int]:
    """The most square ``(px, py)`` with ``px <= py`` and ``px * py == n_devices``."""
    px = max(d for d in range(1, math.isqrt(n_devices) + 1) if n_devices % d == 0)
    return px, n_devices // px


def describe_layout(particles, a=None) -> dict:
    """Where the particles of :func:`jaxpm_halos.from_jaxpm`'s output live.

    Returns (and the demo prints) the mesh, the sharding, the per-device block shapes, the
    position range, the fraction of particles whose position lies outside the lattice
    block of the device that holds them (JaxPM never moves particles between devices), and
    how far (in cells) the farthest of them strays from that block.
    """
    import numpy as np

    nc = particles.pos.shape[0]
    box = particles.box_size
    sharding = particles.pos.sharding
    blocks, outside, total, stray = [], 0, 0, 0.0
    for shard in sorted(particles.pos.addressable_shards, key=lambda s: s.device.id):
        pos = np.asarray(shard.data, np.float64) * (nc / box)  # in cells, [0, nc)
        lattice = [(sl.start or 0, nc if sl.stop is None else sl.stop) for sl in shard.index[:3]]
        inside = np.ones(pos.shape[:-1], bool)
        for dim, (lo, hi) in enumerate(lattice):
            if hi - lo == nc:
                continue
            c = pos[..., dim]
            ok = (c >= lo) & (c < hi)
            # periodic distance from c to the block [lo, hi)
            dist = np.where(ok, 0.0, np.minimum(np.mod(lo - c, nc), np.mod(c - hi, nc)))
            stray = max(stray, float(dist.max()))
            inside &= ok
        out = int(np.count_nonzero(~inside))
        blocks.append(dict(device=shard.device.id, block=list(pos.shape[:-1]),
                           lattice=[list(v) for v in lattice], outside_fraction=out / inside.size))
        outside += out
        total += inside.size
    pos = particles.pos
    mesh = getattr(sharding, "mesh", None)
    return dict(
        nc=nc, box_size=box, a=a, particles=int(particles.num),
        mesh=None if mesh is None else dict(mesh.shape),
        sharding=str(getattr(sharding, "spec", sharding)),
        pos_min=[float(v) for v in pos.min(axis=(0, 1, 2))],
        pos_max=[float(v) for v in pos.max(axis=(0, 1, 2))],
        devices=blocks, outside_fraction=outside / total, max_stray_cells=stray)


def demo_cosmology(omega_c: float = 0.25, sigma8: float = 0.8) -> dict:
    """The parameters of ``jax_cosmo.Planck15(Omega_c=omega_c, sigma8=sigma8)``, the
    cosmology of :func:`run_simulation`, as a dict of floats."""
    import jax_cosmo as jc

    cosmo = jc.Planck15(Omega_c=omega_c, sigma8=sigma8)
    return {k: float(getattr(cosmo, k)) for k in
            ("Omega_c", "Omega_b", "h", "n_s", "sigma8", "Omega_k", "w0", "wa")}


def switchable_saveat_fn(insitu, snapshots):
    """``saveat_fn(a, y, cosmo, on)`` for :func:`run_simulation`: runs
    ``insitu(y, a, times=snapshots)`` at snapshot ``i`` when the traced flag ``on[i]`` is true, and returns zeros of the same
    structure (skipping the analyses, through ``lax.cond``) when it is false.

    The same compiled solve then runs with the analyses on or off, which is how the demo
    times the analyses against the PM steps without compiling twice.
    """
    import jax
    import jax.numpy as jnp

    if len(set(map(float, snapshots))) < len(snapshots):
        # A flag is picked by the nearest save time: a repeated one could not be told apart.
        raise ValueError(f"switchable_saveat_fn: snapshots {list(snapshots)} repeat a time")
    ts = jnp.asarray(snapshots)

    def fn(a, y, cosmo, on):
        run = lambda: insitu(y, a, times=snapshots)  # noqa: E731
        shapes = jax.eval_shape(run)
        off = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)  # noqa: E731
        return jax.lax.cond(on[jnp.argmin(jnp.abs(ts - a))], run, off)

    return fn


def _host(x):
    """A (possibly multi-process) global array as numpy on every process."""
    import numpy as np

    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jaxpm_halos.demo",
        description="A distributed JaxPM run with in-situ FoF halo finding and kNN density "
                    "(jaxpm_halos.InSitu inside diffrax's jitted solve). Writes one HDF5 halo "
                    "catalogue per snapshot, a mass function plot and a density slice.")
    parser.add_argument("--nc", type=int, default=64, help="particles per side (default 64)")
    parser.add_argument("--box", type=float, default=128.0, help="box side in Mpc/h (default 128)")
    parser.add_argument("--steps", type=int, default=20,
                        help="PM steps from a=0.1 to the last snapshot (default 20)")
    parser.add_argument("--snapshots", default="0.5,1.0",
                        help="scale factors of the in-situ snapshots; the run ends at the last "
                             "(default 0.5,1.0)")
    parser.add_argument("--mesh", default=None,
                        help="device mesh 'px,py' (default: all devices, e.g. 2,4 for 8 CPU devices)")
    parser.add_argument("--pm-factor", type=int, default=PM_FACTOR,
                        help="PM grid cells per particle spacing along each axis: the PM grid "
                             "has (pm-factor * nc)^3 cells (default %(default)s; 1 is JaxPM's "
                             "own displacement mode, >1 the demo's refined_pm_ode)")
    parser.add_argument("--m200m", action=argparse.BooleanOptionalAction, default=None,
                        help="measure the spherical-overdensity M200m of every FoF halo in "
                             "situ (InSitu(so=('200m',))) and plot it against Tinker et al. "
                             "2008 beside the FoF masses (default on when --analyses holds "
                             "fof; --no-m200m skips it)")
    parser.add_argument("--centre", choices=("peak", "com"), default="peak",
                        help="SO centre with --m200m: the member with the highest kNN density "
                             "(peak) or the centre of mass (com) (default peak)")
    parser.add_argument("--b", type=float, default=0.2,
                        help="FoF linking length in mean particle separations (default 0.2)")
    parser.add_argument("--min-members", type=int, default=20,
                        help="smallest FoF group in the catalogues (default 20)")
    parser.add_argument("--max-halos", type=int, default=None,
                        help="catalogue rows per device (FoFConfig.max_halos; default "
                             "max(1024, particles per device / 16)); a small --min-members "
                             "may need more")
    parser.add_argument("--buffers", action="append", default=[], metavar="FIELD=CONFIG",
                        help="an InSitu buffer setting as a capacity error spells it, e.g. "
                             "'domain=DomainConfig(capacity_factor=3.0)' (fields domain, fof, "
                             "knn); may be repeated")
    parser.add_argument("--k", type=int, default=16, help="neighbours for the kNN density (default 16)")
    parser.add_argument("--analyses", default="fof,knn_density",
                        help="registered analyses to run in situ (default fof,knn_density)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timing", choices=("snapshot", "total", "none"), default="snapshot",
                        help="time the analyses per snapshot (one more solve per snapshot), in "
                             "total (one more solve, analyses off), or not at all "
                             "(default snapshot)")
    parser.add_argument("--out", default="halos_out",
                        help="output folder for the catalogues and plots (default halos_out)")
    return parser


def _parse_args(argv):
    """The command line: ``(parser, args, snapshots (sorted), pm_nc)``."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        snapshots = sorted(float(v) for v in args.snapshots.split(","))
    except ValueError:
        parser.error(f"--snapshots must be comma-separated scale factors, got {args.snapshots!r}")
    if not snapshots or snapshots[0] <= 0.1 or snapshots[-1] > 1.0:
        parser.error(f"--snapshots must lie in (0.1, 1], got {args.snapshots}")
    if len(set(snapshots)) < len(snapshots):
        parser.error(f"--snapshots repeats a scale factor, got {args.snapshots}")
    for flag in ("nc", "steps", "pm_factor", "min_members", "max_halos"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be a positive integer, got "
                         f"{getattr(args, flag)}")
    if args.k < 2:  # the kNN density (and the peak) count k - 1 neighbours in the ball
        parser.error(f"--k must be at least 2, got {args.k}")
    for flag in ("box", "b"):
        if not 0 < getattr(args, flag) < math.inf:
            parser.error(f"--{flag} must be positive and finite, got {getattr(args, flag)}")
    if args.mesh is not None:
        try:
            args.mesh = tuple(int(v) for v in args.mesh.split(","))
        except ValueError:
            parser.error(f"--mesh must be two integers 'px,py', got {args.mesh!r}")
        if len(args.mesh) != 2 or min(args.mesh) < 1:
            parser.error(f"--mesh must be two positive integers 'px,py', got {args.mesh}")
    try:
        args.buffers = _parse_buffers(args.buffers)
    except (ValueError, TypeError, SyntaxError) as error:
        parser.error(f"--buffers: {error}")
    with_fof = "fof" in args.analyses.split(",")
    if args.m200m and not with_fof:
        parser.error("--m200m measures the FoF haloes: add fof to --analyses, or pass "
                     "--no-m200m")
    args.m200m = with_fof if args.m200m is None else args.m200m
    return parser, args, snapshots, args.pm_factor * args.nc


def _parse_buffers(values: Sequence[str]) -> dict:
    """``--buffers`` values, ``"field=Config(knob=value, ...)"`` as a capacity error spells
    an ``InSitu`` keyword, as ``{field: config}``. Only config classes and literal values
    are read (nothing is evaluated)."""
    from .core import config as _config

    classes = {cls.__name__: cls for cls in (_config.DomainConfig, _config.FoFConfig,
                                             _config.KNNConfig, _config.SOConfig)}
    fields = {"domain": _config.DomainConfig, "fof": _config.FoFConfig,
              "knn": _config.KNNConfig}

    def build(node):
        if not isinstance(node, ast.Call):
            return ast.literal_eval(node)
        if not isinstance(node.func, ast.Name) or node.func.id not in classes or node.args:
            raise ValueError(f"expected one of {sorted(classes)} with keyword arguments, got "
                             f"{ast.unparse(node)!r}")
        return classes[node.func.id](**{kw.arg: build(kw.value) for kw in node.keywords})

    buffers = {}
    for value in values:
        field, _, text = value.partition("=")
        field = field.strip()
        if field not in fields:
            raise ValueError(f"{value!r} must start with one of {sorted(fields)} and '='")
        config = build(ast.parse(text.strip(), mode="eval").body)
        if type(config) is not fields[field]:
            raise ValueError(f"{field}= takes a {fields[field].__name__}, got {text.strip()!r}")
        buffers[field] = config
    return buffers


def _rerun_hint(failure, insitu) -> str:
    """What to pass the demo for a capacity ``failure`` of its in-situ run: ``--max-halos``
    for the catalogue's rows, else ``--buffers`` with the whole grown config, beside those
    of the other configs the run changed ('' when no setting fits)."""
    from .core.config import MAX_HALOS
    from .core.status import spell_config
    from .insitu.errors import changed_configs, insitu_config

    if failure.beyond_bound:
        return ""
    settings = failure.settings()
    if list(settings) == [MAX_HALOS]:
        return f" Here: rerun with --max-halos {settings[MAX_HALOS]}"
    attr, config = insitu_config(failure, insitu)
    # with the other configs this run changed, so that an earlier fix is not dropped
    buffers = {**changed_configs(insitu), attr: f"{attr}={spell_config(failure.grown(config))}"}
    return " Here: rerun with " + " ".join(f"--buffers '{b}'" for b in buffers.values())


def main(argv=None) -> int:
    parser, args, snapshots, pm_nc = _parse_args(argv)
    t_start = time.perf_counter()
    use_host_devices()
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType

    from . import units
    from .core.config import DomainConfig, FoFConfig, KNNConfig
    from .core.status import CapacityError
    from .insitu import REGISTRY, InSitu, check

    analyses = tuple(a for a in args.analyses.split(",") if a)
    if "knn_density" in analyses and "knn_density" not in REGISTRY:
        print("note: the knn_density analysis is not registered in this version; running "
              f"{[a for a in analyses if a != 'knn_density']}", flush=True)
        analyses = tuple(a for a in analyses if a != "knn_density")
    devices = jax.devices()
    shape = args.mesh or default_mesh_shape(len(devices))
    if math.prod(shape) > len(devices):
        parser.error(f"--mesh {shape} needs at most {len(devices)} devices")
    mesh = jax.make_mesh(shape, ("x", "y"), axis_types=(AxisType.Auto, AxisType.Auto),
                         devices=devices[:math.prod(shape)])
    cosmology = demo_cosmology()
    omega_m = cosmology["Omega_c"] + cosmology["Omega_b"]
    mass = units.particle_mass(omega_m, args.box, args.nc)
    fof = args.buffers.get("fof", FoFConfig())
    if args.max_halos is not None:
        fof = dataclasses.replace(fof, max_halos=args.max_halos)
    insitu = InSitu(box_size=args.box, analyses=analyses, b=args.b, min_members=args.min_members,
                    k=args.k, omega_m=omega_m, overdensity=True,
                    paint_absolute_pos=pm_nc != args.nc, pm_nc=pm_nc,
                    so=("200m",) if args.m200m else (),
                    centre=args.centre if args.m200m else "com",
                    domain=args.buffers.get("domain", DomainConfig()),
                    knn=args.buffers.get("knn", KNNConfig()), fof=fof)
    lead = jax.process_index() == 0
    say = (lambda *a, **k: print(*a, **k, flush=True)) if lead else (lambda *a, **k: None)
    say(f"jaxpm_halos demo: {args.nc}^3 particles ({mass:.3g} Msun/h each), box {args.box:g} "
        f"Mpc/h, {args.steps} PM steps to a = {snapshots[-1]:g}, in-situ {list(analyses)} at "
        f"a = {snapshots} (b = {args.b:g}, >= {args.min_members} members, k = {args.k}), PM grid "
        f"{pm_nc}^3 ({args.box / pm_nc:g} Mpc/h cells"
        + (", JaxPM displacement mode" if pm_nc == args.nc else ", absolute positions") +
        f"), mesh {dict(mesh.shape)} on {len(devices)} {devices[0].platform} devices")

    say("compiling the solve with the analyses inside (diffrax SaveAt fn) ...")
    result = run_simulation(args.nc, args.box, args.steps, snapshots, mesh=mesh,
                            saveat_fn=switchable_saveat_fn(insitu, snapshots), seed=args.seed,
                            a_final=snapshots[-1], progress=True,
                            saveat_inputs=jnp.ones(len(snapshots), bool), pm_nc=pm_nc)
    say(f"compiled in {result.compile_s:.1f} s; solve with in-situ analyses: {result.run_s:.2f} s")
    try:  # raises, naming the knob, if any buffer overflowed at any snapshot
        check(result.saved, insitu)
    except CapacityError as error:
        raise SystemExit(f"{error}{_rerun_hint(error.failure, insitu)}") from None
    t_off, t_snap = _time_analyses(result, args.timing, say)

    if lead:
        os.makedirs(args.out, exist_ok=True)
    catalogues = _write_catalogues(result.saved, snapshots, args, insitu, cosmology, mass,
                                   shape, pm_nc)
    rows = _snapshot_rows(result.saved, snapshots, catalogues, t_snap)
    if lead:
        _print_table(rows, t_off, args.steps, result.run_s, args.timing, args.k)
    _plot_final(result, catalogues[-1], snapshots[-1], args, cosmology, mass, pm_nc, lead)
    if lead:
        print(f"total wall time {time.perf_counter() - t_start:.1f} s")
    return 0


def _time_analyses(result: SimulationResult, timing: str, say):
    """``(t_off, t_snap)``: the compiled solve's time with the analyses off, and the
    analyses' time at each snapshot (``timing``: ``"snapshot"``, ``"total"`` or
    ``"none"``: None each)."""
    import jax.numpy as jnp

    n_snap = len(result.snapshots)
    if timing == "none":
        return None, [None] * n_snap
    say("timing: the same compiled solve with the analyses off"
        + (" and with them on at single snapshots" if timing == "snapshot" and n_snap > 1
           else "") + " ...")
    with contextlib.redirect_stdout(io.StringIO()):  # no more progress meters
        _, _, t_off = result.rerun(jnp.zeros(n_snap, bool))
        if timing == "total":
            return t_off, [(result.run_s - t_off) / n_snap] * n_snap
        # on at snapshot i alone, for all but the last; the last one by difference with the
        # main run (all on), which saves a solve
        t_snap = [result.rerun(jnp.arange(n_snap) == i)[2] - t_off for i in range(n_snap - 1)]
    return t_off, t_snap + [result.run_s - t_off - sum(t_snap)]


def _write_catalogues(saved, snapshots, args, insitu, cosmology: dict, mass: float, shape,
                      pm_nc: int):
    """The FoF catalogue of each snapshot (None without FoF), each written to
    ``halos_a{a:.4f}.h5`` in ``args.out``."""
    import numpy as np

    from .io.catalogue import gather_catalogue, write_catalogue

    if "fof" not in saved:
        return [None] * len(snapshots)
    catalogues = []
    for i, a in enumerate(snapshots):
        cat = gather_catalogue(saved["fof"]["catalogue"], snapshot=i)
        write_catalogue(os.path.join(args.out, f"halos_a{a:.4f}.h5"), cat, box_size=args.box,
                        nc=args.nc, a=a, cosmology=cosmology,
                        linking_length=insitu.b * args.box / args.nc, b=insitu.b,
                        min_members=insitu.min_members,
                        units=dict(saved["fof"]["catalogue"].units),
                        attrs=dict(particle_mass=mass, steps=args.steps, seed=args.seed,
                                   mesh=np.asarray(shape), pm_nc=pm_nc))
        catalogues.append(cat)
    return catalogues


def _snapshot_rows(saved, snapshots, catalogues, t_snap):
    """One row of the printed table per snapshot: halos, the three largest masses, the
    median kNN density over the mean and the analyses' time."""
    import numpy as np

    rows = []
    for i, (a, cat) in enumerate(zip(snapshots, catalogues)):
        row = {"a": a, "halos": None, "largest": [], "rho": None, "t": t_snap[i]}
        if cat is not None:
            row["halos"] = len(cat["id"])
            row["largest"] = np.sort(cat["mass"])[::-1][:3].tolist()
        if "knn_density" in saved:
            row["rho"] = float(np.median(_host(saved["knn_density"]["density"])[i] + 1))
        rows.append(row)
    return rows


def _plot_final(result: SimulationResult, final, a: float, args, cosmology: dict, mass: float,
                pm_nc: int, lead: bool):
    """The last snapshot's mass function (with the counts against the fits) and density
    slice, written to ``args.out`` (by the lead process, when there is a catalogue)."""
    from . import from_jaxpm

    particles = from_jaxpm(result.state, box_size=args.box, mass=mass,
                           paint_absolute_pos=result.paint_absolute_pos, pm_nc=result.pm_nc)
    pos = _host(particles.pos)  # every process takes part in the gather
    if not lead or final is None:
        return
    from .plots import plot_density_slice, plot_mass_function

    so_mass = final.get("m200m")
    mf = os.path.join(args.out, "mass_function.png")
    plot_mass_function(mf, final["mass"], box_size=args.box, cosmology=cosmology, a=a,
                       particle_mass=mass, min_members=args.min_members, so_mass=so_mass,
                       title=f"{args.nc}$^3$ particles, {args.box:g} Mpc/h, PM grid "
                             f"{pm_nc}$^3$, {args.steps} steps, a = {a:g}: in-situ FoF "
                             f"b = {args.b:g}")
    _print_fit_ratios(final["mass"], so_mass, args, cosmology, mass, a)
    sl = os.path.join(args.out, "density_slice.png")
    plot_density_slice(sl, pos, box_size=args.box, halo_pos=final["pos"],
                       halo_mass=final["mass"], bins=min(args.nc, 512),
                       title=f"a = {a:g}: projected density of z in [0, {args.box / 8:g}) "
                             f"Mpc/h, FoF halo centres")
    files = sorted(f for f in os.listdir(args.out) if f.startswith("halos_a"))
    print(f"wrote {', '.join(os.path.join(args.out, f) for f in files + [os.path.basename(mf), os.path.basename(sl)])}")


def _print_fit_ratios(fof_mass, so_mass, args, cosmology: dict, mass: float, a: float):
    """Halo counts below and above 100 particles against the Watson (FoF) and Tinker
    (M200m) fits."""
    from .plots import ratio_above

    print(f"\nhaloes at a = {a:g} against the fits (counts / expected, Poisson errors; "
          f"100 particles = {100 * mass:.3g} Msun/h):")
    for label, masses, fit in (("FoF   / Watson 2013", fof_mass, "watson13"),
                               ("M200m / Tinker 2008", so_mass, "tinker08")):
        if masses is None:
            continue
        for lo, hi in ((args.min_members, 100), (100, None)):
            r = ratio_above(masses, box_size=args.box, cosmology=cosmology, a=a, fit=fit,
                            min_mass=lo * mass, max_mass=None if hi is None else hi * mass,
                            particle_mass=mass)
            span = f"{lo}-{hi} particles" if hi else f">= {lo} particles"
            print(f"  {label}, {span:>16}: {r['count']:4d} / {r['expected']:6.1f} = "
                  f"{r['ratio']:.2f} +- {r['error']:.2f}")


def _print_table(rows, t_off, steps, t_on, timing, k):
    per_step = None if t_off is None else t_off / steps
    head = f"{'a':>5} {'z':>5} {'halos':>6}  {'largest masses [Msun/h]':<30}"
    if any(r["rho"] is not None for r in rows):
        head += f" {'median rho/rho_mean':>19}"  # over particles
    if per_step is not None:
        head += f" {'analyses [s]':>12} {'PM step [s]':>11} {'ratio':>6}"
    print()
    print(head)
    for r in rows:
        largest = ", ".join(f"{m:.2e}" for m in r["largest"]) or "-"
        line = f"{r['a']:5.3f} {1 / r['a'] - 1:5.2f} {r['halos'] if r['halos'] is not None else '-':>6}  {largest:<30}"
        if any(x["rho"] is not None for x in rows):
            line += f" {r['rho']:19.3f}" if r["rho"] is not None else f" {'-':>19}"
        if per_step is not None:
            line += f" {r['t']:12.2f} {per_step:11.3f} {r['t'] / per_step:6.1f}"
        print(line)
    if any(r["rho"] is not None for r in rows):
        print(f"median rho/rho_mean: the in-situ kNN density (k = {k}) over the mean density, "
              "median over particles (mass-weighted, hence above 1).")
    if per_step is not None:
        print(f"PM step: the solve with every analysis switched off ({t_off:.2f} s) / {steps} steps. "
              "Analyses: " + ("the solve with the analyses on at that snapshot only, minus the "
                              "solve with them off (the last snapshot: the solve with all on "
                              f"({t_on:.2f} s), minus the others)" if timing == "snapshot" else
                              f"(the solve with all on ({t_on:.2f} s) - the solve with all "
                              "off) / snapshots")
              + ". The same compiled program runs each time (a traced flag and lax.cond switch "
                "the analyses), so compilation is not counted.")


if __name__ == "__main__":
    sys.exit(main())
