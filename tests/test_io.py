"""HDF5 catalogue files: write_catalogue / load_catalogue / gather_catalogue."""

import dataclasses

import h5py
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpm_halos
from jaxpm_halos.io import INSITU_UNITS, gather_catalogue, load_catalogue, write_catalogue

pytestmark = pytest.mark.newest  # all of it in .ci/run's leg 2, less its leg1 parts

COSMO = {
    "Omega_c": 0.25,
    "Omega_b": 0.0486,
    "h": 0.6774,
    "n_s": 0.9667,
    "sigma8": 0.8,
    "name": "Planck15 variant",
}
META = dict(
    box_size=32.0,
    nc=16,
    a=0.5,
    cosmology=COSMO,
    linking_length=0.4,
    b=0.2,
    min_members=5,
    units=INSITU_UNITS,
)


def _catalogue(rng, n):
    return {
        "id": np.sort(rng.choice(4096, n, replace=False)).astype(np.int32),
        "count": rng.integers(5, 300, n).astype(np.int32),
        "mass": rng.uniform(1e12, 1e15, n).astype(np.float32),
        "pos": rng.uniform(0, 32, (n, 3)).astype(np.float32),
        "vel": rng.normal(0, 300, (n, 3)).astype(np.float32),
        "vel_disp": rng.uniform(10, 900, n).astype(np.float32),
        "radius": rng.uniform(0.05, 1.0, n).astype(np.float32),
    }


def test_round_trip_numpy(tmp_path):
    cat = _catalogue(np.random.default_rng(0), 37)
    path = write_catalogue(
        tmp_path / "sub" / "halos.h5", cat, **META, attrs={"steps": 10, "mesh": np.array([2, 4])}
    )
    got = load_catalogue(path)
    assert set(got.keys()) == set(cat)
    for name, value in cat.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape
        np.testing.assert_array_equal(got[name], value)
    assert len(got) == 37
    attrs = got.attrs
    for key in ("box_size", "nc", "a", "linking_length", "b", "min_members"):
        assert attrs[key] == META[key] and type(attrs[key]) is type(META[key])
    assert attrs["cosmology"] == COSMO
    assert attrs["units"] == INSITU_UNITS
    assert attrs["redshift"] == pytest.approx(1.0)
    assert attrs["num_halos"] == 37 and attrs["steps"] == 10
    np.testing.assert_array_equal(attrs["mesh"], [2, 4])
    with h5py.File(path) as f:  # plain HDF5: one dataset per field, units attached
        assert f["pos"].attrs["unit"] == "Mpc/h" and f["vel"].attrs["unit"] == "km/s"
        assert f["mass"].attrs["unit"] == "Msun/h"


def test_round_trip_custom_units_and_empty(tmp_path):
    cat = {k: v[:0] for k, v in _catalogue(np.random.default_rng(1), 3).items()}
    del cat["vel"], cat["vel_disp"]
    units = {"mass": "particles", "pos": "cells"}
    got = load_catalogue(write_catalogue(tmp_path / "empty.h5", cat, **{**META, "units": units}))
    assert len(got) == 0 and "vel" not in got and got["pos"].shape == (0, 3)
    assert got.attrs["units"] == units
    # a misspelt field would leave "mass" without a unit: refused before anything is written
    with pytest.raises(ValueError, match=r"units names \['Mass'\], which are neither"):
        write_catalogue(tmp_path / "typo.h5", cat, **{**META, "units": {"Mass": "Msun/h"}})
    assert not (tmp_path / "typo.h5").exists()
    # names of other catalogues' fields, attributes and standard SO datasets are accepted
    shared = {**INSITU_UNITS, "m200c": "Msun/h", "r500c": "Mpc/h", "steps": "PM steps"}
    got = load_catalogue(
        write_catalogue(
            tmp_path / "shared.h5", cat, **{**META, "units": shared}, attrs={"steps": 10}
        )
    )
    assert got.attrs["units"] == shared


