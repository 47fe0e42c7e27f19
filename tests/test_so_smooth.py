"""Smooth SO masses (``smoothing=h``): equal to a float64 brute force of the definition,
the hard masses as h -> 0, the same on every mesh, and derivatives equal to finite
differences of the float64 definition, offline and in situ (FoF membership held fixed)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import CI_MESHES, make_mesh, mesh_id, mesh_params, on_ci_meshes, requires_jaxpm
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpm_halos as jh
from jaxpm_halos.testing.reference import catalogue, soft_so_reference

BOX = 16.0
N = 4096
RHO = 200 * N / BOX**3  # 200 times the mean density, unit masses
CENTRES = np.array([[4.0, 4.0, 4.0], [12.0, 11.0, 0.2], [8.0, 2.0, 13.0], [0.1, 15.9, 8.0]])


@pytest.fixture(scope="module")
def layout():
    """Clumps of 80-400 particles (one across the box corner) over a uniform background."""
    rng = np.random.default_rng(7)
    clumps = [
        c + s * rng.standard_normal((n, 3))
        for c, s, n in zip(CENTRES, (0.3, 0.4, 0.2, 0.3), (400, 300, 80, 200))
    ]
    uniform = rng.uniform(0, BOX, (N - 980, 3))
    return np.mod(np.concatenate(clumps + [uniform]), BOX).astype(np.float32)


def _put(mesh, a):
    return jax.device_put(jnp.asarray(a), NamedSharding(mesh, P(mesh.axis_names)))


def _smooth(pos, centres, h, mass=1.0):
    return jh.spherical_overdensity(pos, centres, box_size=BOX, density=RHO, mass=mass, smoothing=h)


@on_ci_meshes()
def test_smooth_masses_equal_the_definition_and_the_hard_limit(layout, mesh):
    x = _put(mesh, layout)
    _, hard = jh.spherical_overdensity(x, CENTRES, box_size=BOX, density=RHO)
    for h in (1e-7, 0.05, 0.2):
        radius, soft = _smooth(x, CENTRES, h)
        want, fractional = soft_so_reference(layout, CENTRES, BOX, RHO, 1.0, h)
        np.testing.assert_allclose(soft, want, rtol=2e-5)
        np.testing.assert_allclose(radius, np.cbrt(3 * want / (4 * np.pi * RHO)), rtol=1e-5)
        if h == 1e-7:
            assert not fractional.any()
            np.testing.assert_array_equal(soft, hard)
        else:
            assert fractional.all()


def assert_derivative(ad, moved, eps=1e-6, rtol=1e-3):
    """``ad`` equals the central difference of ``moved(s)`` at 0, or one of the one-sided
    ones: M is piecewise smooth (its derivative jumps where two distances swap order), and
    at such a kink within ``eps`` the derivative is the one-sided one of the side taken."""
    f0, up, down = moved(0.0), moved(eps), moved(-eps)
    sides = [(up - down) / (2 * eps), (up - f0) / eps, (f0 - down) / eps]
    assert any(abs(ad - fd) <= rtol * max(abs(fd), 1.0) for fd in sides), (ad, sides)


@pytest.mark.newest
@on_ci_meshes()
def test_smooth_mass_derivatives_equal_finite_differences(layout, mesh):
    """The derivative of each centre's mass along random directions of the positions and
    the centres, and with respect to the mass, against differences of the float64
    definition."""
    h, mass = 0.1, 2.0
    x, c = _put(mesh, layout), jnp.asarray(CENTRES, jnp.float32)
    weights = jnp.asarray([1.0, -0.5, 2.0, 0.7])

    def objective(p, centres, m):
        return jnp.sum(weights * _smooth(p, centres, h, m)[1])

    gx, gc, gm = jax.jit(jax.grad(objective, argnums=(0, 1, 2)))(x, c, jnp.float32(mass))
    rng = np.random.default_rng(1)
    vx, vc = rng.standard_normal(layout.shape), rng.standard_normal(CENTRES.shape)

    def reference(p, centres, m):
        return np.sum(np.asarray(weights) * soft_so_reference(p, centres, BOX, RHO, m, h)[0])

    assert_derivative(
        np.sum(np.asarray(gx) * vx), lambda s: reference(layout + s * vx, CENTRES, mass)
    )
    assert_derivative(
        np.sum(np.asarray(gc) * vc), lambda s: reference(layout, CENTRES + s * vc, mass)
    )
    assert_derivative(float(gm), lambda s: reference(layout, CENTRES, mass + s))


def test_smoothing_is_refused_with_per_particle_masses_and_bad_widths(layout):
    mesh = make_mesh((2, 4))
    x = _put(mesh, layout)
    with pytest.raises(ValueError, match="equal particle masses"):
        jh.spherical_overdensity(
            x,
            CENTRES,
            box_size=BOX,
            density=RHO,
            mass=_put(mesh, np.ones(N, np.float32)),
            smoothing=0.1,
        )
    for bad in (0.0, -1.0, float("nan"), "0.1", True):
        with pytest.raises(ValueError, match="smoothing"):
            _smooth(x, CENTRES, bad)
    with pytest.raises(ValueError, match="pass so="):
        jh.fof(x, BOX, b=0.2, so_smoothing=0.1)


@pytest.mark.slow
def test_a_small_window_buffer_grows_or_names_its_setting(layout):
    mesh = make_mesh((2, 4))
    x = _put(mesh, layout)
    tiny = jh.SOConfig(smooth_factor=0.01)
    with pytest.raises(jh.CapacityError, match="smooth_factor"):
        jh.spherical_overdensity(
            x, CENTRES, box_size=BOX, density=RHO, smoothing=0.2, config=tiny, grow=False
        )
    with pytest.warns(jh.GrowthWarning, match="smooth_factor"):
        _, grown = jh.spherical_overdensity(
            x, CENTRES, box_size=BOX, density=RHO, smoothing=0.2, config=tiny
        )
    np.testing.assert_array_equal(grown, _smooth(x, CENTRES, 0.2)[1])


def _insitu_objective(insitu, a):
    """``(value, out), d value / d y`` of ``sum weights * m200m`` over InSitu's halos, as a
    function of the state ``y`` and the weights (one per catalogue row, padding included)."""

    def objective(y, weights):
        out = insitu(y, a=a)
        cat = out["fof"]["catalogue"]
        return jnp.sum(jnp.where(cat.id >= 0, cat.so["m200m"], 0) * weights) / 1e12, out

    return jax.jit(jax.value_and_grad(objective, has_aux=True))


def _chain_reference(disp, labels, ids, weights, snap, density, mass, h):
    """The in-situ objective in float64 with FoF membership held fixed: centres of mass
    of the members (periodic), then the smooth SO definition about them."""
    nc, box = snap.nc, snap.box_size
    q = np.stack(np.meshgrid(*[np.arange(nc)] * 3, indexing="ij"), -1)
    pos = np.mod(q + disp, nc) * box / nc
    flat = pos.reshape(-1, 3)
    groups = catalogue(flat, box, labels.reshape(-1), min_members=20)  # InSitu's default
    centre_of = dict(zip(groups["id"], groups["pos"]))
    centres = np.array([centre_of[i] for i in ids])
    so = soft_so_reference(flat, centres, box, density, mass, h)[0]
    return np.sum(so * weights) / 1e12


@pytest.mark.newest
@requires_jaxpm
@pytest.mark.parametrize("shape", mesh_params([(2, 4), (1, 1)], ci=CI_MESHES), ids=mesh_id)
def test_insitu_smooth_masses_differentiate_like_their_definition(jaxpm_snapshot_32, shape):
    """d(sum w m200m) / d(displacement) of InSitu's catalogue (so_smoothing) along a random
    direction equals differences of the float64 chain (frozen membership, centres of
    mass, smooth SO), on (2, 4) and one device."""
    snap, h = jaxpm_snapshot_32, 0.1
    mesh = make_mesh(shape)
    insitu = jh.InSitu(
        box_size=snap.box_size, analyses=("fof",), so=("200m",), so_smoothing=h,
        omega_m=snap.omega_m, mesh=mesh,
    )  # fmt: skip
    y = np.stack([snap.disp, snap.mom])
    y_sharded = jax.device_put(jnp.asarray(y), NamedSharding(mesh, P(None, *mesh.axis_names)))
    # The catalogue's padded length by tracing alone: the objective compiles once.
    n_rows = jax.eval_shape(lambda y: insitu(y, a=snap.a), y_sharded)["fof"]["catalogue"].id.shape
    weights = np.random.default_rng(2).uniform(0.5, 1.5, n_rows)
    objective = _insitu_objective(insitu, snap.a)
    (value, out), grad = objective(y_sharded, jnp.asarray(weights, jnp.float32))
    rows = np.asarray(out["fof"]["catalogue"].id)
    valid = rows >= 0
    labels = np.asarray(out["fof"]["labels"])
    density = float(jh.units.so_density("200m", omega_m=snap.omega_m, a=snap.a))
    mass = jh.units.particle_mass(snap.omega_m, snap.box_size, snap.nc)

    def reference(s):
        return _chain_reference(
            snap.disp + s * v, labels, rows[valid], weights[valid], snap, density, mass, h
        )

    v = np.random.default_rng(3).standard_normal(snap.disp.shape)
    assert valid.sum() > 10
    np.testing.assert_allclose(float(value), reference(0.0), rtol=1e-4)
    # Hundreds of windows hold pairs of distances closer than float32 resolves, where the
    # program's order (and so which side of a kink its derivative takes) can differ from
    # float64's: 1% rather than the offline test's 0.1%.
    assert_derivative(np.sum(np.asarray(grad[0]) * v), reference, eps=1e-6, rtol=1e-2)
