"""kNN and kNN density: exact against scipy's cKDTree on clustered layouts and a real JaxPM
snapshot, identical on every mesh, with query points, a reduce hook, gradients and errors."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import CI_MESHES, MESH_SHAPES, make_mesh, mesh_id, mesh_params
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from scipy.spatial import cKDTree

import jaxpm_halos as jh

BOX = 16.0
N = 4096
EPS = float(np.finfo(np.float32).eps)


def _clustered(seed=0):
    """Clumps on the box corner, on pencil faces and edges of every test mesh and on z = 0,
    a dense core, exact duplicates and coordinates equal to 0 and L, over a sparse uniform
    background with voids (k-th neighbour spheres wider than the narrow pencils)."""
    rng = np.random.default_rng(seed)
    centres = [
        [0.0, 0.0, 0.0],
        [BOX / 2, BOX / 2, BOX / 2],
        [BOX / 4, BOX / 8, 0.0],
        [BOX / 2, 3 * BOX / 4, BOX - 0.05],
        [3 * BOX / 4, BOX / 2, BOX / 3],
        [BOX / 8, BOX / 4, 2 * BOX / 3],
        [BOX, BOX / 2, BOX / 5],
    ]
    clumps = [
        np.asarray(c) + rng.normal(0, s, (150, 3))
        for c, s in zip(centres, [0.3, 0.2, 0.4, 0.1, 0.3, 0.5, 0.2])
    ]
    core = np.asarray([BOX / 4, 3 * BOX / 4, BOX / 4]) + rng.normal(0, 0.01, (200, 3))
    special = np.zeros((46, 3))
    special[:6] = 0.0  # duplicates at the box corner
    special[6:12] = BOX  # ... and at L (wraps to 0)
    special[12:20] = [BOX / 2, BOX / 4, 1.0]  # duplicates on a pencil edge
    special[20:46] = rng.uniform(0, BOX, (26, 3))
    special[30:38] = special[20]  # duplicates in the background
    n_bg = N - 150 * len(centres) - len(core) - len(special)
    background = rng.uniform(0, BOX, (n_bg, 3))
    return np.concatenate(clumps + [core, special, background]).astype(np.float32)


def _wrap64(pos, box):
    pos = np.mod(np.asarray(pos, np.float64), box)
    pos[pos >= box] -= box
    return pos


def _reference(pos, box, k, query=None):
    """cKDTree distances (float64) to the k nearest other particles (or to query points)."""
    data = _wrap64(pos, box)
    tree = cKDTree(data, boxsize=box)
    if query is None:
        dist, _ = tree.query(data, k=k + 1)
        return dist[:, 1:]
    dist, _ = tree.query(_wrap64(query, box), k=k)
    return dist.reshape(len(query), k)


def _true_distances(pos, box, idx, query=None):
    data = _wrap64(pos, box)
    origin = data if query is None else _wrap64(query, box)
    d = data[idx] - origin[:, None, :]
    d -= box * np.round(d / box)
    return np.sqrt((d * d).sum(-1))


def _check_exact(pos, box, k, dist, idx, query=None):
    """Distances match cKDTree to float32 rounding; each returned neighbour really sits at
    the returned distance (so ids differ from the reference only at true ties); no self,
    no repeats."""
    dist, idx = np.asarray(dist), np.asarray(idx)
    want = _reference(pos, box, k, query)
    tol = 8 * EPS * box
    assert dist.shape == want.shape and idx.shape == want.shape
    np.testing.assert_allclose(dist, want, rtol=4 * EPS, atol=tol)
    assert np.all(np.diff(dist, axis=1) >= 0)
    n = len(pos)
    assert idx.min() >= 0 and idx.max() < n
    np.testing.assert_allclose(_true_distances(pos, box, idx, query), dist, rtol=4 * EPS, atol=tol)
    srt = np.sort(idx, axis=1)
    assert not np.any(srt[:, 1:] == srt[:, :-1]), "a neighbour is listed twice"
    if query is None:
        assert not np.any(idx == np.arange(n)[:, None]), "a particle is its own neighbour"


def _assert_same(a, b):
    """Bitwise equal distances and equal ids (equal distances are chosen and listed by id)."""
    (da, ia), (db, ib) = [tuple(np.asarray(x) for x in r) for r in (a, b)]
    np.testing.assert_array_equal(da, db)
    np.testing.assert_array_equal(ia, ib)


def _shard(mesh, x):
    return jax.device_put(x, NamedSharding(mesh, P(tuple(mesh.axis_names))))


@pytest.fixture(scope="module")
def clustered():
    return _clustered()


@pytest.fixture(scope="module")
def unsharded(clustered):
    return jh.knn(clustered, BOX, 8)


@pytest.mark.optimised
@pytest.mark.newest
def test_unsharded_matches_scipy(clustered, unsharded):
    _check_exact(clustered, BOX, 8, *unsharded)


@pytest.mark.optimised
@pytest.mark.parametrize("shape", mesh_params(MESH_SHAPES), ids=mesh_id)
@pytest.mark.newest
def test_every_mesh_matches_scipy_and_the_unsharded_result(clustered, unsharded, shape):
    mesh = make_mesh(shape)
    dist, idx = jh.knn(_shard(mesh, clustered), BOX, 8)
    assert dist.sharding.spec == P(("x", "y"))
    _check_exact(clustered, BOX, 8, dist, idx)
    _assert_same((dist, idx), unsharded)


@pytest.mark.parametrize(
    "k",
    [
        pytest.param(1, marks=pytest.mark.leg1),
        pytest.param(16, marks=pytest.mark.leg1),
        pytest.param(32, marks=pytest.mark.slow),
    ],
)
def test_k(clustered, k):
    mesh = make_mesh((2, 4))
    dist, idx = jh.knn(_shard(mesh, clustered), BOX, k)
    _check_exact(clustered, BOX, k, dist, idx)


@pytest.mark.leg1
def test_gpu_settings_give_the_same_neighbours(clustered, monkeypatch):
    """The settings picked on a GPU (4096 batches per planning step, merge rows of 1024
    values, ``lax.top_k`` of at most 16 per call) give the exact neighbours, the same bits
    on one device and on a mesh as a CPU's default path; run here on the CPU with k = 16,
    whose merges select 18 in two calls. Every ``lax.top_k`` of the program is one
    XLA:GPU's top-k kernel takes (k <= 16, rows of at least 1024), not a sort of every
    row. 64 batches per step, not the GPU's 1024: with those, 8 CPU devices on 2 cores can
    exceed XLA:CPU's 10 s wait between collectives."""
    from jaxpm_halos.knn import _search as knn_module

    cpu = jh.knn(clustered, BOX, 16)
    config = jh.KNNConfig(group_size=64)
    monkeypatch.setattr(knn_module, "_backend", lambda: "gpu")
    jh.clear_caches()  # programs compiled with the CPU settings must not be reused
    try:
        text = jax.jit(lambda x: jh.knn(x, BOX, 16, config=config)).lower(clustered).as_text()
        one = jh.knn(clustered, BOX, 16, config=config)
        mesh = jh.knn(_shard(make_mesh((2, 4)), clustered), BOX, 16, config=config)
    finally:
        jh.clear_caches()
    top_k = re.findall(r"chlo.top_k\(\S+, k = (\d+)\) : tensor<\d+x(\d+)xf32>", text)
    assert len(top_k) >= 2 and all(int(k) <= 16 and int(n) >= 1024 for k, n in top_k), top_k
    for dist, idx in (one, mesh):
        _check_exact(clustered, BOX, 16, dist, idx)
        _assert_same((dist, idx), cpu)


