"""kNN-CDFs: hard CDFs exact against scipy's cKDTree on clustered data on every mesh; the
smoothed CDF against its float64 formula and the hard one as h -> 0; gradients against
finite differences; NaN rows inside jit; the in-situ analysis against the offline call,
with its gradient; errors."""

import doctest
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh, mesh_id, mesh_params, on_ci_meshes
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from scipy.spatial import cKDTree

import jaxpm_halos as jh
from jaxpm_halos.insitu.registry import REGISTRY
from jaxpm_halos.stats.knn_cdf import (
    cdf_sums,
    knn_cdf,
    random_queries,
    register_knn_cdf,
    smooth_step,
)

# By its import path: a package export of the function knn_cdf would shadow the attribute.
module = importlib.import_module("jaxpm_halos.stats.knn_cdf")

BOX = 16.0
N = 4096
Q = 200
RANKS = (1, 2, 4, 8)
COLUMNS = np.asarray(RANKS) - 1
H = 0.25  # smoothing length (Mpc/h): below the CDFs' bends (~1 Mpc/h), above the spacing
EPS32 = float(np.finfo(np.float32).eps)
# float32 kNN distances are within a few ulps of the box's coordinates of the float64
# ones (tests/test_knn.py holds them to 8 eps L = 1.5e-5 here); radii kept farther than
# MARGIN from every reference distance are compared as exact counts.
MARGIN = 1e-4
STEP = 1e-3  # finite-difference step, Mpc/h


def _wrap64(pos, box):
    pos = np.mod(np.asarray(pos, np.float64), box)
    pos[pos >= box] -= box
    return pos


def _clustered(seed=0):
    """Gaussian clumps (one on the box corner, others on pencil faces of the test meshes)
    over a uniform background, and query points: uniform ones plus a few in the clumps."""
    rng = np.random.default_rng(seed)
    centres = np.array(
        [[0.0, 0.0, 0.0], [BOX / 2, BOX / 2, BOX / 2], [BOX / 4, BOX / 8, 3.0], [12.0, 4.0, 9.0]]
    )
    clumps = [c + rng.normal(0, s, (300, 3)) for c, s in zip(centres, (0.3, 0.5, 0.2, 0.8))]
    background = rng.uniform(0, BOX, (N - 1200, 3))
    pos = _wrap64(np.concatenate(clumps + [background]), BOX).astype(np.float32)
    inside = centres + rng.normal(0, 0.3, (len(centres), 3))
    query = np.concatenate([random_queries(Q - len(centres), BOX, seed=seed + 1), inside])
    return pos, _wrap64(query, BOX).astype(np.float32)


POS, QUERY = _clustered()


def _distances(pos, query, box, kmax):
    """cKDTree (float64) distances (Q, kmax) and ids from the query points."""
    tree = cKDTree(_wrap64(pos, box), boxsize=box)
    return tree.query(_wrap64(query, box), k=kmax)


def _clear_radii(dist, radii):
    """Radii moved (up, by 0.1%) until none lies within MARGIN of a distance in ``dist``."""
    radii = np.array(radii, np.float64)
    for i in range(len(radii)):
        while np.min(np.abs(dist - radii[i])) < MARGIN:
            radii[i] *= 1.001
    return radii


REF_DIST, REF_IDX = _distances(POS, QUERY, BOX, RANKS[-1])
RADII = _clear_radii(REF_DIST[:, COLUMNS], np.geomspace(0.1, 3.0, 16))
# The reference counts #{q: d_k(q) <= r} (K, R), and the CDF as knn_cdf rounds it.
REF_COUNTS = np.sum(REF_DIST[:, COLUMNS, None] <= RADII[None, None, :], axis=0)
REF_CDF = REF_COUNTS.astype(np.float32) / np.float32(Q)
WEIGHTS = np.random.default_rng(5).normal(size=(len(RANKS), len(RADII))).astype(np.float32)


