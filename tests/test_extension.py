"""The JaxPM extension: entry point, user analyses, in-situ runs inside diffeqsolve, errors."""

import re
from importlib.metadata import entry_points

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh, missing, requires, requires_jaxpm
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpm_halos
from jaxpm_halos import from_jaxpm, units
from jaxpm_halos.extension import REGISTRY, InSitu, check, register
from jaxpm_halos.io import gather_catalogue

NEEDS_KNN = pytest.mark.skipif(
    "knn_density" not in REGISTRY, reason="the knn_density analysis is not registered yet"
)


def state_sharding(mesh):
    return NamedSharding(mesh, P(None, "x", "y"))


# ----------------------------------------------------------------------------------------
# Discovery and the registry


def test_entry_point_is_discoverable():
    found = {ep.name: ep for ep in entry_points(group="jaxpm.extensions")}
    assert "halos" in found, "pip install -e . declares the jaxpm.extensions entry point"
    ext = found["halos"].load()
    assert ext is jaxpm_halos.extension.EXTENSION
    assert "fof" in ext.analyses
    assert ext.InSitu is InSitu and ext.register is register


@pytest.fixture
def speed_analysis():
    """A user analysis: per-particle speed, id and position, per-device counts, and a
    replicated value."""
    name = "test_speed"

    @register(
        name,
        outputs={
            "speed": "particle",
            "id": "particle",
            "pos": "particle",
            "owned": "device",
            "twice_a": "replicated",
        },
    )
    def speed(snap):
        p = snap.particles
        return {
            "speed": jnp.linalg.norm(p.vel, axis=-1),
            "id": p.id,
            "pos": p.pos,
            "owned": jnp.sum(snap.valid.astype(jnp.int32))[None],
            "twice_a": 2 * snap.a,
        }

    yield name
    REGISTRY.pop(name)


@pytest.mark.parametrize("mesh_shape", [(2, 4), None], ids=["mesh2x4", "single"])
@pytest.mark.newest
def test_user_analysis_comes_back_in_grid_layout(speed_analysis, mesh_shape):
    nc, box, a = 16, 48.0, 0.7
    rng = np.random.default_rng(3)
    disp = rng.uniform(-3, 3, (nc, nc, nc, 3)).astype(np.float32)
    disp[0, 0, 0] = (-0.5, 0.25, nc - 0.5)  # leaves the box on both sides
    mom = rng.normal(0, 2, (nc, nc, nc, 3)).astype(np.float32)
    y = np.stack([disp, mom])
    if mesh_shape is None:
        y_in = jnp.asarray(y)
    else:
        mesh = make_mesh(mesh_shape)
        y_in = jax.device_put(y, state_sharding(mesh))
    out = InSitu(box_size=box, analyses=(speed_analysis,))(y_in, a)
    res = out[speed_analysis]

    speed = np.linalg.norm(units.momentum_to_velocity(mom.astype(np.float64), a, box, nc), axis=-1)
    assert res["speed"].shape == (nc, nc, nc)
    np.testing.assert_allclose(np.asarray(res["speed"]), speed, rtol=2e-6)
    ix, iy, iz = np.indices((nc, nc, nc))
    np.testing.assert_array_equal(np.asarray(res["id"]), (ix * nc + iy) * nc + iz)
    q = np.stack([ix, iy, iz], -1)
    expected = np.mod(q + disp.astype(np.float64), nc) * (box / nc)
    delta = np.abs(np.asarray(res["pos"], np.float64) - expected)
    assert np.minimum(delta, box - delta).max() < 1e-4
    assert np.asarray(res["pos"]).min() >= 0 and np.asarray(res["pos"]).max() < box
    ndev = 1 if mesh_shape is None else 8
    assert res["owned"].shape == (ndev,) and int(np.sum(res["owned"])) == nc**3
    assert float(res["twice_a"]) == pytest.approx(2 * a)
    assert float(out["a"]) == pytest.approx(a)
    if mesh_shape is not None:
        for key in ("speed", "id"):
            assert res[key].sharding.is_equivalent_to(NamedSharding(mesh, P("x", "y")), 3)


@pytest.mark.newest
def test_a_replicated_output_that_differs_between_devices_is_an_error():
    """A "replicated" output comes back as one device's value, so one that differs between
    devices (a per-device sum, not reduced over the mesh) would be a plausible wrong
    answer: it raises outside jit, and inside jit the domain status and check() say which
    output it was."""
    name, nc, box = "test_x_sum", 16, 32.0

    @register(name, outputs={"local": "replicated", "total": "replicated"})
    def x_sum(snap):
        local = jnp.sum(jnp.where(snap.valid, snap.particles.pos[:, 0], 0.0))
        axes = tuple(a for a in (snap.pencils.x_axis, snap.pencils.y_axis) if a)
        return {"local": local, "total": jax.lax.psum(local, axes)}

    try:
        insitu = InSitu(box_size=box, analyses=(name,))
        y = np.zeros((2, nc, nc, nc, 3), np.float32)  # the lattice: x sums differ by pencil
        y_mesh = jax.device_put(y, state_sharding(make_mesh((2, 4))))
        wrong = r"analysis 'test_x_sum', output \['local'\] declared 'replicated' but not the same"
        with pytest.raises(ValueError, match=wrong):
            insitu(y_mesh, 1.0)
        out = jax.jit(lambda y: insitu(y, 1.0))(y_mesh)
        assert not bool(out["domain"].ok)
        with pytest.raises(ValueError, match=wrong) as error:
            check(out, insitu)
        assert "total" not in str(error.value)
        want = nc**2 * (box / nc) * nc * (nc - 1) / 2
        assert float(out[name]["total"]) == pytest.approx(want, rel=1e-6)
        # On one device every output is the same on every device.
        single = insitu(jnp.asarray(y), 1.0)
        assert bool(single["domain"].ok)
        assert float(single[name]["local"]) == pytest.approx(want, rel=1e-6)
    finally:
        REGISTRY.pop(name)


# ----------------------------------------------------------------------------------------
# A real distributed JaxPM run with the analyses inside diffeqsolve


NC, BOX, STEPS, TS = 32, 32.0, 5, (0.5, 1.0)
SO = ("200c", "200m", "vir")
OMEGA_C, SIGMA8 = 0.25, 0.8