def _certified_by_the_tree(monkeypatch):
    """Each host tree call's certificate flags (queries the tree settled), as they run."""
    from jaxpm_halos.knn import _tree as tree

    seen = []
    certify = tree._certify

    def spy(*args, **kwargs):
        out = certify(*args, **kwargs)
        seen.append(out[2])
        return out

    monkeypatch.setattr(tree, "_certify", spy)
    return seen


# Not in leg 2 (for CI's time), where test_knn_host_tree checks the tree and the scan.
@pytest.mark.optimised  # bits against `unsharded`, compiled in that part
def test_the_host_tree_and_the_scan_give_the_same_neighbours(clustered, unsharded, monkeypatch):
    """On the CPU the first local pass is a host k-d tree (search="auto"), each list
    certified against float32 rounding; the scan (search="scan", what other backends run)
    must give the same bits, and so must the tree on a mesh. The layout's duplicates cannot
    be certified: those queries must have gone to the scan and still be exact."""
    seen = _certified_by_the_tree(monkeypatch)
    scan = jh.KNNConfig(search="scan")
    mesh = make_mesh((2, 4))
    tree_mesh = jh.knn(_shard(mesh, clustered), BOX, 8)  # the default: the tree on the CPU
    ok = np.concatenate(seen)
    assert ok.size == N and 0.9 < ok.mean() < 1, ok.mean()
    for result in (
        tree_mesh,
        jh.knn(clustered, BOX, 8, config=scan),
        jh.knn(_shard(mesh, clustered), BOX, 8, config=scan),
    ):
        _check_exact(clustered, BOX, 8, *result)
        _assert_same(result, unsharded)
    rho_tree = jh.knn_density(_shard(mesh, clustered), BOX, 16)
    rho_scan = jh.knn_density(_shard(mesh, clustered), BOX, 16, config=scan)
    np.testing.assert_array_equal(np.asarray(rho_tree), np.asarray(rho_scan))


@pytest.mark.optimised  # bits against `unsharded`, compiled in that part
@pytest.mark.parametrize("library", ["pykdtree", "scipy"])
def test_either_tree_library_gives_the_same_bits(clustered, unsharded, monkeypatch, library):
    """The host tree is pykdtree's where it is installed (leg 1), else cKDTree's (leg 2
    installs scipy only): each, forced in turn, must certify most queries and give the same
    bits as one device."""
    from jaxpm_halos.knn import _tree as tree

    module, name = {
        "pykdtree": ("pykdtree.kdtree", "KDTree"),
        "scipy": ("scipy.spatial", "cKDTree"),
    }[library]
    lib = pytest.importorskip(module)
    monkeypatch.setattr(tree, "_BACKEND", library)
    built, build = [], getattr(lib, name)
    monkeypatch.setattr(lib, name, lambda *a, **kw: built.append(a[0].shape) or build(*a, **kw))
    seen = _certified_by_the_tree(monkeypatch)
    result = jh.knn(_shard(make_mesh((2, 4)), clustered), BOX, 8)
    assert len(built) == 8, built  # one tree per device, the library's
    assert 0.9 < np.concatenate(seen).mean() < 1
    _check_exact(clustered, BOX, 8, *result)
    _assert_same(result, unsharded)


def test_a_tree_library_too_old_or_missing_is_not_used():
    """pykdtree before 1.4.1 returned wrong distances on very large trees: the release is
    read from the installed distribution, and a missing module is never chosen."""
    from jaxpm_halos.knn import _tree as tree

    assert tree._usable("numpy", (1,)) and not tree._usable("numpy", (999,))
    assert not tree._usable("no_such_tree_library")


@pytest.mark.parametrize("shape", mesh_params([(2, 4), (1, 1)], ci=CI_MESHES), ids=mesh_id)
def test_a_vmapped_density_calls_the_tree_per_element_and_equals_the_calls(monkeypatch, shape):
    """Under ``vmap`` the host tree's primitive is batched as a loop of its calls, one per
    element and device; the batch must give each element's own densities, bit for bit,
    and cKDTree's."""
    k = 8
    rng = np.random.default_rng(4)
    pos = rng.uniform(0, BOX, (2, 512, 3)).astype(np.float32)
    pos[1, :50] = pos[1, 50] + rng.normal(0, 0.05, (50, 3))  # a clump in one element only
    pos %= np.float32(BOX)
    mesh = make_mesh(shape)
    seen = _certified_by_the_tree(monkeypatch)
    batched = jax.jit(jax.vmap(lambda p: jh.knn_density(p, BOX, k, mesh=mesh)))
    got = np.asarray(batched(jnp.asarray(pos)))  # (2, 512)
    assert len(seen) == 2 * mesh.size  # one tree query per element and device
    for element, p in zip(got, pos):
        np.testing.assert_array_equal(element, np.asarray(jh.knn_density(p, BOX, k, mesh=mesh)))
        r_k = _reference(p, BOX, k)[:, -1]
        np.testing.assert_allclose(element, (k - 1) / (4 / 3 * np.pi * r_k**3), rtol=1e-5)


def test_search_must_be_named():
    with pytest.raises(ValueError, match="search='kd'.*'auto', 'tree', 'scan'"):
        jh.KNNConfig(search="kd")


