"""Spherical-overdensity masses and radii: exact against a float64 brute force on every
mesh, for centres on box and pencil corners, haloes wider than FoF's ghost layer and
unequal masses; inside jit; growth and errors; the thresholds of ``units.so_density``."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh, mesh_id, requires
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from scipy.spatial import cKDTree

import jaxpm_halos as jh
from jaxpm_halos import units
from jaxpm_halos.testing.reference import so_reference

BOX = 16.0
N = 4096


def _layout(seed=0):
    """Clumps of 20-600 particles on the box corner, on pencil faces and edges of every
    test mesh and at z = 0 and L, a dense core, duplicates, over a uniform background."""
    rng = np.random.default_rng(seed)
    centres = np.array(
        [
            [0.0, 0.0, 0.0],
            [BOX / 2, BOX / 2, BOX / 2],
            [BOX / 4, BOX / 8, 0.0],
            [BOX / 2, 3 * BOX / 4, BOX - 0.05],
            [3 * BOX / 4, BOX / 2, BOX / 3],
            [BOX / 8, BOX / 4, 2 * BOX / 3],
            [BOX, BOX / 2, BOX / 5],
            [BOX / 4, 3 * BOX / 4, BOX / 4],
        ]
    )
    sizes = [600, 300, 150, 80, 40, 20, 200, 300]
    widths = [0.2, 0.15, 0.2, 0.1, 0.15, 0.1, 0.12, 0.02]
    parts = [c + rng.normal(0, w, (s, 3)) for c, s, w in zip(centres, sizes, widths)]
    dup = np.repeat(rng.uniform(0, BOX, (1, 3)), 10, axis=0)
    n_bg = N - sum(sizes) - len(dup)
    pos = np.concatenate(parts + [dup, rng.uniform(0, BOX, (n_bg, 3))])
    pos = np.mod(pos, BOX).astype(np.float32)
    queries = np.concatenate(
        [
            centres,
            dup[:1],
            rng.uniform(0, BOX, (4, 3)),
            [[BOX / 2, BOX / 4, 1.0], [BOX - 1e-4, BOX - 1e-4, BOX - 1e-4]],
        ]
    )
    return pos, queries.astype(np.float32)


POS, CENTRES = _layout()
RHO_MEAN = N / BOX**3
DENSITIES = np.array([200.0, 500.0, 1500.0]) * RHO_MEAN


KNIFE = 1e-5  # relative: float32 distances and sums are good to a few 1e-7


def _check(radius, mass, ref, density, particle_mass=1.0, lightest=None):
    """Masses equal the float64 brute force ``ref = (masses, knife_edges)`` (to float32
    summation, far below the ``lightest`` particle) except at its knife edges, where they
    may differ by one particle (at most ``particle_mass``); radii are
    ``(3 M / 4 pi rho)^1/3`` where the masses are equal."""
    ref, edge = ref
    mass, radius = np.asarray(mass, np.float64), np.asarray(radius, np.float64)
    assert mass.shape == ref.shape
    exact = np.abs(mass - ref) <= 0.25 * (lightest or particle_mass)
    assert np.all(exact | edge), np.c_[mass, ref, edge]
    # One particle, plus float32 summation of the others.
    assert np.all(np.abs(mass - ref) <= particle_mass + 1e-5 * ref), np.c_[mass, ref]
    assert np.sum(edge) <= max(1, 0.2 * edge.size), "so many knife edges prove little"
    expected = np.cbrt(3 * ref / (4 * np.pi * np.asarray(density)))
    np.testing.assert_allclose(radius[exact], expected[exact], rtol=1e-4)


def test_brute_force_reference_is_a_downcrossing():
    """The reference itself on a hand-made profile: 2 particles at r = 1, threshold such
    that 2 / (4/3 pi) is above it and 3 / (4/3 pi 2^3) below."""
    pos = np.array([[5.0, 5, 5], [6, 5, 5], [4, 5, 5], [5, 7, 5]])
    rho = 0.2
    assert 2 / (4 / 3 * np.pi) > rho > 3 / (4 / 3 * np.pi * 8)
    # mass of the 1 nearest at r=0 (inf density), then 3 within r = 1 (0.72 > 0.2),
    # then 4 at r = 2 (0.12 < 0.2): M = 3.
    assert so_reference(pos, [[5.0, 5, 5]], 20.0, rho, 1.0)[0, 0] == 3.0


@pytest.fixture(scope="module")
def reference():
    return so_reference(POS, CENTRES, BOX, DENSITIES, 1.0, KNIFE)


M_P = np.float32(7.3)  # not a power of two: float sums of it round
_MESH_RESULTS = {}  # the first mesh's results, for the others to equal
IMAGES = jh.FoFConfig(domain=jh.DomainConfig(image_factor=2.5))  # clumps sit on z = 0 and L


def _counted(mass, particle_mass=M_P):
    """Whether every mass is exactly float32(count) * particle_mass, one rounding (so the
    same on every mesh), as equal masses are summed; a running float sum is not."""
    mass = np.asarray(mass, np.float32)
    count = np.rint(mass / particle_mass).astype(np.float32)
    return np.array_equal(mass, count * np.float32(particle_mass))


@pytest.mark.newest
def test_exact_on_every_mesh(mesh, reference):
    x = jax.device_put(jnp.asarray(POS), NamedSharding(mesh, P(mesh.axis_names)))
    radius, mass, status = jh.spherical_overdensity(
        x, CENTRES, box_size=BOX, mass=M_P, density=DENSITIES * M_P, with_status=True
    )
    assert bool(status.ok)
    _check(radius, np.asarray(mass) / M_P, reference, DENSITIES)
    assert _counted(mass)
    # Equal masses are counted: about the same centres, the same bits on every mesh.
    first = _MESH_RESULTS.setdefault("so", (np.asarray(radius), np.asarray(mass)))
    np.testing.assert_array_equal(np.asarray(mass), first[1])
    np.testing.assert_array_equal(np.asarray(radius), first[0])
    # The clumps are resolved: non-trivial masses well beyond FoF's ghost layer.
    assert np.asarray(mass)[0, 0] > 400 * M_P and np.asarray(radius)[0, 0] > 0.5


@pytest.mark.slow
def test_equal_masses_are_counted_in_the_catalogue_and_so_the_same_on_every_mesh():
    """FoF masses and SO masses of equal particle masses are count * m, the same bits
    on every mesh; per-row masses that happen to be equal are counted too."""
    got = []
    for shape, mass in (((1, 1), M_P), ((2, 4), np.full(N, M_P))):
        sharding = NamedSharding(make_mesh(shape), P(("x", "y")))
        if np.ndim(mass):
            mass = jax.device_put(mass, sharding)
        _, cat = jh.fof(
            jax.device_put(POS, sharding),
            BOX,
            0.15,
            mass=mass,
            min_members=20,
            so={"500": 500 * float(M_P) * RHO_MEAN},
            config=IMAGES,
        )
        got.append(cat.to_numpy())
    one, mesh = got
    assert len(one["id"]) >= 6
    np.testing.assert_array_equal(one["mass"], one["count"].astype(np.float32) * M_P)
    assert _counted(one["m500"]) and _counted(mesh["m500"])
    # SO about the centre of mass is not compared bitwise: that centre can differ in its
    # last bits between meshes (its sums run over devices).
    for name in ("id", "count", "mass"):
        np.testing.assert_array_equal(mesh[name], one[name], err_msg=name)


def test_the_counted_mass_keeps_the_sums_derivative():
    """d(halo mass) / d(particle mass) is 1 for each member, as for a sum, though equal
    masses are reported as count * m."""
    pos = POS[::8]
    _, cat = jh.fof(pos, BOX, 0.3, mass=np.full(len(pos), M_P), min_members=5)
    members = np.asarray(cat.count)[np.asarray(cat.id) >= 0].sum()
    assert members >= 20

    def total(m):
        _, cat = jh.fof(pos, BOX, 0.3, mass=m, min_members=5)
        return jnp.sum(jnp.where(cat.id >= 0, cat.mass, 0))

    grad = np.asarray(jax.grad(total)(jnp.full(len(pos), M_P)))
    assert set(np.unique(grad)) == {0.0, 1.0} and grad.sum() == members


def test_scalar_threshold_unsharded_any_n_and_masses():
    rng = np.random.default_rng(3)
    pos, masses = POS[:4001], rng.uniform(0.5, 2.0, 4001).astype(np.float32)
    density = 300 * float(masses.sum()) / BOX**3
    radius, mass = jh.spherical_overdensity(
        pos, CENTRES, box_size=BOX, density=density, mass=masses, mesh=make_mesh((2, 4))
    )
    assert radius.shape == mass.shape == (len(CENTRES),)
    ref, edge = so_reference(pos, CENTRES, BOX, density, masses, KNIFE)
    _check(radius, mass, (ref[:, 0], edge[:, 0]), density, particle_mass=2.0, lightest=0.5)
    assert np.sum(np.asarray(mass) == 0) < len(CENTRES) and np.max(ref) > 100


def test_inside_jit_equals_outside(reference):
    mesh = make_mesh((2, 4))
    x = jax.device_put(jnp.asarray(POS), NamedSharding(mesh, P(("x", "y"))))
    f = jax.jit(
        lambda p, c: jh.spherical_overdensity(
            p, c, box_size=BOX, density=DENSITIES, with_status=True
        )
    )
    radius, mass, status = f(x, jnp.asarray(CENTRES))
    assert bool(status.ok)
    _check(radius, mass, reference, DENSITIES)
    # A non-finite centre (refused outside jit) came back as M = R = 0 with status.ok.
    bad = np.array(CENTRES)
    bad[1, 0], bad[3, 2] = np.nan, -np.inf
    r_bad, m_bad, status = f(x, jnp.asarray(bad))
    assert not bool(status.ok) and int(status.nonfinite) == 2
    rows = np.isin(np.arange(len(CENTRES)), [1, 3])
    assert np.all(np.isnan(np.asarray(m_bad)[rows])) and np.all(np.isnan(np.asarray(r_bad)[rows]))
    np.testing.assert_array_equal(np.asarray(m_bad)[~rows], np.asarray(mass)[~rows])


@pytest.mark.leg1
def test_small_radius_grows_or_raises():
    mesh = make_mesh((2, 4))
    x = jax.device_put(jnp.asarray(POS), NamedSharding(mesh, P(("x", "y"))))
    tight = jh.SOConfig(
        radius=0.5, levels=2, domain=jh.DomainConfig(ghost_factor=1.0, image_factor=1.0)
    )
    ref, edge = so_reference(POS, CENTRES[:2], BOX, DENSITIES[0], 1.0, KNIFE)
    with pytest.raises(jh.CapacityError, match="so radius") as info:
        jh.spherical_overdensity(
            x, CENTRES[:2], box_size=BOX, density=DENSITIES[0], config=tight, grow=False
        )
    assert str(info.value.failure.limit.knob) == "SOConfig.radius"
    suggested = info.value.failure.grown(tight)
    assert suggested.radius == pytest.approx(1.0, abs=0.05)  # twice, in 1/1000 of the box
    # Not rows, and not claimed to fit: what is needed is known only once reached.
    assert (
        "SOConfig.radius was not enough ('so radius'): what it needs is only known once "
        f"reached. Rerun with config=SOConfig(radius={suggested.radius}, levels=2, domain="
        "DomainConfig(ghost_factor=1.0, image_factor=1.0)) or more"
    ) in str(info.value)
    with pytest.warns(jh.GrowthWarning, match="SOConfig"):
        radius, mass = jh.spherical_overdensity(
            x, CENTRES[:2], box_size=BOX, density=DENSITIES[0], config=tight
        )
    _check(radius, mass, (ref[:, 0], edge[:, 0]), DENSITIES[0])
    # Inside jit nothing grows: NaN and a failed status.
    f = jax.jit(
        lambda p: jh.spherical_overdensity(
            p, CENTRES[:2], box_size=BOX, density=DENSITIES[0], config=tight, with_status=True
        )
    )
    _, mass, status = f(x)
    assert not bool(status.ok) and np.isnan(np.asarray(mass)[0])
    assert status.failure().buffer == "so radius"


@pytest.mark.leg1
def test_a_threshold_at_the_mean_density_says_why_no_radius_fits():
    """A profile that never falls below the threshold grows the search to the largest
    radius the box supports, then raises an error that says so (not one about a radius
    the user never set)."""
    rng = np.random.default_rng(11)
    pos = rng.uniform(0, 10.0, (2000, 3)).astype(np.float32)
    with pytest.raises(
        jh.CapacityError,
        match=r"SOConfig.radius = .*can be at most 3\.32 "
        r"here: a third of the box",
    ) as info:
        jh.spherical_overdensity(pos, pos[:2], box_size=10.0, density=2000 / 10.0**3)
    assert "at or below the mean density" in str(info.value)
    # Without growth the same message, from the default radius (already the largest).
    with pytest.raises(jh.CapacityError, match="can be at most"):
        jh.spherical_overdensity(pos, pos[:2], box_size=10.0, density=2.0, grow=False)


@pytest.mark.leg1
def test_pair_buffer_batches_and_overflow():
    """A buffer smaller than all centres' candidates handles them in batches (same
    result, bitwise); one smaller than one centre's candidates is reported."""
    mesh = make_mesh((2, 4))
    x = jax.device_put(jnp.asarray(POS), NamedSharding(mesh, P(("x", "y"))))
    ref, edge = so_reference(POS, CENTRES, BOX, DENSITIES[0], 1.0, KNIFE)
    small = jh.SOConfig(pair_factor=3.5)
    radius, mass, status = jh.spherical_overdensity(
        x, CENTRES, box_size=BOX, density=DENSITIES[0], config=small, with_status=True, grow=False
    )
    assert bool(status.ok)
    _check(radius, mass, (ref[:, 0], edge[:, 0]), DENSITIES[0])
    whole = jh.spherical_overdensity(x, CENTRES, box_size=BOX, density=DENSITIES[0])
    np.testing.assert_array_equal(np.asarray(radius), np.asarray(whole[0]))
    np.testing.assert_array_equal(np.asarray(mass), np.asarray(whole[1]))
    with pytest.raises(jh.CapacityError, match="so pairs"):
        jh.spherical_overdensity(
            x,
            CENTRES,
            box_size=BOX,
            density=DENSITIES[0],
            config=jh.SOConfig(pair_factor=0.0),
            grow=False,
        )


