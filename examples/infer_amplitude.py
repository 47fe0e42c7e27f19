"""Infer the amplitude of the linear field from halo summaries, by gradient descent through JaxPM.

    python examples/infer_amplitude.py [--nc 32] [--box 64] [--steps 5] [--mesh 2,4]
        [--a0 0.8] [--iterations 10] [--eps 0.01,0.001] [--queries 1000] [--quick]

The model: JaxPM's linear field ``A * delta_fid`` (Planck15 with Omega_c = 0.25, sigma8 =
0.8, seed 0: A = 1 is that cosmology's field), 2LPT to a = 0.1 and ``--steps``
LeapfrogMidpoint PM steps to a = 1, on a ``--mesh`` of devices (8 CPU host devices when
only a CPU is present). At a = 1, ``jaxpm_halos.InSitu`` runs two analyses inside the
jitted solve, once:

- FoF (b = 0.2, groups of >= 10 particles) with smooth M200m about each group's centre of
  mass (``so=("200m",), so_smoothing=0.2``), differentiable with FoF membership held
  fixed. The summary: their soft counts (``jaxpm_halos.stats.soft_counts``, edges of
  half-width 0.2 dex) in four log10 M200m bins from 13.0 to 14.2 (Msun/h). The lowest
  edge's step starts at 10^12.8, above the smooth M200m of every group of 5 to 9 members
  at the values of A we scanned (0.75 to 1.25), so groups joining or leaving the catalogue
  at 10 members do not move the counts.
- the kNN-CDF (``jaxpm_halos.stats.register_knn_cdf``, in situ) of ``--queries`` fixed
  uniform query points for k = 1, 4, 8 at radii 1, 1.5, 2, 2.5, 3 and 4 Mpc/h, smoothed
  over 0.2 Mpc/h (``smoothing=``), differentiable in the positions.

Why 0.2 for both widths: at 32^3 with 5 steps (PM cells of 2 Mpc/h) haloes are barely
resolved, and a few centre-of-mass M200m move by ~0.1 dex per 1e-3 in A. With
``so_smoothing=0.1`` the counts part's dL/dA swung by up to +-150 within 0.04 of A = 1
(+-110 with 0.2), against +-35 for the kNN-CDF part at A = 1 +- 0.005.

The target is the same run at A = 1 (noiseless: the loss is 0 there). The loss is the sum
of squared differences of the 4 + 18 summaries, each over a fixed variance taken from the
target: Poisson (n + 1) for a count, binomial (C (1 - C) / Q + 1e-4) for a CDF value. One
compiled ``jax.value_and_grad`` of the loss runs the whole chain in reverse mode (diffrax's
default RecursiveCheckpointAdjoint, after ``jaxpm_halos.correct_jaxpm_adjoints()``); the
target and the weights of the loss's two parts are its arguments, so that the same program
computes the target (its summaries at A = 1) and each part's gradient.

Descent on A, from ``--a0``: before the minimum is bracketed, ``dA = -2 L / L'`` (Newton's
step for a loss ``c (A - A*)^2`` whose minimum is 0, as for a noiseless target), at most
0.25 in size; once two iterates have gradients of opposite signs, the zero of the line
through those two gradients (a secant step on L', kept inside the bracket). It stops when a
step would move A by less than 1e-3, or after ``--iterations`` steps, and prints per
iteration A, the loss and its two parts, dL/dA and the seconds it took.

It first checks dL/dA at ``--a0`` against central finite differences of the same loss
(``--eps``), for the loss and for each part, and prints their ratios. dL/dA holds FoF
membership and the neighbour sets fixed. The kNN-CDF part is continuous in A (a k-th
neighbour distance is continuous when the neighbour changes), so its finite difference
converges to dL/dA. The counts part jumps wherever a member joins or leaves a group (its
centre of mass jumps, and its M200m with it) or groups merge, which happens somewhere in the
catalogue for nearly every 1e-3 in A: its finite difference measures those jumps too, and
is not its derivative. At the end it prints the cost of one gradient (compiled, warm) in PM
steps: its time over one step of the same solve without analyses (``--quick`` skips that
solve's compilation, for the test).

Measured on a 2-core AMD EPYC CPU shared with other jobs (8 host devices, mesh (2, 4),
32^3 particles in 64 Mpc/h, 5 steps; 88 FoF groups at A = 1, soft counts 6.99, 6.80,
3.51, 0.82), ``python examples/infer_amplitude.py``:

- compilation of value_and_grad 106 s; one gradient 0.85 s warm (0.9-1.1 s per iteration),
  one PM step of the bare solve 27 ms: the gradient costs 31 PM steps; wall time 132 s;
- finite differences at A = 0.8, eps 1e-3 (1e-2): kNN-CDF part 0.997 (1.010), loss 1.014
  (1.023), counts part 1.95 (1.58), the jumps (it is 3.5% of dL/dA there);
- A: 0.8 -> 0.97256 -> 1.00904 -> 0.99839, the loss 156.3 -> 3.29 -> 0.70 -> 0.051: final
  A = 0.9984 after 3 steps.

From ``--a0 1.2``: A = 0.9993 after 4 steps; at A = 1.2 the kNN-CDF part's ratio is 1.008
(0.999 at eps 1e-2) and the loss's 0.918, as the counts part's finite difference is twice
its derivative there. The fit holds A to within 0.01 of the truth: near A = 1 the counts'
gradient noise moves the zero of dL/dA by a few 1e-3.
"""