def simulate(insitu, mesh, nc, box, steps, ts, seed=0, amplitude=1.0, adjoint=None):
    """JaxPM from a = 0.1 (2LPT) to 1 in ``steps`` LeapfrogMidpoint steps, with
    ``insitu.saveat(ts)`` as diffeqsolve's SaveAt: the in-situ recipe (docs/insitu.md).
    ``amplitude`` scales
    the linear field. Returns the saved outputs and whether the solve succeeded."""
    import diffrax
    import jax_cosmo as jc
    from jaxpm.kernels import interpolate_power_spectrum
    from jaxpm.pm import linear_field, lpt, make_diffrax_ode

    sharding = NamedSharding(mesh, P("x", "y"))
    shape, halo = (nc,) * 3, nc // 2
    k = jnp.logspace(-4, 1, 128)
    pk = jc.power.linear_matter_power(jc.Planck15(Omega_c=OMEGA_C, sigma8=SIGMA8), k)
    field = amplitude * linear_field(
        shape,
        [box] * 3,
        lambda x: interpolate_power_spectrum(x, k, pk, sharding),
        seed=jax.random.PRNGKey(seed),
        sharding=sharding,
    )
    # A fresh cosmology for JaxPM: the one used for pk holds jax_cosmo's cached background,
    # which jaxpm's growth functions misread (KeyError 'h').
    cosmo = jc.Planck15(Omega_c=OMEGA_C, sigma8=SIGMA8)
    dx, p, _ = lpt(cosmo, field, a=0.1, order=2, halo_size=halo, sharding=sharding)
    ode = diffrax.ODETerm(
        make_diffrax_ode(shape, paint_absolute_pos=False, halo_size=halo, sharding=sharding)
    )
    sol = diffrax.diffeqsolve(
        ode,
        diffrax.LeapfrogMidpoint(),
        t0=0.1,
        t1=1.0,
        dt0=None,
        y0=jnp.stack([dx, p]),
        args=cosmo,
        saveat=insitu.saveat(ts, t0=0.1, t1=1.0),
        stepsize_controller=diffrax.StepTo(ts=jnp.linspace(0.1, 1.0, steps + 1)),
        max_steps=steps,
        throw=False,
        **({} if adjoint is None else {"adjoint": adjoint}),
    )
    return sol.ys, sol.result == diffrax.RESULTS.successful


@pytest.fixture(scope="module")
def insitu_run():
    """A 32^3, 32 Mpc/h JaxPM run (2LPT at a = 0.1, 5 LeapfrogMidpoint steps) on a (2, 4)
    mesh with ``InSitu(...).saveat(ts)`` as diffeqsolve's SaveAt."""
    import jax_cosmo as jc

    mesh = make_mesh((2, 4))
    omega_m = OMEGA_C + float(jc.Planck15().Omega_b)
    analyses = ("fof", "knn_density") if "knn_density" in REGISTRY else ("fof",)
    insitu = InSitu(
        box_size=BOX,
        analyses=analyses,
        b=0.2,
        min_members=20,
        k=16,
        omega_m=omega_m,
        save_state=True,
        so=SO,
        centre="peak",
    )
    with _quiet(cast="error"):  # the recipe's trace prints no RuntimeWarning
        out, ok = jax.jit(lambda seed: simulate(insitu, mesh, NC, BOX, STEPS, TS, seed=seed))(0)
    assert bool(ok)
    check(out)
    return dict(
        out=out,
        insitu=insitu,
        mesh=mesh,
        omega_m=omega_m,
        mass=units.particle_mass(omega_m, BOX, NC),
    )


class _quiet:
    """jax_cosmo's int64 warning off; diffrax's inf fill of integer outputs ("invalid value
    encountered in cast") ignored, or with ``cast="error"`` an error: ``InSitu.saveat``,
    called inside the block, must silence it itself."""

    def __init__(self, cast: str = "ignore"):
        self.cast = cast

    def __enter__(self):
        import warnings

        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.filterwarnings("ignore", "Explicitly requested dtype.*int64")  # jax_cosmo's
        warnings.filterwarnings(self.cast, "invalid value encountered in cast")

    def __exit__(self, *exc):
        return self._w.__exit__(*exc)


@pytest.fixture(scope="module")
def reference(insitu_run):
    """fof run afterwards on the saved final state (momenta as velocities, masses Msun/h)."""
    final = insitu_run["out"]["state"][-1]
    particles = from_jaxpm(final, box_size=BOX, mass=insitu_run["mass"])
    labels, cat = jaxpm_halos.fof(particles, b=0.2, min_members=20)
    return final, labels, cat.to_numpy()


@pytest.mark.optimised  # compiled as users do in CI (pyproject.toml)
@requires_jaxpm
def test_insitu_catalogue_equals_fof_afterwards(insitu_run, reference):
    """Done-when: the in-situ catalogue at the final snapshot equals fof run afterwards on
    the saved final state, exactly, and so do the labels."""
    out = insitu_run["out"]
    assert out["fof"]["labels"].shape == (len(TS), NC, NC, NC)
    np.testing.assert_allclose(np.asarray(out["a"]), TS)
    final, labels_ref, ref = reference
    assert final.sharding.is_equivalent_to(state_sharding(insitu_run["mesh"]), 5)

    got = gather_catalogue(out["fof"]["catalogue"], snapshot=len(TS) - 1)
    assert len(ref["id"]) > 10, "the test run should have halos"
    for field in ("id", "count"):
        np.testing.assert_array_equal(got[field], ref[field], err_msg=field)
    # Also when knn_density widens the shared ghost layer: partial sums are keyed by global
    # label, so every float field is bitwise equal too.
    for field in ("mass", "pos", "radius"):
        np.testing.assert_array_equal(got[field], ref[field], err_msg=field)
    labels = out["fof"]["labels"][-1]
    np.testing.assert_array_equal(np.asarray(labels), np.asarray(labels_ref))
    assert labels.sharding.is_equivalent_to(NamedSharding(insitu_run["mesh"], P("x", "y")), 3)
    # every catalogue id is the label of its members, and counts match the labels
    ids, counts = np.unique(np.asarray(labels), return_counts=True)
    big = dict(zip(ids[counts >= 20].tolist(), counts[counts >= 20].tolist()))
    assert dict(zip(got["id"].tolist(), got["count"].tolist())) == big

    # the earlier snapshot is a real, different catalogue
    early = gather_catalogue(out["fof"]["catalogue"], snapshot=0)
    assert len(early["id"]) < len(got["id"])


