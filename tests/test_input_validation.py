"""Hostile-but-realistic input (issue #18): far periodic images, half-precision positions,
bad masses and arguments, excluded rows. Results are checked against scipy and numpy."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh, mesh_id, mesh_params
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from scipy.spatial import cKDTree

import jaxpm_halos as jh
from jaxpm_halos.core.geometry import wrap
from jaxpm_halos.testing import reference as ref

BOX = 100.0
LINK = 1.0


def _image(x: np.ndarray, box: float) -> np.ndarray:
    """Exact periodic image in float64: fmod is exact, and for |x| >= L the image is a
    multiple of ulp(L) below L, so it is a float32."""
    r = np.fmod(np.asarray(x, np.float64), box)
    return np.where(r < 0, r + box, r)


def _far_layout(seed=0, n=1024):
    """Clumps whose first member's x, y or z is written as a far periodic image (1e4 L to
    1e28 L away), over a uniform background. Returns (input, true positions)."""
    rng = np.random.default_rng(seed)
    far = np.float32([-4.6233114e9, 3.3e12, -1e30, 1e30, 7.7e15, -2.5e7, 1.2345e20, 6e6])
    axis = np.arange(len(far)) % 3
    centres = rng.uniform(10, BOX - 10, (len(far), 3))
    centres[np.arange(len(far)), axis] = _image(far, BOX)
    clumps = [c + rng.normal(0, 0.3, (31, 3)) for c in centres]
    for c, clump in zip(centres, clumps):
        clump[0] = c
    background = rng.uniform(0, BOX, (n - 31 * len(far), 3))
    true = np.concatenate(clumps + [background]).astype(np.float32)
    true = np.where(true >= BOX, true - BOX, np.where(true < 0, true + BOX, true))
    given = true.copy()
    given[np.arange(len(far)) * 31, axis] = far
    return given, true.astype(np.float32)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_wrap_is_exact_for_far_images_and_unchanged_in_the_box(jit):
    fn = jax.jit(lambda x: wrap(x, BOX)) if jit else (lambda x: wrap(jnp.asarray(x), BOX))
    rng = np.random.default_rng(1)
    far = np.concatenate(
        [
            np.float32([-4.6233114e9, 1e30, -1e30, 3.4e38, -3.4e38, 1e10]),
            (rng.choice([-1, 1], 2000) * 10.0 ** rng.uniform(3, 38, 2000)),
        ]
    )
    far = far.astype(np.float32)
    got = np.asarray(fn(far))
    assert got[0] == 40.0
    assert np.all((got >= 0) & (got < BOX))
    np.testing.assert_array_equal(got, _image(far, BOX).astype(np.float32))
    # Near the box: the correctly rounded image, -L and L to +0, inside unchanged bitwise.
    near = np.concatenate(
        [rng.uniform(-4 * BOX, 4 * BOX, 20000), [-BOX, BOX, -2 * BOX, 0.0, -0.0, 1e-30, -1e-30]]
    ).astype(np.float32)
    got = np.asarray(fn(near))
    image = _image(near, BOX).astype(np.float32)
    want = np.where((near >= 0) & (near < BOX), near, np.where(image >= BOX, 0, image) + 0.0)
    np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))
    assert np.isnan(np.asarray(fn(np.float32([np.nan, np.inf, -np.inf])))).all()
    # The image is x plus a constant, so its derivative is 1 everywhere, at L (wrapped to
    # 0) and where the image rounds up to L as well: a constant zero used to cut it there.
    grad = jax.grad(lambda x: jnp.sum(wrap(x, BOX)))
    edges = np.float32([BOX, -BOX, 2 * BOX, -1e-9, 0.0, 3.0])
    np.testing.assert_array_equal(np.asarray(grad(edges)), np.ones(6, np.float32))
    from jaxpm_halos.core.geometry import grid_to_box

    nc = 8
    grid = jax.grad(lambda x: jnp.sum(grid_to_box(x, nc, BOX)))(np.float32([nc - 1e-6, nc, -1e-7]))
    np.testing.assert_array_equal(np.asarray(grid), np.full(3, BOX / nc, np.float32))


@pytest.mark.leg1
@pytest.mark.parametrize(
    "shape", [(2, 4), pytest.param(None, marks=pytest.mark.slow)], ids=["mesh2x4", "single"]
)
def test_far_images_give_scipys_groups_and_neighbours(shape):
    given, true = _far_layout()
    mesh = None if shape is None else make_mesh(shape)
    x = given if mesh is None else jax.device_put(given, NamedSharding(mesh, P(("x", "y"))))
    labels, cat = jh.fof(x, BOX, LINK, min_members=20)
    want = ref.fof_labels(true, BOX, LINK)
    np.testing.assert_array_equal(np.asarray(labels), want)
    assert np.all(np.bincount(want)[want[::31][:8]] >= 31)
    assert bool(cat.status.ok)
    dist, idx = jh.knn(x, BOX, 8)
    want_dist, _ = cKDTree(true.astype(np.float64), boxsize=BOX).query(true, k=9)
    np.testing.assert_allclose(np.asarray(dist), want_dist[:, 1:], rtol=4e-7, atol=1e-4)


def _half(dtype):
    """The far layout's true positions, velocities and masses in ``dtype``, their float32
    values (positions that rounded up to L wrapped to 0), and them sharded on (2, 4)."""
    _, true = _far_layout()
    rng = np.random.default_rng(2)
    half = [
        jnp.asarray(a, dtype)
        for a in (true, rng.normal(0, 3, true.shape), rng.uniform(0.5, 2, len(true)))
    ]
    pos32, vel32, mass32 = (np.asarray(a.astype(jnp.float32)) for a in half)
    pos32 = np.where(pos32 >= BOX, np.float32(0), pos32)
    sharded = jax.device_put(half[0], NamedSharding(make_mesh((2, 4)), P(("x", "y"))))
    return half, (pos32, vel32, mass32), sharded


@pytest.mark.parametrize("dtype", [jnp.float16, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)])
def test_half_precision_fof_is_computed_in_float32(dtype):
    """float16 / bfloat16 positions, velocities and masses give scipy's groups and numpy's
    catalogue of their float32 values, in float32."""
    (_, vel, mass), (pos32, vel32, mass32), sharded = _half(dtype)
    link = ref.unambiguous_linking_length(pos32, BOX, LINK)
    labels, cat = jh.fof(sharded, BOX, link, vel=vel, mass=mass, min_members=20)
    want = ref.fof_labels(pos32, BOX, link)
    np.testing.assert_array_equal(np.asarray(labels), want)
    got, want_cat = cat.to_numpy(), ref.catalogue(pos32, BOX, want, 20, vel32, mass32)
    assert got["mass"].dtype == np.float32 and got["vel"].dtype == np.float32
    np.testing.assert_array_equal(got["id"], want_cat["id"])
    np.testing.assert_allclose(got["mass"], want_cat["mass"], rtol=2e-6)
    np.testing.assert_allclose(got["vel"], want_cat["vel"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["radius"], want_cat["radius"], rtol=1e-4, atol=1e-5)


@pytest.mark.leg1
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_half_precision_knn_is_computed_in_float32(dtype):
    _, (pos32, _, _), sharded = _half(dtype)
    dist, _ = jh.knn(sharded, BOX, 8)
    assert dist.dtype == jnp.float32
    want_dist, _ = cKDTree(pos32.astype(np.float64), boxsize=BOX).query(pos32, k=9)
    np.testing.assert_allclose(np.asarray(dist), want_dist[:, 1:], rtol=4e-7, atol=1e-4)


def _without(pos, bad, link, box=BOX):
    """scipy's labels of the rows not in ``bad`` (as input indices), -1 for ``bad``."""
    keep = np.ones(len(pos), bool)
    keep[bad] = False
    want = np.full(len(pos), -1)
    want[keep] = np.nonzero(keep)[0][ref.fof_labels(pos[keep], box, link)]
    return want