def test_frame_positions_from_image_codes_equal_the_decompositions_bitwise():
    """The kNN index keeps a one-byte periodic image per row instead of its frame
    position; the position it recomputes must be the decomposition's, bit for bit (x and
    y images from ``Extended.local_pos``, z images from ``z_images``), at 0, -0.0, just
    below L and in between, for every image."""
    from jaxpm_halos.core.domain import Extended
    from jaxpm_halos.core.ghosts import z_image_rows, z_images
    from jaxpm_halos.knn._frame import in_frame, row_images

    box, width = 100.0, 3.0
    edge = np.float32([0.0, -0.0, 1e-7, 2.9999, 50.0, 97.00001, np.nextafter(np.float32(box), 0)])
    rng = np.random.default_rng(3)
    xy = np.concatenate([edge, rng.uniform(0, box, 57).astype(np.float32)])
    n = xy.size * 9
    pos = np.stack(
        [np.tile(xy, 9), np.roll(np.tile(xy, 9), 5), np.tile(edge, n // edge.size + 1)[:n]], axis=1
    ).astype(np.float32)
    image = np.stack(np.meshgrid([-1, 0, 1], [-1, 0, 1]), -1).reshape(9, 2).repeat(xy.size, 0)
    ext = Extended(
        jnp.asarray(pos), jnp.asarray(image, jnp.int32), jnp.arange(n), jnp.ones(n, bool), n
    )
    want, valid, _, _ = z_images(ext, width, box, n)
    source, side, _, _ = z_image_rows(ext, width, box, n)
    canon = jnp.concatenate([ext.pos, ext.pos[jnp.minimum(source, n - 1)]])
    got = in_frame(canon[:, 0], canon[:, 1], canon[:, 2], row_images(ext, source, side), box)
    keep = np.asarray(valid)
    assert keep[n:].sum() > 0 and np.unique(np.asarray(side)[keep[n:]]).size == 2
    np.testing.assert_array_equal(
        np.asarray(got)[keep].view(np.uint32), np.asarray(want)[keep].view(np.uint32)
    )


def _lattice_with_duplicates():
    """A 6^3 lattice of spacing 1 in a box of 6 with 24 more copies of each of two lattice
    points (one at the corner 0): every distance is an exact integer tie, so the k-th
    neighbour's shell holds more particles than fit, and the duplicates' lists hold only
    distance 0. 264 points, so every test mesh can shard them."""
    grid = np.stack(np.meshgrid(*[np.arange(6)] * 3, indexing="ij"), -1).reshape(-1, 3)
    copies = np.repeat(np.array([[2, 3, 4], [0, 0, 0]]), 24, axis=0)
    return np.concatenate([grid, copies]).astype(np.float32)


def _nearest_by_distance_then_id(data, box, k, query=None):
    """The k nearest (distance, id) of every point (or query point), by float64 brute force
    on exact coordinates; self excluded for the points themselves."""
    origin = data if query is None else query
    d = data[None, :, :].astype(np.float64) - origin[:, None, :]
    d -= box * np.round(d / box)
    d2 = (d * d).sum(-1)  # (Q, N)
    if query is None:
        np.fill_diagonal(d2, np.inf)
    ids = np.broadcast_to(np.arange(len(data)), d2.shape)
    order = np.lexsort((ids, d2), axis=-1)[:, :k]
    return np.sqrt(np.take_along_axis(d2, order, axis=1)), order


@pytest.mark.leg1
def test_ties_across_the_kth_distance_pick_the_lowest_ids():
    """When more particles lie at exactly the k-th distance than the list holds, the ones
    listed are those of lowest id, in id order, on one device and on a mesh, through the
    local search and through the cross-device pass (a ghost layer far thinner than the
    spheres); with query points and per-particle masses too. Before selection was by
    (distance, id), the scan order decided and the lists differed between meshes."""
    pos, box, k = _lattice_with_duplicates(), 6.0, 20
    want_dist, want_idx = _nearest_by_distance_then_id(pos, box, k)
    assert np.sum(want_dist[:, -1:] == want_dist[:, :1]) >= 48  # duplicates: all at 0
    query = pos[::11]
    want_q = _nearest_by_distance_then_id(pos, box, k, query)
    # remote_factor: room for every remote query at once, so that nothing reruns.
    wide = jh.KNNConfig(remote_factor=2.0)
    thin = jh.KNNConfig(ghost_width=0.05, remote_factor=2.0)
    # The other meshes are compared with one device, ids included, by
    # test_every_mesh_matches_scipy_and_the_unsharded_result (the clustered layout's
    # duplicates tie across the list's end there too).
    for shape, config in ((None, wide), ((4, 2), thin)):
        x = pos if shape is None else _shard(make_mesh(shape), pos)
        dist, idx = jh.knn(x, box, k, config=config)
        np.testing.assert_array_equal(np.asarray(dist), want_dist.astype(np.float32))
        np.testing.assert_array_equal(np.asarray(idx), want_idx, err_msg=f"mesh {shape}")
    # Per-particle masses, each id its own: the density tells which ids were listed.
    mass = np.linspace(1.0, 2.0, len(pos), dtype=np.float32)
    mesh = make_mesh((2, 4))
    rho = jh.knn_density(_shard(mesh, pos), box, k, mass=_shard(mesh, mass), config=wide)
    with np.errstate(divide="ignore"):  # the duplicates' r_k is 0: rho = inf
        want_rho = mass[want_idx[:, :-1]].astype(np.float64).sum(1) / (
            4 / 3 * np.pi * want_dist[:, -1] ** 3
        )
    np.testing.assert_allclose(np.asarray(rho), want_rho, rtol=2e-6)
    dist, idx = jh.knn(_shard(make_mesh((4, 2)), pos), box, k, query=query, config=wide)
    np.testing.assert_array_equal(np.asarray(idx), want_q[1])
    np.testing.assert_array_equal(np.asarray(dist), want_q[0].astype(np.float32))


@pytest.mark.parametrize("top_k_limit", [None, 16])
def test_the_merge_keeps_the_nearest_by_distance_then_id(top_k_limit):
    """:func:`merge_nearest` keeps each list's kk smallest (squared distance, id) of its
    running list and candidates, against numpy: 300 lists (more than ``TIE_BLOCK``, so
    tied lists are redone in blocks, the last one clamped) whose distances are small
    integers, most tied at the kk-th, some not; with one ``top_k`` and with calls of at
    most 16 (a GPU's), over rows of 1024 values, candidates shared by every list and not."""
    from jaxpm_halos.knn._scan import TIE_BLOCK, merge_nearest

    rng = np.random.default_rng(5)
    lists, kk, C, R = 300, 17, 1007, 5000
    ids = rng.permutation(R).astype(np.int32)  # row -> global id
    run_d2 = np.sort(rng.integers(0, 6, (lists, kk)), axis=1).astype(np.float32)
    run_row = rng.integers(0, R, (lists, kk)).astype(np.int32)
    cand_d2 = rng.integers(0, 9, (lists, C)).astype(np.float32)
    untied = rng.random(lists) < 0.3  # all candidates beyond the list: no tie at its end
    cand_d2[untied] = 100 + rng.permutation(C).astype(np.float32)
    cand_d2[rng.random((lists, C)) < 0.05] = np.inf
    run_d2[:7, 12:] = np.inf  # lists not yet full
    cand_d2[:7] = np.inf
    shared = rng.integers(0, R, C).astype(np.int32)
    merge = jax.jit(
        lambda a, b, c, d: merge_nearest(a, b, c, d, lambda r: jnp.asarray(ids)[r], top_k_limit)
    )
    for cand_row in (rng.integers(0, R, (lists, C)).astype(np.int32), shared):
        d2, rows = map(np.asarray, merge(run_d2, run_row, cand_d2, cand_row))
        all_d2 = np.concatenate([run_d2, cand_d2], axis=1)
        all_id = ids[np.concatenate([run_row, np.broadcast_to(cand_row, cand_d2.shape)], 1)]
        order = np.lexsort((all_id, all_d2), axis=1)[:, :kk]
        want_d2 = np.take_along_axis(all_d2, order, 1)
        np.testing.assert_array_equal(d2, want_d2)
        found = np.isfinite(want_d2)
        want_id = np.take_along_axis(all_id, order, 1)
        got = np.where(found, ids[rows], -1)
        for i in range(lists):  # order among equal distances is free: compare as sets
            assert sorted(got[i]) == sorted(np.where(found[i], want_id[i], -1)), i
    tied = ~untied & (want_d2[:, -1] == np.sort(all_d2, 1)[:, kk])
    assert np.sum(tied) > TIE_BLOCK  # several blocks


def test_the_scan_merges_every_list_some_candidate_can_enter():
    """The scan's cheap test of which lists a chunk of candidates can change
    (``_scan.may_enter``, plainly rounded distances) keeps every list whose last squared
    distance some candidate's exact one (``distance2_columns``) reaches or beats: candidates
    across the periodic seam, lists ending exactly at a candidate's distance, 1 ulp short
    of it, lists not yet full, and squares about float32's smallest normal number, below
    which XLA flushes them to zero (in one form and not the other)."""
    from jaxpm_halos.knn._scan import distance2_columns, may_enter

    # Compiled, as in the scan: XLA may then contract the plain squares into fused
    # multiply-adds, whose products are not flushed to zero.
    enter = jax.jit(lambda *args: may_enter(*args, box))

    def check(qs, cand, live, lasts):  # (G, B, 3), (G, C, 3), (G, C), [(G, B)]
        q_cols = tuple(jnp.asarray(qs[..., d][..., None]) for d in range(3))  # (G, B, 1)
        c_cols = tuple(jnp.asarray(cand[..., d][:, None]) for d in range(3))  # (G, 1, C)
        exact = np.asarray(distance2_columns(*q_cols, *c_cols, box))  # (G, B, C)
        exact = np.where(live[:, None], exact, np.inf)
        for last in lasts(exact):
            want = np.any(exact <= last[..., None], axis=-1)
            got = np.asarray(enter(q_cols, c_cols, jnp.asarray(live), jnp.asarray(last)))
            assert np.all(got[want]), np.argwhere(want & ~got)
            margin = last[..., None] * (1 + 2.0**-16) + 8 * np.finfo(np.float32).tiny
            assert not np.any(got & ~np.any(exact <= margin, axis=-1))  # a margin of ulps

    rng = np.random.default_rng(0)
    box, G, B, C = 64.0, 6, 16, 40
    qs = rng.uniform(0, box, (G, B, 3)).astype(np.float32)
    cand = rng.uniform(0, box, (G, C, 3)).astype(np.float32)
    cand[0] = np.mod(qs[0, :1] + rng.normal(0, 1e-3, (C, 3)), box).astype(np.float32)
    cand[1] = np.nextafter(qs[1, :1], np.float32(box)) * np.ones((C, 1), np.float32)
    cand[2, :, 0] = np.float32(box) - cand[2, :, 0] * 1e-3  # across the seam from x ~ 0
    qs[2, :, 0] *= 1e-3
    live = rng.uniform(size=(G, C)) < 0.8
    pick = lambda exact: np.take_along_axis(exact, rng.integers(0, C, (G, B, 1)), -1)[..., 0]
    check(
        qs,
        cand,
        live,
        lambda exact: (
            last := pick(exact),
            np.nextafter(last, np.float32(-np.inf)),  # 1 ulp short of the same candidate
            np.full((G, B), np.inf, np.float32),
        ),
    )
    # One candidate a list, 3e-19 from the query: 2% of these lists were missed with a
    # margin of one smallest normal number.
    tiny = rng.uniform(0, 3e-19, (2, 2000, 1, 3)).astype(np.float32)
    check(tiny[0], tiny[1], np.ones((2000, 1), bool), lambda exact: (exact[..., 0],))


@pytest.mark.leg1
def test_spheres_wider_than_the_ghost_layer_are_completed_across_devices(clustered):
    # A ghost layer far thinner than the k-th neighbour distance: almost every particle
    # near a face needs the cross-device pass, whose buffer grows automatically.
    mesh = make_mesh((4, 2))
    config = jh.KNNConfig(
        ghost_width=0.05,
        remote_factor=0.01,
        domain=jh.DomainConfig(ghost_factor=1.0, image_factor=1.0),
    )
    (dist, idx), status = jh.knn(_shard(mesh, clustered), BOX, 8, config=config, with_status=True)
    assert int(np.max(np.asarray(status.needed["knn remote"]))) > 32
    _check_exact(clustered, BOX, 8, dist, idx)


@pytest.mark.slow
def test_a_clustered_device_may_complete_more_queries_remotely_than_two_n0():
    """64 particles on 8 devices (n0 = 8), a clump of 21 on one device and k = 40: most of
    its queries need the cross-device pass (28 rows). Its buffer was capped at 2 n0 = 16
    rows, so growth stopped there and the suggestion pasted as written failed the same
    way. Now its 32-row floor holds them, and only the clump's capacity grows."""
    rng = np.random.default_rng(1)
    pos = rng.uniform(0, BOX, (64, 3)).astype(np.float32)
    pos[:20] = pos[20] + rng.normal(0, 0.05, (20, 3)).astype(np.float32)
    pos[30:34], pos[34] = BOX, 0.0  # at L (wrapped to 0) and at 0: exact duplicates
    pos %= np.float32(BOX)
    with pytest.warns(jh.GrowthWarning, match="capacity_factor"):
        dist, idx = jh.knn(pos, BOX, 40, mesh=make_mesh((2, 4)))
    _check_exact(pos, BOX, 40, dist, idx)


@pytest.mark.leg1
def test_jaxpm_snapshot(jaxpm_snapshot_32):
    snap = jaxpm_snapshot_32
    box, k = snap.box_size, 16
    particles = jh.from_jaxpm(snap.disp_sharded, box_size=box)
    dist, idx = jh.knn(particles, k=k)
    nc = snap.nc
    assert dist.shape == (nc, nc, nc, k) and idx.shape == (nc, nc, nc, k)
    assert dist.sharding.spec == particles.pos.sharding.spec
    pos = np.asarray(particles.pos).reshape(-1, 3)
    _check_exact(pos, box, k, np.asarray(dist).reshape(-1, k), np.asarray(idx).reshape(-1, k))
    # Voids: the k-th neighbour reaches several mean separations.
    assert float(np.max(dist[..., -1])) > 2.5 * box / nc
    rho = jh.knn_density(particles, k=k)
    rk = np.asarray(dist[..., -1], np.float64)
    np.testing.assert_allclose(np.asarray(rho), (k - 1) / (4 / 3 * np.pi * rk**3), rtol=1e-5)


@pytest.mark.leg1
def test_density_with_masses_and_overdensity(clustered):
    k = 8
    mass = np.random.default_rng(1).uniform(0.5, 2.0, N).astype(np.float32)
    dist, idx = jh.knn(clustered, BOX, k)
    delta = jh.knn_density(clustered, BOX, k, mass=mass, overdensity=True)
    rk = np.asarray(dist, np.float64)[:, -1]
    with np.errstate(divide="ignore"):  # duplicates: r_k = 0 and an infinite density
        rho = mass[np.asarray(idx)][:, : k - 1].sum(1) / (4 / 3 * np.pi * rk**3)
    mean = mass.astype(np.float64).sum() / BOX**3
    np.testing.assert_allclose(np.asarray(delta), rho / mean - 1, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_density_of_equal_masses_equals_per_particle_masses(clustered):
    """Equal masses (static or a traced scalar) keep only the k-th neighbour; the densities
    are bitwise those of the same masses given per particle (all k - 1 gathered)."""
    x = _shard(make_mesh((2, 4)), clustered)
    m = 0.37  # not a power of two: a product would differ from the sum in the last bits
    rows = np.asarray(jh.knn_density(x, BOX, 16, mass=np.full(N, m, np.float32)))
    np.testing.assert_array_equal(np.asarray(jh.knn_density(x, BOX, 16, mass=m)), rows)
    np.testing.assert_array_equal(np.asarray(jh.knn_density(x, BOX, 16, mass=jnp.float32(m))), rows)


def _query_points(clustered, k=8):
    """Query points of ``clustered`` (992, wrapped from outside the box, five on particles
    and one at L) sharded on (2, 4), their neighbours, and the particles and mesh."""
    rng = np.random.default_rng(2)
    query = rng.uniform(-BOX, 2 * BOX, (992, 3)).astype(np.float32)  # outside: wrapped
    query[:5] = clustered[:5]  # on particles
    query[5] = [BOX, BOX, BOX]
    mesh = make_mesh((2, 4))
    particles = _shard(mesh, clustered)
    return query, jh.knn(particles, BOX, k, query=_shard(mesh, query)), particles, mesh


def test_query_points(clustered):
    k = 8
    query, (dist, idx), particles, mesh = _query_points(clustered, k)
    assert dist.shape == (992, k) and dist.sharding.spec == P(("x", "y"))
    _check_exact(clustered, BOX, k, dist, idx, query=query)
    assert np.all(np.asarray(dist)[:5, 0] == 0)
    scan = jh.KNNConfig(search="scan")
    _assert_same((dist, idx), jh.knn(particles, BOX, k, query=_shard(mesh, query), config=scan))
    # Query points that are not sharded, in any leading shape and not a multiple of the
    # device count.
    rho = jh.knn_density(particles, BOX, k, query=query[:990].reshape(2, 495, 3))
    assert rho.shape == (2, 495)
    rk = np.asarray(dist, np.float64)[:990, -1]
    with np.errstate(divide="ignore"):  # query points on duplicates: r_k = 0
        want = (k - 1) / (4 / 3 * np.pi * rk**3)
    np.testing.assert_allclose(np.asarray(rho).reshape(990), want, rtol=1e-5)


@pytest.mark.slow
def test_query_points_on_a_grid(clustered):
    """A grid of query points sharded P("x", "y") comes back sharded so (it came back in
    the program's own layout), with the densities of the same points in a list."""
    k = 8
    query, (dist, _), particles, mesh = _query_points(clustered, k)
    with np.errstate(divide="ignore"):  # query points on duplicates: r_k = 0
        want = (k - 1) / (4 / 3 * np.pi * np.asarray(dist, np.float64)[:128, -1] ** 3)
    grid = jax.device_put(query[:128].reshape(4, 4, 8, 3), NamedSharding(mesh, P("x", "y")))
    rho_grid = jh.knn_density(particles, BOX, k, query=grid)
    assert rho_grid.sharding.is_equivalent_to(NamedSharding(mesh, P("x", "y")), 3)
    np.testing.assert_allclose(np.asarray(rho_grid).reshape(128), want, rtol=1e-5)


@pytest.mark.slow
def test_overdensity_of_equal_masses_is_the_same_bits_on_a_mesh_as_on_one_device(clustered):
    """The mean density of equal masses is N m with N counted exactly: a float sum of the
    masses would round differently on different meshes (and differ from InSitu's)."""
    m = np.float32(7.3)
    got = [
        np.asarray(
            jh.knn_density(_shard(make_mesh(shape), clustered), BOX, 8, mass=m, overdensity=True)
        )
        for shape in ((1, 1), (2, 4))
    ]
    for other in got[1:]:
        np.testing.assert_array_equal(other, got[0])
    # The value: cKDTree's density over N m / L^3 (float32 rounding of 1 + delta apart).
    r_k = _reference(clustered, BOX, 8)[:, -1]
    with np.errstate(divide="ignore"):  # duplicates: r_k = 0
        rho = 7 * float(m) / (4 / 3 * np.pi * r_k**3)
    # rtol: float32 wrapping and distances against float64 (a wrong neighbour is ~1e-2)
    np.testing.assert_allclose(got[0] + 1.0, rho / (N * float(m) / BOX**3), rtol=3e-5, atol=1e-6)


@pytest.mark.slow  # FoF's runs in CI: the padding is the shared pipeline's
@pytest.mark.parametrize("shape", [(2, 4), (8, 1)], ids=mesh_id)
def test_particle_count_not_divisible_by_the_devices(clustered, shape):
    """N = 4093 on 8 devices: padded inside; no padding row is a neighbour, and the mean
    density of ``overdensity`` counts the real particles only."""
    pos, k = clustered[: N - 3], 8
    mesh = make_mesh(shape)
    dist, idx = jh.knn(pos, BOX, k, mesh=mesh)
    _check_exact(pos, BOX, k, dist, idx)
    delta = jh.knn_density(pos, BOX, k, mesh=mesh, overdensity=True)
    rk = np.asarray(dist, np.float64)[:, -1]
    with np.errstate(divide="ignore"):  # duplicates: r_k = 0
        want = (k - 1) / (4 / 3 * np.pi * rk**3) / ((N - 3) / BOX**3) - 1
    # The padded count would be off by 7e-4 (1 + delta).
    np.testing.assert_allclose(np.asarray(delta), want, rtol=1e-5, atol=1e-6)


def test_reduce_hook_returns_only_per_particle_values(clustered):
    k = 8
    mesh = make_mesh((2, 4))

    def mean_distance(dist, idx, data):
        return {
            "mean": jnp.mean(dist, axis=1),
            "far_id": idx[:, -1],
            "id": data["id"],
            "x": data["pos"][:, 0],
        }

    out = jh.knn(_shard(mesh, clustered), BOX, k, reduce=mean_distance)
    dist, idx = jh.knn(clustered, BOX, k)
    np.testing.assert_allclose(np.asarray(out["mean"]), np.asarray(dist).mean(1), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(out["id"]), np.arange(N))
    np.testing.assert_array_equal(
        np.asarray(out["x"]), _wrap64(clustered, BOX)[:, 0].astype(np.float32)
    )
    far = np.asarray(out["far_id"])
    np.testing.assert_allclose(
        _true_distances(clustered, BOX, far[:, None])[:, 0],
        np.asarray(dist)[:, -1],
        rtol=4 * EPS,
        atol=8 * EPS * BOX,
    )
    # A value that is not per row is refused by name, at trace time.
    with pytest.raises(
        ValueError,
        match=r"knn's reduce fn must return per-row arrays.*"
        r"output \['total'\] has shape \(\)",
    ):
        jh.knn(_shard(mesh, clustered), BOX, k, reduce=lambda d, i, x: {"total": d.sum()})
    # Query points carry only their positions: a missing field is named, with what is there.
    with pytest.raises(
        KeyError,
        match=r"asked data for 'mass'; data holds "
        r"\['neighbour_mass', 'pos'\]",
    ):
        jh.knn(
            _shard(mesh, clustered),
            BOX,
            k,
            query=clustered[:16],
            reduce=lambda d, i, x: {"m": x["mass"]},
        )
    # A KeyError of the fn's own (not a row field) comes back as it was raised.
    with pytest.raises(KeyError) as error:
        jh.knn(_shard(mesh, clustered), BOX, k, reduce=lambda d, i, x: {"m": {}["weights"]})
    assert error.value.args == ("weights",)


def test_gradients_equal_the_analytic_gradient_with_the_neighbours_held_fixed():
    """Reverse mode of sum(w * dist) + sum(log rho) against its float64 analytic gradient:
    with the neighbours held fixed, d |x_j - x_n| moves x_j along the unit offset u and x_n
    against it, and log rho = const - 3 log r_k."""
    rng = np.random.default_rng(3)
    box, n, k = 8.0, 512, 4
    pos = rng.uniform(0, box, (n, 3)).astype(np.float32)
    mesh = make_mesh((2, 4))
    weights = rng.uniform(0.5, 1.5, (n, k)).astype(np.float32)

    def objective(p):
        dist, _ = jh.knn(p, box, k, mesh=mesh)
        rho = jh.knn_density(p, box, k, mesh=mesh)
        return jnp.sum(weights * dist) + jnp.sum(jnp.log(rho))

    jh.knn(_shard(mesh, pos), box, k, mesh=mesh)  # buffers fit (unchecked inside jit)
    grad = np.asarray(jax.jit(jax.grad(objective))(_shard(mesh, pos)), np.float64)
    _, idx = jh.knn(_shard(mesh, pos), box, k, mesh=mesh)
    idx = np.asarray(idx)
    x = np.asarray(pos, np.float64)
    offset = x[:, None, :] - x[idx]  # (n, k, 3) from each neighbour to its query
    offset -= box * np.round(offset / box)
    r = np.linalg.norm(offset, axis=-1)
    u = offset / r[..., None]
    coef = weights.astype(np.float64)
    coef[:, -1] -= 3 / r[:, -1]  # d log rho / d r_k
    want = np.zeros_like(x)
    np.add.at(want, np.arange(n), np.sum(coef[..., None] * u, axis=1))
    np.add.at(want, idx.reshape(-1), -(coef[..., None] * u).reshape(-1, 3))
    assert np.abs(3 / r[:, -1]).mean() > 1  # the density's part is not negligible
    np.testing.assert_allclose(grad, want, rtol=1e-3, atol=1e-3 * np.abs(want).max())


def _reference_neighbours(pos, box, k, query=None):
    """cKDTree's k nearest other particles (or those of query points): (dist, idx)."""
    tree = cKDTree(_wrap64(pos, box), boxsize=box)
    if query is None:
        dist, idx = tree.query(_wrap64(pos, box), k=k + 1)
        return dist[:, 1:], idx[:, 1:]
    return tree.query(_wrap64(query, box), k=k)


@pytest.mark.slow
@pytest.mark.parametrize("shape", mesh_params([(1, 1), (2, 4)]), ids=mesh_id)
def test_overdensity_gradient_with_respect_to_masses_is_the_analytic_one(shape):
    """Reverse mode of sum(w * delta) with respect to per-particle masses (N = 510, padded
    on 8 devices): the masses enter each density's sum and the mean. Rows not computed
    (NaN densities, zero cotangents) made every entry NaN. A traced scalar mass cancels
    (delta does not depend on it): a finite zero, not NaN, and no error from ``pmax``."""
    rng = np.random.default_rng(4)
    box, n, k = 8.0, 510, 4
    pos = rng.uniform(0, box, (n, 3)).astype(np.float32)
    mass = rng.uniform(0.5, 2.0, n).astype(np.float32)
    weights = rng.normal(size=n).astype(np.float32)
    mesh = make_mesh(shape)
    delta = lambda m: jh.knn_density(pos, box, k, mass=m, mesh=mesh, overdensity=True)
    gradient = jax.jit(jax.grad(lambda m: jnp.sum(weights * delta(m))))
    grad = np.asarray(gradient(mass))
    r, nearest = _reference_neighbours(pos, box, k)
    volume = 4 / 3 * np.pi * r[:, -1] ** 3
    mass = mass.astype(np.float64)
    mean = mass.sum() / box**3
    nearest = nearest[:, : k - 1]  # the k - 1 masses of each density
    want = np.zeros(n)
    np.add.at(want, nearest.reshape(-1), np.repeat(weights / (volume * mean), k - 1))
    want -= np.sum(weights * mass[nearest].sum(1) / volume) / (mean**2 * box**3)
    np.testing.assert_allclose(grad, want, rtol=1e-3, atol=1e-4 * np.abs(want).max())
    scalar = gradient(jnp.float32(1.3))
    scale = np.sum(np.abs(weights * np.asarray(delta(jnp.float32(1.3))))) / 1.3
    assert np.isfinite(scalar) and abs(float(scalar)) < 1e-5 * scale


@pytest.mark.parametrize("shape", mesh_params([(1, 1), (2, 4)], ci=CI_MESHES), ids=mesh_id)
def test_gradient_with_respect_to_query_points_is_the_analytic_one(shape):
    """d sum(w * dist) / d query: each distance moves with its query point along the unit
    offset from the neighbour (neighbours held fixed), wrapped across the box."""
    rng = np.random.default_rng(5)
    box, n, k = 8.0, 512, 4
    pos = rng.uniform(0, box, (n, 3)).astype(np.float32)
    query = rng.uniform(0, box, (61, 3)).astype(np.float32)
    query[0] = [0.01, 4.0, 7.99]  # neighbours across two faces
    weights = rng.uniform(0.5, 1.5, (61, k)).astype(np.float32)
    mesh = make_mesh(shape)
    dist = lambda q: jh.knn(pos, box, k, mesh=mesh, query=q)[0]
    grad = np.asarray(jax.jit(jax.grad(lambda q: jnp.sum(weights * dist(q))))(query))
    _, idx = _reference_neighbours(pos, box, k, query=query)
    offset = query[:, None, :].astype(np.float64) - pos[idx]  # (61, k, 3)
    offset -= box * np.round(offset / box)
    unit = offset / np.linalg.norm(offset, axis=-1, keepdims=True)
    want = np.sum(weights[..., None] * unit, axis=1)
    np.testing.assert_allclose(grad, want, rtol=1e-3, atol=1e-4)


@pytest.mark.newest
def test_local_api_inside_user_shard_map(clustered):
    k = 8
    mesh = make_mesh((4, 2), names=("row", "col"))
    spec = P(("row", "col"))
    want_dist, want_idx = jh.knn(clustered, BOX, k)
    query = np.random.default_rng(4).uniform(0, BOX, (800, 3)).astype(np.float32)

    def step(block, q):
        i = jax.lax.axis_index(("row", "col"))
        n = block.shape[0]
        parts = jh.Particles.create(block, BOX, id=i * n + jnp.arange(n))
        domain, (dist, idx), status = jh.knn_local(parts, k, axes=("row", "col"))
        (qdist, qidx), qstatus = jh.knn_local(parts, k, axes=("row", "col"), query=q)
        return domain.id, dist, idx, (status.ok & qstatus.ok)[None], qdist, qidx

    # shard_map's default check_vma=True: its loops used to be refused there.
    ids, dist, idx, ok, qdist, qidx = map(
        np.asarray,
        jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec, spec), out_specs=(spec,) * 6))(
            _shard(mesh, clustered), _shard(mesh, query)
        ),
    )
    assert ok.all()
    valid = ids >= 0
    assert valid.sum() == N
    np.testing.assert_array_equal(dist[valid], np.asarray(want_dist)[ids[valid]])
    # Global ids (ties by id on every mesh), not rows of a device.
    np.testing.assert_array_equal(idx[valid], np.asarray(want_idx)[ids[valid]])
    # Query results come back in the caller's rows.
    _check_exact(clustered, BOX, k, qdist, qidx, query=query)