@pytest.mark.optimised
@requires_jaxpm
def test_insitu_units(insitu_run, reference):
    """Velocities are momentum_to_velocity of the mean momentum; masses count * m_p."""
    out = insitu_run["out"]
    a = TS[-1]
    mom = reference[2]  # vel: mean momentum in grid units
    got = gather_catalogue(out["fof"]["catalogue"], snapshot=len(TS) - 1)
    np.testing.assert_array_equal(got["id"], mom["id"])
    vel = units.momentum_to_velocity(mom["vel"].astype(np.float64), a, BOX, NC)
    scale = np.abs(vel).max()
    np.testing.assert_allclose(got["vel"], vel, rtol=1e-5, atol=1e-5 * scale)
    np.testing.assert_allclose(
        got["vel_disp"],
        units.momentum_to_velocity(mom["vel_disp"], a, BOX, NC),
        rtol=1e-4,
        atol=1e-5 * scale,
    )
    m_p = units.particle_mass(insitu_run["omega_m"], BOX, NC)
    np.testing.assert_allclose(got["mass"], got["count"] * m_p, rtol=1e-5)
    # The catalogue carries these units for its files (a file's default labels).
    carried = dict(out["fof"]["catalogue"].units)
    assert (carried["mass"], carried["vel"], carried["pos"]) == ("Msun/h", "km/s", "Mpc/h")
    # positions in Mpc/h inside the box; radii well below the box
    assert got["pos"].min() >= 0 and got["pos"].max() < BOX
    assert 0 < got["radius"].min() and got["radius"].max() < BOX / 4


@pytest.mark.optimised
@requires_jaxpm
def test_insitu_so_and_peaks_equal_fof_afterwards_and_brute_force(insitu_run):
    """Inside diffeqsolve's SaveAt: the density peaks and SO masses and radii (thresholds
    at each snapshot's a) equal fof(so=..., centre="peak") run afterwards on the saved
    state, and a float64 brute force to within one particle."""
    from test_so import KNIFE
    from test_so import _check as check_so

    from jaxpm_halos.testing.reference import so_reference

    out, insitu, m_p = insitu_run["out"], insitu_run["insitu"], insitu_run["mass"]
    for snapshot, a in enumerate(TS):
        state = out["state"][snapshot]
        particles = from_jaxpm(state, box_size=BOX, mass=m_p)
        _, cat = jaxpm_halos.fof(
            particles,
            b=0.2,
            min_members=20,
            so=SO,
            omega_m=insitu.omega_m,
            a=a,
            centre="peak",
            k=insitu.k,
        )
        ref = cat.to_numpy()
        got = gather_catalogue(out["fof"]["catalogue"], snapshot=snapshot)
        names = ["peak"] + [p + n for n in SO for p in "mr"]
        assert set(names) <= set(got)
        for name in names:
            np.testing.assert_array_equal(got[name], ref[name], err_msg=name)
        thresholds = [units.so_density(n, omega_m=insitu.omega_m, a=a) for n in SO]
        pos = np.asarray(particles.pos).reshape(-1, 3)
        brute = so_reference(pos, got["peak"], BOX, thresholds, m_p, KNIFE)
        for d, n in enumerate(SO):
            check_so(
                got["r" + n], got["m" + n], (brute[0][:, d], brute[1][:, d]), thresholds[d], m_p
            )
        assert np.all(got["m200m"] >= got["mvir"]) and np.all(got["mvir"] >= got["m200c"])
        assert np.max(got["m200m"]) > 50 * m_p  # resolved haloes, not single particles


@pytest.mark.optimised
@NEEDS_KNN
@requires_jaxpm
def test_insitu_density_equals_knn_density_afterwards(insitu_run):
    out = insitu_run["out"]
    final = out["state"][-1]
    ref = jaxpm_halos.knn_density(
        from_jaxpm(final, box_size=BOX, mass=insitu_run["mass"]), k=insitu_run["insitu"].k
    )
    dens = out["knn_density"]["density"]
    assert dens.shape == (len(TS), NC, NC, NC)
    np.testing.assert_array_equal(np.asarray(dens[-1]), np.asarray(ref))


@NEEDS_KNN
@pytest.mark.slow
@requires_jaxpm
def test_derivative_through_the_solve_is_the_chain_rule():
    """Forward models differentiate through the simulation. With diffrax.ForwardMode, the
    derivative with respect to the linear field's amplitude of the in-situ kNN density and
    FoF centres must be the chain rule applied by hand to the final state's own tangent:
    through each particle's k-th neighbour distance (neighbours held fixed), and through the
    mean displacement of each halo's members. (Reverse mode through a distributed JaxPM
    step is wrong upstream: see docs/gradients.md.)"""
    import diffrax

    nc, box, steps, k = 16, 32.0, 3, 8
    mesh = make_mesh((2, 4))
    insitu = InSitu(
        box_size=box, analyses=("fof", "knn_density"), min_members=5, k=k, save_state=True
    )

    def run(amplitude):
        out, _ = simulate(
            insitu, mesh, nc, box, steps, (1.0,), amplitude=amplitude, adjoint=diffrax.ForwardMode()
        )
        cat = out["fof"]["catalogue"]
        return (out["state"][-1], out["knn_density"]["density"][-1], cat.pos[-1]), out

    with _quiet():
        (y, rho, _), (dy, drho, dcentres), out = jax.jit(
            lambda a: jax.jvp(run, (a,), (jnp.ones_like(a),), has_aux=True)
        )(jnp.float32(1.0))
    check(out)  # buffers are not checked inside jit
    count, ids = out["fof"]["catalogue"].count[-1], out["fof"]["catalogue"].id[-1]
    y, dy = np.asarray(y, np.float64), np.asarray(dy, np.float64)
    assert np.abs(dy[0]).max() > 0.1, "the final displacements should depend on the amplitude"
    scale = box / nc
    lattice = np.stack(np.meshgrid(*[np.arange(nc)] * 3, indexing="ij"), -1)
    pos = (np.mod(lattice + y[0], nc) * scale).reshape(-1, 3)
    dpos = (dy[0] * scale).reshape(-1, 3)

    _, neighbours = jaxpm_halos.knn(from_jaxpm(jnp.asarray(y, jnp.float32), box_size=box), k=k)
    j = np.asarray(neighbours).reshape(-1, k)[:, -1]
    delta = pos - pos[j]
    delta -= box * np.round(delta / box)
    r2 = np.sum(delta**2, axis=1)
    expected = (
        -3 * np.asarray(rho, np.float64).reshape(-1) * np.sum(delta * (dpos - dpos[j]), axis=1) / r2
    )
    np.testing.assert_allclose(
        np.asarray(drho).reshape(-1), expected, rtol=2e-3, atol=2e-3 * np.abs(expected).max()
    )

    labels = np.asarray(
        jaxpm_halos.fof(
            from_jaxpm(jnp.asarray(y, jnp.float32), box_size=box), b=0.2, min_members=5
        )[0]
    ).reshape(-1)
    count, ids, dcentres = np.asarray(count), np.asarray(ids), np.asarray(dcentres)
    halos = np.flatnonzero(count > 0)
    assert len(halos) > 40, "the test run should have halos"
    for row in halos:
        members = labels == ids[row]
        assert members.sum() == count[row]
        np.testing.assert_allclose(
            dcentres[row], dpos[members].mean(axis=0), rtol=1e-3, atol=1e-4 * np.abs(dpos).max()
        )