@pytest.mark.slow
def test_no_centres_give_empty_results_inside_and_outside_jit():
    # A catalogue with no haloes (a small box, an early snapshot) was refused: "H >= 1".
    empty = np.zeros((0, 3), np.float32)
    radius, mass, status = jh.spherical_overdensity(
        POS, empty, box_size=BOX, density=DENSITIES, with_status=True
    )
    assert radius.shape == mass.shape == (0, len(DENSITIES)) and bool(status.ok)
    f = jax.jit(
        lambda c: jh.spherical_overdensity(
            POS, c, box_size=BOX, density=DENSITIES[0], mesh=make_mesh((2, 4)), with_status=True
        )
    )
    radius, mass, status = f(jnp.asarray(empty))
    assert radius.shape == mass.shape == (0,) and radius.dtype == jnp.float32
    assert bool(status.ok) and not bool(status.not_run)


def test_errors():
    with pytest.raises(ValueError, match="centres"):
        jh.spherical_overdensity(POS, CENTRES[:, :2], box_size=BOX, density=1.0)
    with pytest.raises(ValueError, match="positive"):
        jh.spherical_overdensity(POS, CENTRES, box_size=BOX, density=-1.0)
    with pytest.raises(ValueError, match="third of the box"):
        jh.spherical_overdensity(
            POS, CENTRES, box_size=BOX, density=1.0, config=jh.SOConfig(radius=BOX / 2), mesh=None
        )
    with pytest.raises(ValueError, match="pencil"):
        jh.spherical_overdensity(
            POS,
            CENTRES,
            box_size=BOX,
            density=1.0,
            config=jh.SOConfig(radius=3.0),
            mesh=make_mesh((1, 8)),
        )
    centres = np.concatenate([CENTRES, np.full((2, 3), np.nan)])
    with pytest.raises(jh.InvalidInputError, match="2 SO centres are NaN") as error:
        jh.spherical_overdensity(POS, centres, box_size=BOX, density=1.0)
    assert error.value.failure == jh.Failure(jh.FailureKind.NONFINITE, 2)
    # No particles: a ZeroDivisionError before.
    with pytest.raises(ValueError, match="0 rows, and at least 1 particle is needed"):
        jh.spherical_overdensity(POS[:0], CENTRES, box_size=BOX, density=1.0)