import argparse
import time
import warnings

from jaxpm_halos.pm import default_halo_size
from jaxpm_halos.simulation import use_host_devices

use_host_devices()

import diffrax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax_cosmo as jc  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from jaxpm.kernels import interpolate_power_spectrum  # noqa: E402
from jaxpm.pm import linear_field, lpt, make_diffrax_ode  # noqa: E402

import jaxpm_halos  # noqa: E402
from jaxpm_halos.stats import random_queries, register_knn_cdf, soft_counts  # noqa: E402

OMEGA_M = 0.25 + 0.0486  # Planck15's Omega_b with Omega_c = 0.25
MIN_MEMBERS = 10
EDGES = np.array([13.0, 13.3, 13.6, 13.9, 14.2])  # log10 M200m, Msun/h
WIDTH = 0.2  # dex, the soft edges' half-width
SO_SMOOTHING = 0.2  # the smooth M200m's relative width
RANKS = (1, 4, 8)
RADII = np.array([1.0, 1.5, 2.0, 2.5, 3.0, 4.0])  # Mpc/h
CDF_SMOOTHING = 0.2  # Mpc/h
CDF_FLOOR = 1e-4  # added to the binomial variance of a CDF value
PARTS = {  # weights of the loss's two parts, (counts, kNN-CDF)
    "loss": np.array([1.0, 1.0], np.float32),
    "counts": np.array([1.0, 0.0], np.float32),
    "kNN-CDF": np.array([0.0, 1.0], np.float32),
}
MAX_STEP = 0.25  # largest |dA| of one descent step
TOL_STEP = 1e-3  # descent stops once |dA| falls below


def cosmology():
    return jc.Planck15(Omega_c=0.25, sigma8=0.8)


def initial_field(nc, box, sharding):
    """delta_fid: JaxPM's linear field (seed 0), sharded ``sharding``."""
    k = jnp.logspace(-4, 1, 128)
    pk = jc.power.linear_matter_power(cosmology(), k)
    return jax.jit(
        lambda: linear_field(
            (nc,) * 3,
            [box] * 3,
            lambda x: interpolate_power_spectrum(x, k, pk, sharding),
            seed=jax.random.PRNGKey(0),
            sharding=sharding,
        )
    )()


def solve(delta, *, nc, steps, sharding, halo, saveat):
    """``sol.ys`` of JaxPM from the linear field ``delta`` at a = 0.1..1 (reverse mode by
    diffrax's default RecursiveCheckpointAdjoint)."""
    cosmo = cosmology()
    dx, p, _ = lpt(cosmo, delta, a=0.1, order=2, halo_size=halo, sharding=sharding)
    ode = diffrax.ODETerm(
        make_diffrax_ode((nc,) * 3, paint_absolute_pos=False, halo_size=halo, sharding=sharding)
    )
    return diffrax.diffeqsolve(
        ode,
        diffrax.LeapfrogMidpoint(),
        t0=0.1,
        t1=1.0,
        dt0=None,
        y0=jnp.stack([dx, p]),
        args=cosmo,
        saveat=saveat,
        stepsize_controller=diffrax.StepTo(ts=jnp.linspace(0.1, 1.0, steps + 1)),
        max_steps=steps,
        throw=False,
    ).ys


def summaries(amplitude, delta, *, insitu, cdf_name, **solve_args):
    """((soft counts (4,), kNN-CDF (3, 6)), in-situ outputs) of the run from
    ``amplitude * delta``, at a = 1."""
    out = solve(amplitude * delta, saveat=insitu.saveat([1.0], t0=0.1, t1=1.0), **solve_args)
    cat = out["fof"]["catalogue"]
    counts = soft_counts(cat.so["m200m"][-1], EDGES, width=WIDTH, valid=cat.id[-1] >= 0)
    return (counts, out[cdf_name]["cdf"][-1]), out


