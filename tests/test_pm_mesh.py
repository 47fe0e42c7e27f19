"""A PM grid finer than the particle lattice: absolute-position states.

JaxPM 0.1.6 paints absolute positions only on one device and only with as many cells as
particles (its cic_paint reshapes the particles to the mesh shape), so the demo's
``run_simulation(pm_nc=...)`` uses its own PM step, ``refined_pm_ode``. Checked here:

- ``refined_pm_ode`` at ``pm_nc == nc`` against JaxPM's ODE; on a (2, 4) mesh against one
  device at ``pm_nc = 2 nc``, one evaluation and a whole run from the same initial field;
- InSitu's positions, velocities and ids for absolute-position states against an
  independent numpy conversion, and against the lattice mode on the same initial state;
- in-situ FoF inside the solve against ``jaxpm_halos.fof`` run afterwards on the same
  positions (bitwise);
- the errors for a state that contradicts the declared mode or PM grid.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh, requires_jaxpm
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpm_halos
from jaxpm_halos import from_jaxpm, units
from jaxpm_halos.extension import REGISTRY, InSitu, check, register
from jaxpm_halos.io import gather_catalogue

OMEGA_C, SIGMA8 = 0.25, 0.8  # run_simulation's default cosmology


@pytest.fixture
def rows_analysis():
    """A user analysis returning what InSitu hands the analyses: position, velocity, id."""
    name = "test_pm_rows"

    @register(name, outputs={"pos": "particle", "vel": "particle", "id": "particle"})
    def rows(snap):
        p = snap.particles
        return {"pos": p.pos, "vel": p.vel, "id": p.id}

    yield name
    REGISTRY.pop(name)


def _quiet():
    import warnings

    w = warnings.catch_warnings()
    w.__enter__()
    warnings.filterwarnings("ignore", "Explicitly requested dtype.*int64")
    warnings.filterwarnings("ignore", "invalid value encountered in cast")
    return w


def _cosmo():
    import jax_cosmo as jc

    return jc.Planck15(Omega_c=OMEGA_C, sigma8=SIGMA8)


def _field(nc, box, seed=3):
    """A linear field drawn on one device, to start runs on different meshes alike."""
    import jax_cosmo as jc
    from jaxpm.kernels import interpolate_power_spectrum
    from jaxpm.pm import linear_field

    k = jnp.logspace(-4, 1, 128)
    pk = jc.power.linear_matter_power(_cosmo(), k)
    return np.asarray(
        linear_field(
            (nc,) * 3,
            [box] * 3,
            lambda x: interpolate_power_spectrum(x, k, pk),
            seed=jax.random.PRNGKey(seed),
        )
    )


# ----------------------------------------------------------------------------------------
# The PM step


@requires_jaxpm
def test_refined_ode_at_lattice_resolution_is_jaxpms():
    """At pm_nc == nc, refined_pm_ode on absolute positions q + d gives JaxPM's
    make_diffrax_ode on displacements d (one device), and JaxPM's own absolute mode
    (run_simulation(paint_absolute_pos=True)) evolves q + d like its displacement mode."""
    from jaxpm.pm import make_diffrax_ode

    from jaxpm_halos.pm import refined_pm_ode
    from jaxpm_halos.simulation import run_simulation

    nc, box = 16, 32.0
    w = _quiet()
    try:
        disp = run_simulation(nc, box, 4, seed=1)
        absolute = run_simulation(nc, box, 4, seed=1, paint_absolute_pos=True)
    finally:
        w.__exit__(None, None, None)
    assert absolute.paint_absolute_pos and absolute.pm_nc == nc and not disp.paint_absolute_pos
    q = np.stack(np.indices((nc,) * 3), -1).astype(np.float32)
    y = np.asarray(disp.state)
    np.testing.assert_allclose(np.asarray(absolute.state[0]), q + y[0], atol=2e-5)
    np.testing.assert_allclose(np.asarray(absolute.state[1]), y[1], atol=2e-5)
    assert np.abs(y[0]).max() > 1, "the run should have moved the particles"

    cosmo = _cosmo()
    ref = jax.jit(lambda y: make_diffrax_ode((nc,) * 3, paint_absolute_pos=False)(0.7, y, cosmo))(
        jnp.asarray(y)
    )
    got = jax.jit(lambda y: refined_pm_ode(nc, nc)(0.7, y, cosmo))(
        jnp.asarray(np.stack([q + y[0], y[1]]))
    )
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(ref[0]))  # p / (a^3 E)
    scale = float(np.abs(ref[1]).max())
    assert scale > 1
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(ref[1]), atol=2e-6 * scale)


@pytest.mark.slow
@requires_jaxpm
def test_refined_ode_on_a_mesh_equals_one_device():
    """pm_nc = 2 nc: the PM density has mean 1, and the (2, 4) mesh gives the single-device
    forces (one evaluation) and the single-device run from the same initial field.

    64 Mpc/h: the (2, 4) mesh's blocks are 16 Mpc/h along y, and the default halo (the
    cap, 2 blocks) reaches 16 Mpc/h; particles strayed up to 11 Mpc/h. In 32 Mpc/h they
    strayed 13 Mpc/h, past the 8 Mpc/h reach, and the run differed by 1.3 PM cells."""
    from jaxpm_halos.pm import default_halo_size, refined_pm_ode
    from jaxpm_halos.simulation import run_simulation

    nc, box, steps = 16, 64.0, 5
    mesh = make_mesh((2, 4))
    field = _field(nc, box)
    w = _quiet()
    try:
        one = run_simulation(nc, box, steps, initial_field=field, pm_nc=2 * nc)
        dist = run_simulation(nc, box, steps, mesh=mesh, initial_field=field, pm_nc=2 * nc)
    finally:
        w.__exit__(None, None, None)
    assert dist.paint_absolute_pos and dist.pm_nc == 2 * nc
    assert dist.halo_size == default_halo_size(2 * nc, box, 2 * nc // 4)
    assert dist.state.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "x", "y")), 5)
    y1, yd = np.asarray(one.state), np.asarray(dist.state)
    q2 = 2 * np.stack(np.indices((nc,) * 3), -1)
    assert np.abs(y1[0] - q2).max() > 2, "the run should have moved the particles"
    np.testing.assert_allclose(yd[0], y1[0], atol=1e-4)  # PM cells, after 5 steps
    np.testing.assert_allclose(yd[1], y1[1], atol=1e-5 * np.abs(y1[1]).max())

    cosmo = _cosmo()
    sharding = NamedSharding(mesh, P("x", "y"))
    y = jax.device_put(jnp.asarray(y1), NamedSharding(mesh, P(None, "x", "y")))
    ode1 = refined_pm_ode(nc, 2 * nc)
    oded = refined_pm_ode(nc, 2 * nc, halo_size=dist.halo_size, sharding=sharding)
    f1 = np.asarray(jax.jit(lambda y: ode1(1.0, y, cosmo))(jnp.asarray(y1)))
    fd = np.asarray(jax.jit(lambda y: oded(1.0, y, cosmo))(y))
    np.testing.assert_allclose(fd, f1, atol=2e-6 * np.abs(f1[1]).max())
    rho = np.asarray(jax.jit(oded.paint)(y[0]))
    assert rho.shape == (2 * nc,) * 3
    assert rho.mean() == pytest.approx(1.0, rel=1e-5) and rho.max() > 10


# ----------------------------------------------------------------------------------------
# InSitu on absolute-position states


@requires_jaxpm
@pytest.mark.parametrize(
    "mesh_shape", [(2, 4), pytest.param(None, marks=pytest.mark.slow)], ids=["mesh2x4", "single"]
)
def test_insitu_absolute_positions_and_velocities(rows_analysis, mesh_shape):
    """At a = 0.1 (the 2LPT state), InSitu on the pm_nc = 2 nc state gives positions
    wrap(x box / pm_nc), velocities 100 (box / pm_nc) p / a km/s and lattice ids (numpy,
    float64), and the same positions and velocities as the lattice-mode state of the same
    initial field (where p is in lattice cells: the velocity is unit-independent)."""
    from jaxpm_halos.simulation import run_simulation

    nc, box, a = 16, 48.0, 0.1
    mesh = None if mesh_shape is None else make_mesh(mesh_shape)
    field = _field(nc, box, seed=4)
    w = _quiet()
    try:
        fine = run_simulation(
            nc, box, 1, (a,), mesh=mesh, initial_field=field, pm_nc=2 * nc, a_final=0.2
        )
        lattice = run_simulation(nc, box, 1, (a,), mesh=mesh, initial_field=field, a_final=0.2)
    finally:
        w.__exit__(None, None, None)
    y_fine, y_lat = fine.saved[0], lattice.saved[0]
    out = InSitu(box_size=box, analyses=(rows_analysis,), paint_absolute_pos=True, pm_nc=2 * nc)(
        y_fine, a
    )[rows_analysis]
    ref = InSitu(box_size=box, analyses=(rows_analysis,))(y_lat, a)[rows_analysis]

    x, p = np.asarray(y_fine, np.float64)
    assert x.min() < 0 or x.max() >= 2 * nc, "some particles should lie outside [0, pm_nc)"
    pos = np.mod(x * (box / (2 * nc)), box)
    vel = 100.0 * (box / (2 * nc)) * p / a
    got_pos = np.asarray(out["pos"], np.float64)
    delta = np.abs(got_pos - pos)
    assert np.minimum(delta, box - delta).max() < 1e-5 * box
    assert got_pos.min() >= 0 and got_pos.max() < box
    np.testing.assert_allclose(
        np.asarray(out["vel"]), vel, rtol=1e-5, atol=1e-6 * np.abs(vel).max()
    )
    assert np.abs(vel).max() > 10, "2LPT velocities at a = 0.1 are tens of km/s"
    ix, iy, iz = np.indices((nc,) * 3)
    np.testing.assert_array_equal(np.asarray(out["id"]), (ix * nc + iy) * nc + iz)
    # the lattice mode on the same initial conditions: same physical values
    delta = np.abs(got_pos - np.asarray(ref["pos"], np.float64))
    assert np.minimum(delta, box - delta).max() < 1e-5 * box
    np.testing.assert_allclose(
        np.asarray(out["vel"]), np.asarray(ref["vel"]), rtol=1e-5, atol=1e-6 * np.abs(vel).max()
    )
    if mesh is not None:
        assert out["pos"].sharding.is_equivalent_to(NamedSharding(mesh, P("x", "y")), 4)


@pytest.fixture(scope="module")
def fine_insitu_run():
    """32^3 in 32 Mpc/h, PM grid 64^3, 5 steps, on a (2, 4) mesh, with InSitu FoF inside
    the solve at a = 1."""
    import jax_cosmo as jc

    from jaxpm_halos.simulation import run_simulation

    nc, box = 32, 32.0
    omega_m = OMEGA_C + float(jc.Planck15().Omega_b)
    insitu = InSitu(
        box_size=box,
        analyses=("fof",),
        b=0.2,
        min_members=20,
        omega_m=omega_m,
        paint_absolute_pos=True,
        pm_nc=2 * nc,
        save_state=True,
    )
    w = _quiet()
    try:
        res = run_simulation(
            nc,
            box,
            5,
            (1.0,),
            mesh=make_mesh((2, 4)),
            pm_nc=2 * nc,
            saveat_fn=lambda a, y, cosmo: insitu(y, a),
        )
    finally:
        w.__exit__(None, None, None)
    check(res.saved)
    return dict(res=res, insitu=insitu, nc=nc, box=box, mass=units.particle_mass(omega_m, box, nc))


@requires_jaxpm
@pytest.mark.slow
def test_insitu_fof_on_a_finer_pm_grid_equals_fof_afterwards(fine_insitu_run):
    """The in-situ catalogue and labels equal jaxpm_halos.fof on from_jaxpm(state,
    paint_absolute_pos=True, pm_nc=64), bitwise; the same on one device (InSitu called on
    the gathered state).

    The state is the one the save function received (``save_state=True``): diffrax hands
    it an interpolation at a = 1, which can differ from the solve's final state by an ulp
    (then so do a few radii; measured with the lattice mode too)."""
    r = fine_insitu_run
    res, nc, box = r["res"], r["nc"], r["box"]
    state = res.saved["state"][0]
    np.testing.assert_allclose(np.asarray(state), np.asarray(res.state), atol=1e-5)
    particles = from_jaxpm(
        state, box_size=box, mass=r["mass"], paint_absolute_pos=True, pm_nc=2 * nc
    )
    labels_ref, cat = jaxpm_halos.fof(particles, b=0.2, min_members=20)
    ref = cat.to_numpy()
    assert len(ref["id"]) > 10, "the test run should have halos"
    got = gather_catalogue(res.saved["fof"]["catalogue"], snapshot=0)
    for field in ("id", "count", "mass", "pos", "radius"):
        np.testing.assert_array_equal(got[field], ref[field], err_msg=field)
    np.testing.assert_array_equal(np.asarray(res.saved["fof"]["labels"][0]), np.asarray(labels_ref))
    np.testing.assert_allclose(got["mass"], got["count"] * r["mass"], rtol=1e-5)
    # velocities: the mean momentum (PM cells) of the members, converted with pm_nc
    np.testing.assert_allclose(
        got["vel"],
        units.momentum_to_velocity(ref["vel"], 1.0, box, 2 * nc),
        rtol=1e-5,
        atol=1e-5 * np.abs(got["vel"]).max(),
    )

    # one device: InSitu on the gathered state against fof on it (float sums run in
    # another order than on 8 devices: ids and counts equal the mesh's, masses to 2e-6)
    state1 = jnp.asarray(np.asarray(state))
    one = InSitu(
        box_size=box,
        analyses=("fof",),
        b=0.2,
        min_members=20,
        omega_m=r["insitu"].omega_m,
        paint_absolute_pos=True,
        pm_nc=2 * nc,
    )(state1, 1.0)
    single = gather_catalogue(one["fof"]["catalogue"])
    ref1 = jaxpm_halos.fof(
        from_jaxpm(state1, box_size=box, mass=r["mass"], paint_absolute_pos=True, pm_nc=2 * nc),
        b=0.2,
        min_members=20,
    )[1].to_numpy()
    for field in ("id", "count", "mass", "pos", "radius"):
        np.testing.assert_array_equal(single[field], ref1[field], err_msg=field)
    for field in ("id", "count"):
        np.testing.assert_array_equal(single[field], ref[field], err_msg=field)
    np.testing.assert_allclose(single["mass"], ref["mass"], rtol=2e-6)


# ----------------------------------------------------------------------------------------
# Errors


def _absolute_state(nc=8, factor=2, seed=0):
    rng = np.random.default_rng(seed)
    q = np.stack(np.indices((nc,) * 3), -1)
    x = factor * q + rng.uniform(-1.5, 1.5, q.shape)
    return jnp.asarray(np.stack([x, rng.normal(0, 1, q.shape)]).astype(np.float32))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(), "declared as displacements"),
        (
            dict(paint_absolute_pos=True),
            "looks like absolute positions in cells of a grid of about 16",
        ),
        (
            dict(paint_absolute_pos=True, pm_nc=32),
            "looks like absolute positions in cells of a grid of about 16",
        ),
        (dict(pm_nc=16), "pm_nc = 16 differs from the lattice's nc = 8"),
    ],
)
@pytest.mark.leg1
def test_state_that_contradicts_the_mode(kwargs, match):
    y = _absolute_state()  # nc = 8, positions in cells of a 16^3 grid
    with pytest.raises(ValueError, match=match):
        InSitu(box_size=10.0, analyses=("fof",), b=0.2, **kwargs)(y)
    with pytest.raises(ValueError, match=match):
        from_jaxpm(y, box_size=10.0, **kwargs)
    # the right declaration runs, and so does a displacement state declared as one
    InSitu(box_size=10.0, analyses=("fof",), paint_absolute_pos=True, pm_nc=16)(y)
    disp = y.at[0].add(-2.0 * jnp.asarray(np.stack(np.indices((8,) * 3), -1), jnp.float32))
    InSitu(box_size=10.0, analyses=("fof",))(disp)
    with pytest.raises(ValueError, match="looks like displacements"):
        InSitu(box_size=10.0, analyses=("fof",), paint_absolute_pos=True, pm_nc=16)(disp)


@pytest.mark.parametrize("pm_nc", [0, -8, 16.0, "16", True])
def test_bad_pm_nc(pm_nc):
    with pytest.raises(ValueError, match="pm_nc must be a positive integer"):
        InSitu(box_size=10.0, paint_absolute_pos=True, pm_nc=pm_nc)
    with pytest.raises(ValueError, match="pm_nc must be a positive integer"):
        from_jaxpm(_absolute_state(), box_size=10.0, paint_absolute_pos=True, pm_nc=pm_nc)


def test_bad_paint_absolute_pos():
    with pytest.raises(ValueError, match="paint_absolute_pos must be True or False"):
        InSitu(box_size=10.0, paint_absolute_pos="yes")


@requires_jaxpm
def test_run_simulation_pm_nc_errors():
    from jaxpm_halos.simulation import run_simulation

    with pytest.raises(ValueError, match="needs an absolute-position state"):
        run_simulation(16, 32.0, 2, pm_nc=32, paint_absolute_pos=False)
    with pytest.raises(ValueError, match="pm_nc = 34 is not divisible by the mesh shape"):
        run_simulation(16, 32.0, 2, mesh=make_mesh((2, 4)), pm_nc=34)
    with pytest.raises(ValueError, match="pm_nc must be a positive integer"):
        run_simulation(16, 32.0, 2, pm_nc=0)