# ----------------------------------------------------------------------------------------
# Work per save time (issue #19)


def _oscillator(t, y, args):
    return jnp.stack([y[1], -y[0]])


def _sorts_per_step_and_per_save(saveat, mesh, nc=16, steps=3, adjoint=None, field=_oscillator):
    """Compile a diffeqsolve with ``saveat`` on a ``(2, nc, nc, nc, 3)`` state sharded like
    JaxPM's, and count the sort instructions that run at every step and those inside
    diffrax's save loop (see tests/hlo.py). A harmonic oscillator stands in for the PM
    force: what matters is only where XLA puts the analyses. Also returns the number of
    sort instructions in the whole program."""
    import diffrax
    from hlo import save_loop_counts

    def solve(y0):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(field),
            diffrax.Euler(),
            t0=0.1,
            t1=1.0,
            dt0=None,
            y0=y0,
            saveat=saveat,
            max_steps=steps,
            throw=False,
            stepsize_controller=diffrax.StepTo(ts=jnp.linspace(0.1, 1.0, steps + 1)),
            **({} if adjoint is None else {"adjoint": adjoint}),
        )
        return sol.ys

    y0 = jax.ShapeDtypeStruct((2, nc, nc, nc, 3), jnp.float32, sharding=state_sharding(mesh))
    with _quiet():
        text = jax.jit(solve).lower(y0).compile().as_text()
    return (*save_loop_counts(text, "sort"), text.count(" sort("))


@requires("diffrax")
@pytest.mark.parametrize(
    "adjoint", ["recursive_checkpoint", pytest.param("forward_mode", marks=pytest.mark.slow)]
)
def test_one_save_time_runs_the_analyses_once_not_at_every_step(adjoint):
    """With a single save time, diffrax's save loop reads ts[0] whatever its index, so XLA
    (while-loop-invariant-code-motion) used to hoist the whole SaveAt function out of it:
    the analyses ran at every solver step (11.9 s against 1.4 s at 64^3, 10 steps). Every
    sort of FoF must sit inside the save loop, none in the step loop outside it."""
    import diffrax

    mesh = make_mesh((2, 4))
    insitu = InSitu(box_size=32.0, analyses=("fof",), min_members=5)
    per_step, per_save, total = _sorts_per_step_and_per_save(
        insitu.saveat([1.0], t0=0.1, t1=1.0),
        mesh,
        adjoint=None if adjoint == "recursive_checkpoint" else diffrax.ForwardMode(),
    )
    assert per_step == 0, f"{per_step} sorts run at every step ({per_save} in the save loop)"
    assert per_save > 0, "the analyses' sorts should be found in diffrax's save loop"
    # diffrax's branch for a solve with t0 == t1 (never taken here) used to hold a second
    # copy of the analyses, which XLA kept: twice the compile time.
    assert total == per_save, f"{total - per_save} sorts outside the save loop (t0 == t1 branch?)"


@requires("diffrax")
@pytest.mark.parametrize("mesh_shape", [None, (2, 4)])
def test_a_solve_that_takes_no_step_reports_that_the_analyses_did_not_run(mesh_shape):
    """With t0 == t1 diffrax takes no step and saves its t0 == t1 branch, where the
    analyses are a placeholder (they are compiled once, in the save loop): its statuses say
    so and check names the fix, rather than passing zeros for a catalogue."""
    import diffrax

    nc = 16
    insitu = InSitu(box_size=32.0, analyses=("fof",), min_members=5)
    y0 = jnp.zeros((2, nc, nc, nc, 3), jnp.float32)
    if mesh_shape is not None:
        y0 = jax.device_put(y0, state_sharding(make_mesh(mesh_shape)))
    solve = jax.jit(
        lambda y: (
            diffrax.diffeqsolve(
                diffrax.ODETerm(_oscillator),
                diffrax.Euler(),
                t0=1.0,
                t1=1.0,
                dt0=0.1,
                y0=y,
                saveat=insitu.saveat([1.0]),
                max_steps=4,
                throw=False,
            ).ys
        )
    )
    with _quiet():
        out = solve(y0)
    assert not np.any(out["domain"].ok) and not np.any(out["fof"]["catalogue"].status.ok)
    with pytest.raises(
        ValueError,
        match=r"did not run: the diffrax solve took no step .*"
        r"insitu\(y0, a\)",
    ) as error:
        check(out, insitu)
    assert error.value.failure.kind is jaxpm_halos.FailureKind.NOT_RUN


@requires("diffrax")
def test_the_counter_sees_a_sort_that_runs_at_every_step():
    """The control of the counts above: a sort in the vector field, and one in a SaveAt
    fn with two save times (which XLA leaves in the save loop), are found where they run
    (were diffrax's loops renamed, per_step would read 0 whatever the analyses do)."""
    import diffrax

    mesh = make_mesh((2, 4))
    sorting = lambda t, y, args: jnp.sort(_oscillator(t, y, args), axis=-2)  # noqa: E731
    saveat = diffrax.SaveAt(ts=[0.5, 1.0], fn=lambda t, y, args: jnp.sort(y[0], axis=-2))
    per_step, per_save, _ = _sorts_per_step_and_per_save(saveat, mesh, field=sorting)
    assert per_step > 0 and per_save > 0, (per_step, per_save)