def test_definition_names_with_omega_m_are_their_so_density_thresholds():
    """``density="200c"`` (or a list of names) with ``omega_m`` and ``a`` is
    ``units.so_density``'s threshold; a name without them raised a JAX dtype error."""
    run = lambda **kw: jh.spherical_overdensity(POS, CENTRES, box_size=BOX, mass=1e11, **kw)
    names = ("200c", "vir")
    want = run(density=[units.so_density(n, omega_m=0.3, a=0.8) for n in names])
    np.testing.assert_array_equal(run(density=list(names), omega_m=0.3, a=0.8), want)
    np.testing.assert_array_equal(run(density="200c", omega_m=0.3, a=0.8)[1], want[1][:, 0])
    with pytest.raises(ValueError, match=r"density='200c' needs omega_m= \(and a=\)"):
        run(density="200c")
    with pytest.raises(ValueError, match="is a threshold already: leave omega_m out"):
        run(density=1.0, omega_m=0.3)
    with pytest.raises(ValueError, match=r"density='200c': the '200c' threshold .* Msun/h"):
        jh.spherical_overdensity(POS, CENTRES, box_size=BOX, density="200c", omega_m=0.3)


# ----------------------------------------------------------------------------------------
# Thresholds


G_SI = 6.67430e-11
MSUN_KG = 1.32712440041e20 / G_SI
MPC_M = 3.0856775814913673e22