def test_round_trip_of_a_sharded_catalogue(tmp_path):
    """A padded, sharded Catalogue from fof on a (2, 4) mesh, and one stacked over snapshots."""
    rng = np.random.default_rng(2)
    n, box = 4096, 32.0
    centres = rng.uniform(0, box, (40, 3))
    pos = np.mod(centres[rng.integers(0, 40, n)] + rng.normal(0, 0.3, (n, 3)), box)
    pos = pos.astype(np.float32)
    mesh = make_mesh((2, 4))
    sharded = jax.device_put(pos, NamedSharding(mesh, P(("x", "y"))))
    vel = jax.device_put(rng.normal(size=(n, 3)).astype(np.float32), sharded.sharding)
    config = jaxpm_halos.FoFConfig(domain=jaxpm_halos.DomainConfig(ghost_factor=0.5))
    _, cat = jaxpm_halos.fof(sharded, box, b=0.2, vel=vel, min_members=5, config=config)
    expected = cat.to_numpy()
    assert len(expected["id"]) > 10
    got = load_catalogue(write_catalogue(tmp_path / "c.h5", cat, **META))
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value)
    # fof's fields are in its inputs' units (here unit masses): the file labelled them
    # Msun/h and km/s by default; now the units must be given.
    bare = {k: v for k, v in META.items() if k != "units"}
    with pytest.raises(ValueError, match="units are not known.*pass units="):
        write_catalogue(tmp_path / "bare.h5", cat, **bare)
    assert not (tmp_path / "bare.h5").exists()

    # The first snapshot holds no halos (num 0); -1 is the last, as in numpy.
    stacked = jax.tree.map(lambda x: jnp.stack([0 * x, x]), cat)
    assert len(gather_catalogue(stacked, snapshot=0)["id"]) == 0
    for i in (1, -1):
        fields = gather_catalogue(stacked, snapshot=i)
        for name, value in expected.items():
            np.testing.assert_array_equal(fields[name], value)
    with pytest.raises(ValueError, match="out of range: the catalogue holds 2 snapshots"):
        gather_catalogue(stacked, snapshot=2)
    with pytest.raises(ValueError, match="snapshot"):
        gather_catalogue(stacked)
    with pytest.raises(
        ValueError,
        match=r"stacked over snapshots \(as InSitu.saveat returns "
        r"it\): take one with jaxpm_halos.gather_catalogue",
    ):
        stacked.to_numpy()  # raised an IndexError
    with pytest.raises(ValueError, match="snapshot"):
        gather_catalogue(cat, snapshot=0)

    # A catalogue whose status failed (a buffer overflowed, or positions were left out
    # inside jit) used to be written as if complete.
    name, limit = cat.status.limits[0]
    overflowed = dataclasses.replace(
        cat,
        status=dataclasses.replace(
            cat.status, needed={**cat.status.needed, name: jnp.int32(limit.rows + 1)}
        ),
    )
    with pytest.raises(
        jaxpm_halos.CapacityError,
        match=rf"the catalogue is incomplete or "
        rf"wrong, its status failed: jaxpm_halos: buffer '{name}' overflowed",
    ):
        write_catalogue(tmp_path / "overflowed.h5", overflowed, **META)
    assert not (tmp_path / "overflowed.h5").exists()
    nonfinite = dataclasses.replace(
        cat, status=dataclasses.replace(cat.status, nonfinite=jnp.int32(3))
    )
    with pytest.raises(jaxpm_halos.InvalidInputError, match="3 particle positions"):
        gather_catalogue(nonfinite)
    got = load_catalogue(write_catalogue(tmp_path / "anyway.h5", nonfinite, **META, throw=False))
    np.testing.assert_array_equal(got["id"], expected["id"])
    # Stacked: only the snapshot whose status failed is refused.
    stacked = jax.tree.map(lambda x, y: jnp.stack([x, y]), nonfinite, cat)
    with pytest.raises(jaxpm_halos.InvalidInputError):
        gather_catalogue(stacked, snapshot=0)
    np.testing.assert_array_equal(gather_catalogue(stacked, snapshot=1)["id"], expected["id"])


def test_load_rejects_other_files(tmp_path):
    path = tmp_path / "other.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("pos", data=np.zeros((3, 3)))
    with pytest.raises(ValueError, match="not a jaxpm_halos catalogue"):
        load_catalogue(path)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(a=0.0), "a must be positive and finite, got 0.0"),
        (dict(a=-0.5), "a must be positive and finite"),
        (dict(a=float("nan")), "a must be positive and finite, got nan"),
        (dict(a=float("inf")), "a must be positive and finite"),
        (dict(nc=16.7), "nc must be an integer, got 16.7"),
        (dict(nc=0), "nc must be at least 1"),
        (dict(nc=True), "nc must be an integer"),
        (dict(box_size=-32.0), "box_size must be positive and finite"),
        (dict(box_size=float("inf")), "box_size must be positive and finite"),
        (dict(b=0.0), "b must be positive and finite"),
        (dict(linking_length=float("nan")), "linking_length must be positive and finite"),
        (dict(min_members=2.5), "min_members must be an integer"),
        # metadata that contradicts itself or the rows (the catalogue's groups have >= 5)
        (
            dict(linking_length=0.5),
            r"linking_length=0.5 is not b \* box_size / nc = "
            r"0.2 \* 32 / 16 = 0.4",
        ),
        (
            dict(min_members=400),
            r"min_members=400, but the catalogue holds a group of \d+ "
            "members",
        ),
        (dict(attrs={"format": "mine"}), r"attrs: 'format' is reserved"),
        (dict(attrs={"num_halos": 99999}), r"attrs: 'num_halos' is reserved"),
        (dict(attrs={"cosmology": 1}), r"attrs: 'cosmology' is reserved"),
        (dict(attrs={"note": None}), r"attrs\['note'\]: HDF5 attributes hold numbers"),
        (dict(attrs={"note": {"x": 1}}), r"attrs\['note'\]"),
        (dict(cosmology={"h": None}), r"cosmology\['h'\]"),
        # numpy would make the number a string, read back as text
        (dict(cosmology={"w": [-1.0, "wa"]}), r"cosmology\['w'\]: .* numbers or strings, not both"),
    ],
)
def test_bad_settings_raise_before_any_file_is_made(tmp_path, change, message):
    cat = _catalogue(np.random.default_rng(4), 5)
    with pytest.raises(ValueError, match=message):
        write_catalogue(tmp_path / "bad.h5", cat, **{**META, **change})
    assert list(tmp_path.iterdir()) == []