# In CI, test_one_save_time_runs_the_analyses_once_not_at_every_step checks the same loops
# through InSitu.saveat.
@pytest.mark.slow
@requires_jaxpm
@pytest.mark.parametrize("saveat_fn", ["insitu", "insitu_switchable", "user_sort"])
def test_demo_with_one_snapshot_runs_its_saveat_fn_once_not_at_every_step(saveat_fn):
    """The same through the demo's run_simulation, whose SaveAt also saves t1 and whose
    switchable_saveat_fn wraps the analyses in a lax.cond; and for any saveat_fn there (here
    a sort of the displacements along z)."""
    from hlo import save_loop_counts

    from jaxpm_halos.simulation import run_simulation, switchable_saveat_fn

    nc, box = 16, 32.0
    mesh = make_mesh((2, 4))
    insitu = InSitu(box_size=box, analyses=("fof",), min_members=5)
    if saveat_fn == "insitu":  # as the docs say it may be passed: called with the times
        kwargs = dict(saveat_fn=insitu)
    elif saveat_fn == "insitu_switchable":
        kwargs = dict(
            saveat_fn=switchable_saveat_fn(insitu, [1.0]), saveat_inputs=jnp.ones(1, bool)
        )
    else:
        kwargs = dict(saveat_fn=lambda a, y, cosmo: jnp.sort(y[0, ..., 0], axis=-1))
    with _quiet():
        result = run_simulation(nc, box, 2, [1.0], mesh=mesh, **kwargs)
    text = result.compiled.as_text()
    per_step, per_save = save_loop_counts(text, "sort")
    assert per_step == 0, f"{per_step} sorts run at every step ({per_save} in the save loop)"
    assert per_save > 0, "the saveat_fn's sorts should be found in diffrax's save loop"
    if saveat_fn != "user_sort":  # analyses, not also compiled for diffrax's t0 == t1 case
        assert text.count(" sort(") == per_save, (text.count(" sort("), per_save)
    if saveat_fn == "insitu":  # and what it saved is the catalogue of the final state
        offline = insitu(result.state, 1.0)["fof"]["catalogue"]
        saved = result.saved["fof"]["catalogue"]
        np.testing.assert_array_equal(np.asarray(saved.id[0]), np.asarray(offline.id))
        np.testing.assert_array_equal(np.asarray(saved.count[0]), np.asarray(offline.count))
        assert int(np.sum(offline.num)) > 0


@pytest.mark.newest
def test_an_analysis_registered_again_runs_its_new_function():
    """The compiled InSitu program was keyed on the analysis names alone, so the second
    registration silently ran the first function."""
    y = jnp.asarray(np.random.default_rng(2).normal(0, 0.5, (2, 8, 8, 8, 3)), jnp.float32)
    name = "test_scaled_x"
    try:
        got = []
        for factor in (1.0, 2.0):
            register(name)(lambda snap, f=factor: f * snap.particles.pos[:, 0])
            insitu = InSitu(box_size=16.0, analyses=(name,))  # equal InSitus both times
            got.append(np.asarray(insitu(y, 1.0)[name]))
        np.testing.assert_array_equal(got[1], 2 * got[0])
    finally:
        REGISTRY.pop(name)


@pytest.mark.parametrize("name", ["a", "domain", "state", "fof", "knn_density", ""])
def test_names_that_would_shadow_results_or_built_ins_are_refused(name):
    with pytest.raises(ValueError, match="name"):
        register(name)(lambda snap: snap.particles.pos[:, 0])
    assert name not in REGISTRY or REGISTRY[name].run.__module__ == "jaxpm_halos.insitu.registry"


def test_snapshot_knn_equals_ckdtree_on_a_thin_ghost_layer():
    """snap.knn searches the snapshot's own ghost layer, so it is exact whatever width the
    analysis was registered with (a thin one here: many spheres are completed across
    devices); knn_on_decomposition given a wider width than the layer was wrong and
    reported ok."""
    from scipy.spatial import cKDTree

    nc, box, k = 8, 16.0, 6
    rng = np.random.default_rng(5)
    y = np.stack([rng.normal(0, 0.5, (nc, nc, nc, 3)), np.zeros((nc, nc, nc, 3))])
    y = jax.device_put(y.astype(np.float32), state_sharding(make_mesh((2, 4))))
    name = "test_snapshot_knn"

    @register(
        name, outputs={"dist": "particle", "ok": "particle", "status": "replicated"}, width=0.5
    )
    def nearest(snap):
        result, status = snap.knn(k, config=jaxpm_halos.KNNConfig(remote_factor=2.0))
        return {"dist": result["dist"], "ok": result["ok"], "status": status}

    try:
        out = InSitu(box_size=box, analyses=(name,))(y, 1.0)[name]
    finally:
        REGISTRY.pop(name)
    pos = np.asarray(from_jaxpm(y, box_size=box).pos, np.float64).reshape(-1, 3)
    want = cKDTree(pos, boxsize=box).query(pos, k=k + 1)[0][:, 1:]
    assert bool(out["status"].ok) and np.all(np.asarray(out["ok"]))
    np.testing.assert_allclose(np.asarray(out["dist"]).reshape(-1, k), want, rtol=2e-6, atol=1e-5)


# ----------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize(
    "outputs, fn, message",
    [
        (
            {"x": "particle"},
            lambda snap: {"x": snap.particles.pos[:5, 0]},
            r"'test_bad_output', output \['x'\]: a 'particle' output needs one row per owned row",
        ),
        ("particle", lambda snap: jnp.sum(snap.particles.pos), "got \\(\\)"),
        (
            "device",
            lambda snap: jnp.sum(snap.particles.pos),
            r"leading axis \(e.g. value\[None\]\)",
        ),
        # a key the outputs= dict lacks: JAX's "Dict key mismatch" named no analysis
        (
            {"x": "particle"},
            lambda snap: {"x": snap.particles.pos[:, 0], "n": jnp.sum(snap.valid)},
            r"analysis 'test_bad_output': its declared outputs=\{'x': 'particle'\} .* does not "
            r"match the tree it returned",
        ),
    ],
)
def test_outputs_that_do_not_fit_their_kind_name_the_analysis(outputs, fn, message):
    y = jnp.zeros((2, 8, 8, 8, 3), jnp.float32)
    register("test_bad_output", outputs=outputs)(fn)
    try:
        with pytest.raises(ValueError, match=message):
            InSitu(box_size=16.0, analyses=("test_bad_output",))(y, 1.0)
    finally:
        REGISTRY.pop("test_bad_output")


def test_an_unknown_output_kind_is_refused_at_registration():
    with pytest.raises(
        ValueError,
        match=r"analysis 'test_kind': outputs= holds kinds "
        r"\['per-particle'\]; each must be one of",
    ):
        register("test_kind", outputs={"x": "per-particle"})
    assert "test_kind" not in REGISTRY


def test_unregistered_analysis_name():
    with pytest.raises(ValueError, match=r"no in-situ analysis named 'halo_finder'.*'fof'"):
        InSitu(box_size=32.0, analyses=("fof", "halo_finder"))


@requires("diffrax")  # InSitu.saveat builds a diffrax.SaveAt
@pytest.mark.parametrize("ts", [(0.05, 1.0), (0.5, 1.2), ()])
def test_snapshot_times_outside_the_solve(ts):
    insitu = InSitu(box_size=32.0, analyses=("fof",))
    with pytest.raises(ValueError, match=r"must be non-empty, finite and lie in \[0.1, 1.0\]"):
        insitu.saveat(ts, t0=0.1, t1=1.0)
    insitu.saveat((0.1, 0.5, 1.0), t0=0.1, t1=1.0)  # the end points are fine