def _smooth_reference(dist, radii, h):
    """The smoothed CDF in float64 numpy: mean over queries of S((r - d_k) / h)."""
    u = np.clip((radii[None, None, :] - dist[:, :, None]) / h, -1, 1)
    return np.mean(0.5 + 0.75 * u - 0.25 * u**3, axis=0)


def _shard(mesh, x):
    return jax.device_put(x, NamedSharding(mesh, P(("x", "y"))))


def _direction(seed, n, moved):
    """A random direction (n, 3) moving ``moved`` random particles."""
    rng = np.random.default_rng(seed)
    v = np.zeros((n, 3), np.float32)
    v[rng.choice(n, moved, replace=False)] = rng.normal(size=(moved, 3))
    return v


def _same_neighbours(pos, v, query, box, ranks, step):
    """Whether every query's k-th neighbour (each k of ``ranks``) is the same particle at
    ``pos - step v``, ``pos`` and ``pos + step v`` (cKDTree): then each d_k is smooth along
    the segment and central differences measure the gradient, not a kink."""
    columns = np.asarray(ranks) - 1
    ids = [_distances(pos + s * step * v, query, box, ranks[-1])[1][:, columns] for s in (-1, 0, 1)]
    return np.array_equal(ids[0], ids[1]) and np.array_equal(ids[1], ids[2])


def _clean_directions(pos, query, box, ranks, moved, count=3):
    """``count`` directions (seeded) along which no k-th neighbour changes within STEP."""
    found = []
    for seed in range(100):
        v = _direction(seed, len(pos), moved)
        if _same_neighbours(pos, v, query, box, ranks, STEP):
            found.append(v)
            if len(found) == count:
                return found
    raise AssertionError("no direction without a neighbour change: move fewer particles")


# Finite differences in float32: each position rounds to ~1 ulp (2e-6 Mpc/h near L = 16,
# 4e-6 at 32), so each distance difference over 2 STEP is off by up to ~3e-3 relative, and
# a query's term in f by |W| S'/h (<= 0.75/h per Mpc/h, times |W| ~ 1) times that, over Q.
# Those errors, of random sign, sum over the queries, ranks and radii to ~1e-3 at most
# (measured on (2, 4): <= 3.5e-4, offline and in situ); directions are screened so that no
# k-th neighbour changes within the step (a kink would add ~|W| S'/h / Q ~ 1e-2 each).
FD_RTOL, FD_ATOL = 1e-2, 1e-3


def _check_directional(grad, f, x, directions, step):
    for v in directions:
        v = jnp.asarray(v)
        fd = (float(f(x + step * v)) - float(f(x - step * v))) / (2 * step)
        exact = float(jnp.vdot(grad, v))
        assert abs(fd - exact) <= FD_RTOL * abs(exact) + FD_ATOL, (fd, exact)


DIRECTIONS = _clean_directions(POS, QUERY, BOX, RANKS, moved=256)


# ----------------------------------------------------------------------------------------
# Offline


@pytest.mark.newest
@on_ci_meshes()
def test_hard_and_smooth_cdfs_match_the_references_on_every_mesh(mesh):
    pos, query = _shard(mesh, POS), _shard(mesh, QUERY)
    cdf, status = knn_cdf(pos, query, RADII, k=RANKS, box_size=BOX, with_status=True)
    assert bool(status.ok) and cdf.shape == (len(RANKS), len(RADII))
    np.testing.assert_array_equal(np.rint(np.asarray(cdf) * Q).astype(int), REF_COUNTS)
    # One division: numpy's bits, or within one rounding where XLA compiled without
    # optimisation (CI's newest-jax leg) divides through the reciprocal.
    np.testing.assert_allclose(np.asarray(cdf), REF_CDF, rtol=2**-23, atol=0)
    assert 0 < REF_CDF.mean() < 1 and len(np.unique(REF_CDF)) > 20  # the radii span the CDFs
    # h far below MARGIN: every step is exactly 0 or 1, the hard CDF's bits
    tiny = knn_cdf(pos, query, RADII, k=RANKS, box_size=BOX, smoothing=MARGIN / 10)
    np.testing.assert_array_equal(np.asarray(tiny), np.asarray(cdf))
    smooth = knn_cdf(pos, query, RADII, k=RANKS, box_size=BOX, smoothing=H)
    # Distances off by <= 1.5e-5 move each S by <= 1.5e-5 * 3/(4 H); float32 sums of Q
    # terms add ~Q eps.
    want = _smooth_reference(REF_DIST[:, COLUMNS], RADII, H)
    np.testing.assert_allclose(np.asarray(smooth), want, rtol=0, atol=1e-4)
    assert np.abs(want - REF_COUNTS / Q).max() > 0.02  # the smoothing is not a no-op here


