"""from_jaxpm on real JaxPM output: positions, ids, sharding, input forms, errors."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh, requires_jaxpm
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpm_halos import Particles, from_jaxpm


def lattice(nc):
    return np.stack(np.meshgrid(*[np.arange(nc)] * 3, indexing="ij"), axis=-1)


def expected_positions(disp, box):
    """mod(q + d, nc) * L / nc, in float64."""
    nc = disp.shape[0]
    return np.mod(lattice(nc) + disp.astype(np.float64), nc) * (box / nc)


def periodic_error(pos, ref, box):
    d = np.abs(np.asarray(pos, np.float64) - ref)
    return np.minimum(d, box - d).max()


def check_lattice_particles(p, disp, mom, box):
    nc = disp.shape[0]
    assert isinstance(p, Particles)
    assert p.shape == (nc, nc, nc) and p.box_size == box
    pos = np.asarray(p.pos)
    assert pos.dtype == np.float32
    assert pos.min() >= 0 and pos.max() < box
    # float32 rounding of q + d (|q + d| < 2 nc) and of the scaling by box / nc
    assert (
        periodic_error(pos, expected_positions(disp, box), box)
        <= 8 * np.finfo(np.float32).eps * box
    )
    ids = np.asarray(p.id)
    assert ids.dtype == np.int32
    ix, iy, iz = np.indices((nc, nc, nc))
    np.testing.assert_array_equal(ids, (ix * nc + iy) * nc + iz)
    assert int(p.num) == nc**3
    if mom is None:
        assert p.vel is None
    else:
        np.testing.assert_array_equal(np.asarray(p.vel), mom)


@pytest.mark.optimised  # a JaxPM run, compiled as users do in CI (pyproject.toml)
def test_real_run_positions_ids(jaxpm_snapshot_32):
    snap = jaxpm_snapshot_32
    p = from_jaxpm(snap.disp_sharded, snap.mom_sharded, snap.box_size, mass=2.5)
    check_lattice_particles(p, snap.disp, snap.mom, snap.box_size)
    assert p.mass == 2.5
    # the run really leaves particles outside [0, nc): wrapping is exercised
    q_plus_d = lattice(snap.nc) + snap.disp
    assert q_plus_d.min() < 0 and q_plus_d.max() >= snap.nc


@pytest.mark.parametrize("shape", [(2, 4), (4, 2), (1, 8), (8, 1), (1, 1)])
def test_keeps_sharding(jaxpm_snapshot_32, shape):
    snap = jaxpm_snapshot_32
    mesh = make_mesh(shape)
    sharding = NamedSharding(mesh, P("x", "y"))
    disp = jax.device_put(snap.disp, sharding)
    mom = jax.device_put(snap.mom, sharding)
    p = from_jaxpm(disp, mom, box_size=snap.box_size)
    assert p.pos.sharding == sharding
    assert p.id.sharding == sharding
    assert p.vel.sharding == sharding
    check_lattice_particles(p, snap.disp, snap.mom, snap.box_size)

    # Inside jit the layout comes from sharding propagation: same placement.
    pj = jax.jit(lambda d, m: from_jaxpm(d, m, box_size=snap.box_size))(disp, mom)
    for arr, ndim in ((pj.pos, 4), (pj.id, 3), (pj.vel, 4)):
        assert isinstance(arr.sharding, NamedSharding)
        assert arr.sharding.is_equivalent_to(sharding, ndim), arr.sharding
    np.testing.assert_array_equal(np.asarray(pj.pos), np.asarray(p.pos))
    np.testing.assert_array_equal(np.asarray(pj.id), np.asarray(p.id))


def test_stacked_state_matches(jaxpm_snapshot_32):
    snap = jaxpm_snapshot_32
    state = jax.device_put(
        np.stack([snap.disp, snap.mom]), NamedSharding(snap.mesh, P(None, "x", "y"))
    )
    ps = from_jaxpm(state, box_size=snap.box_size)
    p = from_jaxpm(snap.disp_sharded, snap.mom_sharded, box_size=snap.box_size)
    for a, b in ((ps.pos, p.pos), (ps.id, p.id), (ps.vel, p.vel)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.sharding == snap.sharding
    assert int(ps.num) == int(p.num) and ps.box_size == p.box_size
    # stacked state inside jit too
    pj = jax.jit(lambda y: from_jaxpm(y, box_size=snap.box_size))(state)
    np.testing.assert_array_equal(np.asarray(pj.pos), np.asarray(p.pos))
    np.testing.assert_array_equal(np.asarray(pj.vel), snap.mom)


def test_unsharded_input(jaxpm_snapshot_32):
    snap = jaxpm_snapshot_32
    ref = from_jaxpm(snap.disp_sharded, box_size=snap.box_size)
    for disp in (snap.disp, jnp.asarray(snap.disp)):  # numpy, and a one-device jax array
        p = from_jaxpm(disp, box_size=snap.box_size)
        check_lattice_particles(p, snap.disp, None, snap.box_size)
        np.testing.assert_array_equal(np.asarray(p.pos), np.asarray(ref.pos))
        assert len(p.pos.sharding.device_set) == 1


def test_wrap_edges():
    """Positions that round onto the box edge fold back to 0, never L."""
    nc, box = 4, 3.0
    disp = np.zeros((nc, nc, nc, 3), np.float32)
    disp[0, 0, 0] = [-1e-9, -2e-8, -nc]  # q + d just below 0, and exactly -nc
    disp[-1, -1, -1] = [1.0, 1.0 - 1e-8, 2 * nc - 1]  # q + d = nc, just below nc, 3 nc - 2
    disp[1, 2, 3] = [-5 * nc + 0.5, 7.25, -0.25]
    p = from_jaxpm(disp, box_size=box)
    pos = np.asarray(p.pos)
    assert pos.min() >= 0 and pos.max() < box
    assert (
        periodic_error(pos, expected_positions(disp, box), box)
        <= 8 * np.finfo(np.float32).eps * box
    )
    np.testing.assert_array_equal(pos[-1, -1, -1, :2], [0, 0])
    np.testing.assert_array_equal(pos[0, 0, 0, 2], 0)


def test_float64_input():
    nc, box = 4, 10.0
    rng = np.random.default_rng(1)
    disp = rng.normal(scale=3, size=(nc, nc, nc, 3))
    from jaxpm_halos.core.cells import _x64

    with _x64():
        p = from_jaxpm(disp, box_size=box)
        assert p.pos.dtype == np.float64 and p.id.dtype == np.int32
        np.testing.assert_allclose(np.asarray(p.pos), expected_positions(disp, box), atol=1e-12)


def test_mass_forms():
    nc = 4
    disp = np.zeros((nc, nc, nc, 3), np.float32)
    masses = np.full((nc, nc, nc), 3.0, np.float32)
    p = from_jaxpm(disp, box_size=1.0, mass=masses)
    np.testing.assert_array_equal(np.asarray(p.masses()), masses.reshape(-1))
    assert from_jaxpm(disp, box_size=1.0).mass == 1.0


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((np.zeros((4, 4, 3), np.float32),), dict(box_size=1.0), "shape"),
        ((np.zeros((4, 4, 4, 2), np.float32),), dict(box_size=1.0), "shape"),
        ((np.zeros((4, 4, 8, 3), np.float32),), dict(box_size=1.0), "shape"),
        ((np.zeros((3, 4, 4, 4, 3), np.float32),), dict(box_size=1.0), "stacked"),
        ((np.zeros((2, 4, 4, 8, 3), np.float32),), dict(box_size=1.0), "shape"),
        (
            (np.zeros((4, 4, 4, 3), np.float32), np.zeros((4, 4, 4, 2), np.float32)),
            dict(box_size=1.0),
            "mom",
        ),
        (
            (np.zeros((4, 4, 4, 3), np.float32), np.zeros((8, 8, 8, 3), np.float32)),
            dict(box_size=1.0),
            "mom",
        ),
        (
            (np.zeros((2, 4, 4, 4, 3), np.float32), np.zeros((4, 4, 4, 3), np.float32)),
            dict(box_size=1.0),
            "mom",
        ),
        ((np.zeros((4, 4, 4, 3), np.float32),), dict(), "box_size"),
        ((np.zeros((4, 4, 4, 3), np.float32),), dict(box_size=0.0), "box_size"),
        ((np.zeros((4, 4, 4, 3), np.float32),), dict(box_size=-2.0), "box_size"),
        ((np.zeros((4, 4, 4, 3), np.float32),), dict(box_size=float("nan")), "box_size"),
        ((np.zeros((4, 4, 4, 3), np.float32),), dict(box_size=float("inf")), "box_size"),
        ((np.zeros((4, 4, 4, 3), np.float32),), dict(box_size=1.0, mass=np.ones((4, 4))), "mass"),
        ((np.zeros((4, 4, 4, 3), np.int32),), dict(box_size=1.0), "floating"),
    ],
)
def test_bad_inputs(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        from_jaxpm(*args, **kwargs)


@requires_jaxpm
@pytest.mark.optimised
def test_in_situ_saveat():
    """from_jaxpm inside diffrax's SaveAt fn of a distributed run (the demo's plug-in point)."""
    from jaxpm_halos.simulation import describe_layout, run_simulation

    nc, box = 16, 32.0
    mesh = make_mesh((2, 4))

    def fn(a, y, cosmo):
        p = from_jaxpm(y, box_size=box)
        return p.pos, p.id

    res = run_simulation(nc, box, 2, snapshots=[0.55, 1.0], mesh=mesh, saveat_fn=fn)
    pos, ids = res.saved
    assert pos.shape == (2, nc, nc, nc, 3) and ids.shape == (2, nc, nc, nc)
    final = from_jaxpm(res.state, box_size=box)
    assert final.pos.sharding == NamedSharding(mesh, P("x", "y"))
    # same formula, separately compiled: equal up to float32 rounding
    assert (
        periodic_error(pos[1], np.asarray(final.pos, np.float64), box)
        <= 8 * np.finfo(np.float32).eps * box
    )
    np.testing.assert_array_equal(np.asarray(ids[0]), np.asarray(final.id))
    layout = describe_layout(final, a=1.0)
    assert len(layout["devices"]) == 8 and all(b["block"] == [8, 4, 16] for b in layout["devices"])
    assert 0 <= layout["outside_fraction"] < 1


def test_import_does_not_load_jaxpm():
    code = (
        "import jaxpm_halos, sys; "
        "assert 'jaxpm' not in sys.modules and 'jaxdecomp' not in sys.modules, "
        "sorted(m for m in sys.modules if m.startswith(('jaxpm', 'jaxdecomp')))"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