@pytest.mark.leg1
@pytest.mark.parametrize("shape", [(2, 4), None], ids=["mesh2x4", "single"])
def test_excluded_rows_have_label_minus_one_under_jit(shape):
    """Row 0 is the first member of a 31-member group: its label 0 is a real group id."""
    _, true = _far_layout()
    bad = true.copy()
    bad[0] = np.nan
    bad[40, 1] = np.inf
    bad[-1, 2] = -np.inf
    mesh = None if shape is None else make_mesh(shape)
    x = bad if mesh is None else jax.device_put(bad, NamedSharding(mesh, P(("x", "y"))))
    labels, cat = jax.jit(lambda p: jh.fof(p, BOX, LINK, min_members=20, mesh=mesh))(x)
    assert int(cat.status.nonfinite) == 3
    np.testing.assert_array_equal(np.asarray(labels), _without(true, [0, 40, len(true) - 1], LINK))
    with pytest.raises(jh.InvalidInputError, match="3 particle positions"):
        jh.fof(x, BOX, LINK, min_members=20, mesh=mesh)


@pytest.mark.leg1
def test_excluded_rows_have_label_minus_one_in_situ_under_jit():
    nc, box = 8, 8.0
    rng = np.random.default_rng(4)
    disp = rng.uniform(-0.3, 0.3, (nc, nc, nc, 3)).astype(np.float32)
    lattice = np.stack(np.meshgrid(*[np.arange(nc)] * 3, indexing="ij"), -1).reshape(-1, 3)
    clump = np.flatnonzero(lattice.sum(1) % 5 == 0)[:40]  # 40 particles gathered at one spot
    disp.reshape(-1, 3)[clump] = (
        np.array([2.0, 5.0, 3.0]) + rng.uniform(-0.05, 0.05, (len(clump), 3)) - lattice[clump]
    )
    disp.reshape(-1, 3)[clump[0]] = np.nan
    disp[7, 7, 7, 0] = np.inf
    mesh = make_mesh((2, 4))
    y = jax.device_put(
        np.stack([disp, np.zeros_like(disp)]), NamedSharding(mesh, P(None, "x", "y"))
    )
    insitu = jh.InSitu(box_size=box, analyses=("fof",), min_members=20)
    labels = jax.jit(lambda s: insitu(s, 1.0)["fof"]["labels"])(y)
    pos = np.asarray(jh.from_jaxpm(y, box_size=box).pos).reshape(-1, 3)
    bad = [clump[0], nc**3 - 1]
    want = _without(np.nan_to_num(pos), bad, 0.2 * box / nc, box)
    assert np.bincount(want[want >= 0]).max() == 39
    np.testing.assert_array_equal(np.asarray(labels).reshape(-1), want)


@pytest.mark.parametrize(
    "k, message",
    [
        (1, r"InSitu\(k=1\): a kNN density needs k >= 2"),
        (0, r"InSitu\(k=0\): a kNN density needs k >= 2"),
        (-3, r"a kNN density needs k >= 2"),
        (2.5, r"InSitu\(k=2.5\): k must be an integer"),
        (True, r"k must be an integer"),
        ("16", r"k must be an integer"),
    ],
)
def test_insitu_rejects_a_bad_k_at_construction(k, message):
    with pytest.raises(ValueError, match=message):
        jh.InSitu(box_size=16.0, k=k)
    jh.InSitu(box_size=16.0, analyses=("fof",), k=k)  # k is knn_density's only
    assert jh.InSitu(box_size=16.0, k=np.int64(2)).k == 2


