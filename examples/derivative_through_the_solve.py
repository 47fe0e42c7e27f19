"""Differentiate a halo and density summary through a distributed JaxPM run.

    python examples/derivative_through_the_solve.py [--nc 32] [--steps 5]
        [--check-halo-adjoint [--correct-adjoints]]

The simulation (linear field scaled by an amplitude A, 2LPT, PM steps with diffrax) runs on
8 CPU host devices (mesh (2, 4)) or on the GPUs present, with in-situ FoF and kNN density
inside the jitted solve. It prints d/dA of two summaries by forward-mode differentiation
(``diffrax.ForwardMode`` and ``jax.jvp``): the mean log kNN density, next to a central
finite difference, and the mean halo radius. Derivatives hold FoF membership and the
neighbour sets fixed. The density is continuous in A, so its finite difference converges to
the derivative; a halo summary jumps whenever a halo gains or loses a member, so its finite
difference measures those jumps and is not printed.

Forward mode suits a few parameters. Reverse mode (``jax.grad``) through a JaxPM step on
more than one device needs ``jaxpm_halos.correct_jaxpm_adjoints()`` first (see
``examples/field_level_gradient.py``): jaxdecomp 0.2.9 transposes its halo exchange as if
it were self-adjoint, so without it the adjoints of JaxPM's CIC painting and reading are
wrong at domain edges. ``--check-halo-adjoint`` measures it on the current mesh: it prints
``<w, J v>`` for JaxPM's ``cic_paint_dx`` by forward mode and by reverse mode, which must
agree; add ``--correct-adjoints`` to measure it with the correction. The in-situ analyses
themselves differentiate correctly in both modes.
"""

import argparse
import warnings

from jaxpm_halos.pm import default_halo_size
from jaxpm_halos.simulation import default_mesh_shape, use_host_devices

use_host_devices()

import diffrax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax_cosmo as jc  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from jaxpm.kernels import interpolate_power_spectrum  # noqa: E402
from jaxpm.painting import cic_paint_dx  # noqa: E402
from jaxpm.pm import linear_field, lpt, make_diffrax_ode  # noqa: E402

import jaxpm_halos  # noqa: E402


def summaries(amplitude, *, insitu, nc, box, steps, sharding, halo):
    """(mean log density, mean halo radius in Mpc/h) at a = 1, and the in-situ outputs."""
    k = jnp.logspace(-4, 1, 128)
    pk = jc.power.linear_matter_power(jc.Planck15(Omega_c=0.25, sigma8=0.8), k)
    field = amplitude * linear_field(
        (nc,) * 3,
        [box] * 3,
        lambda x: interpolate_power_spectrum(x, k, pk, sharding),
        seed=jax.random.PRNGKey(0),
        sharding=sharding,
    )
    cosmo = jc.Planck15(Omega_c=0.25, sigma8=0.8)
    dx, p, _ = lpt(cosmo, field, a=0.1, order=2, halo_size=halo, sharding=sharding)
    ode = diffrax.ODETerm(
        make_diffrax_ode((nc,) * 3, paint_absolute_pos=False, halo_size=halo, sharding=sharding)
    )
    sol = diffrax.diffeqsolve(
        ode,
        diffrax.LeapfrogMidpoint(),
        t0=0.1,
        t1=1.0,
        dt0=None,
        y0=jnp.stack([dx, p]),
        args=cosmo,
        saveat=insitu.saveat([1.0], t0=0.1, t1=1.0),
        stepsize_controller=diffrax.StepTo(ts=jnp.linspace(0.1, 1.0, steps + 1)),
        max_steps=steps,
        throw=False,
        adjoint=diffrax.ForwardMode(),
    )
    out = sol.ys
    cat = out["fof"]["catalogue"]
    found = cat.count > 0
    radius = jnp.sum(jnp.where(found, cat.radius, 0)) / jnp.maximum(jnp.sum(found), 1)
    return jnp.stack([jnp.mean(jnp.log(out["knn_density"]["density"])), radius]), out


def check_halo_adjoint(nc, sharding, halo):
    """<w, J v> of JaxPM's cic_paint_dx by forward and by reverse mode (equal if correct)."""
    rng = np.random.default_rng(0)
    disp, v = (rng.normal(0, s, (nc, nc, nc, 3)).astype(np.float32) for s in (0.4, 1.0))
    w = rng.normal(0, 1, (nc, nc, nc)).astype(np.float32)
    disp, v, w = (jax.device_put(a, sharding) for a in (disp, v, w))

    def paint(s, disp, v, w):
        return jnp.sum(w * cic_paint_dx(disp + s * v, halo_size=halo, sharding=sharding))

    forward = jax.jit(lambda s, *a: jax.jvp(lambda t: paint(t, *a), (s,), (1.0,))[1])
    reverse = jax.jit(jax.grad(paint))
    return float(forward(0.0, disp, v, w)), float(reverse(0.0, disp, v, w))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nc", type=int, default=32)
    parser.add_argument("--box", type=float, default=64.0)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--eps", type=float, default=1e-3)
    parser.add_argument("--check-halo-adjoint", action="store_true")
    parser.add_argument(
        "--correct-adjoints",
        action="store_true",
        help="call jaxpm_halos.correct_jaxpm_adjoints() first",
    )
    args = parser.parse_args()
    if args.correct_adjoints:
        jaxpm_halos.correct_jaxpm_adjoints()
    nc, box = args.nc, args.box
    # jax_cosmo asks for int64 indices; diffrax fills integer output buffers with inf first.
    warnings.filterwarnings("ignore", "Explicitly requested dtype.*int64")
    warnings.filterwarnings("ignore", "invalid value encountered in cast")

    shape = default_mesh_shape(jax.device_count())
    mesh = jax.make_mesh(shape, ("x", "y"), axis_types=(AxisType.Auto,) * 2)
    sharding = NamedSharding(mesh, P("x", "y"))
    halo = default_halo_size(nc, box, min(nc // shape[0], nc // shape[1]))
    print(f"{jax.device_count()} devices, mesh {shape}, {nc}^3 particles in {box} Mpc/h")

    if args.check_halo_adjoint:
        fwd, rev = check_halo_adjoint(nc, sharding, halo)
        print(
            f"JaxPM cic_paint_dx <w, J v>: forward mode {fwd:.5f}, reverse mode {rev:.5f}"
            f" ({'agree' if abs(fwd - rev) <= 1e-4 * abs(fwd) else 'DISAGREE'})"
        )

    insitu = jaxpm_halos.InSitu(box_size=box, analyses=("fof", "knn_density"), k=16)
    fn = lambda a: summaries(
        a,
        insitu=insitu,
        nc=nc,
        box=box,
        steps=args.steps,  # noqa: E731
        sharding=sharding,
        halo=halo,
    )
    value, tangent, out = jax.jit(lambda a: jax.jvp(fn, (a,), (jnp.ones_like(a),), has_aux=True))(
        jnp.float32(1)
    )
    jaxpm_halos.check_insitu(out, insitu)  # raises, naming an InSitu setting that fits
    forward = jax.jit(lambda a: fn(a)[0])
    fd = (forward(jnp.float32(1 + args.eps)) - forward(jnp.float32(1 - args.eps))) / (2 * args.eps)
    print(
        f"mean log density: {float(value[0]):8.4f}   d/dA {float(tangent[0]):8.4f}   "
        f"finite difference (eps {args.eps}) {float(fd[0]):8.4f}"
    )
    print(f"mean halo radius: {float(value[1]):8.4f} Mpc/h   d/dA {float(tangent[1]):8.4f}")


if __name__ == "__main__":
    main()
