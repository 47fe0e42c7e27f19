"""Run directories: write_run / load_run round-trip an in-situ JaxPM run's catalogues,
members, merger links, tree and metadata, checked against numpy references."""

import dataclasses

import jax
import numpy as np
import pytest
from conftest import make_mesh, requires_jaxpm

import jaxpm_halos
from jaxpm_halos.testing.reference import merger_links_reference

pytestmark = [pytest.mark.newest, requires_jaxpm]
NC, BOX, STEPS, TIMES = 32, 32.0, 10, (0.5, 0.75, 1.0)


def insitu_run(mesh_shape, **settings):
    from jaxpm_halos.simulation import run_simulation

    mesh = None if mesh_shape is None else make_mesh(mesh_shape)
    insitu = jaxpm_halos.InSitu(
        box_size=BOX, analyses=("fof",), b=0.2, min_members=10, omega_m=0.2986, **settings
    )
    run = run_simulation(NC, BOX, STEPS, TIMES, mesh=mesh, saveat_fn=insitu)
    return run, insitu


@pytest.fixture(
    scope="module",
    params=[(2, 4), pytest.param(None, marks=pytest.mark.slow)],
    ids=["mesh2x4", "one_device"],
)
def written(request, tmp_path_factory):
    run, insitu = insitu_run(request.param)
    directory = tmp_path_factory.mktemp("run") / "halos"
    cosmology = {"Omega_c": 0.25, "Omega_b": 0.0486, "h": 0.6774, "sigma8": 0.8, "n_s": 0.9667}
    path = jaxpm_halos.write_run(
        directory,
        run.saved,
        insitu,
        times=TIMES,
        cosmology=cosmology,
        steps=STEPS,
        seed=0,
        lightcone={"observer": (16.0, 16.0, 16.0), "z_max": 0.2},
    )
    return run, insitu, jaxpm_halos.load_run(path)


def test_catalogues_and_metadata_round_trip(written):
    run, insitu, loaded = written
    assert len(loaded) == 3 and np.allclose(loaded.a, TIMES)
    assert loaded.cosmology["Omega_m"] == pytest.approx(0.2986)
    attrs = loaded.attrs
    assert (attrs["box_size"], attrs["nc"], attrs["pm_nc"], attrs["steps"]) == (BOX, NC, NC, STEPS)
    assert attrs["particle_mass"] == pytest.approx(jaxpm_halos.units.particle_mass(0.2986, BOX, NC))
    assert (attrs["min_members"], attrs["b"], attrs["seed"]) == (10, 0.2, 0)
    assert attrs["version_jax"] == jax.__version__ and attrs["created"]
    for i in range(3):
        expected = jaxpm_halos.gather_catalogue(run.saved["fof"]["catalogue"], snapshot=i)
        got = loaded.catalogue(i)
        assert got.keys() == expected.keys() and len(got) > 10
        for name in expected:
            np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
        assert got.attrs["units"]["vel"] == "km/s" and got.attrs["a"] == TIMES[i]


def test_members_round_trip_for_every_halo(written):
    run, _, loaded = written
    for i in range(3):
        labels = np.asarray(run.saved["fof"]["labels"][i]).ravel()
        ids = loaded.catalogue(i)["id"]
        table = loaded.member_table(i)
        order = np.argsort(labels, kind="stable")  # members by label, ids ascending
        starts = np.searchsorted(labels[order], ids)
        for row, halo in enumerate(ids):
            expected = order[starts[row] : starts[row] + table["count"][row]]
            assert (labels[expected] == halo).all() and (labels == halo).sum() == len(expected)
            start = table["offset"][row]
            np.testing.assert_array_equal(table["ids"][start : start + len(expected)], expected)
        np.testing.assert_array_equal(
            loaded.members(i, int(ids[-1])), np.flatnonzero(labels == ids[-1])
        )
    with pytest.raises(KeyError, match="no halo 1 at snapshot 0"):
        loaded.members(0, 1)