@pytest.mark.parametrize("k", [64, 65, 1000])
def test_insitu_rejects_k_of_at_least_the_particle_count(k):
    y = jnp.zeros((2, 4, 4, 4, 3), jnp.float32)
    with pytest.raises(ValueError, match=rf"InSitu\(k={k}\): .*nc\*\*3 = 64\. Use k <= 63"):
        jh.InSitu(box_size=16.0, analyses=("knn_density",), k=k)(y)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(b=float("inf")), r"InSitu\(b=inf\): b must be positive and finite"),
        (dict(b=float("nan")), r"InSitu\(b=nan\): b must be positive and finite"),
        (dict(b=0.0), r"b must be positive and finite"),
        (dict(b="0.2"), r"b must be positive and finite"),
        (dict(omega_m=-0.3), r"InSitu\(omega_m=-0.3\): omega_m must be positive and finite"),
        (dict(omega_m=float("nan")), r"omega_m must be positive and finite"),
        (dict(min_members=2.5), r"min_members must be an integer, got 2.5"),
        (dict(min_members="2"), r"min_members must be an integer, got '2'"),
        (dict(min_members=True), r"min_members must be an integer, got True"),
        (dict(min_members=0), r"min_members must be at least 1, got 0"),
    ],
)
def test_insitu_rejects_bad_settings_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        jh.InSitu(box_size=16.0, **kwargs)
    with pytest.raises(ValueError, match=r"InSitu\(box_size=inf\): box_size must be positive"):
        jh.InSitu(box_size=float("inf"))  # was accepted; fof refuses it
    insitu = jh.InSitu(box_size=16.0, min_members=np.int64(7), b=np.float32(0.25))
    assert insitu.min_members == 7 and type(insitu.min_members) is int
    # Concrete JAX scalars are numbers too, stored as floats (the config is hashed).
    insitu = jh.InSitu(box_size=jnp.asarray(32.0), b=jnp.asarray(0.25), omega_m=np.float64(0.3))
    assert (insitu.box_size, insitu.b, insitu.omega_m) == (32.0, 0.25, 0.3)
    assert type(insitu.box_size) is float
    hash(insitu)
    for flag in (jnp.asarray(True), np.array(True), np.complex64(1.0)):  # not lengths
        with pytest.raises(ValueError, match="box_size must be positive and finite"):
            jh.InSitu(box_size=flag)


@pytest.mark.parametrize(
    "b, shape, message",
    [
        (
            4.5,
            (2, 4),
            r"InSitu\(b=4.5\): the linking length b \* box_size / nc = 4.5 is wider "
            r"than a pencil \(4\) of the \(2, 4\) mesh; use b <= 3\.999 or fewer devices",
        ),
        # Both limits: the box's is named (fewer devices cannot help), with a b that fits both.
        (
            10,
            (2, 4),
            r"InSitu\(b=10\): the linking length b \* box_size / nc = 10 must be below "
            r"a third of the box 16: use b <= 3\.999$",
        ),
        (4.5, (8, 1), r"wider than a pencil \(2\) of the \(8, 1\) mesh; use b <= 1\.999"),
        (
            6,
            (1, 1),
            r"InSitu\(b=6\): the linking length b \* box_size / nc = 6 must be below a "
            r"third of the box 16: use b < nc / 3 = 5\.33333",
        ),
    ],
)
def test_insitu_names_b_when_the_linking_length_does_not_fit(b, shape, message):
    mesh = make_mesh(shape)
    y = jax.device_put(jnp.zeros((2, 16, 16, 16, 3)), NamedSharding(mesh, P(None, "x", "y")))
    with pytest.raises(ValueError, match=message):
        jh.InSitu(box_size=16.0, analyses=("fof",), b=b)(y)


@pytest.mark.parametrize("a", [0.0, -1.0, float("nan"), float("inf"), 1e-50])
def test_insitu_refuses_a_scale_factor_that_is_not_positive_and_finite(a):
    """Velocities are momenta over a: a = 0 or NaN gave NaN velocities, a = -1 flipped
    them, with no error. 1e-50 is 0 in the float32 state."""
    y = jax.device_put(
        jnp.zeros((2, 16, 16, 16, 3)), NamedSharding(make_mesh((2, 4)), P(None, "x", "y"))
    )
    with pytest.raises(ValueError, match=r"the scale factor a must be positive and finite"):
        jh.InSitu(box_size=16.0, analyses=("fof",))(y, a)


@pytest.mark.leg1
def test_insitu_takes_an_integer_state_as_float32():
    """Integer displacements stack particles on lattice points: groups of coincident
    particles, as scipy finds them."""
    nc, box = 8, 8.0
    rng = np.random.default_rng(6)
    lattice = np.stack(np.meshgrid(*[np.arange(nc)] * 3, indexing="ij"), -1).reshape(-1, 3)
    movers = rng.choice(nc**3, 60, replace=False)
    disp = np.zeros((nc**3, 3), np.int32)
    disp[movers] = np.array([2, 5, 3]) - lattice[movers]  # 60 particles onto (2, 5, 3)
    disp = disp.reshape(nc, nc, nc, 3)
    y = jax.device_put(
        np.stack([disp, np.zeros_like(disp)]), NamedSharding(make_mesh((2, 4)), P(None, "x", "y"))
    )
    out = jh.InSitu(box_size=box, analyses=("fof",), min_members=20)(y)
    pos = np.asarray(jh.from_jaxpm(y.astype(jnp.float32), box_size=box).pos).reshape(-1, 3)
    want = ref.fof_labels(pos, box, 0.2 * box / nc)
    np.testing.assert_array_equal(np.asarray(out["fof"]["labels"]).reshape(-1), want)
    assert np.bincount(want).max() >= 60
    np.testing.assert_array_equal(
        out["fof"]["catalogue"].to_numpy()["count"], [np.bincount(want).max()]
    )


@pytest.mark.parametrize("min_members", [2.5, "2", True, 20.0])
def test_fof_requires_an_integer_min_members(min_members):
    _, true = _far_layout()
    with pytest.raises(
        ValueError,
        match=rf"min_members must be an integer, got "
        rf"{re.escape(repr(min_members))}",
    ):
        jh.fof(true, BOX, LINK, min_members=min_members)