def test_local_api_axes_must_cover_the_shard_maps_split_or_name_it_independent():
    """axes=("row", None) on a shard_map split over "row" and "col" searched each device's
    own rows as the whole pencil: wrong neighbours, status ok. Now it raises; an ensemble
    (each "col" index its own box) is declared with independent_axes and is exact."""
    k = 4
    mesh = make_mesh((2, 4), names=("row", "col"))
    boxes = np.random.default_rng(6).uniform(0, BOX, (4, 256, 3)).astype(np.float32)

    def step(block):
        parts = jh.Particles.create(block[0], BOX)  # (rows, 3): one half of one box
        i = jax.lax.axis_index("row")
        parts = dataclasses.replace(parts, id=parts.id + i * block.shape[1])
        domain, (dist, _), status = jh.knn_local(
            parts, k, axes=("row", None), independent_axes=("col",)
        )
        return domain.id[None], dist[None], status.ok[None, None]

    spec = P("col", "row")
    ensemble = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=spec, out_specs=spec))
    ids, dist, ok = map(np.asarray, ensemble(jnp.asarray(boxes)))
    assert ok.all()
    for box in range(4):
        valid = ids[box].reshape(-1) >= 0
        got = dist[box].reshape(-1, k)[valid][np.argsort(ids[box].reshape(-1)[valid])]
        want = cKDTree(boxes[box], boxsize=BOX).query(boxes[box], k + 1)[0][:, 1:]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(
        ValueError,
        match=r"mesh axes \['col'\] that axes=\('row', None\) does "
        r"not name.*independent_axes=\('col',\)",
    ):
        jax.eval_shape(
            jax.shard_map(
                lambda b: jh.knn_local(jh.Particles.create(b[0], BOX), k, axes=("row", None))[1],
                mesh=mesh,
                in_specs=spec,
                out_specs=spec,
            ),
            jnp.asarray(boxes),
        )