def test_links_and_tree_round_trip(written):
    run, _, loaded = written
    labels = run.saved["fof"]["labels"]
    backward = []
    for i in range(2):
        forward, later = merger_links_reference(
            np.asarray(labels[i]),
            loaded.catalogue(i)["id"],
            np.asarray(labels[i + 1]),
            loaded.catalogue(i + 1)["id"],
        )
        np.testing.assert_array_equal(loaded.links(i)["descendant"], forward["descendant"])
        np.testing.assert_array_equal(loaded.links(i)["shared"], forward["shared"])
        np.testing.assert_array_equal(
            loaded.links(i + 1)["main_progenitor"], later["main_progenitor"]
        )
        np.testing.assert_array_equal(loaded.links(i + 1)["n_progenitors"], later["n_progenitors"])
        backward.append(later)
    assert (loaded.links(0)["main_progenitor"] == -1).all() and (
        loaded.links(2)["descendant"] == -1
    ).all()
    branches = jaxpm_halos.main_branches(backward)
    np.testing.assert_array_equal(loaded.tree["main_branch"], branches)
    catalogues = [loaded.catalogue(i).fields for i in range(3)]
    np.testing.assert_array_equal(
        loaded.tree["mass"], jaxpm_halos.along_branches(branches, catalogues)
    )


def test_lightcone_round_trips(written):
    run, insitu, loaded = written
    catalogues = [loaded.catalogue(i).fields for i in range(3)]
    cone = jaxpm_halos.lightcone(
        catalogues,
        TIMES,
        observer=(16.0, 16.0, 16.0),
        z_max=0.2,
        cosmology=loaded.cosmology,
        box_size=BOX,
    )
    assert cone.keys() == loaded.lightcone.keys() and len(cone["id"]) > 1000
    for name in cone:
        np.testing.assert_array_equal(loaded.lightcone[name], cone[name], err_msg=name)
    # shells: a = 1 to 461 Mpc/h, a = 0.75 on to z = 0.2 (563 Mpc/h); a = 0.5 lies beyond
    assert set(cone["snapshot"]) == {1, 2} and cone["z_cos"].max() <= 0.2


def _with_halos_needed(saved, rows: int):
    """``saved`` with its FoF status saying ``rows`` catalogue rows were needed at the last
    snapshot, beyond any ``max_halos``."""
    from jaxpm_halos.core.config import MAX_HALOS

    cat = saved["fof"]["catalogue"]
    name = next(n for n, limit in cat.status.limits if limit.knob == MAX_HALOS)
    needed = dict(cat.status.needed, **{name: cat.status.needed[name].at[-1].set(rows)})
    cat = dataclasses.replace(cat, status=dataclasses.replace(cat.status, needed=needed))
    return dict(saved, fof=dict(saved["fof"], catalogue=cat))


def test_failed_status_is_refused_and_the_old_run_kept(written, tmp_path):
    run, insitu, loaded = written
    if list(loaded.attrs["mesh_shape"]) != [2, 4]:
        pytest.skip("the refusals do not depend on the mesh: checked on (2, 4)")
    failed = _with_halos_needed(run.saved, 10**6)  # as a run whose catalogue overflowed
    with pytest.raises(jaxpm_halos.CapacityError, match="max_halos"):
        jaxpm_halos.write_run(loaded.directory, failed, insitu, times=TIMES, cosmology={})
    assert jaxpm_halos.load_run(loaded.directory).attrs["created"] == loaded.attrs["created"]
    with pytest.raises(ValueError, match="Omega_m = 0.3, but the InSitu's omega_m"):
        jaxpm_halos.write_run(
            tmp_path / "r", run.saved, insitu, times=TIMES, cosmology={"Omega_m": 0.3}
        )
    with pytest.raises(ValueError, match="increasing"):
        jaxpm_halos.write_run(
            tmp_path / "r", run.saved, insitu, times=(1.0, 0.75, 0.5), cosmology={}
        )
    assert not (tmp_path / "r").exists()
