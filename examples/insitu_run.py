"""The in-situ recipe as a script: a distributed JaxPM run whose halo catalogues, member ids,
merger tree and light cone are written to a run directory.

    python examples/insitu_run.py [--nc 64] [--box 128] [--steps 20]
        [--snapshots 0.5,0.75,1.0] [--mesh 2,4] [--pm-factor 1] [--z-max 0.1] [--out halos_run]

One host, any number of devices: the mesh defaults to all of them (8 CPU host devices when
only a CPU is present). The run follows docs/insitu.md: JaxPM's linear field, 2LPT to
a = 0.1 and ``--steps`` LeapfrogMidpoint PM steps, with ``jaxpm_halos.InSitu`` running FoF
(with M200m) at each snapshot inside the jitted solve. ``--pm-factor 2`` puts the PM
forces on a grid twice as fine (``jaxpm_halos.pm.refined_pm_ode``), which SO masses need.
Then ``jaxpm_halos.write_run`` writes ``--out`` (see docs/runs.md), which it reads back.

Several hosts: ``examples/multihost_run.py`` runs the same function on every process.
"""

import argparse
import os
import warnings

# jax_cosmo's growth ODE asks for int64, which jax (32-bit by default) truncates: harmless.
warnings.filterwarnings("ignore", "Explicitly requested dtype.*int64", UserWarning)


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nc", type=int, default=64, help="particles per side")
    parser.add_argument("--box", type=float, default=128.0, help="box side, Mpc/h")
    parser.add_argument("--steps", type=int, default=20, help="PM steps from a = 0.1 to 1")
    parser.add_argument("--snapshots", default="0.5,0.75,1.0", help="scale factors saved")
    parser.add_argument("--mesh", default=None, help="device mesh 'px,py' (default: all)")
    parser.add_argument("--pm-factor", type=int, default=1, help="PM cells per particle, per side")
    parser.add_argument("--z-max", type=float, default=0.1, help="light cone depth")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="halos_run", help="the run directory to write")
    return parser.parse_args(argv)


def simulate(args, mesh, insitu, ts):
    """The solve of docs/insitu.md with ``insitu.saveat(ts)``: ``sol.ys``."""
    import diffrax
    import jax
    import jax.numpy as jnp
    import jax_cosmo as jc
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from jaxpm.distributed import uniform_particles
    from jaxpm.kernels import interpolate_power_spectrum
    from jaxpm.pm import linear_field, lpt, make_diffrax_ode

    from jaxpm_halos.pm import default_halo_size, refined_pm_ode

    nc, box, pm_nc = args.nc, args.box, args.pm_factor * args.nc
    sharding = NamedSharding(mesh, P(*mesh.axis_names))
    block = min(nc // n for n in mesh.devices.shape)  # the smallest lattice block side
    halo = default_halo_size(nc, box, block)

    @jax.jit
    def run(seed):
        k = jnp.logspace(-4, 1, 128)
        pk = jc.power.linear_matter_power(jc.Planck15(Omega_c=0.25, sigma8=0.8), k)
        field = linear_field(
            (nc,) * 3,
            [box] * 3,
            lambda x: interpolate_power_spectrum(x, k, pk, sharding),
            seed=jax.random.PRNGKey(seed),
            sharding=sharding,
        )
        cosmo = jc.Planck15(Omega_c=0.25, sigma8=0.8)  # a second object: JaxPM's KeyError 'h'
        dx, p, _ = lpt(cosmo, field, a=0.1, order=2, halo_size=halo, sharding=sharding)
        if pm_nc == nc:  # JaxPM's own distributed mode: displacements in lattice cells
            y0 = jnp.stack([dx, p])
            ode = make_diffrax_ode(
                (nc,) * 3, paint_absolute_pos=False, halo_size=halo, sharding=sharding
            )
        else:  # absolute positions and momenta in PM cells, on the finer grid
            q = uniform_particles((nc,) * 3, sharding).astype(dx.dtype)
            y0 = (pm_nc / nc) * jnp.stack([q + dx, p])
            pm_halo = default_halo_size(pm_nc, box, block * pm_nc // nc)
            ode = refined_pm_ode(nc, pm_nc, halo_size=pm_halo, sharding=sharding)
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(ode),
            diffrax.LeapfrogMidpoint(),
            t0=0.1,
            t1=1.0,
            dt0=None,
            y0=y0,
            args=cosmo,
            saveat=insitu.saveat(ts, t0=0.1, t1=1.0),
            stepsize_controller=diffrax.StepTo(ts=jnp.linspace(0.1, 1.0, args.steps + 1)),
            max_steps=args.steps,
            throw=False,
        )
        return sol.ys, sol.result == diffrax.RESULTS.successful

    return run(args.seed)


def main(argv=None):
    import jax
    import jax_cosmo as jc
    import numpy as np
    from jax.sharding import AxisType

    import jaxpm_halos
    from jaxpm_halos.simulation import default_mesh_shape

    args = parse(argv)
    shape = (
        tuple(int(n) for n in args.mesh.split(","))
        if args.mesh
        else default_mesh_shape(jax.device_count())
    )
    mesh = jax.make_mesh(shape, ("x", "y"), axis_types=(AxisType.Auto,) * 2)
    ts = sorted(float(a) for a in args.snapshots.split(","))
    cosmology = jc.Planck15(Omega_c=0.25, sigma8=0.8)
    pm_nc = args.pm_factor * args.nc
    insitu = jaxpm_halos.InSitu(
        box_size=args.box,
        analyses=("fof",),
        b=0.2,
        min_members=20,
        omega_m=float(cosmology.Omega_m),
        so=("200m",),
        paint_absolute_pos=pm_nc != args.nc,
        pm_nc=pm_nc,
    )
    out, ok = simulate(args, mesh, insitu, ts)
    if not bool(ok):
        raise SystemExit("the diffrax solve failed")
    jaxpm_halos.check_insitu(out, insitu)  # raises, naming a setting that fits, on overflow
    path = jaxpm_halos.write_run(
        args.out,
        out,
        insitu,
        times=ts,
        cosmology=cosmology,
        steps=args.steps,
        seed=args.seed,
        lightcone={"observer": (args.box / 2,) * 3, "z_max": args.z_max},
    )
    if path is None:  # not process 0
        return 0
    run = jaxpm_halos.load_run(path)
    last = run.catalogue(-1)
    big = int(np.argmax(last["mass"]))
    members = run.members(-1, int(last["id"][big]))
    print(
        f"wrote {os.path.abspath(path)}: {len(run)} snapshots on mesh {shape}, "
        f"{len(last)} haloes at a = {ts[-1]:g}; the largest, {last['mass'][big]:.3g} Msun/h "
        f"(M200m {last['m200m'][big]:.3g}), has {len(members)} members; "
        f"{len(run.lightcone['id'])} haloes on the light cone to z = {args.z_max:g}"
    )
    return 0


if __name__ == "__main__":
    from jaxpm_halos.simulation import use_host_devices

    use_host_devices()  # 8 CPU host devices when no accelerator is present
    raise SystemExit(main())