def test_integer_settings_may_be_concrete_zero_d_arrays():
    # as numpy integers are; a 1-element array is not a scalar
    _, true = _far_layout()
    _, want = jh.fof(true, BOX, LINK, min_members=20)
    _, got = jh.fof(true, BOX, LINK, min_members=jnp.int32(20))
    np.testing.assert_array_equal(got.to_numpy()["id"], want.to_numpy()["id"])
    np.testing.assert_array_equal(jh.knn(true, BOX, jnp.int32(2))[1], jh.knn(true, BOX, 2)[1])
    with pytest.raises(ValueError, match=r"k must be an integer, got array\(\[3\]\)"):
        jh.knn(true, BOX, np.array([3]))


def test_min_members_beyond_int32_is_refused_by_name():
    # not JAX's OverflowError from casting it into the kernels
    _, true = _far_layout()
    with pytest.raises(ValueError, match=r"min_members must be at most 2147483647"):
        jh.fof(true, BOX, LINK, min_members=2**31)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num=65), r"num \(the number of valid rows\) must be at most 64, got 65"),
        (dict(num=-1), r"must be at least 0, got -1"),
        (dict(num=2.5), r"num \(the number of valid rows\) must be an integer, got 2.5"),
        (
            dict(num=np.array([3, 4])),
            r"num \(the number of valid rows\) must be an integer, got array",
        ),
        (dict(vel=np.zeros((64, 2))), r"vel must have shape \(64, 3\).*got \(64, 2\)"),
        (dict(mass=np.ones(65)), r"mass must have shape \(64,\).*got \(65,\)"),
        (dict(mass=np.ones((64, 1))), r"mass must have shape \(64,\).*got \(64, 1\)"),
        (dict(mass="1"), r"mass must hold real numbers, got dtype <U1"),
        (dict(mass=np.ones(64, bool)), r"mass must hold real numbers, got dtype bool"),
        (dict(vel=np.zeros((64, 3), complex)), r"vel must hold real numbers"),
    ],
)
def test_particles_refuse_a_num_or_row_field_that_does_not_fit_the_rows(kwargs, message):
    # Each was taken before: num truncated or clipped, vel and mass broadcast or cut.
    pos = np.random.default_rng(4).uniform(0, 10.0, (64, 3)).astype(np.float32)
    with pytest.raises(ValueError, match=message):
        jh.Particles.create(pos, 10.0, **kwargs)
    fine = dict(num=np.int64(64), vel=np.zeros((64, 3)), mass=np.ones(64))
    assert int(jh.Particles.create(pos, 10.0, **fine).num) == 64
    # device ids of an unsigned type in range are taken (uint32's limit once overflowed)
    ids = jh.Particles.create(pos, 10.0, id=jnp.arange(64, dtype=jnp.uint32)).id
    np.testing.assert_array_equal(ids, np.arange(64))


def test_complex_or_text_inputs_are_refused_by_name():
    # complex ones were cast to their real part with only numpy's ComplexWarning
    pos = np.random.default_rng(4).uniform(0, 10.0, (64, 3))
    with pytest.raises(ValueError, match=r"positions must hold real numbers, got dtype complex"):
        jh.knn(pos.astype(complex), 10.0, 2)
    with pytest.raises(ValueError, match=r"vel must hold real numbers, got dtype complex"):
        jh.fof(pos, 10.0, 0.5, vel=pos.astype(complex))
    with pytest.raises(ValueError, match=r"positions must hold real numbers, got dtype <U"):
        jh.knn([["1", "2", "3"]] * 8, 10.0, 2)


def test_boolean_inputs_are_refused_by_name():
    # A mask passed where coordinates or masses belong was taken as 0 and 1.
    pos = np.random.default_rng(4).uniform(0, 10.0, (64, 3)).astype(np.float32)
    mask = pos > 5
    calls = {
        "positions": lambda: jh.fof(mask, 10.0, 0.5),
        "query points": lambda: jh.knn_density(pos, 10.0, 2, query=mask[:4]),
        "SO centres": lambda: jh.spherical_overdensity(pos, mask[:4], box_size=10.0, density=1.0),
        "mass": lambda: jh.fof(pos, 10.0, 0.5, mass=True),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=f"{name} must hold real numbers, got dtype bool"):
            call()
    with pytest.raises(ValueError, match="positions must hold real numbers, got dtype bool"):
        jh.Particles.create(mask, 10.0)


def test_velocities_and_masses_may_be_lists():
    _, true = _far_layout()
    rng = np.random.default_rng(9)
    vel, mass = rng.normal(0, 3, true.shape), rng.uniform(0.5, 2, len(true))
    labels, cat = jh.fof(
        true, BOX, LINK, vel=vel.tolist(), mass=mass.tolist(), min_members=np.int64(20)
    )
    want = ref.fof_labels(true, BOX, LINK)
    np.testing.assert_array_equal(np.asarray(labels), want)
    got, want_cat = cat.to_numpy(), ref.catalogue(true, BOX, want, 20, vel, mass)
    np.testing.assert_array_equal(got["count"], want_cat["count"])
    np.testing.assert_allclose(got["mass"], want_cat["mass"], rtol=2e-6)
    np.testing.assert_allclose(got["vel"], want_cat["vel"], rtol=1e-5, atol=1e-5)


def _bad_masses():
    _, true = _far_layout()
    mass = np.random.default_rng(10).uniform(0.5, 2, len(true)).astype(np.float32)
    bad = mass.copy()
    bad[0], bad[40], bad[500] = np.nan, -1.0, np.inf  # row 0: first member of a group
    return true, mass, bad


@pytest.mark.parametrize("mass", ["rows", "scalar"])
def test_bad_masses_raise_outside_jit(mass):
    true, _, bad = _bad_masses()
    given, count = (bad, 3) if mass == "rows" else (np.float32(-2.0), 1)
    message = rf"{count} particle masses are NaN, inf or negative"
    with pytest.raises(jh.InvalidInputError, match=message) as fof_error:
        jh.fof(true, BOX, LINK, mass=given)
    with pytest.raises(jh.InvalidInputError, match=message) as knn_error:
        jh.knn_density(true, BOX, 8, mass=jnp.asarray(given))
    for error in (fof_error, knn_error):  # the kind to branch on, as a status's error has
        assert error.value.failure == jh.Failure(jh.FailureKind.NONFINITE, count)