@pytest.mark.leg1
def test_knn_on_decomposition_shares_the_domain(clustered):
    from jaxpm_halos.core.domain import decompose
    from jaxpm_halos.core.geometry import wrap
    from jaxpm_halos.core.layout import Pencils
    from jaxpm_halos.knn._search import ghost_width

    k = 8
    mesh = make_mesh((2, 4))
    pencils = Pencils("x", "y", 2, 4, BOX)
    n0 = N // 8
    width = ghost_width(k, N, pencils)
    want_dist, want_idx = jh.knn(clustered, BOX, k)

    def step(block):
        n = block.shape[0]
        i = jax.lax.axis_index(("x", "y"))
        fields = {"pos": wrap(block, BOX), "id": i * n + jnp.arange(n, dtype=jnp.int32)}
        dec = decompose(pencils, fields, jnp.ones(n, bool), width, n, 2 * n, 2 * n)
        result, status = jh.knn_on_decomposition(pencils, dec, k, width, n0=n0)
        return dec.migrated.payload["id"], result["dist"], result["idx"], status.ok[None]

    spec = P(("x", "y"))
    ids, dist, idx, ok = map(
        np.asarray,
        jax.jit(jax.shard_map(step, mesh=mesh, in_specs=spec, out_specs=(spec,) * 4))(
            _shard(mesh, clustered)
        ),
    )
    assert ok.all()
    valid = ids >= 0
    assert valid.sum() == N
    _assert_same(
        (dist[valid], idx[valid]),
        (np.asarray(want_dist)[ids[valid]], np.asarray(want_idx)[ids[valid]]),
    )


