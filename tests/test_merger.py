"""Merger links against a serial reference, on the snapshots of one JaxPM run."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ALL_MESHES, CI_MESHES, make_mesh, mesh_params, requires_jaxpm
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpm_halos
from jaxpm_halos.testing.reference import merger_links_reference

pytestmark = pytest.mark.newest
NC, BOX, STEPS = 32, 32.0, 10


@pytest.fixture(scope="module")
def history(jaxpm_history_32):
    return jaxpm_history_32  # (3, nc, nc, nc, 3) displacements at a = 0.5, 0.75, 1


def snapshots_on(history, shape):
    """FoF labels and catalogues of each snapshot, on a mesh ``shape`` (None: one device)."""
    out = []
    for disp in history:
        if shape is not None:
            disp = jax.device_put(disp, NamedSharding(make_mesh(shape), P("x", "y")))
        particles = jaxpm_halos.from_jaxpm(disp, box_size=BOX)
        out.append(jaxpm_halos.fof(particles, b=0.2, min_members=10))
    return out


def reference(snapshots, i):
    (la, ca), (lb, cb) = snapshots[i], snapshots[i + 1]
    return merger_links_reference(
        np.asarray(la), ca.to_numpy()["id"], np.asarray(lb), cb.to_numpy()["id"]
    )


def assert_links_equal(links, expected):
    for got, want in zip(links.to_numpy(), expected):
        assert got.keys() == want.keys()
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)


@pytest.mark.parametrize("shape", mesh_params(ALL_MESHES, ci=CI_MESHES) + [None])
def test_links_match_reference(history, shape):
    """Eager and under a plain jax.jit, on every mesh and on one device."""
    snapshots = snapshots_on(history, shape)
    jitted = jax.jit(jaxpm_halos.merger_links)
    for i in range(len(snapshots) - 1):
        expected = reference(snapshots, i)
        assert len(expected[0]["id"]) > 10 and (expected[1]["n_progenitors"] > 1).any()
        assert_links_equal(jaxpm_halos.merger_links(*snapshots[i], *snapshots[i + 1]), expected)
        links = jitted(*snapshots[i], *snapshots[i + 1])
        assert links.id.sharding.is_fully_replicated
        assert_links_equal(links, expected)


def test_pair_buffer_overflow(history):
    snapshots = snapshots_on(history, (2, 4))
    small = jaxpm_halos.MergerConfig(max_pairs=2)
    with pytest.raises(jaxpm_halos.CapacityError, match=r"config=MergerConfig\(max_pairs="):
        jaxpm_halos.merger_links(*snapshots[0], *snapshots[1], config=small, grow=False)
    with pytest.warns(jaxpm_halos.GrowthWarning, match="MergerConfig"):
        grown = jaxpm_halos.merger_links(*snapshots[0], *snapshots[1], config=small)
    assert_links_equal(grown, reference(snapshots, 0))
    inside = jax.jit(lambda *a: jaxpm_halos.merger_links(*a, config=small))
    links = inside(*snapshots[0], *snapshots[1])
    assert not bool(links.status.ok)
    with pytest.raises(jaxpm_halos.CapacityError):
        links.to_numpy()


def test_refuses_mismatched_input(history):
    (la, ca), (lb, cb) = snapshots_on(history[:2], None)
    with pytest.raises(ValueError, match="same shape"):
        jaxpm_halos.merger_links(la, ca, lb.ravel(), cb)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="one snapshot's Catalogue"):
            jaxpm_halos.merger_links(la, ca, lb, {"id": cb.id})


def _check_tree(labels, catalogue):
    """snapshot_links (eager, under jax.jit, and grown), main_branches and along_branches of
    FoF labels and a catalogue stacked over the snapshots, against the serial reference."""
    catalogues = [jaxpm_halos.gather_catalogue(catalogue, snapshot=i) for i in range(len(labels))]
    links = jaxpm_halos.snapshot_links(labels, catalogue)
    jitted = jax.jit(jaxpm_halos.snapshot_links)(labels, catalogue)
    small = jaxpm_halos.MergerConfig(max_pairs=2)  # grown once, for every pair alike
    with pytest.warns(jaxpm_halos.GrowthWarning, match="MergerConfig"):
        grown = jaxpm_halos.snapshot_links(labels, catalogue, config=small)
    for i in range(len(catalogues) - 1):
        expected = merger_links_reference(
            np.asarray(labels[i]),
            catalogues[i]["id"],
            np.asarray(labels[i + 1]),
            catalogues[i + 1]["id"],
        )
        for stacked in (links, jitted, grown):
            assert_links_equal(jax.tree.map(lambda x, i=i: x[i], stacked), expected)
    branches = jaxpm_halos.main_branches(links)
    mass = jaxpm_halos.along_branches(branches, catalogues, "mass")
    np.testing.assert_array_equal(branches[:, -1], catalogues[-1]["id"])
    np.testing.assert_array_equal(mass[:, -1], catalogues[-1]["mass"])
    assert np.isnan(mass[branches == -1]).all() and not np.isnan(mass[branches >= 0]).any()
    for s in range(len(catalogues) - 1):  # each column is the next one's main progenitor
        backward = jaxpm_halos.merger_links(
            labels[s],
            jax.tree.map(lambda x, s=s: x[s], catalogue),
            labels[s + 1],
            jax.tree.map(lambda x, s=s: x[s + 1], catalogue),
        ).to_numpy()[1]
        main = dict(zip(backward["id"].tolist(), backward["main_progenitor"].tolist()))
        assert branches[:, s].tolist() == [
            main.get(b, -1) if b >= 0 else -1 for b in branches[:, s + 1]
        ]
    assert (branches[:, 0] >= 0).mean() > 0.3  # most of today's haloes existed at a = 0.5


def test_tree_of_stacked_snapshots(history):
    """The tree of one run's snapshots stacked as InSitu.saveat returns them (with -m slow,
    test_tree_of_an_in_situ_run takes them from an in-situ run)."""
    snapshots = snapshots_on(history, (2, 4))
    labels = jnp.stack([snapshot_labels for snapshot_labels, _ in snapshots])
    catalogue = jax.tree.map(lambda *fields: jnp.stack(fields), *[cat for _, cat in snapshots])
    _check_tree(labels, catalogue)


@pytest.mark.slow
@requires_jaxpm
def test_tree_of_an_in_situ_run():
    from jaxpm_halos.simulation import run_simulation

    insitu = jaxpm_halos.InSitu(box_size=BOX, analyses=("fof",), b=0.2, min_members=10)
    run = run_simulation(NC, BOX, STEPS, (0.5, 0.75, 1.0), mesh=make_mesh((2, 4)), saveat_fn=insitu)
    _check_tree(run.saved["fof"]["labels"], run.saved["fof"]["catalogue"])


def test_two_key_sort_gives_the_same_links(history, monkeypatch):
    """Catalogues too large for one uint32 sort key take a two-key sort: same links."""
    from jaxpm_halos.merger import links

    snapshots = snapshots_on(history, (2, 4))
    monkeypatch.setattr(links, "_ONE_KEY_LIMIT", 0)
    jaxpm_halos.clear_caches()
    assert_links_equal(
        jaxpm_halos.merger_links(*snapshots[0], *snapshots[1]), reference(snapshots, 0)
    )
    jaxpm_halos.clear_caches()
