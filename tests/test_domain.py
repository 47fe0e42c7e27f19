"""Pencil-domain exchange: conservation, ghost completeness and the return trip, on every
mesh, for random flat input and for a real JaxPM grid; overflow reporting."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpm_halos as jh
from jaxpm_halos.core.domain import return_trip
from jaxpm_halos.core.frontend import local_fields, prepare
from jaxpm_halos.core.pipeline import plan_for

pytestmark = pytest.mark.newest  # all of it in .ci/run's leg 2, less its leg1 parts

BOX = 16.0


def _run(x, mesh, width, config=jh.DomainConfig(), box=BOX):
    """Migrate + ghosts + return trip of the particle ids; returns per-device arrays."""
    problem, args, specs = prepare(x, box, mesh=mesh)
    layout, pencils = problem.layout, problem.pencils
    plan = plan_for(problem, config, width)
    capacity = plan.capacity_rows

    def device(*blocks):
        fields, shape = local_fields(problem, *blocks)
        n = fields["pos"].shape[0]
        dec, status = plan.decompose(fields, jnp.ones(n, bool))
        mig = dec.migrated
        back = return_trip(
            pencils,
            mig.payload["id"],
            mig.payload["origin"],
            mig.count,
            n,
            plan.transfer_rows,
            capacity,
        )
        ext = dec.ext
        return (
            ext.pos[None],
            ext.image[None],
            ext.id[None],
            back.reshape(shape),
            fields["id"].reshape(shape),
            status,
        )

    dev = layout.device_spec
    out = jax.jit(
        lambda *a: layout.run(device, a, specs, (dev, dev, dev, layout.spec, layout.spec, P()))
    )(*args)
    return out, pencils, capacity


def _check(out, pencils, capacity, pos, width, box=BOX):
    epos, eimg, eid, back, ids, status = out
    status.check()
    ndev = pencils.num_devices
    eimg = np.asarray(eimg).reshape(ndev, -1, 2)
    eid = np.asarray(eid).reshape(ndev, -1)
    ids = np.asarray(ids).reshape(-1)
    n = len(ids)
    # Conservation: every id owned exactly once, and by the pencil holding its position.
    owned = np.concatenate([e[:capacity][e[:capacity] >= 0] for e in eid])
    np.testing.assert_array_equal(np.sort(owned), np.arange(n))
    # Round trip: the ids come back exactly in the input layout.
    np.testing.assert_array_equal(np.asarray(back).reshape(-1), ids)
    # Ghosts: every periodic image within `width` of the pencil, and nothing else.
    wpos = np.zeros((n, 3))
    wpos[ids] = np.mod(pos.reshape(-1, 3), box)
    wx, wy = pencils.widths
    for d in range(ndev):
        i, j = divmod(d, pencils.py)
        lo, hi = np.array([i * wx, j * wy]), np.array([(i + 1) * wx, (j + 1) * wy])
        home = np.all((wpos[:, :2] >= lo) & (wpos[:, :2] < hi), 1)
        assert set(eid[d, :capacity][eid[d, :capacity] >= 0]) == set(np.nonzero(home)[0])
        got = {
            (eid[d, k], eimg[d, k, 0], eimg[d, k, 1])
            for k in range(capacity, eid.shape[1])
            if eid[d, k] >= 0
        }
        want = set()
        for sx in (-1, 0, 1):
            for sy in (-1, 0, 1):
                q = wpos[:, :2] + box * np.array([sx, sy])
                near = np.all((q >= lo - width) & (q < hi + width), 1)
                if sx == sy == 0:
                    near &= ~home
                want |= {(k, sx, sy) for k in np.nonzero(near)[0]}
        assert got == want, f"device {d}: {len(got - want)} extra, {len(want - got)} missing"


@pytest.fixture(scope="module")
def flat():
    rng = np.random.default_rng(0)
    pos = rng.uniform(0, BOX, (4096, 3)).astype(np.float32)
    pos[:4] = 0.0
    pos[4:8] = BOX  # wraps to 0
    pos[8:16] = pos[100]  # duplicates
    pos[16:24] = rng.uniform(-BOX, 2 * BOX, (8, 3))  # outside the box
    return pos


@pytest.mark.parametrize("width_fraction", [0.1, 1.0])
def test_flat_random_input_on_every_mesh(flat, mesh, width_fraction):
    if mesh.size == 1:
        x, pencils_width = flat, BOX
    else:
        x = jax.device_put(flat, NamedSharding(mesh, P(tuple(mesh.axis_names))))
        shape = tuple(mesh.shape.values())
        pencils_width = min(BOX / shape[0], BOX / shape[1])
    width = width_fraction * pencils_width * 0.999
    # A full-width layer on each face: the y stage forwards owned rows and both x layers.
    config = jh.DomainConfig(ghost_factor=3.5 if width_fraction == 1.0 else None)
    out, pencils, capacity = _run(x, mesh if mesh.size > 1 else None, width, config)
    _check(out, pencils, capacity, flat, width)


def test_unsharded_input_has_periodic_self_images(flat):
    width = 1.0
    out, pencils, capacity = _run(flat, None, width)
    assert pencils.num_devices == 1
    _check(out, pencils, capacity, flat, width)


@pytest.mark.parametrize("shape", [(2, 4), (1, 8), (8, 1)])
def test_jaxpm_grid_strays_migrate_and_return(jaxpm_snapshot_32, shape):
    snap = jaxpm_snapshot_32
    mesh = make_mesh(shape)
    disp = jax.device_put(snap.disp, NamedSharding(mesh, P("x", "y")))
    parts = jh.from_jaxpm(disp, None, snap.box_size)
    width = 0.5
    out, pencils, capacity = _run(parts, None, width, box=snap.box_size)
    _check(out, pencils, capacity, np.asarray(parts.pos), width, box=snap.box_size)


def test_overflow_is_reported_with_a_value_that_fits(flat):
    mesh = make_mesh((2, 4))
    x = jax.device_put(flat, NamedSharding(mesh, P(("x", "y"))))
    out, _, _ = _run(x, mesh, 0.5, jh.DomainConfig(transfer_factor=0.05))
    status = out[-1]
    assert not bool(status.ok)
    with pytest.raises(jh.CapacityError, match=r"transfer_factor=([0-9.]+)") as info:
        status.check()
    value = float(info.value.args[0].split("transfer_factor=")[1].rstrip(").").split(")")[0])
    out, pencils, capacity = _run(x, mesh, 0.5, jh.DomainConfig(transfer_factor=value))
    _check(out, pencils, capacity, flat, 0.5)


def test_sort_rows_is_a_stable_argsort():
    """The packed single-key sort equals numpy's stable argsort, with duplicates, negative
    keys and the int32 extremes, inside jit and with x64 off."""
    from jaxpm_halos.core.cells import sort_rows

    rng = np.random.default_rng(1)
    key = rng.integers(-50, 50, 5000).astype(np.int32)
    key[:7] = [np.iinfo(np.int32).max, np.iinfo(np.int32).min, 0, -1, 0, 49, -50]
    sorted_key, order = jax.jit(sort_rows)(jnp.asarray(key))
    assert sorted_key.dtype == jnp.int32 and order.dtype == jnp.int32
    want = np.argsort(key, kind="stable")
    np.testing.assert_array_equal(np.asarray(order), want)
    np.testing.assert_array_equal(np.asarray(sorted_key), key[want])


def test_sources_inverts_a_scatter_to_distinct_slots():
    """``sources`` (every migration's index) against numpy: targets out of range (the int32
    extremes, ``rows`` itself) are dropped, empty slots hold ``len(target)``, and an empty
    input gives empty slots; ``selection`` keeps the marked rows in order."""
    from jaxpm_halos.core.rows import selection, sources

    rng = np.random.default_rng(2)
    rows = 900
    target = rng.permutation(2 * rows)[:700].astype(np.int32)  # distinct, half beyond rows
    target[:3] = [np.iinfo(np.int32).min, np.iinfo(np.int32).max, rows]
    want = np.full(rows, target.size, np.int32)
    keep = (target >= 0) & (target < rows)
    want[target[keep]] = np.nonzero(keep)[0]
    got = jax.jit(sources, static_argnums=1)(jnp.asarray(target), rows)
    np.testing.assert_array_equal(np.asarray(got), want)
    empty = jax.jit(sources, static_argnums=1)(jnp.zeros((0,), jnp.int32), 5)
    np.testing.assert_array_equal(np.asarray(empty), np.zeros(5, np.int32))
    mask = rng.random(3000) < 0.2
    picked, count = jax.jit(selection, static_argnums=1)(jnp.asarray(mask), 800)
    marked = np.nonzero(mask)[0]
    assert int(count) == marked.size
    np.testing.assert_array_equal(np.asarray(picked)[: marked.size], marked)
    assert np.all(np.asarray(picked)[marked.size :] == mask.size)