@pytest.mark.leg1
@pytest.mark.parametrize(
    "shape", [(2, 4), pytest.param(None, marks=pytest.mark.slow)], ids=["mesh2x4", "single"]
)
def test_bad_masses_inside_jit_are_excluded_and_counted(shape):
    true, mass, bad = _bad_masses()
    mesh = None if shape is None else make_mesh(shape)
    rows = NamedSharding(mesh, P(("x", "y"))) if mesh else None
    x, m = (a if mesh is None else jax.device_put(a, rows) for a in (true, bad))
    labels, cat = jax.jit(lambda p, w: jh.fof(p, BOX, LINK, mass=w, min_members=20, mesh=mesh))(
        x, m
    )
    assert int(cat.status.nonfinite) == 3 and not bool(cat.status.ok)
    want = _without(true, [0, 40, 500], LINK)
    np.testing.assert_array_equal(np.asarray(labels), want)
    keep = want >= 0
    got = cat.to_numpy(throw=False)  # the status failed: the others' catalogue, asked for
    want_cat = ref.catalogue(
        true[keep], BOX, np.searchsorted(np.nonzero(keep)[0], want[keep]), 20, mass=mass[keep]
    )
    np.testing.assert_allclose(got["mass"], want_cat["mass"], rtol=2e-6)
    rho, status = jax.jit(
        lambda p, w: jh.knn_density(p, BOX, 8, mass=w, mesh=mesh, with_status=True)
    )(x, m)
    assert int(status.nonfinite) == 3
    rho = np.asarray(rho)
    assert np.isnan(rho[[0, 40, 500]]).all()
    # The others' densities: as if the excluded particles were not there at all.
    want_rho = jh.knn_density(true[keep], BOX, 8, mass=mass[keep])
    np.testing.assert_allclose(rho[keep], np.asarray(want_rho), rtol=1e-6)