def _rho_crit_physical(omega_m, a):
    """3 H(a)^2 / (8 pi G) in h^2 Msun / Mpc^3, from Newton's constant (h = 1)."""
    h = 100e3 / MPC_M * math.sqrt(omega_m / a**3 + 1 - omega_m)
    return 3 * h * h / (8 * math.pi * G_SI) * MPC_M**3 / MSUN_KG


@pytest.mark.parametrize("omega_m,a", [(0.3, 1.0), (0.3089, 0.5), (0.25, 0.25)])
def test_so_density_from_newton(omega_m, a):
    crit = _rho_crit_physical(omega_m, a) * a**3  # comoving
    mean = omega_m * _rho_crit_physical(omega_m, 1.0)
    assert units.so_density("200c", omega_m=omega_m, a=a) == pytest.approx(200 * crit, rel=3e-4)
    assert units.so_density("500c", omega_m=omega_m, a=a) == pytest.approx(500 * crit, rel=3e-4)
    assert units.so_density("200m", omega_m=omega_m, a=a) == pytest.approx(200 * mean, rel=3e-4)
    x = omega_m / a**3 / (omega_m / a**3 + 1 - omega_m) - 1
    delta = 18 * math.pi**2 + 82 * x - 39 * x * x
    assert units.so_density("vir", omega_m=omega_m, a=a) == pytest.approx(delta * crit, rel=3e-4)


