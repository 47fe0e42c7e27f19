"""Field-level gradient: jax.grad of a kNN-density statistic w.r.t. the whole initial field.

    python examples/field_level_gradient.py [--nc 32] [--box 64] [--steps 5] [--k 16]
                                            [--mesh 2,4] [--without-correction]

The forward model: JaxPM's linear density field delta_L (nc^3 numbers, the parameters),
2LPT to a = 0.1, ``--steps`` LeapfrogMidpoint PM steps to a = 1, and the kNN density of
every particle computed in situ at a = 1 (``jaxpm_halos.InSitu``). The statistic is the
mean log density, S = mean(log rho_kNN). ``jax.grad`` gives dS/d delta_L at every cell in
one reverse pass (diffrax's default RecursiveCheckpointAdjoint), on the mesh (8 CPU host
devices when only a CPU is present).

The distributed gradient is checked against the same gradient on one device. It prints the
time of one gradient (compiled, warm), its peak memory (XLA temporaries per device, from
``compile().memory_analysis()``), and its cost in PM steps (the gradient's time over one
step of the same solve without analyses).

Reverse mode through distributed JaxPM needs ``jaxpm_halos.correct_jaxpm_adjoints()``
(called first here): jaxdecomp 0.2.9's halo exchange has a wrong transpose.
``--without-correction`` skips it and shows the wrong gradient it gives.
"""

import argparse
import time
import warnings

from jaxpm_halos.demo import default_halo_size, use_host_devices

use_host_devices()

import diffrax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax_cosmo as jc  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402
from jaxpm.kernels import interpolate_power_spectrum  # noqa: E402
from jaxpm.pm import linear_field, lpt, make_diffrax_ode  # noqa: E402

import jaxpm_halos  # noqa: E402


def solve(delta, *, nc, steps, sharding, halo, saveat):
    """``sol.ys`` of JaxPM from the linear field ``delta`` ``(nc, nc, nc)`` at a = 0.1..1."""
    cosmo = jc.Planck15(Omega_c=0.25, sigma8=0.8)
    dx, p, _ = lpt(cosmo, delta, a=0.1, order=2, halo_size=halo, sharding=sharding)
    ode = diffrax.ODETerm(make_diffrax_ode((nc,) * 3, paint_absolute_pos=False,
                                           halo_size=halo, sharding=sharding))
    return diffrax.diffeqsolve(
        ode, diffrax.LeapfrogMidpoint(), t0=0.1, t1=1.0, dt0=None, y0=jnp.stack([dx, p]),
        args=cosmo, saveat=saveat,
        stepsize_controller=diffrax.StepTo(ts=jnp.linspace(0.1, 1.0, steps + 1)),
        max_steps=steps, throw=False).ys


def statistic(delta, *, insitu, **solve_args):
    """S = mean log kNN density at a = 1, computed in situ: a scalar."""
    out = solve(delta, saveat=insitu.saveat([1.0], t0=0.1, t1=1.0), **solve_args)
    return jnp.mean(jnp.log(out["knn_density"]["density"]))


def measure(fn, *args, repeats=3):
    """Compile ``fn`` under jit; returns (output, compile s, best run s, temp bytes/device)."""
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - start
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = jax.block_until_ready(compiled(*args))
        runs.append(time.perf_counter() - start)
    return out, compile_s, min(runs), compiled.memory_analysis().temp_size_in_bytes


def initial_field(nc, box, sharding):
    """JaxPM's linear field (Planck15, sigma8 0.8, seed 0), sharded ``sharding``."""
    k = jnp.logspace(-4, 1, 128)
    pk = jc.power.linear_matter_power(jc.Planck15(Omega_c=0.25, sigma8=0.8), k)
    return jax.jit(lambda: linear_field(
        (nc,) * 3, [box] * 3, lambda x: interpolate_power_spectrum(x, k, pk, sharding),
        seed=jax.random.PRNGKey(0), sharding=sharding))()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nc", type=int, default=32)
    parser.add_argument("--box", type=float, default=64.0)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--mesh", default="2,4")
    parser.add_argument("--without-correction", action="store_true")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", "Explicitly requested dtype.*int64")
    warnings.filterwarnings("ignore", "invalid value encountered in cast")
    if not args.without_correction:
        jaxpm_halos.correct_jaxpm_adjoints()  # once, before anything is traced

    nc, steps = args.nc, args.steps
    shape = tuple(int(s) for s in args.mesh.split(","))
    mesh = jax.make_mesh(shape, ("x", "y"), axis_types=(AxisType.Auto,) * 2)
    sharding = NamedSharding(mesh, P("x", "y"))
    halo = default_halo_size(nc, args.box, min(nc // shape[0], nc // shape[1]))
    delta = initial_field(nc, args.box, sharding)
    common = dict(nc=nc, steps=steps)
    print(f"{nc}^3 particles in {args.box} Mpc/h, {steps} PM steps, kNN k = {args.k}, "
          f"mesh {shape} (halo_size {halo}), {jax.device_count()} {jax.default_backend()} "
          f"devices; correction {'OFF' if args.without_correction else 'on'}")

    insitu = jaxpm_halos.InSitu(box_size=args.box, analyses=("knn_density",), k=args.k,
                                mesh=mesh)
    grad_fn = jax.value_and_grad(lambda d: statistic(d, insitu=insitu, sharding=sharding,
                                                     halo=halo, **common))
    (value, grad), grad_compile, grad_s, grad_mem = measure(grad_fn, delta)
    plain = lambda d: solve(d, sharding=sharding, halo=halo,  # noqa: E731
                            saveat=diffrax.SaveAt(t1=True), **common)
    _, _, solve_s, solve_mem = measure(plain, delta)
    stat = lambda d: statistic(d, insitu=insitu, sharding=sharding, halo=halo, **common)  # noqa: E731
    _, _, forward_s, forward_mem = measure(stat, delta)

    one_insitu = jaxpm_halos.InSitu(box_size=args.box, analyses=("knn_density",), k=args.k)
    one_fn = jax.value_and_grad(lambda d: statistic(d, insitu=one_insitu, sharding=None,
                                                    halo=0, **common))
    delta_one = jax.device_put(np.asarray(delta), jax.devices()[0])
    (one_value, one_grad), _, one_s, one_mem = measure(one_fn, delta_one, repeats=1)

    grad, one_grad = np.asarray(grad, np.float64), np.asarray(one_grad, np.float64)
    err = np.abs(grad - one_grad).max() / np.abs(one_grad).max()
    cosine = np.sum(grad * one_grad) / np.linalg.norm(grad) / np.linalg.norm(one_grad)
    step_s = solve_s / steps
    mib = 2.0**20
    print(f"S = mean log rho_kNN: {float(value):.6f} on the mesh, {float(one_value):.6f} on one device")
    print(f"dS/d delta_L ({nc}^3 cells): max |mesh - one device| / max |one device| = {err:.2e}, "
          f"cosine {cosine:.8f}")
    print(f"one gradient: {grad_s:.3f} s warm (compile {grad_compile:.1f} s), "
          f"{grad_mem / mib:.1f} MiB temporaries per device")
    print(f"forward S: {forward_s:.3f} s ({forward_mem / mib:.1f} MiB); solve alone: "
          f"{solve_s:.3f} s ({solve_mem / mib:.1f} MiB), one PM step {step_s * 1e3:.1f} ms")
    print(f"cost of one gradient: {grad_s / step_s:.1f} PM steps "
          f"({grad_s / forward_s:.2f}x the forward statistic); one device: {one_s:.3f} s, "
          f"{one_mem / mib:.1f} MiB")


if __name__ == "__main__":
    main()