@pytest.mark.parametrize(
    "ids, message",
    [
        (
            np.arange(64, dtype=np.int64) * 2**32,
            r"must lie in \[0, 2147483646\].* from 0 to 270582939648",
        ),
        (np.arange(64) - 1, r"from -1 to 62"),
        (np.arange(64) + (2**31 - 64), r"from 2147483584 to 2147483647"),
        (jnp.arange(64, dtype=jnp.int32) - 5, r"from -5 to 58"),
        (np.arange(64) // 2, r"must be unique"),
        (np.arange(64.0), r"must be integers"),
        (np.arange(63), r"leading shape \(64,\)"),
    ],
)
def test_ids_that_would_be_wrapped_or_read_as_markers_are_refused(ids, message):
    """int32 would wrap 64-bit ids (distinct particles sharing an id merge their groups);
    -1 and the int32 maximum are the kernels' markers; repeated ids share a label."""
    pos = np.random.default_rng(4).uniform(0, 10.0, (64, 3)).astype(np.float32)
    with pytest.raises(ValueError, match=message):
        jh.Particles.create(pos, 10.0, id=ids)


def test_given_ids_label_the_groups_and_padding_ids_are_not_checked():
    rng = np.random.default_rng(5)
    pos = np.concatenate(
        [
            rng.normal(2.0, 0.05, (30, 3)),
            rng.normal(7.0, 0.05, (30, 3)),
            rng.uniform(0, 10.0, (4, 3)),
        ]
    ).astype(np.float32)
    ids = 10 * rng.permutation(64) + 3
    _, cat = jh.fof(jh.Particles.create(pos, 10.0, id=ids), linking_length=0.5, min_members=20)
    got = cat.to_numpy()
    assert sorted(got["id"]) == sorted([ids[:30].min(), ids[30:60].min()])
    np.testing.assert_array_equal(got["count"], [30, 30])
    # Rows at or after num become padding: their ids are not the caller's.
    padded = jh.Particles.create(pos, 10.0, id=np.concatenate([ids[:60], [-7] * 4]), num=60)
    np.testing.assert_array_equal(np.asarray(padded.id)[60:], -1)
    # Inside jit nothing is checked (nothing can raise there): device ids made outside, and
    # padding ids with a traced num, pass through as before.
    on_device = jnp.asarray(ids)
    got = jax.jit(lambda p: jh.Particles.create(p, 10.0, id=on_device).id)(pos)
    np.testing.assert_array_equal(got, ids)
    got = jax.jit(lambda p, n: jh.Particles.create(p, 10.0, id=padded.id, num=n).id)(pos, 60)
    np.testing.assert_array_equal(got, np.asarray(padded.id))


@pytest.mark.parametrize(
    "shape", [(2, 4), pytest.param((1, 1), marks=pytest.mark.slow)], ids=["mesh2x4", "mesh1x1"]
)
def test_repeated_ids_on_devices_fail_the_status(shape):
    """Ids already on devices are not checked for repeats when made; FoF counts every
    repeat: clumps A and B (apart) share their smallest id, C holds its own twice, and two
    background particles share an id that is no group's smallest."""
    rng = np.random.default_rng(6)
    pos = np.concatenate(
        [
            rng.normal(2.0, 0.05, (30, 3)),
            rng.normal(7.0, 0.05, (30, 3)),
            rng.normal([2.0, 7.0, 5.0], 0.05, (25, 3)),
            rng.uniform(0, 10.0, (43, 3)),
        ]
    ).astype(np.float32)
    ids = np.arange(128, dtype=np.int32) + 100
    ids[30], ids[60:85] = ids[0], ids[60:85] - 100
    ids[70] = ids[60]
    ids[90] = ids[95]  # background: no group's smallest
    mesh = make_mesh(shape)
    rows = NamedSharding(mesh, P(("x", "y")))
    particles = jh.Particles.create(jax.device_put(pos, rows), 10.0, id=jax.device_put(ids, rows))
    with pytest.raises(jh.InvalidInputError, match=r"particle ids repeat \(3 repeats found\)"):
        jh.fof(particles, linking_length=0.5, min_members=20)
    status = jax.jit(lambda p: jh.fof(p, linking_length=0.5, min_members=20)[1].status)(particles)
    assert int(status.repeated_ids) == 3 and not bool(status.ok)
    assert status.failure() == jh.Failure(jh.FailureKind.REPEATED_IDS, 3)
    if shape != (1, 1):  # the runtime check inside jit, on every device of the mesh

        def checked(p):
            labels, cat = jh.fof(p, linking_length=0.5, min_members=20)
            return cat.status.error_if(labels)

        with pytest.raises(Exception, match=r"particle ids repeat \(3 repeats found\)"):
            jax.block_until_ready(jax.jit(checked)(particles))


@pytest.mark.slow
@pytest.mark.parametrize("shape", mesh_params([(2, 4), (1, 8), (1, 1)]), ids=mesh_id)
def test_repeated_ids_of_groups_below_min_members_are_caught(shape):
    """The probe's case: groups too small for the catalogue, whole on different devices,
    sharing their smallest id (pairs at opposite corners, and isolated particles); also by
    fof_local inside the caller's shard_map."""
    rng = np.random.default_rng(7)
    pos = rng.uniform(0, 10.0, (256, 3)).astype(np.float32)
    pos[:2] = [[0.5, 0.5, 0.5], [0.52, 0.5, 0.5]]  # a pair ...
    pos[2:4] = [[9.0, 9.0, 5.0], [9.02, 9.0, 5.0]]  # ... and another, far from it
    ids = np.arange(256, dtype=np.int32)
    ids[2], ids[200] = ids[0], ids[100]  # the pairs share their smallest id; two loners one
    mesh = make_mesh(shape)
    rows = NamedSharding(mesh, P(("x", "y")))
    particles = jh.Particles.create(jax.device_put(pos, rows), 10.0, id=jax.device_put(ids, rows))
    with pytest.raises(jh.InvalidInputError, match=r"particle ids repeat \(2 repeats found\)"):
        jh.fof(particles, linking_length=0.1, min_members=20)
    status = jax.jit(lambda p: jh.fof(p, linking_length=0.1, min_members=20)[1].status)(particles)
    assert int(status.repeated_ids) == 2

    def local(block, block_ids):
        parts = jh.Particles.create(block, 10.0, id=block_ids)
        _, _, cat = jh.fof_local(parts, 0.1, axes=mesh.axis_names, min_members=20)
        return cat.status.repeated_ids[None]

    spec = P(("x", "y"))
    inside = jax.shard_map(local, mesh=mesh, in_specs=(spec, spec), out_specs=spec)
    found = jax.jit(inside)(jax.device_put(pos, rows), jax.device_put(ids, rows))
    assert (np.asarray(found) == 2).all()
    unique = jh.Particles.create(
        jax.device_put(pos, rows), 10.0, id=jax.device_put(np.arange(256, dtype=np.int32), rows)
    )
    assert bool(
        jax.jit(lambda p: jh.fof(p, linking_length=0.1, min_members=20)[1].status.ok)(unique)
    )


@pytest.mark.leg1
def test_padded_particles_raise_rather_than_count_their_padding():
    """The public calls take every row as a particle: padding rows (id -1, zero positions)
    would be counted as particles at the origin, so padded Particles raise."""
    pos = np.random.default_rng(3).uniform(0, 10.0, (200, 3)).astype(np.float32)
    padded = jh.Particles.create(pos, 10.0, num=120)
    for call in (
        lambda: jh.knn(padded, k=2),
        lambda: jh.fof(padded, linking_length=0.5),
        lambda: jh.knn_density(padded, k=4),
    ):
        with pytest.raises(ValueError, match=r"hold 120 particles in 200 rows"):
            call()
    # Its valid rows, as the message suggests, give scipy's neighbours.
    dense = jh.Particles.create(padded.pos[:120], 10.0, id=padded.id[:120])
    dist, idx = jh.knn(dense, k=2)
    want, want_idx = cKDTree(pos[:120], boxsize=10.0).query(pos[:120], k=3)
    np.testing.assert_allclose(np.asarray(dist), want[:, 1:], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(idx), want_idx[:, 1:])


@pytest.mark.leg1
def test_padding_rows_of_a_traced_num_are_left_out_and_fail_the_status():
    # Inside jit num may be unknown: the padding rows (id -1, at the origin) were read as
    # particles with status ok. Now they are left out like non-finite rows and counted;
    # the valid rows keep scipy's neighbours.
    pos = np.random.default_rng(3).uniform(0, 10.0, (200, 3)).astype(np.float32)

    def padded_knn(p, num):
        return jh.knn(jh.Particles.create(p, 10.0, num=num), k=2, with_status=True)

    (dist, idx), status = jax.jit(padded_knn)(pos, 120)
    assert status.failure() == jh.Failure(jh.FailureKind.NONFINITE, 80)
    want, want_idx = cKDTree(pos[:120], boxsize=10.0).query(pos[:120], k=3)
    np.testing.assert_allclose(np.asarray(dist)[:120], want[:, 1:], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(idx)[:120], want_idx[:, 1:])
    assert np.isnan(np.asarray(dist)[120:]).all() and (np.asarray(idx)[120:] == -1).all()
    # dense Particles passed through jit (num traced, equal to the rows) are all particles
    (dist, _), status = jax.jit(padded_knn)(pos, 200)
    assert bool(status.ok)
    np.testing.assert_allclose(
        np.asarray(dist), cKDTree(pos, boxsize=10.0).query(pos, 3)[0][:, 1:], rtol=1e-5, atol=1e-6
    )


def test_traced_ids_out_of_range_are_left_out_and_fail_the_status():
    # Inside jit ids cannot be refused: -1 (padding) and the int32 maximum ("no id") were
    # cast and used as particle ids with status ok. Now those particles are left out and
    # counted like non-finite ones; the others keep scipy's neighbours, ids included.
    pos = np.random.default_rng(13).uniform(0, 10.0, (120, 3)).astype(np.float32)
    ids = np.arange(120, dtype=np.int32) + 5
    ids[[7, 50]] = -1, np.iinfo(np.int32).max

    def knn_with_ids(p, i):
        return jh.knn(jh.Particles.create(p, 10.0, id=i), k=2, with_status=True)

    (dist, idx), status = jax.jit(knn_with_ids)(pos, ids)
    assert status.failure() == jh.Failure(jh.FailureKind.NONFINITE, 2)
    keep = np.ones(120, bool)
    keep[[7, 50]] = False
    want, want_row = cKDTree(pos[keep], boxsize=10.0).query(pos[keep], k=3)
    np.testing.assert_allclose(np.asarray(dist)[keep], want[:, 1:], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(idx)[keep], ids[keep][want_row[:, 1:]])
    assert np.isnan(np.asarray(dist)[~keep]).all() and (np.asarray(idx)[~keep] == -1).all()
    (_, idx), status = jax.jit(knn_with_ids)(pos, np.arange(120, dtype=np.int32))
    assert bool(status.ok) and int(np.asarray(idx).min()) >= 0
    # narrow ids: the bound 2**31 - 2 wrapped to -2 in int16 and every particle was left out
    for dtype, bad in ((np.int16, -1), (np.uint8, None)):
        narrow = np.arange(120).astype(dtype)
        if bad is not None:
            narrow[9] = bad
        left_out = np.isnan(
            np.asarray(jax.jit(lambda p, i: jh.Particles.create(p, 10.0, id=i).pos)(pos, narrow))
        ).any(axis=1)
        np.testing.assert_array_equal(np.where(left_out)[0], [] if bad is None else [9])


@pytest.mark.parametrize(
    "n, k, message",
    [
        (1, 1, r"there are 1\. No k fits: 2 particles at least are needed"),
        (3, 3, r"there are 3\. Use k <= 2"),
    ],
)
def test_too_large_k_names_a_k_that_fits_or_none(n, k, message):
    pos = np.random.default_rng(4).uniform(0, 10.0, (n, 3)).astype(np.float32)
    with pytest.raises(ValueError, match=message):
        jh.knn(pos, 10.0, k)


@pytest.mark.parametrize(
    "mass",
    [pytest.param(0.0, marks=pytest.mark.slow), np.zeros(64, np.float32)],
    ids=["scalar", "rows"],
)
@pytest.mark.leg1
def test_overdensity_of_zero_total_mass_raises(mass):
    pos = np.random.default_rng(5).uniform(0, 10.0, (64, 3)).astype(np.float32)
    with pytest.raises(ValueError, match="total mass is 0"):
        jh.knn_density(pos, 10.0, 4, mass=mass, overdensity=True)
    rho = jh.knn_density(pos, 10.0, 4, mass=mass)  # a density of zero mass is zero
    assert np.all(np.asarray(rho) == 0)
    if np.ndim(mass) == 0:
        return  # the traced check below compiles a program: one parameter is enough
    # inside jit the overdensities are NaN, and the status says the masses were unusable
    delta, status = jax.jit(
        lambda p, m: jh.knn_density(p, 10.0, 4, mass=m, overdensity=True, with_status=True)
    )(pos, mass)
    assert np.isnan(np.asarray(delta)).all()
    assert status.failure() == jh.Failure(jh.FailureKind.NONFINITE, 64)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: jh.FoFConfig(max_halos=-5), r"FoFConfig\(max_halos=-5\)"),
        (lambda: jh.DomainConfig(capacity_factor=-1.0), r"DomainConfig\(capacity_factor=-1.0\)"),
        (lambda: jh.SOConfig(radius=float("nan")), r"SOConfig\(radius=nan\)"),
        (lambda: jh.KNNConfig(batch_size="16"), r"KNNConfig\(batch_size='16'\)"),
    ],
)
def test_a_config_refuses_a_negative_or_non_numeric_setting_at_construction(make, message):
    with pytest.raises(ValueError, match=message + ": a setting must be a finite number"):
        make()
    assert jh.KNNConfig(remote_factor=0.0).remote_factor == 0.0  # zero is a setting