def test_so_density_limits():
    # Bryan & Norman: Delta_c ~ 101 for Omega_m = 0.3 today (~337 times the mean), and
    # 18 pi^2 in an Einstein-de Sitter universe at any a.
    vir = units.so_density("vir", omega_m=0.3)
    assert vir / units.RHO_CRIT == pytest.approx(101.1, abs=0.1)
    assert vir / (0.3 * units.RHO_CRIT) == pytest.approx(337.1, abs=0.3)
    for a in (0.2, 1.0):
        assert units.so_density("vir", omega_m=1.0, a=a) == pytest.approx(
            18 * math.pi**2 * units.RHO_CRIT
        )
    # Early on, 200c tends to 200m (Omega_m(a) -> 1).
    assert units.so_density("200c", omega_m=0.3, a=0.01) == pytest.approx(
        units.so_density("200m", omega_m=0.3), rel=1e-5
    )
    traced = jax.jit(lambda a: units.so_density("vir", omega_m=0.3, a=a))(0.5)
    assert float(traced) == pytest.approx(units.so_density("vir", omega_m=0.3, a=0.5), rel=1e-6)
    for bad in ("200", "abc", "-5c", 200):
        with pytest.raises(ValueError):
            units.so_density(bad, omega_m=0.3)
    for a in (-1.0, 0.0, float("inf"), np.float32(-1), jnp.float32(0)):  # gave e.g. -2.2e13
        with pytest.raises(ValueError, match="scale factor a must be positive and finite"):
            units.so_density("200c", omega_m=0.3, a=a)
    # numpy and jax scalars were let through (1.5 gave 5.55e13), Python floats refused
    for omega_m in (1.5, np.float32(1.5), jnp.float32(0), np.nan, np.array([0.3, 2.0])):
        with pytest.raises(ValueError, match=r"omega_m must lie in \(0, 1\]"):
            units.so_density("200c", omega_m=omega_m)
    assert units.so_density("200m", omega_m=np.float32(0.3)) == pytest.approx(
        units.so_density("200m", omega_m=0.3)
    )


@requires("jax_cosmo")
def test_so_density_against_jax_cosmo():
    import jax_cosmo as jc

    cosmo = jc.Planck15(Omega_c=0.25, Omega_b=0.05)
    for a in (0.4, 1.0):
        e2 = float(jc.background.Esqr(cosmo, a))
        omega_a = float(jc.background.Omega_m_a(cosmo, a))
        x = omega_a - 1
        expected = (18 * math.pi**2 + 82 * x - 39 * x * x) * units.RHO_CRIT * e2 * a**3
        assert units.so_density("vir", omega_m=0.3, a=a) == pytest.approx(expected, rel=1e-4)
        assert units.so_density("200c", omega_m=0.3, a=a) == pytest.approx(
            200 * units.RHO_CRIT * e2 * a**3, rel=1e-4
        )


# ----------------------------------------------------------------------------------------
# The catalogue: density-peak centres and SO quantities from fof