def test_knn_on_decomposition_refuses_a_width_wider_than_the_layer(clustered):
    """The decomposition records its ghost layer, so a wider search width (which would miss
    neighbours beyond the layer and report ok) is refused while tracing."""
    from jaxpm_halos.core.domain import decompose
    from jaxpm_halos.core.geometry import wrap
    from jaxpm_halos.core.layout import Pencils

    mesh = make_mesh((2, 4))
    pencils = Pencils("x", "y", 2, 4, BOX)
    width = 1.5

    def step(block):
        n = block.shape[0]
        fields = {"pos": wrap(block, BOX), "id": jnp.arange(n, dtype=jnp.int32)}
        dec = decompose(pencils, fields, jnp.ones(n, bool), width, n, 2 * n, 2 * n)
        assert dec.width == width
        result, _ = jh.knn_on_decomposition(pencils, dec, 8, width + 0.5, n0=n)
        return result["dist"]

    spec = P(("x", "y"))
    with pytest.raises(
        ValueError,
        match=r"width=2.0 is not within the decomposition's "
        r"ghost layer \(1.5\)",
    ):
        jax.jit(
            jax.shard_map(step, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
        ).trace(_shard(mesh, clustered))


@pytest.mark.leg1
def test_non_finite_positions_are_reported_and_excluded(clustered):
    bad = clustered.copy()
    bad[7] = np.nan
    bad[9, 1] = np.inf
    with pytest.raises(jh.InvalidInputError, match="2 particle positions"):
        jh.knn(bad, BOX, 8)
    (dist, idx), status = jax.jit(lambda x: jh.knn(x, BOX, 8, with_status=True))(bad)
    assert int(status.nonfinite) == 2
    dist, idx = np.asarray(dist), np.asarray(idx)
    assert np.isnan(dist[[7, 9]]).all() and (idx[[7, 9]] == -1).all()
    keep = np.ones(N, bool)
    keep[[7, 9]] = False
    want = _reference(clustered[keep], BOX, 8)
    np.testing.assert_allclose(dist[keep], want, rtol=4 * EPS, atol=8 * EPS * BOX)
    assert not np.isin(idx[keep], [7, 9]).any()


@pytest.mark.slow
def test_capacity_overflow_names_the_knob(clustered):
    mesh = make_mesh((2, 4))
    config = jh.KNNConfig(domain=jh.DomainConfig(capacity_factor=1.0))
    with pytest.raises(jh.CapacityError, match="capacity_factor") as info:
        jh.knn(_shard(mesh, clustered), BOX, 8, config=config, grow=False)
    value = float(re.search(r"capacity_factor=([0-9.]+)", str(info.value)).group(1))
    config = jh.KNNConfig(domain=jh.DomainConfig(capacity_factor=value))
    dist, idx = jh.knn(_shard(mesh, clustered), BOX, 8, config=config)
    _check_exact(clustered, BOX, 8, dist, idx)


@pytest.mark.leg1
def test_index_overflow_names_the_knob_and_grows(clustered):
    # The index keeps only the valid rows of the padded exchange buffers, at most
    # index_factor * n0 of them: a factor below what a device holds must be reported.
    x = _shard(make_mesh((2, 4)), clustered)
    small = jh.KNNConfig(index_factor=0.5)
    with pytest.raises(jh.CapacityError, match="'knn index'.*index_factor") as info:
        jh.knn(x, BOX, 8, config=small, grow=False)
    value = float(re.search(r"index_factor=([0-9.]+)", str(info.value)).group(1))
    assert value > 0.5
    suggested = jh.knn(x, BOX, 8, config=jh.KNNConfig(index_factor=value))
    _check_exact(clustered, BOX, 8, *suggested)
    with pytest.warns(jh.GrowthWarning, match="index_factor"):
        grown = jh.knn(x, BOX, 8, config=small)
    _assert_same(grown, suggested)


@pytest.mark.slow
def test_overflow_inside_jit_leaves_no_row_plausible(clustered):
    # The index holds rows every query may read: once it overflowed, no row can be trusted,
    # so every row is NaN / -1 (not finite and wrong), and the density alike.
    x = _shard(make_mesh((2, 4)), clustered)
    small = jh.KNNConfig(index_factor=0.5)
    (dist, idx), status = jax.jit(lambda p: jh.knn(p, BOX, 8, config=small, with_status=True))(x)
    assert not bool(status.ok) and status.failure().buffer == "knn index"
    assert np.isnan(np.asarray(dist)).all() and (np.asarray(idx) == -1).all()
    rho, status = jax.jit(lambda p: jh.knn_density(p, BOX, 8, config=small, with_status=True))(x)
    assert not bool(status.ok) and np.isnan(np.asarray(rho)).all()
    summed = lambda dist, idx, data: data["neighbour_mass"].sum(axis=1)  # noqa: E731
    masses = jax.jit(lambda p: jh.knn(p, BOX, 8, config=small, reduce=summed))(x)
    assert np.isnan(np.asarray(masses)).all()


def _row_summary(dist, idx, data):
    """A reduce whose outputs are finite on any neighbours, complete or not."""
    near = dist < 2.0
    return {
        "count": near.sum(axis=1),
        "any": near.any(axis=1),
        "mean": jnp.nan_to_num(dist).mean(axis=1),
        "first": jnp.maximum(idx[:, 0], 0),
    }


@pytest.mark.parametrize(
    "config",
    [
        jh.KNNConfig(ghost_width=0.5),
        pytest.param(
            jh.KNNConfig(domain=jh.DomainConfig(capacity_factor=1.2)), marks=pytest.mark.slow
        ),
    ],
    ids=["knn-remote", "domain-capacity"],
)
def test_reduce_rows_not_completed_inside_jit_are_blank(clustered, unsharded, config):
    # A reduce turns partial neighbours into finite values (a count, a flag, an index) that
    # look right; the rows not completed come back NaN / -1 / False, the others exact.
    x = _shard(make_mesh((2, 4)), clustered)
    out, status = jax.jit(
        lambda p: jh.knn(p, BOX, 8, config=config, reduce=_row_summary, with_status=True)
    )(x)
    assert not bool(status.ok)
    out = {key: np.asarray(value) for key, value in out.items()}
    blank = np.isnan(out["mean"])
    assert blank.any()
    assert (out["count"][blank] == -1).all() and (out["first"][blank] == -1).all()
    assert not out["any"][blank].any()
    want = _row_summary(*unsharded, None)
    for key in ("count", "any", "first"):
        np.testing.assert_array_equal(out[key][~blank], np.asarray(want[key])[~blank], key)
    # the same distances, summed in an order jit may change
    np.testing.assert_allclose(out["mean"][~blank], np.asarray(want["mean"])[~blank], rtol=4 * EPS)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(k=0), "at least 1"),
        (dict(k=N), "k \\+ 1"),
        (dict(k=2.5), "integer"),
        (dict(k=8, query=np.zeros((4, 2), np.float32)), "trailing axis"),
        # the query is named, not the particles (they are fine)
        (
            dict(k=8, query=np.asarray([[1, 2, 3], [np.nan, 1, 1]], np.float32)),
            "1 query points are NaN or inf",
        ),
    ],
)
def test_bad_arguments_raise(clustered, kwargs, message):
    with pytest.raises(ValueError, match=message):
        jh.knn(clustered, BOX, **kwargs)


