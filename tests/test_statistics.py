"""Soft halo counts: the hard counts (np.histogram) as the width goes to 0, a float64
reference of the definition, the second-order bias of docs/statistics.md, derivatives
against finite differences, and counts of smooth SO masses from a catalogue sharded on a
mesh and on one device (the chain's derivative against the float64 definitions)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import CI_MESHES, make_mesh, mesh_id, mesh_params
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpm_halos as jh
from jaxpm_halos.stats import soft_counts
from jaxpm_halos.testing.reference import catalogue, soft_so_reference

EDGES = np.arange(12.0, 15.01, 0.25)


def counts_reference(mass, edges, width):
    """The definition in float64."""
    x = np.log10(mass)[:, None]
    u = np.clip((x - np.asarray(edges)[None, :]) / width, -1, 1)
    above = np.sum(0.5 + u * (0.75 - 0.25 * u * u), axis=0)
    return above[:-1] - above[1:]


@pytest.fixture(scope="module")
def masses():
    rng = np.random.default_rng(0)
    x = 12 + 2.5 * rng.power(0.3, 600)  # a falling mass function of log10 (M / (Msun/h))
    # None within float32's rounding of an edge: the hard limit is then exact.
    return 10 ** x[np.min(np.abs(x[:, None] - EDGES[None, :]), axis=1) > 1e-3]


@pytest.mark.newest
def test_soft_counts_are_the_hard_ones_as_the_width_goes_to_zero(masses):
    hard = np.histogram(np.log10(masses), EDGES)[0]
    gap = np.min(np.abs(np.log10(masses)[:, None] - EDGES[None, :]))
    np.testing.assert_array_equal(soft_counts(masses, EDGES, width=0.9 * gap), hard)
    for width in (0.05, 0.2):
        got = soft_counts(masses, EDGES, width=width)
        np.testing.assert_allclose(
            got, counts_reference(masses, EDGES, width), rtol=1e-5, atol=1e-4
        )


def test_padding_nan_and_empty_masses_count_nothing(masses):
    padded = np.concatenate([masses, [np.nan, 0.0, -1.0, 1e13]])
    valid = np.arange(len(padded)) < len(masses) + 3  # the last row is padding
    np.testing.assert_allclose(
        soft_counts(padded, EDGES, width=0.1, valid=valid),
        soft_counts(masses, EDGES, width=0.1),
        rtol=1e-5,
    )


def test_the_bias_follows_the_second_order_formula():
    """Many haloes drawn from n(x) = exp(-3 x) on a wide range: the soft counts differ from
    the hard ones by -(w^2 / 10) (n'(e_b) - n'(e_{b+1})) (the expected counts, integrated)."""
    rng = np.random.default_rng(1)
    x = 12 - np.log(1 - rng.uniform(size=2_000_000) * (1 - np.exp(-9))) / 3  # 12 to 15
    width, edges = 0.2, np.arange(12.5, 14.01, 0.5)
    got = np.float64(soft_counts(10**x, edges, width=width))
    hard = np.histogram(x, edges)[0]
    scale = len(x) * 3 / (1 - np.exp(-9))  # n(x) = scale exp(-3 (x - 12))
    slope = -3 * scale * np.exp(-3 * (edges - 12))  # n'(e)
    predicted = -(width**2 / 10) * (slope[:-1] - slope[1:])
    np.testing.assert_allclose(got - hard, predicted, rtol=0.05, atol=5 * np.sqrt(hard).max() / 20)


def test_soft_counts_derivatives_equal_finite_differences(masses):
    weights = np.random.default_rng(2).standard_normal(len(EDGES) - 1)
    f = lambda m: jnp.sum(soft_counts(m, EDGES, width=0.2) * weights)
    grad = np.asarray(jax.grad(f)(jnp.asarray(masses, jnp.float32)), np.float64)
    v = np.random.default_rng(3).standard_normal(len(masses)) * masses * 1e-3
    eps = 1e-3
    ref = lambda s: np.sum(counts_reference(masses + s * v, EDGES, 0.2) * weights)
    fd = (ref(eps) - ref(-eps)) / (2 * eps)
    assert np.sum(grad * v) == pytest.approx(fd, rel=1e-3)


@pytest.mark.parametrize("shape", mesh_params([(2, 4), (1, 1)], ci=CI_MESHES), ids=mesh_id)
def test_counts_of_smooth_so_masses_from_a_sharded_catalogue(shape):
    """fof(so_smoothing) on a mesh, then soft counts of its m200 (padded rows included):
    the counts equal the definitions' and their derivative along random positions equals
    differences of the float64 chain (FoF membership held fixed)."""
    rng = np.random.default_rng(4)
    box, n = 16.0, 4096
    centres = rng.uniform(0, box, (12, 3))
    sizes = rng.integers(30, 300, 12)
    clumps = [c + 0.25 * rng.standard_normal((s, 3)) for c, s in zip(centres, sizes)]
    pos = np.mod(np.concatenate(clumps + [rng.uniform(0, box, (n - sizes.sum(), 3))]), box)
    pos = pos.astype(np.float32)
    mesh = make_mesh(shape)
    x = jax.device_put(jnp.asarray(pos), NamedSharding(mesh, P(mesh.axis_names)))
    rho, h, edges = 200 * n / box**3, 0.1, np.arange(1.0, 3.01, 0.25)  # log10 of particles

    def summary(p):
        labels, cat = jh.fof(p, box, b=0.2, so={"200": rho}, so_smoothing=h)
        return soft_counts(cat.so["m200"], edges, width=0.1, valid=cat.id >= 0), (labels, cat)

    v = rng.standard_normal(pos.shape)
    (counts, (labels, halos)), (tangent, _) = jax.jvp(summary, (x,), (jnp.asarray(v, jnp.float32),))
    halos = halos.to_numpy()
    labels = np.asarray(labels)

    def chain(p):
        groups = catalogue(p, box, labels, min_members=20)  # fof's default
        assert np.array_equal(groups["id"], halos["id"])
        m200 = soft_so_reference(p, groups["pos"], box, rho, 1.0, h)[0]
        return counts_reference(m200, edges, 0.1)

    np.testing.assert_allclose(np.asarray(counts), chain(pos.astype(np.float64)), atol=1e-4)
    eps = 1e-6
    fd = (chain(pos + eps * v) - chain(pos - eps * v)) / (2 * eps)
    np.testing.assert_allclose(np.asarray(tangent), fd, rtol=1e-2, atol=1e-2)