def _planted(seed=1):
    """Clumps with a known densest member: a tight core of 12 particles whose nearest
    point is planted at a known spot, inside a looser halo of 150, on box and pencil
    corners; over a uniform background."""
    rng = np.random.default_rng(seed)
    spots = np.array(
        [
            [0.02, 0.02, BOX - 0.02],
            [BOX / 2, BOX / 4, BOX / 2],
            [BOX / 4, BOX / 2, 0.5],
            [3 * BOX / 4, 3 * BOX / 4, 3 * BOX / 4],
        ]
    )
    parts = []
    for spot in spots:
        parts.append(spot + rng.normal(0, 0.35, (150, 3)))
        core = spot + rng.normal(0, 0.004, (12, 3))
        parts.append(core)
    pos = np.concatenate(parts + [rng.uniform(0, BOX, (2000, 3))])
    return np.mod(pos, BOX).astype(np.float32), spots


@pytest.fixture(scope="module")
def planted():
    """The planted layout and its kNN density (k = 8), which is bitwise the same on every
    mesh (tests/test_knn.py), so one device computes it."""
    pos, spots = _planted()
    return pos, spots, np.asarray(jh.knn_density(pos, BOX, 8, mesh=make_mesh((1, 1))))


# In CI, test_insitu_so_and_peaks_equal_fof_afterwards_and_brute_force checks peaks and SO.
@pytest.mark.slow
@pytest.mark.leg1
@pytest.mark.parametrize("shape", [(1, 8), (4, 2), (1, 1)], ids=mesh_id)
def test_density_peaks_of_planted_clumps_and_so(shape, planted):
    mesh = make_mesh(shape)
    pos, spots, rho = planted
    x = jax.device_put(jnp.asarray(pos), NamedSharding(mesh, P(mesh.axis_names)))
    density = {"200": 200 * len(pos) / BOX**3, "1000": 1000 * len(pos) / BOX**3}
    labels, cat = jh.fof(x, BOX, b=0.2, min_members=50, so=density, centre="peak", k=8)
    assert bool(cat.status.ok) and cat.centre == "peak"
    got = cat.to_numpy()
    assert len(got["id"]) == len(spots)
    # Each peak is a member of its tight core, within its spread of the planted spot.
    for spot in spots:
        d = np.abs(got["peak"] - spot)
        d = np.minimum(d, BOX - d)
        assert np.min(np.linalg.norm(d, axis=1)) < 0.03
    # The peak is exactly the member with the highest kNN density (ties: smallest id).
    labels = np.asarray(labels)
    for hid, peak in zip(got["id"], got["peak"]):
        members = np.where(labels == hid)[0]
        best = members[np.lexsort((members, -rho[members]))[0]]
        np.testing.assert_array_equal(peak, pos[best])
    ref, edge = so_reference(pos, got["peak"], BOX, np.array(list(density.values())), 1.0, KNIFE)
    for d, name in enumerate(density):
        _check(got["r" + name], got["m" + name], (ref[:, d], edge[:, d]), list(density.values())[d])
    # First downcrossings beyond the tight cores (12 particles), within the clumps.
    assert np.all(got["m200"] >= got["m1000"]) and np.all(got["m200"] > 12)


@pytest.mark.slow
def test_peaks_after_a_knn_overflow_inside_jit_are_nan(planted):
    """Inside jit the peaks' kNN overflowed (status failed), and every group's peak was
    the origin, with a finite SO mass about it (118 particles): plausible and wrong. No
    member has a density then, so the peak and SO are NaN; outside jit the same call
    grows the buffer and gives the peaks."""
    mesh = make_mesh((2, 4))
    pos, spots, _ = planted
    x = jax.device_put(jnp.asarray(pos), NamedSharding(mesh, P(mesh.axis_names)))
    small = jh.FoFConfig(knn=jh.KNNConfig(index_factor=0.5))
    run = lambda p: jh.fof(
        p,
        BOX,
        b=0.2,
        min_members=50,
        so={"200": 200 * RHO_MEAN},  # noqa: E731
        centre="peak",
        k=8,
        config=small,
    )
    _, cat = jax.jit(run)(x)
    assert cat.status.failure().buffer == "peak knn index"
    rows = np.asarray(cat.id) >= 0
    assert rows.sum() == len(spots)
    assert np.isnan(np.asarray(cat.peak)[rows]).all()
    assert np.isnan(np.asarray(cat.so["m200"])[rows]).all()
    with pytest.warns(jh.GrowthWarning):
        _, grown = run(x)
    assert bool(grown.status.ok) and np.isfinite(grown.to_numpy()["peak"]).all()


