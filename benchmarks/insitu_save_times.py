"""Cost of the in-situ analyses inside diffeqsolve against the number of save times.

The in-situ recipe of docs/insitu.md (64^3 in 128 Mpc/h, 2LPT to a = 0.1, LeapfrogMidpoint, mesh
(2, 4)) with ``insitu.saveat(ts)``, against the same solve saving only the states at ``ts``
(``diffrax.SaveAt(ts=ts)``), both from the same 2LPT state (a PM step is the latter's time
over its steps, as in ``run.py``), and the analyses alone on the final state. Issue #19: with one
save time the analyses used to run at every PM step. Nothing is cached on disk.

    python benchmarks/insitu_save_times.py [--nc 64] [--box 128] [--steps 10]
        [--ts 1.0 0.5,1.0 0.2,0.4,0.6,0.8,1.0] [--repeats 3] [--search auto|tree|scan]
"""

import argparse
import os
import time
import warnings

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import diffrax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax_cosmo as jc  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P
from jaxpm.kernels import interpolate_power_spectrum  # noqa: E402
from jaxpm.pm import linear_field, lpt, make_diffrax_ode  # noqa: E402

import jaxpm_halos  # noqa: E402


def _cosmology():
    return jc.Planck15(Omega_c=0.25, sigma8=0.8)


def analyses(box, search="auto"):
    """The analyses the recipe runs in situ: FoF (b = 0.2, 20 members) and kNN density
    (k = 16), in the recipe's cosmology; ``search`` is kNN's (``KNNConfig.search``)."""
    return jaxpm_halos.InSitu(
        box_size=box,
        analyses=("fof", "knn_density"),
        b=0.2,
        min_members=20,
        k=16,
        omega_m=0.25 + 0.0486,
        knn=jaxpm_halos.KNNConfig(search=search),
    )


def _sharding(mesh):
    return None if mesh is None else NamedSharding(mesh, P("x", "y"))


def initial_state(nc, box, sharding, seed):
    """The recipe's initial conditions: 2LPT displacements and momenta at a = 0.1."""
    k = jnp.logspace(-4, 1, 128)
    pk = jc.power.linear_matter_power(_cosmology(), k)
    field = linear_field(
        (nc,) * 3,
        [box] * 3,
        lambda x: interpolate_power_spectrum(x, k, pk, sharding),
        seed=jax.random.PRNGKey(seed),
        sharding=sharding,
    )
    dx, p, _ = lpt(_cosmology(), field, a=0.1, order=2, halo_size=16, sharding=sharding)
    return jnp.stack([dx, p])


def solve(nc, steps, sharding, saveat, y0):
    """The recipe's diffeqsolve from ``y0`` with ``saveat``: ``(ys, ok)``."""
    ode = diffrax.ODETerm(
        make_diffrax_ode((nc,) * 3, paint_absolute_pos=False, halo_size=16, sharding=sharding)
    )
    sol = diffrax.diffeqsolve(
        ode,
        diffrax.LeapfrogMidpoint(),
        t0=0.1,
        t1=1.0,
        dt0=None,
        y0=y0,
        args=_cosmology(),
        saveat=saveat,
        stepsize_controller=diffrax.StepTo(ts=jnp.linspace(0.1, 1.0, steps + 1)),
        max_steps=steps,
        throw=False,
    )
    return sol.ys, sol.result == diffrax.RESULTS.successful


def recipe(nc, steps, mesh, saveat):
    """The recipe's ``simulate`` from its 2LPT state ``y0`` with another ``saveat``,
    jitted (``mesh`` None: one device, no sharding). The initial conditions are left
    out, so the solve's time over its steps is a PM step (as in ``run.py``)."""
    sharding = _sharding(mesh)
    return jax.jit(lambda y0: solve(nc, steps, sharding, saveat, y0))


def solve_temporaries(nc, steps, mesh, saveat):
    """XLA's temporary bytes of the compiled solve alone (from a given state), per device
    times the devices: what the analyses add to a run's working memory."""
    sharding = _sharding(mesh)
    y0 = jax.ShapeDtypeStruct((2, nc, nc, nc, 3), jnp.float32, sharding=sharding)
    compiled = jax.jit(lambda y: solve(nc, steps, sharding, saveat, y)).lower(y0).compile()
    devices = 1 if mesh is None else mesh.size
    return compiled.memory_analysis().temp_size_in_bytes * devices


def min_time(fn, repeats):
    """Seconds: the first call (compiles) and the fastest of ``repeats`` more."""
    t = time.perf_counter()
    out = jax.block_until_ready(fn())
    first = time.perf_counter() - t
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t)
    return out, first, best


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--nc", type=int, default=64)
    parser.add_argument("--box", type=float, default=128.0)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--ts", nargs="+", default=["1.0", "0.5,1.0", "0.2,0.4,0.6,0.8,1.0"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--search", default="auto", help="KNNConfig.search: auto, tree or scan")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", "Explicitly requested dtype.*int64")
    warnings.filterwarnings("ignore", "invalid value encountered in cast")
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
    insitu = analyses(args.box, args.search)
    print(
        f"{args.nc}^3, {args.box:g} Mpc/h, {args.steps} steps, mesh (2, 4); min of {args.repeats}",
        flush=True,
    )
    y0 = jax.jit(lambda: initial_state(args.nc, args.box, _sharding(mesh), 0))()
    final = None
    for spec in args.ts:
        ts = [float(v) for v in spec.split(",")]
        off = recipe(args.nc, args.steps, mesh, diffrax.SaveAt(ts=jnp.asarray(ts)))
        on = recipe(args.nc, args.steps, mesh, insitu.saveat(ts, t0=0.1, t1=1.0))
        (states, _), _, t_off = min_time(lambda: off(y0), args.repeats)
        final = states[-1]
        (out, ok), first, t_on = min_time(lambda: on(y0), args.repeats)
        assert bool(ok)
        jaxpm_halos.check_insitu(out, insitu)
        extra = (t_on - t_off) / len(ts)
        print(
            f"ts={ts}: solve {t_on:.2f} s with the analyses, {t_off:.2f} s without; "
            f"extra {extra:.2f} s per snapshot = {extra / (t_off / args.steps):.1f} PM "
            f"steps (first call {first:.0f} s)",
            flush=True,
        )
    _, _, alone = min_time(lambda: insitu(final, 1.0), args.repeats)
    print(f"the analyses alone on the final state: {alone:.2f} s", flush=True)


if __name__ == "__main__":
    main()