def test_other_ranks_and_replicated_queries_in_any_leading_shape():
    pos = _shard(make_mesh((2, 4)), POS)
    cdf = knn_cdf(pos, QUERY.reshape(10, 20, 3), RADII[::3], k=(3, 8), box_size=BOX)
    want = np.mean(REF_DIST[:, [2, 7], None] <= RADII[None, None, ::3], axis=0)
    np.testing.assert_array_equal(np.rint(np.asarray(cdf) * Q), np.rint(want * Q))


@on_ci_meshes()
def test_gradient_matches_finite_differences(mesh):
    pos, query = _shard(mesh, POS), _shard(mesh, QUERY)

    def f(p):
        cdf = knn_cdf(p, query, RADII, k=RANKS, box_size=BOX, smoothing=H)
        return jnp.sum(WEIGHTS * cdf)

    grad = jax.grad(f)(pos)
    assert grad.shape == POS.shape and np.isfinite(np.asarray(grad)).all()
    assert np.count_nonzero(np.asarray(grad).any(axis=1)) > 100  # many particles matter
    _check_directional(grad, f, pos, DIRECTIONS, STEP)


def test_the_hard_cdf_has_zero_gradient():
    grad = jax.grad(lambda p: jnp.sum(knn_cdf(p, QUERY, RADII[:4], k=(1,), box_size=BOX)))(POS)
    assert not np.asarray(grad).any()


def test_rows_not_computed_are_nan_not_misses():
    d = jnp.asarray([[0.5, 1.0], [jnp.nan, jnp.nan], [0.2, jnp.nan], [9.0, 9.0]])  # (4, 2)
    valid = jnp.asarray([True, True, True, False])  # the last row is padding
    radii = jnp.asarray([0.3, 2.0])
    sums, blank = cdf_sums(d, valid, radii)
    np.testing.assert_array_equal(np.asarray(blank), [1, 2])
    np.testing.assert_array_equal(np.asarray(sums), [[1, 2], [0, 1]])
    fractions = module.cdf_fractions(sums, blank, 3, jnp.float32)
    assert np.isnan(np.asarray(fractions)).all()
    # the smooth sums' gradient stays finite in the rows computed
    g = jax.grad(lambda d: jnp.sum(cdf_sums(d, valid, radii, 0.1)[0]))(d)
    assert np.isfinite(np.asarray(g)).all()


@pytest.mark.leg1
def test_an_overflow_inside_jit_gives_nan_and_a_failed_status():
    pos = _shard(make_mesh((2, 4)), POS)
    small = jh.KNNConfig(index_factor=0.5)
    cdf, status = jax.jit(
        lambda p: knn_cdf(p, QUERY, RADII, box_size=BOX, config=small, with_status=True)
    )(pos)
    assert not bool(status.ok) and status.failure().buffer == "knn index"
    assert np.isnan(np.asarray(cdf)).all()


def test_smooth_step_is_a_c1_step_of_compact_support():
    u = jnp.linspace(-2, 2, 401)
    s = np.asarray(smooth_step(u))
    assert (s[u <= -1] == 0).all() and (s[u >= 1] == 1).all()
    assert (np.diff(s) >= 0).all()
    ds = np.asarray(jax.vmap(jax.grad(smooth_step))(u))
    np.testing.assert_allclose(ds, np.where(np.abs(u) < 1, 0.75 * (1 - u**2), 0), atol=1e-6)