@requires("diffrax")
def test_snapshot_times_out_of_order_are_refused():
    """diffrax refuses them only inside the solve, where on a mesh its check fails on one
    device while the others wait in a collective, and the process aborts."""
    insitu = InSitu(box_size=32.0, analyses=("fof",))
    with pytest.raises(
        ValueError,
        match=r"sorted in the solve's direction \(increasing\); "
        r"pass \[0.5, 1.0\]",
    ):
        insitu.saveat((1.0, 0.5), t0=0.1, t1=1.0)
    with pytest.raises(ValueError, match="decreasing"):
        insitu.saveat((0.5, 1.0), t0=1.0, t1=0.1)
    with pytest.raises(ValueError, match="one direction"):  # without t0, t1: either order
        insitu.saveat((0.5, 1.0, 0.7))
    with pytest.raises(ValueError, match="finite"):
        insitu.saveat((0.5, float("nan")))
    with pytest.raises(ValueError, match=r"1-D sequence, got shape \(2, 1\)"):  # not flattened
        insitu.saveat([[0.5], [1.0]])
    for bound in (dict(t0=0.1), dict(t1=1.0)):  # one bound alone would check nothing
        with pytest.raises(ValueError, match="pass both of the solve's t0 and t1"):
            insitu.saveat((0.05, 1.5), **bound)
    assert insitu.saveat(1.0, t0=0.1, t1=1.0).subs.ts.shape == (1,)  # one time
    insitu.saveat((1.0, 0.5), t0=1.0, t1=0.1)  # a backward solve
    insitu.saveat((1.0, 0.5))
    insitu.saveat((0.5, 0.5, 1.0))  # a repeated time is a repeated snapshot
    with pytest.raises(TypeError, match="concrete save times"):  # was a bare tracer error
        jax.jit(lambda ts: insitu.saveat(ts).subs.ts)(jnp.asarray([0.5, 1.0]))
    # Text was parsed as numbers by numpy; complex times met numpy's own TypeError.
    for ts, dtype in ((["0.5", "1.0"], "<U3"), ([0.5 + 1j], "complex128")):
        with pytest.raises(
            ValueError, match=f"snapshot times must hold real numbers, got dtype {dtype}"
        ):
            insitu.saveat(ts, t0=0.1, t1=1.0)


def test_a_boolean_or_complex_state_is_refused():
    # A complex state was cast to its real part (only numpy's ComplexWarning said so), a
    # boolean one taken as displacements of 0 and 1.
    insitu = InSitu(box_size=32.0, analyses=("fof",))
    y = np.zeros((2, 8, 8, 8, 3), np.float32)
    for bad in (y.astype(np.complex64), y > 0):
        with pytest.raises(
            ValueError, match=f"the JaxPM state must hold real numbers, got dtype {bad.dtype}"
        ):
            insitu(bad, 1.0)


def test_an_analysis_asking_for_a_layer_wider_than_a_pencil_is_named():
    y = jnp.zeros((2, 8, 8, 8, 3), jnp.float32)
    name = "test_too_wide"
    try:
        register(name, width=40.0)(lambda snap: snap.particles.pos[:, 0])
        insitu = InSitu(box_size=32.0, analyses=(name,))
        with pytest.raises(
            ValueError,
            match=f"analysis '{name}' asks for a ghost layer of 40 "
            r".*\[0, 32\].*smaller width=",
        ):
            insitu(y, 1.0)
    finally:
        REGISTRY.pop(name)


@pytest.mark.parametrize(
    "shape", [(16, 16, 16, 3), (3, 16, 16, 16, 3), (2, 16, 16, 8, 3), (2, 16, 16, 16, 2)]
)
def test_state_of_the_wrong_shape(shape):
    insitu = InSitu(box_size=32.0, analyses=("fof",))
    with pytest.raises(ValueError, match=r"\(2, nc, nc, nc, 3\)"):
        insitu(jnp.zeros(shape, jnp.float32), 1.0)


def test_a_batch_of_scale_factors_is_refused():
    insitu = InSitu(box_size=32.0, analyses=("fof",))
    with pytest.raises(ValueError, match=r"a must be one scale factor, got .* shape \(2,\)"):
        insitu(jnp.zeros((2, 16, 16, 16, 3), jnp.float32), np.array([1.0, 1.0]))


@pytest.mark.parametrize("spec", [P(None, None, "x", "y"), P("x", "y")])
def test_state_sharded_over_the_wrong_axes(spec):
    mesh = make_mesh((2, 4))
    y = jax.device_put(np.zeros((2, 16, 16, 16, 3), np.float32), NamedSharding(mesh, spec))
    insitu = InSitu(box_size=32.0, analyses=("fof",))
    with pytest.raises(ValueError, match=r"sharded over its grid's first two axes"):
        insitu(y, 1.0)


# ----------------------------------------------------------------------------------------
# Capacities


@pytest.mark.slow
@NEEDS_KNN
def test_overflow_of_fofs_own_ghost_layer_names_a_setting_that_fits():
    """kNN widens the shared ghost layer, and FoF rebuilds a narrow one of its own. A clump
    hugging a domain face overflows only FoF's buffer: the error must spell the InSitu
    setting, and its value must fit both ghost buffers (they share the knob)."""
    nc, box = 16, 16.0
    mesh = make_mesh((2, 4))  # pencils of 8 x 4 Mpc/h
    rng = np.random.default_rng(5)
    disp = rng.uniform(-0.3, 0.3, (nc, nc, nc, 3)).astype(np.float32)
    lattice = np.stack(np.meshgrid(*[np.arange(nc)] * 3, indexing="ij"), -1).reshape(-1, 3)
    block = np.flatnonzero((lattice[:, 0] < 8) & (lattice[:, 1] < 4))  # device (0, 0)'s
    moved = rng.permutation(block)[:300]
    clump = np.array([4.0, 3.9, 8.0]) + rng.uniform(-0.05, 0.05, (300, 3))
    disp.reshape(-1, 3)[moved] = clump - lattice[moved]
    y = jax.device_put(
        jnp.stack([jnp.asarray(disp), jnp.zeros((nc, nc, nc, 3))]), state_sharding(mesh)
    )

    overflow = r"buffer 'fof ghosts' overflowed"
    with pytest.raises(jaxpm_halos.CapacityError, match=overflow) as error:
        InSitu(box_size=box)(y, grow=False)
    setting = re.search(
        r"Rerun with (InSitu\(domain=DomainConfig\("
        r"ghost_factor=([0-9.]+)\)\))",
        str(error.value),
    )
    assert setting, str(error.value)
    fitted = InSitu(
        box_size=box, domain=jaxpm_halos.DomainConfig(ghost_factor=float(setting.group(2)))
    )
    out = fitted(y, grow=False)  # raises if any buffer, FoF's or the shared one, overflows
    labels, _ = jaxpm_halos.fof(
        from_jaxpm(y, box_size=box),
        b=0.2,
        min_members=20,
        config=jaxpm_halos.FoFConfig(domain=fitted.domain),
    )
    # By default the call grows the buffer itself, warns once, and gives the same result.
    with pytest.warns(jaxpm_halos.GrowthWarning, match=r"InSitu\(domain=DomainConfig"):
        grown = InSitu(box_size=box)(y)
    np.testing.assert_array_equal(np.asarray(grown["fof"]["labels"]), np.asarray(labels))
    np.testing.assert_array_equal(np.asarray(out["fof"]["labels"]), np.asarray(labels))
    assert np.bincount(np.asarray(labels).ravel()).max() >= 300