def loss(amplitude, delta, target, weights, *, queries, **summary_args):
    """(L, (parts, summaries, in-situ outputs)): ``parts`` are the squared differences of
    the soft counts and of the kNN-CDF to ``target`` (their values at A = 1), each over its
    fixed variance taken from the target, and L = weights . parts (the fit's loss with
    weights (1, 1); one part alone with (1, 0) or (0, 1), for the finite-difference
    check)."""
    (counts, cdf), out = summaries(amplitude, delta, **summary_args)
    counts_t, cdf_t = target
    var_counts = counts_t + 1.0  # Poisson
    var_cdf = cdf_t * (1 - cdf_t) / queries + CDF_FLOOR  # binomial
    parts = jnp.stack(
        [
            jnp.sum((counts - counts_t) ** 2 / var_counts),
            jnp.sum((cdf - cdf_t) ** 2 / var_cdf),
        ]
    )
    return jnp.dot(weights, parts), (parts, (counts, cdf), out)


def timed(fn, *args, repeats=1):
    """(output, best seconds of ``repeats`` runs)."""
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        runs.append(time.perf_counter() - start)
    return out, min(runs)


def next_amplitude(a, value, grad, below, above):
    """The next A. Once two points bracket the minimum (``below`` = (A, dL/dA < 0),
    ``above`` = (A, dL/dA > 0)), the zero of the straight line through their gradients (a
    secant step on dL/dA, kept inside the bracket); before that, ``-2 L / L'``, Newton's
    step for a loss ``c (A - A*)^2`` whose minimum is 0 (as for a noiseless target), at
    most ``MAX_STEP`` in size."""
    if below is not None and above is not None:
        (a0, g0), (a1, g1) = below, above
        return a0 - g0 * (a1 - a0) / (g1 - g0)
    return a + float(np.clip(-2 * value / grad, -MAX_STEP, MAX_STEP))


