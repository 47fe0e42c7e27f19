"""A small distributed JaxPM run whose final state is handed to jaxpm_halos.

Run it with::

    python -m jaxpm_halos.demo [--nc 64] [--box 128] [--steps 20] [--mesh 2,4] [--out halos_out]

On a machine with only a CPU, the run is spread over 8 XLA host devices (a ``(2, 4)``
mesh) unless ``XLA_FLAGS`` already chooses a device count. The simulation follows JaxPM's
distributed recipe: a linear field, 2LPT to ``a = 0.1``, then ``--steps`` PM steps to
``a = 1`` with diffrax's ``LeapfrogMidpoint``. The final state goes through
:func:`jaxpm_halos.from_jaxpm`, and the demo prints how the particles are laid out over the
devices.

:func:`run_simulation` is the reusable part: in-situ analyses plug in as ``saveat_fn``,
which diffrax evaluates inside the jitted solve at each requested scale factor
(``diffrax.SaveAt(ts=snapshots, fn=saveat_fn)``).

This module imports jaxpm, jaxdecomp, jax_cosmo and diffrax; ``import jaxpm_halos`` does not.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
import warnings
from typing import Any, Callable, Sequence

HOST_DEVICES = 8


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
      state: the final diffrax state at ``a = a_final``: ``(2, nc, nc, nc, 3)``, displacement
        (grid cells) and momentum (grid units), sharded over the mesh.
      snapshots: the scale factors at which ``saved`` was taken (may be empty).
      saved: ``saveat_fn``'s outputs stacked over ``snapshots`` (the states themselves if
        ``saveat_fn`` is None), or None if no snapshots were requested.
      a_final: the final scale factor.
      mesh: the device mesh (None for a single device).
      sharding: the ``NamedSharding`` of the ``(nc, nc, nc, ...)`` grids, or None.
      box_size, nc, omega_m: the run's parameters (``omega_m = Omega_c + Omega_b``).
        halo_size: JaxPM's painting halo, in cells.
      compile_s, run_s: seconds spent compiling and running the jitted simulation.
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


def run_simulation(nc: int, box: float, steps: int, snapshots: Sequence[float] = (), mesh=None,
                   saveat_fn: Callable | None = None, *, seed: int = 0, a_init: float = 0.1,
                   a_final: float = 1.0, omega_c: float = 0.25, sigma8: float = 0.8,
                   lpt_order: int = 2, halo_size: int | None = None,
                   progress: bool = False, initial_field=None) -> SimulationResult:
    """Run a JaxPM particle-mesh simulation of ``nc**3`` particles in a box of side ``box`` Mpc/h.

    Initial conditions: a Gaussian linear field for ``jax_cosmo.Planck15(Omega_c=omega_c,
    sigma8=sigma8)``, displaced with LPT of order ``lpt_order`` at ``a_init``. The PM
    integration takes ``steps`` equal steps in ``a`` up to ``a_final`` with diffrax's
    ``LeapfrogMidpoint``. Everything runs in one ``jit``.

    Args:
      nc: particles (and grid cells) per side.
      box: box side in Mpc/h.
      steps: number of PM steps.
      snapshots: scale factors in ``[a_init, a_final]`` at which to evaluate ``saveat_fn``.
      mesh: a 2D ``jax.sharding.Mesh`` with Auto axes (its two axes split the grid's x and y,
        in that order; names are taken from the mesh), or None to run on one device.
      saveat_fn: ``fn(a, y, cosmo) -> pytree`` run inside the solve at each snapshot, where
        ``y`` is the stacked ``(2, nc, nc, nc, 3)`` state; e.g.
        ``lambda a, y, cosmo: jaxpm_halos.from_jaxpm(y, box_size=box).pos``. None saves ``y``.
      seed: seed of the initial conditions.
      halo_size: JaxPM's painting halo in cells (see :func:`default_halo_size`).
      progress: show diffrax's text progress meter during the solve.
      initial_field: optional ``(nc, nc, nc)`` linear density field to start from instead
        of drawing one from ``seed``. JaxPM draws different random numbers on different
        meshes, so this is how to compare runs on different meshes.
    """
    import diffrax
    import jax
    import jax.numpy as jnp
    import jax_cosmo as jc
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jaxpm.kernels import interpolate_power_spectrum
    from jaxpm.pm import linear_field, lpt, make_diffrax_ode

    mesh_shape = (nc, nc, nc)
    sharding = None
    if mesh is not None and mesh.size > 1:
        if len(mesh.axis_names) != 2:
            raise ValueError(f"JaxPM needs a 2D device mesh, got axes {mesh.axis_names}")
        px, py = mesh.devices.shape
        if nc % px or nc % py:
            raise ValueError(f"nc = {nc} is not divisible by the mesh shape {(px, py)}")
        sharding = NamedSharding(mesh, P(*mesh.axis_names))
        block = min(nc // px if px > 1 else nc, nc // py if py > 1 else nc)
    else:
        mesh, block = None, nc
    if halo_size is None:
        halo_size = default_halo_size(nc, box, block)
    snapshots = tuple(float(a) for a in snapshots)
    if any(not a_init <= a <= a_final for a in snapshots):
        raise ValueError(f"snapshots {snapshots} must lie in [{a_init}, {a_final}]")
    omega_m = omega_c + float(jc.Planck15().Omega_b)

    def simulate(seed, initial_field):
        # Two Cosmology objects: jax_cosmo caches its background in the object, and sharing
        # one between the power spectrum and lpt fails (KeyError: 'h').
        k = jnp.logspace(-4, 1, 128)
        pk = jc.power.linear_matter_power(jc.Planck15(Omega_c=omega_c, sigma8=sigma8), k)
        pk_fn = lambda x: interpolate_power_spectrum(x, k, pk, sharding)
        if initial_field is None:
            field = linear_field(mesh_shape, [box] * 3, pk_fn, seed=jax.random.PRNGKey(seed),
                                 sharding=sharding)
        else:
            field = initial_field if sharding is None else jax.lax.with_sharding_constraint(
                initial_field, sharding)
        cosmo = jc.Planck15(Omega_c=omega_c, sigma8=sigma8)
        dx, p, _ = lpt(cosmo, field, a=a_init, order=lpt_order, halo_size=halo_size,
                       sharding=sharding)
        ode = diffrax.ODETerm(make_diffrax_ode(mesh_shape, paint_absolute_pos=False,
                                               halo_size=halo_size, sharding=sharding))
        subs = [diffrax.SubSaveAt(t1=True)]
        if snapshots:
            subs.append(diffrax.SubSaveAt(ts=jnp.asarray(snapshots), fn=saveat_fn or _identity))
        sol = diffrax.diffeqsolve(
            ode, diffrax.LeapfrogMidpoint(), t0=a_init, t1=a_final, dt0=None,
            y0=jnp.stack([dx, p], axis=0), args=cosmo, saveat=diffrax.SaveAt(subs=subs),
            stepsize_controller=diffrax.StepTo(ts=jnp.linspace(a_init, a_final, steps + 1)),
            max_steps=steps,
            # throw=True would route the whole solution through an equinox error check, a
            # host callback on device 0: the state gets gathered there and comes back
            # replicated. Check the result ourselves instead.
            throw=False,
            progress_meter=diffrax.TextProgressMeter() if progress else diffrax.NoProgressMeter())
        final, saved = sol.ys[0][0], (sol.ys[1] if snapshots else None)
        if sharding is not None:
            # Keep JaxPM's layout: left alone, XLA may replicate the outputs.
            state_sharding = NamedSharding(mesh, P(None, *mesh.axis_names))
            final = jax.lax.with_sharding_constraint(final, state_sharding)
            if snapshots and saveat_fn is None:
                saved = jax.lax.with_sharding_constraint(
                    saved, NamedSharding(mesh, P(None, None, *mesh.axis_names)))
        return final, saved, sol.result == diffrax.RESULTS.successful

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
        compiled = jax.jit(simulate).lower(seed, initial_field).compile()
    compile_s = time.perf_counter() - t
    t = time.perf_counter()
    final, saved, ok = jax.block_until_ready(compiled(seed, initial_field))
    run_s = time.perf_counter() - t
    if not bool(ok):
        raise RuntimeError("the diffrax solve did not finish successfully")
    return SimulationResult(final, snapshots, saved, a_final, mesh, sharding, float(box), nc,
                            omega_m, halo_size, compile_s, run_s)


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxpm_halos.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--nc", type=int, default=64, help="particles per side (default 64)")
    parser.add_argument("--box", type=float, default=128.0, help="box side in Mpc/h (default 128)")
    parser.add_argument("--steps", type=int, default=20, help="PM steps from a=0.1 to 1 (default 20)")
    parser.add_argument("--mesh", default=None,
                        help="device mesh 'px,py' (default: all devices, e.g. 2,4 for 8 CPU devices)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="halos_out",
                        help="output folder for particles.h5 and layout.json (default halos_out)")
    args = parser.parse_args(argv)

    use_host_devices()
    import jax
    import numpy as np
    from jax.sharding import AxisType

    from . import from_jaxpm, units

    devices = jax.devices()
    shape = (tuple(int(v) for v in args.mesh.split(",")) if args.mesh
             else default_mesh_shape(len(devices)))
    if len(shape) != 2 or math.prod(shape) > len(devices):
        parser.error(f"--mesh {shape} needs 2 axes and at most {len(devices)} devices")
    mesh = jax.make_mesh(shape, ("x", "y"), axis_types=(AxisType.Auto, AxisType.Auto),
                         devices=devices[:math.prod(shape)])
    print(f"jaxpm_halos demo: {args.nc}^3 particles, box {args.box:g} Mpc/h, {args.steps} steps, "
          f"mesh {dict(mesh.shape)} on {devices[0].platform} ({len(devices)} devices)", flush=True)

    t0 = time.perf_counter()
    result = run_simulation(args.nc, args.box, args.steps, mesh=mesh, seed=args.seed, progress=True)
    print(f"compiled in {result.compile_s:.1f} s, ran {args.steps} steps in {result.run_s:.1f} s",
          flush=True)

    mass = units.particle_mass(result.omega_m, args.box, args.nc)
    particles = from_jaxpm(result.state, box_size=args.box, mass=mass)
    layout = describe_layout(particles, a=result.a_final)
    print(f"particles: {layout['particles']} (mass {mass:.4g} Msun/h), mesh {layout['mesh']}, "
          f"sharding {layout['sharding']}")
    print(f"position range: {_fmt(layout['pos_min'])} .. {_fmt(layout['pos_max'])} "
          f"(box [0, {args.box:g}))")
    for block in layout["devices"]:
        print(f"  device {block['device']}: block {tuple(block['block'])}, lattice "
              f"x{block['lattice'][0]} y{block['lattice'][1]}, "
              f"{100 * block['outside_fraction']:.1f}% outside their lattice block")
    print(f"outside their lattice block overall: {100 * layout['outside_fraction']:.1f}%, "
          f"by at most {layout['max_stray_cells']:.2f} cells (JaxPM halo_size {result.halo_size})")
    if 2 * layout["max_stray_cells"] > result.halo_size:
        print("warning: particles stray farther than halo_size / 2: JaxPM's painting may have "
              "missed mass near block edges; pass a larger halo_size")

    if args.out:
        import h5py

        os.makedirs(args.out, exist_ok=True)
        vel = units.momentum_to_velocity(np.asarray(particles.vel), result.a_final, args.box, args.nc)
        path = os.path.join(args.out, "particles.h5")
        with h5py.File(path, "w") as f:
            f.create_dataset("pos", data=np.asarray(particles.pos).reshape(-1, 3))
            f.create_dataset("vel", data=vel.reshape(-1, 3).astype(np.float32))
            f.create_dataset("id", data=np.asarray(particles.id).reshape(-1))
            f.attrs.update(dict(box_size=args.box, nc=args.nc, a=result.a_final,
                                particle_mass=mass, pos_unit="Mpc/h", vel_unit="km/s",
                                mass_unit="Msun/h"))
        with open(os.path.join(args.out, "layout.json"), "w") as f:
            json.dump(layout, f, indent=1)
        print(f"wrote {path} and layout.json")
    print(f"total {time.perf_counter() - t0:.1f} s")
    return 0


def _fmt(values):
    return "(" + ", ".join(f"{v:.7g}" for v in values) + ")"


if __name__ == "__main__":
    sys.exit(main())