def test_more_particles_than_int32_ids_can_number_are_refused_before_tracing():
    # fof, knn and InSitu on a raw 1296^3 grid or 2**31 + 8 flat rows traced happily: the
    # int32 lattice ids wrapped negative (from_jaxpm alone refused them)
    mesh = make_mesh((2, 4))
    grid = jax.ShapeDtypeStruct(
        (1296, 1296, 1296, 3), jnp.float32, sharding=NamedSharding(mesh, P("x", "y"))
    )
    flat = jax.ShapeDtypeStruct(
        (2**31 + 8, 3), jnp.float32, sharding=NamedSharding(mesh, P(("x", "y")))
    )
    insitu = jh.InSitu(box_size=1000.0, analyses="fof", b=0.2)
    state = jax.ShapeDtypeStruct(
        (2,) + grid.shape, jnp.float32, sharding=NamedSharding(mesh, P(None, "x", "y"))
    )
    for call, arg in [
        (lambda p: jh.fof(p, 1000.0, b=0.2), grid),
        (lambda p: jh.knn(p, 1000.0, 4), flat),
        (lambda y: insitu(y, 1.0), state),
    ]:
        with pytest.raises(ValueError, match=r"particle rows: .* at most 2\*\*31 - 1"):
            jax.eval_shape(call, arg)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: jh.KNNConfig(batch_size=0), r"KNNConfig\(batch_size=0\): .* integer >= 1$"),
        (lambda: jh.KNNConfig(chunk_size=1.5), r"KNNConfig\(chunk_size=1.5\)"),
        (lambda: jh.FoFConfig(max_halos=2.5), r"FoFConfig\(max_halos=2.5\): .* >= 1 \(or None"),
        (lambda: jh.SOConfig(levels=0), r"SOConfig\(levels=0\)"),
    ],
)
def test_a_config_refuses_a_count_that_is_not_a_positive_integer(make, message):
    # batch_size=0 failed with a ZeroDivisionError and 1.5 with a shapes TypeError, deep in
    # the trace, naming no setting
    with pytest.raises(ValueError, match=message):
        make()
    assert jh.KNNConfig(batch_size=np.int64(1), chunk_size=1).batch_size == 1


