"""The cell-list primitives FoF and SO search with, against numpy and scipy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components

from jaxpm_halos.core.cells import search_columns, union


def _columns(rng, count, longest):
    """Sorted runs (with repeated values) laid end to end: values, and each run's bounds."""
    lengths = rng.integers(0, longest + 1, count)
    values = [np.sort(rng.integers(0, 12, n)).astype(np.float32) for n in lengths]
    hi = np.cumsum(lengths).astype(np.int32)
    return np.concatenate(values), hi - lengths.astype(np.int32), hi


@pytest.mark.parametrize("right", [False, True])
def test_search_columns_matches_numpy_in_every_range(right):
    rng = np.random.default_rng(7)
    z, lo, hi = _columns(rng, 400, 37)  # empty runs, runs of one, ties, 2^k +- 1 lengths
    lo, hi = np.repeat(lo, 4), np.repeat(hi, 4)
    target = rng.integers(-1, 14, lo.shape[0]).astype(np.float32)  # below, inside, above
    side = "right" if right else "left"
    expected = [a + np.searchsorted(z[a:b], t, side=side) for a, b, t in zip(lo, hi, target)]
    search = jax.jit(search_columns, static_argnums=4)
    np.testing.assert_array_equal(search(z, lo, hi, target, right), expected)
    # A deeper search than the longest range needs gives the same positions.
    deeper = jax.jit(lambda *a: search_columns(*a, right, jnp.int32(9)))
    np.testing.assert_array_equal(deeper(z, lo, hi, target), expected)


def test_union_gives_the_connected_components():
    rng = np.random.default_rng(3)
    n, m = 3000, 2600  # below the percolation threshold: many trees, some long chains
    u, v = rng.integers(0, n, m).astype(np.int32), rng.integers(0, n, m).astype(np.int32)
    link = rng.random(m) < 0.9
    roots = np.asarray(jax.jit(union)(jnp.arange(n, dtype=jnp.int32), u, v, link))
    graph = coo_matrix((np.ones(link.sum()), (u[link], v[link])), shape=(n, n))
    _, component = connected_components(graph, directed=False)
    smallest = np.full(component.max() + 1, n)
    np.minimum.at(smallest, component, np.arange(n))
    np.testing.assert_array_equal(roots, smallest[component])  # every row at its root