def test_check_grows_what_every_analysis_saw_overflow_in_one_suggestion():
    """FoF's status saw the ghosts overflow, kNN's (another ghost buffer of the same
    decomposition) needed more of them and the z images too: the suggestion left
    image_factor as it was, so the pasted fix met the images' overflow one rerun later."""
    from jaxpm_halos.core.config import GHOSTS, IMAGES
    from jaxpm_halos.core.errors import Limit
    from jaxpm_halos.core.status import Status

    fof = Status(
        {"fof ghosts": jnp.int32(300)}, jnp.int32(0), (("fof ghosts", Limit(GHOSTS, 100, 1000.0)),)
    )
    knn = Status(
        {"ghosts": jnp.int32(450), "z images": jnp.int32(900)},
        jnp.int32(0),
        (("ghosts", Limit(GHOSTS, 100, 1000.0)), ("z images", Limit(IMAGES, 50, 1000.0))),
    )
    with pytest.raises(jaxpm_halos.CapacityError) as error:
        check({"fof": fof, "knn_density": knn})
    assert "Rerun with InSitu(domain=DomainConfig(ghost_factor=0.45, image_factor=0.9))." in str(
        error.value
    ), str(error.value)


def test_check_with_the_insitu_spells_its_whole_config():
    from jaxpm_halos.core.config import GHOSTS
    from jaxpm_halos.core.errors import Limit
    from jaxpm_halos.core.status import Status

    status = Status(
        {"ghosts": jnp.int32(300)}, jnp.int32(0), (("ghosts", Limit(GHOSTS, 100, 1000.0)),)
    )
    insitu = InSitu(
        box_size=64.0,
        fof=jaxpm_halos.FoFConfig(max_halos=50),
        domain=jaxpm_halos.DomainConfig(image_factor=0.7),
    )
    with pytest.raises(jaxpm_halos.CapacityError) as error:
        check({"domain": status}, insitu)
    # FoF's config, changed by the user (or an earlier suggestion), is kept beside it.
    assert (
        "Rerun with InSitu(domain=DomainConfig(ghost_factor=0.3, image_factor=0.7), "
        "fof=FoFConfig(max_halos=50))." in str(error.value)
    )
    with pytest.raises(jaxpm_halos.CapacityError) as error:  # without it: the knob alone
        check({"domain": status})
    assert "Rerun with InSitu(domain=DomainConfig(ghost_factor=0.3))." in str(error.value)


def _collapsed_state(mesh, nc=16, centre=(4.0, 2.0, 8.0), sigma=0.6, seed=0):
    """A state whose particles all fall onto one clump (grid units): the shared
    decomposition's buffers overflow on the device holding it."""
    rng = np.random.default_rng(seed)
    lattice = np.stack(np.meshgrid(*[np.arange(nc)] * 3, indexing="ij"), -1).astype(np.float32)
    target = np.asarray(centre, np.float32) + rng.normal(0, sigma, lattice.shape)
    disp = (target - lattice).astype(np.float32)
    return jax.device_put(
        jnp.stack([jnp.asarray(disp), jnp.zeros_like(jnp.asarray(disp))]), state_sharding(mesh)
    )


def _shared_decomposition_overflow():
    """A collapsed state on (2, 4), box 32, and FoF with kNN density in situ whose shared
    decomposition overflows its ghost buffer alone (one growth round, not three)."""
    domain = jaxpm_halos.DomainConfig(capacity_factor=8.8, transfer_factor=2.21)
    insitu = InSitu(box_size=32.0, analyses=("fof", "knn_density"), k=8, domain=domain)
    return _collapsed_state(make_mesh((2, 4))), 32.0, insitu


@pytest.mark.leg1
@NEEDS_KNN
def test_every_analysis_status_covers_the_shared_decomposition():
    """Under jit an overflow of the shared decomposition used to show only in
    out["domain"]: the kNN status said ok with every density wrong. Now each analysis's
    status includes the decomposition it ran on, so check_insitu of any part raises."""
    y, box, insitu = _shared_decomposition_overflow()
    out = jax.jit(lambda y: insitu(y, 1.0))(y)
    assert not bool(out["domain"].ok)
    assert not bool(out["knn_density"]["status"].ok)
    assert not bool(out["fof"]["catalogue"].status.ok)
    for part in (out["knn_density"], out["fof"], out):
        with pytest.raises(jaxpm_halos.CapacityError, match=r"InSitu\(domain=DomainConfig"):
            check(part, insitu)


@pytest.mark.slow
@NEEDS_KNN
def test_an_eager_insitu_call_grows_the_shared_decomposition():
    """The eager call grows the shared decomposition's buffers and equals cKDTree's
    density."""
    from scipy.spatial import cKDTree

    y, box, insitu = _shared_decomposition_overflow()
    with pytest.warns(jaxpm_halos.GrowthWarning):
        grown = insitu(y, 1.0)
    pos = np.asarray(from_jaxpm(y, box_size=box).pos, np.float64).reshape(-1, 3)
    r_k = cKDTree(pos, boxsize=box).query(pos, k=8 + 1)[0][:, -1]
    want = (8 - 1) / (4 / 3 * np.pi * r_k**3)  # unit masses
    np.testing.assert_allclose(
        np.asarray(grown["knn_density"]["density"]).reshape(-1), want, rtol=1e-4
    )