@pytest.mark.parametrize(
    "so, message",
    [
        ({"ass": 200.0}, r"replace the catalogue's \['mass'\]"),
        ({"adius": 5.0}, r"\['radius'\]"),
        ({"": 5.0}, "must not be empty"),
        ({"2/0": 5.0}, "holds '/'.*e.g. '2_0'"),
    ],
)
def test_so_names_cannot_overwrite_catalogue_fields(so, message):
    pos = np.random.default_rng(6).uniform(0, 10.0, (64, 3)).astype(np.float32)
    with pytest.raises(ValueError, match=message):
        jh.fof(pos, 10.0, 0.5, so=so)


def test_insitu_takes_one_analysis_named_as_a_string():
    assert jh.InSitu(box_size=16.0, analyses="fof").analyses == ("fof",)


@pytest.mark.leg1
def test_a_box_size_that_disagrees_with_the_particles_is_refused():
    """The Particles' positions were wrapped into their own box; a different box_size
    used to win silently (fof on a 32 box searched as 64: 78 groups instead of 49)."""
    particles = jh.Particles.create(np.full((8, 3), 1.0, np.float32), box_size=32.0)
    centres = jnp.zeros((1, 3))
    calls = (
        lambda **kw: jh.fof(particles, b=0.2, **kw),
        lambda **kw: jh.knn_density(particles, k=2, **kw),
        lambda **kw: jh.spherical_overdensity(particles, centres, density=200.0, **kw),
    )
    for call in calls:
        with pytest.raises(
            ValueError,
            match=r"box_size=64.0 disagrees with the Particles' "
            r"box_size=32.0; leave box_size out",
        ):
            call(box_size=64.0)
    # The same box, spelled otherwise, is accepted (the first call's program is reused).
    want = np.asarray(calls[1]())
    for same in (32, np.int64(32), np.float32(32.0)):
        np.testing.assert_array_equal(np.asarray(calls[1](box_size=same)), want)
    tenth = jh.Particles.create(np.full((8, 3), 0.01, np.float32), box_size=0.1)
    jh.knn_density(tenth, k=2, box_size=np.float32(0.1))  # 0.1 in float32 is 0.1


@pytest.mark.parametrize("box", [[32.0, 32.0, 64.0], np.array([32.0, 32.0, 64.0]), "32"])
def test_a_box_size_that_is_not_one_number_says_boxes_are_cubic(box):
    """A per-axis box raised a bare TypeError from float()."""
    with pytest.raises(
        ValueError,
        match=r"box_size must be one number, the side of a cubic "
        r"periodic box \(non-cubic boxes are not supported\)",
    ):
        jh.fof(np.zeros((8, 3), np.float32), box, 0.2)
    with pytest.raises(ValueError, match=r"non-cubic boxes are not supported"):
        jh.from_jaxpm(np.zeros((4, 4, 4, 3), np.float32), box_size=box)


def test_a_knob_shared_by_buffers_of_different_scales_is_grown_in_its_own_unit():
    """kNN at query points sizes the queries' buffers with the particles' capacity_factor,
    at 25 query rows per unit against 512 particle rows. 200 queries in one pencil need
    factor 8; the suggestion was 534 / 25 = 21.36, the particle buffer's (unfilled) rows
    taken as query rows, which also bloated the particle buffers."""
    from jaxpm_halos.core.config import CAPACITY
    from jaxpm_halos.core.errors import Limit
    from jaxpm_halos.core.status import Status

    status = Status(
        {"capacity": jnp.int32(534), "query capacity": jnp.int32(200)},
        jnp.int32(0),
        (("capacity", Limit(CAPACITY, 1024, 512.0)), ("query capacity", Limit(CAPACITY, 50, 25.0))),
    )
    failure = status.failure()
    assert (failure.buffer, failure.count, failure.needed) == ("query capacity", 200, 200)
    assert failure.settings() == {CAPACITY: 8.0}
    # Both overflow: the first is reported, sized for the one needing more of the knob.
    for queries, factor in ((60, 10.0), (300, 12.0)):
        status = Status(
            {"capacity": jnp.int32(5120), "query capacity": jnp.int32(queries)},
            jnp.int32(0),
            status.limits,
        )
        failure = status.failure()
        assert (failure.buffer, failure.needed) == ("capacity", int(factor * 512))
        assert failure.settings() == {CAPACITY: factor}


def test_growth_that_runs_out_of_rounds_raises_the_failure_in_fields():
    """A call whose need keeps rising ends in a CapacityError that still carries its
    failure (it was a bare CapacityError with failure None) and counts the rounds."""
    from jaxpm_halos.core.config import CAPACITY
    from jaxpm_halos.core.errors import Limit
    from jaxpm_halos.core.retry import MAX_ROUNDS, run_growing
    from jaxpm_halos.core.status import Status

    calls = []

    def call(config):  # needs twice what the last config held, every time
        rows = int(round(config.capacity_factor * 100))
        calls.append(rows)
        return Status(
            {"capacity": jnp.int32(2 * rows)},
            jnp.int32(0),
            (("capacity", Limit(CAPACITY, rows, 100.0)),),
        )

    with pytest.raises(jh.CapacityError, match=f"after {MAX_ROUNDS} rounds") as error:
        run_growing(call, jh.DomainConfig(capacity_factor=1.0), Status.failure, grow=True)
    assert len(calls) == MAX_ROUNDS
    assert error.value.failure.buffer == "capacity"
    assert error.value.failure.needed == 2 * calls[-1]