def test_a_catalogue_without_a_required_field_is_not_written(tmp_path):
    # load_catalogue refused the file afterwards ("the catalogue file lacks [...]").
    cat = _catalogue(np.random.default_rng(4), 5)
    partial = {name: cat[name] for name in ("id", "count", "pos")}
    with pytest.raises(
        ValueError,
        match=r"the catalogue lacks \['mass', 'radius'\], which "
        "load_catalogue requires",
    ):
        write_catalogue(tmp_path / "partial.h5", partial, **META)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_leaves_no_file(tmp_path, monkeypatch):
    cat = _catalogue(np.random.default_rng(5), 5)
    path = write_catalogue(tmp_path / "halos.h5", cat, **META)
    before = load_catalogue(path)

    def fail_midway(group, name):  # the datasets are written, the groups fail
        raise OSError("disk full")

    monkeypatch.setattr(h5py.Group, "create_group", fail_midway)
    with pytest.raises(OSError, match="disk full"):
        write_catalogue(path, _catalogue(np.random.default_rng(6), 9), **META)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["halos.h5"]
    np.testing.assert_array_equal(load_catalogue(path)["id"], before["id"])  # kept as it was


def test_a_directory_as_the_path_is_named_and_nothing_is_written(tmp_path):
    with pytest.raises(IsADirectoryError, match="is a directory; give a file path"):
        write_catalogue(tmp_path, _catalogue(np.random.default_rng(5), 5), **META)
    assert list(tmp_path.iterdir()) == []


def test_a_path_below_a_file_says_the_parent_is_not_a_directory(tmp_path):
    (tmp_path / "file.txt").write_text("")
    for path in (tmp_path / "file.txt" / "out.h5", tmp_path / "file.txt" / "sub" / "out.h5"):
        with pytest.raises(NotADirectoryError, match=r"file.txt' is a file, not a directory"):
            write_catalogue(path, _catalogue(np.random.default_rng(5), 5), **META)
    assert [p.name for p in tmp_path.iterdir()] == ["file.txt"]


def test_string_array_attrs_round_trip(tmp_path):
    cat = _catalogue(np.random.default_rng(7), 3)
    got = load_catalogue(
        write_catalogue(tmp_path / "s.h5", cat, **META, attrs={"labels": np.array(["a", "bc"])})
    )
    assert list(got.attrs["labels"]) == ["a", "bc"] and got.attrs["num_halos"] == 3


def _damaged(path, damage):
    with h5py.File(path, "r+") as f:
        damage(f)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda f: f.__delitem__("mass"), r"lacks \['mass'\]"),
        (lambda f: f.__delitem__("id"), r"lacks \['id'\]"),
        (lambda f: f.__delitem__("cosmology"), r"lacks \['cosmology'\]"),
        (
            lambda f: (f.__delitem__("radius"), f.create_dataset("radius", data=np.ones(4))),
            r"dataset 'radius' has shape \(4,\); with 5 ids it should be \(5,\)",
        ),
        (
            lambda f: (f.__delitem__("pos"), f.create_dataset("pos", data=np.ones((5, 2)))),
            r"dataset 'pos' has shape \(5, 2\)",
        ),
        (
            lambda f: f.attrs.__setitem__("num_halos", 99999),
            "num_halos is 99999, but the datasets hold 5 halos",
        ),
        (lambda f: f.attrs.__delitem__("num_halos"), "num_halos is None"),
        # An SO definition listed without its datasets (it was silently left out).
        (
            lambda f: f.attrs.__setitem__("so_definitions", ["200c"]),
            r"so_definitions lists \['200c'\], but the file lacks \['m200c', 'r200c'\]",
        ),
    ],
)
def test_load_names_what_a_damaged_file_lacks(tmp_path, damage, message):
    cat = _catalogue(np.random.default_rng(8), 5)
    path = write_catalogue(tmp_path / "d.h5", cat, **META)
    assert len(load_catalogue(path)) == 5
    _damaged(path, damage)
    with pytest.raises(ValueError, match=message):
        load_catalogue(path)