def test_bad_density_arguments_raise(clustered):
    with pytest.raises(ValueError, match="k >= 2"):
        jh.knn_density(clustered, BOX, 1)
    with pytest.raises(ValueError, match="need at least k particles"):
        jh.knn(clustered[:16], BOX, 17, query=np.zeros((3, 3), np.float32))


def test_knn_local_with_fewer_valid_particles_than_k_fails_its_status():
    """Padded Particles with 4 valid rows and k = 5 (total left at rows x devices): every
    row is NaN, and the status said ok."""
    rows, k = 16, 5
    pos = np.random.default_rng(0).uniform(0, BOX, (rows, 3)).astype(np.float32)

    def step(pos):
        ids = jnp.where(jnp.arange(rows) < 4, jnp.arange(rows), -1)
        parts = jh.Particles.create(pos, BOX, id=ids, num=4)
        _, (dist, _), status = jh.knn_local(parts, k)
        (qdist, _), qstatus = jh.knn_local(parts, k, query=jnp.ones((1, 3)))
        return dist[:4], status, qdist, qstatus

    dist, status, qdist, qstatus = jax.jit(step)(pos)
    assert np.isnan(np.asarray(dist)).all() and np.isnan(np.asarray(qdist)).all()
    for st, rows_left in ((status, 4), (qstatus, 1)):
        assert not bool(st.ok)
        assert st.failure() == jh.Failure(jh.FailureKind.TOO_FEW, rows_left)
    with pytest.raises(jh.InvalidInputError, match="fewer than k neighbours"):
        status.check()
