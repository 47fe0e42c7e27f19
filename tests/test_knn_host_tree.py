"""kNN's host k-d tree on the installed jax, and the XLA scan taken in its place where jax
lacks the private callback interface the tree's primitive lowers through
(``jax._src.callback``: :func:`jaxpm_halos.knn._tree._host_primitive`): both exact against
scipy's cKDTree, and the same bits."""

import sys

import jax
import numpy as np
import pytest
from conftest import make_mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from scipy.spatial import cKDTree

import jaxpm_halos as jh
from jaxpm_halos.knn import _tree as _knn_tree

BOX, N, K = 8.0, 1024, 8
EPS = float(np.finfo(np.float32).eps)
MESH = (2, 4)


def _positions():
    """A uniform box with a clump wrapping across z = 0 and exact duplicates (whose lists
    the tree cannot certify: the scan searches those again)."""
    rng = np.random.default_rng(11)
    pos = rng.uniform(0, BOX, (N, 3))
    pos[:100] = np.asarray([BOX / 4, BOX / 2, 0.05]) + rng.normal(0, 0.05, (100, 3))
    pos[100:106] = pos[200]
    return np.mod(pos, BOX).astype(np.float32)


def _wrap64(pos):
    pos = np.mod(np.asarray(pos, np.float64), BOX)
    pos[pos >= BOX] -= BOX
    return pos


def _check_exact(pos, dist, idx):
    """Distances equal cKDTree's (boxsize: periodic) to float32 rounding, and each listed
    neighbour sits at its listed distance, never the particle itself nor twice."""
    dist, idx = np.asarray(dist), np.asarray(idx)
    data = _wrap64(pos)
    want = cKDTree(data, boxsize=BOX).query(data, k=K + 1)[0][:, 1:]
    tol = 8 * EPS * BOX
    assert dist.shape == idx.shape == (N, K)
    np.testing.assert_allclose(dist, want, rtol=4 * EPS, atol=tol)
    d = data[idx] - data[:, None, :]
    d -= BOX * np.round(d / BOX)
    np.testing.assert_allclose(np.sqrt((d * d).sum(-1)), dist, rtol=4 * EPS, atol=tol)
    assert not np.any(idx == np.arange(N)[:, None])
    srt = np.sort(idx, axis=1)
    assert not np.any(srt[:, 1:] == srt[:, :-1])


def _knn(pos, **kwargs):
    mesh = make_mesh(MESH)
    sharded = jax.device_put(pos, NamedSharding(mesh, P(tuple(mesh.axis_names))))
    return jh.knn(sharded, BOX, K, **kwargs)


def _spy_tree(monkeypatch):
    """The host tree's queries as they run: the points each device's tree is asked about."""
    queried = []
    tree_query = _knn_tree._tree_query

    def spy(data):
        query = tree_query(data)
        return lambda points, k: queried.append(len(points)) or query(points, k)

    monkeypatch.setattr(_knn_tree, "_tree_query", spy)
    return queried


@pytest.fixture(scope="module")
def positions():
    return _positions()


@pytest.fixture(scope="module")
def tree_result(positions):
    return _knn(positions)


@pytest.mark.newest
def test_the_host_tree_is_used_on_the_installed_jax_and_is_exact(positions, monkeypatch):
    """On the CPU (search="auto") the host tree is available on this jax and answers every
    particle's query, one tree per device; the lists are cKDTree's."""
    assert _knn_tree.available(), "the host tree's callback interface is missing on this jax"
    queried = _spy_tree(monkeypatch)
    jh.clear_caches()  # traced here, with the spy in place
    dist, idx = _knn(positions)
    assert len(queried) == MESH[0] * MESH[1] and sum(queried) == N, queried
    _check_exact(positions, dist, idx)


@pytest.mark.newest
def test_without_the_private_callback_interface_the_scan_gives_the_same_bits(
    positions, tree_result, monkeypatch
):
    """Where ``jax._src.callback`` or its names are missing, the host primitive is not
    defined, ``available()`` says so, and search="auto" takes the scan: no error, the tree
    never queried, cKDTree's lists and the tree's bits. search="tree" says why it cannot."""
    import jax._src.callback as callback

    with monkeypatch.context() as m:  # the module gone
        m.setitem(sys.modules, "jax._src.callback", None)
        assert _knn_tree._host_primitive() is None
    for name in ("emit_python_callback", "_callback_op_sharding"):  # a name gone
        with monkeypatch.context() as m:
            m.delattr(callback, name)
            assert _knn_tree._host_primitive() is None
    # What the module computed on import, had the interface been missing.
    monkeypatch.setattr(_knn_tree, "_HOST_CALL", None)
    assert not _knn_tree.available()
    queried = _spy_tree(monkeypatch)
    jh.clear_caches()  # programs traced with the tree must not be reused
    try:
        result = _knn(positions)
        with pytest.raises(ValueError, match="search='tree'.*jax._src.callback"):
            _knn(positions, config=jh.KNNConfig(search="tree"))
    finally:
        jh.clear_caches()  # nor these once the tree is back
    assert queried == []
    _check_exact(positions, *result)
    for got, want in zip(result, tree_result):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