def test_random_queries_are_seeded_and_in_the_box():
    a, b = random_queries(1000, 10.0, seed=3), random_queries(1000, 10.0, seed=3)
    assert a.shape == (1000, 3) and a.dtype == np.float32 and np.array_equal(a, b)
    assert (a >= 0).all() and (a < 10.0).all()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(k=8), r"tuple of neighbour ranks, e.g. k=\(8,\)"),
        (dict(k=()), "non-empty tuple"),
        (dict(k=(0, 2)), "positive ints"),
        (dict(k=(1.5,)), "positive ints"),
        (dict(k=(4, 2, 2)), r"ascending order; pass k=\(2, 4\)"),
        (dict(k=(1, N + 1)), "need at least k particles"),
        (dict(radii=[[1.0]]), "1-D"),
        (dict(radii=[]), "non-empty"),
        (dict(radii=[1.0, -1.0]), "positive and finite"),
        (dict(radii=[np.nan]), "positive and finite"),
        (dict(radii=[True]), "radii"),
        (dict(smoothing=0.0), "smoothing must be a positive"),
        (dict(smoothing=[0.1, 0.2]), "one length"),
        (dict(query=np.zeros((4, 2), np.float32)), "trailing axis"),
        (dict(query=np.full((2, 3), np.nan, np.float32)), "query points are NaN"),
    ],
)
def test_bad_arguments_raise(kwargs, message):
    args = dict(query=QUERY[:8], radii=RADII, box_size=BOX) | kwargs
    with pytest.raises(ValueError, match=message):
        knn_cdf(POS, **args)


def test_bad_registrations_raise():
    with pytest.raises(ValueError, match=r"\(Q, 3\)"):
        register_knn_cdf("bad_cdf", query=np.zeros((5, 2)), radii=[1.0])
    with pytest.raises(ValueError, match="finite"):
        register_knn_cdf("bad_cdf", query=np.full((5, 3), np.inf), radii=[1.0])
    with pytest.raises(ValueError, match="smoothing"):
        register_knn_cdf("bad_cdf", query=QUERY, radii=[1.0], smoothing=-1.0)
    assert "bad_cdf" not in REGISTRY


def test_docstring_examples_run_as_written():
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.attempted > 0 and result.failed == 0


# ----------------------------------------------------------------------------------------
# In situ

NC, INSITU_BOX = 16, 32.0
INSITU_QUERY = random_queries(Q, INSITU_BOX, seed=7)
INSITU_H = 0.5  # Mpc/h, in a box with a mean separation of 2 Mpc/h


def _displacements(seed=0):
    """Displacements (cells) of a 16^3 lattice: Gaussian scatter plus four collapsing
    regions pulled toward their centres."""
    rng = np.random.default_rng(seed)
    disp = rng.normal(0, 0.7, (NC, NC, NC, 3))
    lattice = np.stack(np.meshgrid(*[np.arange(NC)] * 3, indexing="ij"), axis=-1)
    for centre in rng.uniform(0, NC, (4, 3)):
        offset = (centre - lattice + NC / 2) % NC - NC / 2
        near = np.linalg.norm(offset, axis=-1) < 4
        disp[near] += 0.8 * offset[near]
    state = np.zeros((2, NC, NC, NC, 3), np.float32)
    state[0] = disp
    return state


STATE = _displacements()
INSITU_POS = np.asarray(jh.from_jaxpm(STATE, box_size=INSITU_BOX).pos).reshape(-1, 3)
INSITU_DIST = _distances(INSITU_POS, INSITU_QUERY, INSITU_BOX, RANKS[-1])[0][:, COLUMNS]
INSITU_RADII = _clear_radii(INSITU_DIST, np.linspace(0.4, 5.0, 12))