def descend(value_and_grad, a, iterations):
    """Descent on A from ``a`` (:func:`next_amplitude`), printing each iteration; stops
    when a step would move A by less than ``TOL_STEP`` or after ``iterations`` steps.
    Returns (final A, steps taken)."""
    print(f"{'iter':>4} {'A':>9} {'loss':>11} {'counts':>9} {'kNN-CDF':>11} {'dL/dA':>11} {'s':>6}")
    below = above = None
    for it in range(iterations + 1):
        (value, parts, grad), s = timed(value_and_grad, a)
        print(
            f"{it:4d} {a:9.5f} {value:11.5f} {parts[0]:9.5f} {parts[1]:11.5f} {grad:11.4f} {s:6.2f}"
        )
        if grad < 0:
            below = (a, grad)
        elif grad > 0:
            above = (a, grad)
        else:
            return a, it
        new = next_amplitude(a, value, grad, below, above)
        if it == iterations or abs(new - a) < TOL_STEP:
            return a, it
        a = new


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nc", type=int, default=32)
    parser.add_argument("--box", type=float, default=64.0)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--mesh", default="2,4")
    parser.add_argument("--a0", type=float, default=0.8, help="starting amplitude")
    parser.add_argument("--iterations", type=int, default=10, help="most descent steps")
    parser.add_argument(
        "--eps", default="0.01,0.001", help="finite-difference steps in A, comma-separated"
    )
    parser.add_argument("--queries", type=int, default=1000, help="kNN-CDF query points")
    parser.add_argument(
        "--quick", action="store_true", help="skip the cost in PM steps (its own compilation)"
    )
    args = parser.parse_args()
    # jax_cosmo asks for int64 indices; diffrax fills integer output buffers with inf first.
    warnings.filterwarnings("ignore", "Explicitly requested dtype.*int64")
    warnings.filterwarnings("ignore", "invalid value encountered in cast")
    jaxpm_halos.correct_jaxpm_adjoints()  # once, before anything is traced
    start_all = time.perf_counter()

    shape = tuple(int(s) for s in args.mesh.split(","))
    mesh = jax.make_mesh(shape, ("x", "y"), axis_types=(AxisType.Auto,) * 2)
    sharding = NamedSharding(mesh, P("x", "y"))
    halo = default_halo_size(args.nc, args.box, min(args.nc // shape[0], args.nc // shape[1]))
    print(
        f"{args.nc}^3 particles in {args.box} Mpc/h, {args.steps} PM steps, mesh {shape} "
        f"(halo_size {halo}), {jax.device_count()} {jax.default_backend()} devices"
    )
    cdf_name = register_knn_cdf(
        "infer_knn_cdf",
        query=random_queries(args.queries, args.box, seed=1),
        radii=RADII,
        k=RANKS,
        smoothing=CDF_SMOOTHING,
    )
    insitu = jaxpm_halos.InSitu(
        box_size=args.box,
        analyses=("fof", cdf_name),
        min_members=MIN_MEMBERS,
        omega_m=OMEGA_M,
        so=("200m",),
        so_smoothing=SO_SMOOTHING,
        mesh=mesh,
    )
    solve_args = dict(nc=args.nc, steps=args.steps, sharding=sharding, halo=halo)
    fn = lambda a, d, t, w: loss(  # noqa: E731
        a, d, t, w, queries=args.queries, insitu=insitu, cdf_name=cdf_name, **solve_args
    )
    delta = initial_field(args.nc, args.box, sharding)
    placeholder = (jnp.zeros(len(EDGES) - 1), jnp.zeros((len(RANKS), len(RADII))))

    # One program for everything: value_and_grad of the loss, the target an argument.
    start = time.perf_counter()
    grad_fn = (
        jax.jit(jax.value_and_grad(fn, has_aux=True))
        .lower(jnp.float32(1), delta, placeholder, PARTS["loss"])
        .compile()
    )
    print(f"value_and_grad compiled in {time.perf_counter() - start:.1f} s")

    # The target: the summaries of the run at A = 1.
    (_, (_, target, out)), _ = grad_fn(jnp.float32(1), delta, placeholder, PARTS["loss"])
    jaxpm_halos.check_insitu(out, insitu)  # raises, naming an InSitu setting that fits
    groups = int(jnp.sum(out["fof"]["catalogue"].id[-1] >= 0))
    counts = np.asarray(target[0], np.float64).round(2).tolist()
    print(
        f"target (A = 1): {groups} FoF groups of >= {MIN_MEMBERS} particles; soft counts of "
        f"M200m in log10 bins {EDGES.tolist()}: {counts}"
    )
    for rank, row in zip(RANKS, np.asarray(target[1], np.float64)):
        print(f"  kNN-CDF k = {rank} at r = {RADII.tolist()} Mpc/h: {row.round(3).tolist()}")

    def value_and_grad(a, weights=PARTS["loss"]):
        (value, (parts, _, out)), grad = grad_fn(jnp.float32(a), delta, target, weights)
        jaxpm_halos.check_insitu(out, insitu)
        return float(value), np.asarray(parts, np.float64), float(grad)

    # dL/dA against central finite differences of the same loss at the start, for the
    # loss and each of its parts (the parts come with every evaluation; each part's
    # gradient is one more reverse pass, with its weights).
    grads = {name: value_and_grad(args.a0, w)[2] for name, w in PARTS.items()}
    for eps in (float(e) for e in args.eps.split(",")):
        plus, minus = value_and_grad(args.a0 + eps)[1], value_and_grad(args.a0 - eps)[1]
        for name, w in PARTS.items():
            fd = float(np.dot(w, plus - minus)) / (2 * eps)
            print(
                f"FD check at A = {args.a0}, eps {eps:g}: {name:>7}: dL/dA {grads[name]:10.4f}, "
                f"central difference {fd:10.4f}, ratio {grads[name] / fd:.4f}"
            )

    a, taken = descend(value_and_grad, args.a0, args.iterations)
    print(f"final A = {a:.5f} after {taken} steps, |A - 1| = {abs(a - 1):.5f}")

    if not args.quick:
        # Cost: one warm gradient over one PM step of the same solve without analyses.
        bare = (
            jax.jit(lambda d: solve(d, saveat=diffrax.SaveAt(t1=True), **solve_args))
            .lower(delta)
            .compile()
        )
        _, solve_s = timed(bare, delta, repeats=3)
        _, grad_s = timed(grad_fn, jnp.float32(a), delta, target, PARTS["loss"], repeats=3)
        step_s = solve_s / args.steps
        print(
            f"cost: one gradient {grad_s:.3f} s warm; the solve alone {solve_s:.3f} s, one PM "
            f"step {step_s * 1e3:.1f} ms: the gradient costs {grad_s / step_s:.1f} PM steps"
        )
    print(f"wall time {time.perf_counter() - start_all:.1f} s")


if __name__ == "__main__":
    main()