def test_an_insitu_config_nested_in_fof_is_refused_not_ignored():
    with pytest.raises(ValueError, match=r"pass domain=DomainConfig\(ghost_factor=0.5\)"):
        InSitu(
            box_size=32.0,
            fof=jaxpm_halos.FoFConfig(domain=jaxpm_halos.DomainConfig(ghost_factor=0.5)),
        )
    with pytest.raises(ValueError, match=r"pass domain=DomainConfig\(image_factor=0.5\)"):
        InSitu(
            box_size=32.0,
            fof=jaxpm_halos.FoFConfig(
                so=jaxpm_halos.SOConfig(domain=jaxpm_halos.DomainConfig(image_factor=0.5))
            ),
        )
    with pytest.raises(ValueError, match=r"pass knn=KNNConfig\(batch_size=8\)"):
        InSitu(box_size=32.0, fof=jaxpm_halos.FoFConfig(knn=jaxpm_halos.KNNConfig(batch_size=8)))


def test_so_settings_are_checked_and_an_so_overflow_names_insitu_fof():
    with pytest.raises(ValueError, match="omega_m"):
        InSitu(box_size=32.0, so=("200c",))
    with pytest.raises(ValueError, match="unknown SO definition"):
        InSitu(box_size=32.0, so=("200x",), omega_m=0.3)
    with pytest.raises(ValueError, match="centre"):
        InSitu(box_size=32.0, centre="potential")
    with pytest.raises(ValueError, match="include 'fof'"):
        InSitu(box_size=32.0, analyses=("knn_density",), centre="peak")
    # An unresolved profile is spelled as the InSitu argument that holds SOConfig.
    from jaxpm_halos.core.layout import Pencils
    from jaxpm_halos.insitu.errors import insitu_error
    from jaxpm_halos.so._search import radius_limit

    limit = radius_limit(4.0, Pencils(None, None, 1, 1, 32.0))
    failure = jaxpm_halos.Failure(
        jaxpm_halos.FailureKind.OVERFLOW, 2 * limit.rows, "so radius", limit, 2 * limit.rows
    )
    insitu = InSitu(
        box_size=32.0,
        omega_m=0.3,
        so=("vir",),
        fof=jaxpm_halos.FoFConfig(max_halos=64, so=jaxpm_halos.SOConfig(radius=4.0)),
    )
    message = str(insitu_error(failure, insitu))
    assert "InSitu(fof=FoFConfig(max_halos=64, so=SOConfig(radius=8.0" in message
    assert (
        str(insitu_error(failure, None)).count("InSitu(fof=FoFConfig(so=SOConfig(radius=8.0") == 1
    )


def test_an_insitu_suggestion_keeps_the_fixes_of_the_other_configs():
    """A suggestion for FoF's config, after the run's decomposition was grown, spells both:
    pasted in place of the earlier suggestion it must not undo that fix (a probe went back
    and forth between the two)."""
    import re

    from jaxpm_halos.core.layout import Pencils
    from jaxpm_halos.insitu.errors import insitu_error
    from jaxpm_halos.so._search import radius_limit

    limit = radius_limit(4.0, Pencils(None, None, 1, 1, 32.0))
    failure = jaxpm_halos.Failure(
        jaxpm_halos.FailureKind.OVERFLOW, 2 * limit.rows, "so radius", limit, 2 * limit.rows
    )
    domain = jaxpm_halos.DomainConfig(ghost_factor=0.46)
    insitu = InSitu(box_size=32.0, omega_m=0.3, so=("vir",), domain=domain)
    message = str(insitu_error(failure, insitu))
    spelled = re.search(r"Rerun with InSitu\((.*?)\)(?: or more|\.)", message).group(1)
    pasted = eval(f"dict({spelled})", vars(jaxpm_halos))
    assert pasted["domain"] == domain
    assert pasted["fof"].so.radius == 8.0 and pasted["fof"] == failure.grown(
        InSitu(box_size=32.0).fof
    )


def _clumpy_state(mesh, nc=16, seed=1):
    """A lattice state (grid units) with three blocks of 64 particles gathered into clumps,
    one on a box corner: a few FoF groups to measure SO about."""
    rng = np.random.default_rng(seed)
    lattice = np.stack(np.meshgrid(*[np.arange(nc)] * 3, indexing="ij"), -1).astype(np.float32)
    target = lattice.copy()
    for corner, centre in (
        ((0, 0, 0), (0.1, 0.2, 15.9)),
        ((6, 2, 8), (7.5, 3.5, 9.5)),
        ((10, 10, 2), (12.0, 11.5, 3.5)),
    ):
        block = tuple(slice(c, c + 4) for c in corner)
        target[block] = np.asarray(centre) + rng.normal(0, 0.25, (4, 4, 4, 3))
    disp = jnp.asarray(target - lattice)
    return jax.device_put(jnp.stack([disp, jnp.zeros_like(disp)]), state_sharding(mesh))


@pytest.mark.slow
def test_insitu_so_thresholds_are_fofs_eager_inside_jit_and_at_a_save_time():
    """SO thresholds depend on a through float arithmetic. Computed in float32 inside the
    program they came out an ulp away from fof(so=..., a=...)'s float64 ones at a = 0.6
    (vir and 200c), and so did the radii. Eager, inside jit with a constant a, and at a
    save time given traced with times= (as saveat's function, which runs too where diffrax
    is installed, passes it) they now equal fof's."""
    mesh, box, a = make_mesh((2, 4)), 32.0, 0.6
    y = _clumpy_state(mesh)
    so = ("vir", "200c")
    insitu = InSitu(box_size=box, b=0.2, min_members=20, omega_m=0.3, so=so)
    particles = from_jaxpm(y, box_size=box, mass=units.particle_mass(0.3, box, 16))
    _, cat = jaxpm_halos.fof(particles, b=0.2, min_members=20, so=so, omega_m=0.3, a=a)
    want = cat.to_numpy()
    assert len(want["id"]) == 3
    times = [0.3, a, 1.0]
    at_time = jax.jit(lambda y, t: insitu(y, t, times=times))
    runs = {
        "eager": insitu(y, a),
        "jit": jax.jit(lambda y: insitu(y, a))(y),
        "save time": at_time(y, jnp.float32(a)),
    }
    if not missing("diffrax"):  # saveat's own function, as diffeqsolve calls it
        save = insitu.saveat(times).subs.fn
        runs["saveat"] = jax.jit(lambda y, t: save(t, y, None))(y, jnp.float32(a))
    for how, out in runs.items():
        got = gather_catalogue(out["fof"]["catalogue"])
        for name in ("mvir", "rvir", "m200c", "r200c"):
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{how}: {name}")
    # A traced a that is none of the times given is computed from itself (in float32), not
    # looked up at the nearest time.
    _, cat = jaxpm_halos.fof(particles, b=0.2, min_members=20, so=so, omega_m=0.3, a=0.65)
    want = cat.to_numpy()
    out = at_time(y, jnp.float32(0.65))
    got = gather_catalogue(out["fof"]["catalogue"])
    for name in ("rvir", "r200c"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, err_msg=name)