@pytest.fixture(scope="module")
def registered():
    names = (
        register_knn_cdf(query=INSITU_QUERY, radii=INSITU_RADII, k=RANKS),
        register_knn_cdf(
            "knn_cdf_smooth", query=INSITU_QUERY, radii=INSITU_RADII, k=RANKS, smoothing=INSITU_H
        ),
    )
    yield names
    for name in names:
        REGISTRY.pop(name)


def _state(mesh):
    return jax.device_put(STATE, NamedSharding(mesh, P(None, "x", "y")))


@pytest.fixture(scope="module")
def insitu_reference(registered):
    """The in-situ CDFs on (2, 4), and the offline ones on the same positions."""
    mesh = make_mesh((2, 4))
    y = _state(mesh)
    out = jh.InSitu(box_size=INSITU_BOX, analyses=registered)(y, a=1.0)
    jh.check_insitu(out)
    particles = jh.from_jaxpm(y, box_size=INSITU_BOX)
    offline = [
        knn_cdf(particles, INSITU_QUERY, INSITU_RADII, k=RANKS, smoothing=h)
        for h in (None, INSITU_H)
    ]
    return out, offline


def test_insitu_cdf_is_the_offline_cdf(insitu_reference):
    out, (hard, smooth) = insitu_reference
    cdf = np.asarray(out["knn_cdf"]["cdf"])
    assert cdf.shape == (len(RANKS), len(INSITU_RADII)) and bool(out["knn_cdf"]["status"].ok)
    np.testing.assert_array_equal(cdf, np.asarray(hard))
    want = np.sum(INSITU_DIST[:, :, None] <= INSITU_RADII, axis=0)
    np.testing.assert_array_equal(np.rint(cdf * Q).astype(int), want)
    # The same S values, summed per device and then over devices: float32 rounding.
    np.testing.assert_allclose(
        np.asarray(out["knn_cdf_smooth"]["cdf"]), np.asarray(smooth), rtol=0, atol=Q * EPS32
    )


@pytest.mark.parametrize("shape", mesh_params([(1, 8), (8, 1), (1, 1)], ci=[(1, 1)]), ids=mesh_id)
def test_insitu_cdf_is_the_same_on_every_mesh(registered, insitu_reference, shape):
    out = jh.InSitu(box_size=INSITU_BOX, analyses=registered[:1])(_state(make_mesh(shape)))
    jh.check_insitu(out)
    np.testing.assert_array_equal(
        np.asarray(out["knn_cdf"]["cdf"]), np.asarray(insitu_reference[0]["knn_cdf"]["cdf"])
    )


@pytest.mark.slow
@pytest.mark.parametrize("shape", mesh_params([(2, 4), (1, 1)]), ids=mesh_id)
def test_insitu_gradient_matches_finite_differences(registered, shape):
    insitu = jh.InSitu(box_size=INSITU_BOX, analyses=registered[1:])
    y = _state(make_mesh(shape))

    def f(y):
        return jnp.sum(WEIGHTS[:, : len(INSITU_RADII)] * insitu(y, a=1.0)["knn_cdf_smooth"]["cdf"])

    grad = jax.grad(f)(y)
    assert np.isfinite(np.asarray(grad)).all() and not np.asarray(grad[1]).any()
    # Forward mode gives the same derivative (one psum of a float and an int32 once failed).
    tangent = jax.jvp(f, (y,), (y,))[1]
    np.testing.assert_allclose(float(tangent), float(jnp.vdot(grad, y)), rtol=1e-4)
    cells = NC / INSITU_BOX  # displacements are in lattice cells
    directions = []
    for v in _clean_directions(INSITU_POS, INSITU_QUERY, INSITU_BOX, RANKS, moved=256):
        # the direction in Mpc/h moves y[0] by v * cells
        state = np.zeros_like(STATE)
        state[0] = v.reshape(NC, NC, NC, 3) * cells
        directions.append(jax.device_put(state, y.sharding))
    _check_directional(grad, f, y, directions, STEP)