@pytest.mark.slow
def test_a_peak_among_members_whose_density_is_partly_unknown_is_nan():
    """Clumps on pencil corners, and a cross-device kNN buffer ('peak knn remote') too
    small inside jit: some members get no density, and the densest of the rest was taken
    as the peak, finite and wrong for 2 of 8 groups (with an SO mass about it). Every peak
    is now NaN or exactly the densest member's position (ties: smallest id)."""
    rng = np.random.default_rng(2)
    box, k = 20.0, 16
    centres = rng.uniform(0, box, (8, 3))
    centres[:4] = [[10, 5, 10], [0, 0, 3], [10, 15, 7], [0.02, 10, 12]]
    pos = (
        np.concatenate(
            [rng.uniform(0, box, (400, 3))]
            + [c + 0.3 * rng.standard_normal((50, 3)) for c in centres]
        ).astype(np.float32)
        % box
    )
    rho = np.asarray(jh.knn_density(pos, box, k, mesh=make_mesh((1, 1))))
    mesh = make_mesh((2, 4))
    x = jax.device_put(jnp.asarray(pos), NamedSharding(mesh, P(mesh.axis_names)))
    small = jh.FoFConfig(knn=jh.KNNConfig(ghost_width=0.05, index_factor=8.0))
    labels, cat = jax.jit(
        lambda p: jh.fof(
            p, box, 0.4, centre="peak", k=k, config=small, so={"200": 200 * len(pos) / box**3}
        )
    )(x)
    assert cat.status.failure().buffer == "peak knn remote"
    labels, rows = np.asarray(labels), np.asarray(cat.id) >= 0
    peaks, m200 = np.asarray(cat.peak)[rows], np.asarray(cat.so["m200"])[rows]
    unknown = np.isnan(peaks).any(axis=1)
    assert unknown.any() and np.isnan(m200[unknown]).all()
    for hid, peak in zip(np.asarray(cat.id)[rows][~unknown], peaks[~unknown]):
        members = np.where(labels == hid)[0]
        np.testing.assert_array_equal(peak, pos[members[np.lexsort((members, -rho[members]))[0]]])


@pytest.mark.slow
def test_coincident_particles_have_a_defined_density_and_leave_the_peak_finite():
    """k coincident massless members made (k-1) 0 / 0 = NaN densities with status ok, and
    the peak (read NaN as "not computed") and the SO mass about it NaN too, eager, with
    nothing raised. Now such a density is 0 (and inf for coincident massive ones), and the
    peak is the densest member's position."""
    rng = np.random.default_rng(15)
    box, k = 16.0, 2
    clump = 5.0 + 0.15 * rng.standard_normal((40, 3))
    clump[[10, 11, 12]] = clump[5]
    clump[[20, 21]] = clump[30]
    pos = np.concatenate([clump, rng.uniform(0, box, (200, 3))]).astype(np.float32)
    mass = np.ones(len(pos), np.float32)
    mass[[5, 10, 11, 12]] = 0  # a massless point of 4 particles; 20, 21, 30 massive
    rho = np.asarray(jh.knn_density(pos, box, k, mass=mass))
    assert (rho[[5, 10, 11, 12]] == 0).all() and np.isinf(rho[[20, 21, 30]]).all()
    np.testing.assert_array_equal(
        jh.knn_density(pos, box, k, mass=mass, mesh=make_mesh((1, 1))), rho
    )
    dist, idx = cKDTree(pos.astype(np.float64), boxsize=box).query(pos, k + 1)
    apart = dist[:, k] > 0  # the others against the formula, float64 brute force
    want = mass[idx[:, 1]] / (4 / 3 * np.pi * dist[:, k] ** 3)
    np.testing.assert_allclose(rho[apart], want[apart], rtol=2e-5)
    labels, cat = jh.fof(pos, box, 0.4, mass=mass, min_members=10, centre="peak", k=k)
    assert bool(cat.status.ok)
    fields = cat.to_numpy()
    assert fields["id"][0] == 0  # the clump's group, labelled by its particle 0
    members = np.where(np.asarray(labels) == 0)[0]
    densest = members[np.lexsort((members, -rho[members]))[0]]
    assert densest == 20
    np.testing.assert_array_equal(fields["peak"][0], pos[densest])