@pytest.mark.leg1  # SO and peaks: test_so's run there
def test_round_trip_so_and_peak(tmp_path):
    """SO datasets (m200c, r200c, ...) and the density peak, from a sharded fof catalogue,
    with their units, definitions and centre; a numpy dict infers the centre from peak."""
    rng = np.random.default_rng(5)
    clumps = rng.uniform(0, 32, (6, 3))
    pos = np.concatenate(
        [c + rng.normal(0, 0.3, (80, 3)) for c in clumps] + [rng.uniform(0, 32, (1520, 3))]
    )
    pos = jax.device_put(
        jnp.asarray(np.mod(pos, 32).astype(np.float32)),
        NamedSharding(make_mesh((2, 4)), P(("x", "y"))),
    )
    _, cat = jaxpm_halos.fof(
        pos,
        32.0,
        b=0.2,
        mass=1e11,
        min_members=5,
        so=("200c", "vir"),
        omega_m=0.3,
        a=0.5,
        centre="peak",
        k=8,
    )
    expected = cat.to_numpy()
    assert {"peak", "m200c", "r200c", "mvir", "rvir"} <= set(expected)
    assert np.all(expected["m200c"] > 0)
    so_units = jaxpm_halos.core.catalogue.insitu_units(True, ("200c", "vir"))
    got = load_catalogue(write_catalogue(tmp_path / "so.h5", cat, **{**META, "units": so_units}))
    assert set(got.keys()) == set(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    assert list(got.attrs["so_definitions"]) == ["200c", "vir"]
    assert got.attrs["so_centre"] == "peak"
    assert got.attrs["units"]["m200c"] == "Msun/h"
    assert got.attrs["units"]["rvir"] == "Mpc/h (comoving)"
    with h5py.File(tmp_path / "so.h5") as f:
        assert "200c" in f["m200c"].attrs["definition"]
        assert "density peak" in f["r200c"].attrs["definition"]
    # From the numpy dict: same datasets, centre read off the presence of peak.
    got = load_catalogue(write_catalogue(tmp_path / "so_np.h5", expected, **META))
    assert got.attrs["so_centre"] == "peak" and set(got.keys()) == set(expected)
    # META's units hold no SO entries: an SO mass takes the unit of mass, a radius of pos.
    assert got.attrs["units"]["mvir"] == "Msun/h" and got.attrs["units"]["r200c"] == "Mpc/h"


def test_custom_so_names_and_unsorted_ids_are_not_mislabelled(tmp_path):
    cat = _catalogue(np.random.default_rng(6), 4)
    cat["m200"] = cat["r200"] = np.ones(4, np.float32)  # fof(so={"200": density}) names it
    path = write_catalogue(tmp_path / "custom.h5", cat, **META)
    with h5py.File(path) as f:
        definition = f["m200"].attrs["definition"]
        assert "named '200' by the caller" in definition and "so_density" not in definition
        assert f["r200"].attrs["unit"] == "Mpc/h"
    shuffled = {k: v[::-1] for k, v in cat.items()}
    with pytest.raises(ValueError, match="ids must be unique and sorted"):
        write_catalogue(tmp_path / "shuffled.h5", shuffled, **META)
    assert not (tmp_path / "shuffled.h5").exists()


def test_a_column_load_would_not_read_back_is_refused(tmp_path):
    """A field that is neither a catalogue field nor an SO mass and radius pair was written
    as if it were an SO quantity and dropped on load: now the write refuses it."""
    cat = _catalogue(np.random.default_rng(5), 4)
    cat["my_extra"] = np.arange(4.0)
    with pytest.raises(ValueError, match=r"\['my_extra'\] are neither"):
        write_catalogue(tmp_path / "extra.h5", cat, **META)
    assert not (tmp_path / "extra.h5").exists()
    cat = _catalogue(np.random.default_rng(5), 4)
    cat["m200c"] = cat["r200c"] = np.ones(4, np.float32)  # an SO pair is written and read
    got = load_catalogue(write_catalogue(tmp_path / "so.h5", cat, **META))
    np.testing.assert_array_equal(got["r200c"], np.ones(4, np.float32))