@pytest.mark.slow
def test_peak_gradient_is_the_densest_members_and_so_gradients_are_zero(planted):
    """d peak / d positions is the identity on the densest member (the choice held fixed)
    and zero elsewhere; SO masses have zero gradients with respect to positions and
    particle masses (reverse mode through their search once raised a JAX error)."""
    mesh = make_mesh((2, 4))
    pos, _, rho = planted
    x = jax.device_put(jnp.asarray(pos), NamedSharding(mesh, P(mesh.axis_names)))
    m = jax.device_put(jnp.ones(len(pos), jnp.float32), NamedSharding(mesh, P(mesh.axis_names)))
    labels, cat = jh.fof(
        x, BOX, b=0.2, min_members=50, mass=m, so={"200": 200 * RHO_MEAN}, centre="peak", k=8
    )
    weights = np.random.default_rng(5).normal(size=cat.peak.shape).astype(np.float32)
    weights[np.asarray(cat.id) < 0] = 0

    def objective(p, masses):
        _, c = jh.fof(
            p,
            BOX,
            b=0.2,
            min_members=50,
            mass=masses,
            so={"200": 200 * RHO_MEAN},
            centre="peak",
            k=8,
        )
        return jnp.sum(c.peak * weights) + jnp.sum(jnp.where(c.id >= 0, c.so["m200"], 0))

    grad_pos, grad_mass = jax.jit(jax.grad(objective, argnums=(0, 1)))(x, m)
    want = np.zeros(pos.shape, np.float32)
    labels, ids = np.asarray(labels), np.asarray(cat.id)
    for row in np.nonzero(ids >= 0)[0]:
        members = np.where(labels == ids[row])[0]
        want[members[np.lexsort((members, -rho[members]))[0]]] = weights[row]
    assert np.count_nonzero(want) > 10
    np.testing.assert_array_equal(np.asarray(grad_pos), want)
    np.testing.assert_array_equal(np.asarray(grad_mass), 0)


@pytest.mark.leg1
def test_fof_so_definitions_about_the_centre_of_mass():
    """``so=("200c", ...)`` with omega_m and a: masses in the input's unit, about ``pos``."""
    pos, _ = _planted(2)
    particle = 1e11
    box = BOX  # read as Mpc/h
    labels, cat = jh.fof(
        pos, box, b=0.2, mass=particle, min_members=50, so=("200c", "vir"), omega_m=0.3, a=0.8
    )
    got = cat.to_numpy()
    assert cat.centre == "com" and "peak" not in got
    thresholds = [units.so_density(n, omega_m=0.3, a=0.8) for n in ("200c", "vir")]
    ref, edge = so_reference(pos, got["pos"], box, thresholds, particle, KNIFE)
    for d, name in enumerate(("200c", "vir")):
        _check(got["r" + name], got["m" + name], (ref[:, d], edge[:, d]), thresholds[d], particle)
    with pytest.raises(ValueError, match="omega_m"):
        jh.fof(pos, box, b=0.2, so=("200c",))
    # Unit masses (the default) with named definitions: every halo would get M = R = 0.
    for mass in (None, np.ones(len(pos), np.float32), jnp.ones(len(pos))):
        with pytest.raises(
            ValueError,
            match=r"'200c' threshold .* times the data's mean "
            r"density .* pass mass= in Msun/h",
        ):
            jh.fof(pos, box, b=0.2, mass=mass, so=("200c",), omega_m=0.3)
    with pytest.raises(ValueError, match="centre"):
        jh.fof(pos, box, b=0.2, centre="middle")


@pytest.mark.slow
def test_a_group_of_massless_members_has_nan_centre_and_so_values():
    """Masses of 0 are allowed; a group whose members are all massless has no
    mass-weighted centre, velocity or radius (0 / 0): NaN, not its first member's
    position and zeros. SO about that NaN centre is NaN too, not M = R = 0; the other
    group's values are the plain numpy ones."""
    rng = np.random.default_rng(6)
    pos = (
        np.concatenate(
            [
                rng.normal(4.0, 0.1, (30, 3)),
                rng.normal(11.0, 0.1, (30, 3)),
                rng.uniform(0, BOX, (452, 3)),
            ]
        ).astype(np.float32)
        % BOX
    )
    vel = rng.normal(0, 100, pos.shape).astype(np.float32)
    mass = np.ones(len(pos), np.float32)
    mass[:30] = 0
    _, cat = jh.fof(pos, BOX, 0.4, vel=vel, mass=mass, min_members=20, so={"200": 200.0})
    assert bool(cat.status.ok)
    got = cat.to_numpy()
    assert list(got["id"]) == [0, 30] and list(got["mass"]) == [0, 30]
    for name in ("pos", "vel", "vel_disp", "radius", "m200", "r200"):
        assert np.all(np.isnan(got[name][0])), name
        assert np.all(np.isfinite(got[name][1])), name
    np.testing.assert_allclose(got["pos"][1], pos[30:60].mean(0), rtol=1e-5)
    np.testing.assert_allclose(got["vel"][1], vel[30:60].mean(0), rtol=1e-4, atol=1e-3)
    assert got["m200"][1] >= 20  # the clump's core, over 200 times the mean density
