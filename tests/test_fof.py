"""FoF: exact against scipy on adversarial layouts, on every mesh; catalogue against numpy."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import CI_MESHES, make_mesh, mesh_id, mesh_params
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from scipy.spatial import cKDTree

import jaxpm_halos as jh
from jaxpm_halos.core.geometry import periodic_distance2
from jaxpm_halos.testing import reference as ref

BOX = 16.0
N = 4096
L_LINK = 0.2 * BOX / N ** (1 / 3)
MIN_MEMBERS = 10
# Clumps sit on every pencil face and on z = 0 on purpose, far above the clustering margin of the
# automatic ghost buffers.
FACES = jh.FoFConfig(domain=jh.DomainConfig(ghost_factor=1.0, image_factor=1.0))


def _adversarial(seed=0):
    """Clumps on box corners, faces and pencil edges/corners of every test mesh, exact
    duplicates, coordinates equal to 0 and L, over a uniform background."""
    rng = np.random.default_rng(seed)
    edges = [0.0, BOX / 8, BOX / 4, BOX / 2, 3 * BOX / 4]
    centres = [[x, y, z] for x in edges[::2] for y in edges for z in (0.0, BOX / 2)][:30]
    centres += [[BOX, BOX, BOX], [BOX / 2, 0.0, BOX - 0.01]]
    clumps = [np.asarray(c) + rng.normal(0, 0.15, (40, 3)) for c in centres]
    background = rng.uniform(0, BOX, (N - 40 * len(centres) - 40, 3))
    special = np.zeros((40, 3))
    special[:8] = 0.0
    special[8:16] = BOX
    special[16:24] = [BOX, 0.0, BOX / 2]
    special[24:32] = background[0]
    special[32:40] = rng.uniform(0, BOX, (8, 3))
    pos = np.concatenate(clumps + [background, special]).astype(np.float32)
    vel = rng.normal(3, 1, pos.shape).astype(np.float32)
    mass = rng.uniform(0.5, 2, len(pos)).astype(np.float32)
    return pos, vel, mass


def _tie_free(make, link):
    """First dataset from ``make(seed)`` with no pair distance ambiguously close to ``link``."""
    for seed in range(20):
        data = make(seed)
        if ref.unambiguous_linking_length(data[0], BOX, link) == link:
            return data
    raise RuntimeError("no tie-free dataset")


@pytest.fixture(scope="module")
def adversarial():
    pos, vel, mass = _tie_free(_adversarial, L_LINK)
    labels = ref.fof_labels(pos, BOX, L_LINK)
    return pos, vel, mass, labels, ref.catalogue(pos, BOX, labels, MIN_MEMBERS, vel, mass)


def _shard(mesh, *arrays):
    if mesh is None:
        return arrays
    sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    return tuple(jax.device_put(a, sharding) for a in arrays)


def _assert_catalogue(got, want):
    np.testing.assert_array_equal(got["id"], want["id"])
    np.testing.assert_array_equal(got["count"], want["count"])
    np.testing.assert_allclose(got["mass"], want["mass"], rtol=2e-6)
    assert np.abs(ref.periodic_difference(got["pos"], want["pos"], BOX)).max() < 1e-4 * BOX
    np.testing.assert_allclose(got["vel"], want["vel"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["vel_disp"], want["vel_disp"], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got["radius"], want["radius"], rtol=1e-4, atol=1e-5)


_RESULTS = {}


@pytest.mark.optimised
@pytest.mark.newest
def test_labels_and_catalogue_match_scipy(adversarial, mesh):
    pos, vel, mass, want_labels, want_cat = adversarial
    assert len(want_cat["id"]) >= 20 and np.bincount(want_labels).max() >= 40
    p, v, m = _shard(mesh, pos, vel, mass)
    labels, cat = jh.fof(p, BOX, L_LINK, vel=v, mass=m, min_members=MIN_MEMBERS, config=FACES)
    if mesh.size > 1:
        assert labels.sharding.is_equivalent_to(p.sharding, 1)
    np.testing.assert_array_equal(np.asarray(labels), want_labels)
    got = cat.to_numpy()
    _assert_catalogue(got, want_cat)
    assert cat.id.shape[0] == mesh.size * jh.FoFConfig().halo_rows(N // mesh.size)
    padding = np.asarray(cat.id) < 0
    assert np.all(np.asarray(cat.count)[padding] == 0)
    _RESULTS[tuple(mesh.shape.values())] = got


@pytest.mark.optimised
@pytest.mark.newest
def test_unsharded_numpy_input_and_mesh_invariance(adversarial):
    pos, vel, mass, want_labels, want_cat = adversarial
    labels, cat = jh.fof(
        pos, BOX, L_LINK, vel=vel, mass=mass, min_members=MIN_MEMBERS, config=FACES
    )
    np.testing.assert_array_equal(np.asarray(labels), want_labels)
    got = cat.to_numpy()
    _assert_catalogue(got, want_cat)
    if not _RESULTS:  # run alone (e.g. -k): one mesh to compare with
        p, v, m = _shard(make_mesh((2, 4)), pos, vel, mass)
        _, other = jh.fof(p, BOX, L_LINK, vel=v, mass=m, min_members=MIN_MEMBERS, config=FACES)
        _RESULTS[(2, 4)] = other.to_numpy()
    for shape, other in _RESULTS.items():
        np.testing.assert_array_equal(other["id"], got["id"], err_msg=str(shape))
        np.testing.assert_array_equal(other["count"], got["count"], err_msg=str(shape))
        np.testing.assert_allclose(other["pos"], got["pos"], atol=1e-5 * BOX, err_msg=str(shape))


def _poisson_near_percolation(seed):
    rng = np.random.default_rng(100 + seed)
    return (rng.uniform(0, BOX, (N, 3)).astype(np.float32),)


@pytest.mark.leg1
@pytest.mark.parametrize("shape", [(1, 8), (8, 1), (2, 4), (4, 2)])
def test_percolating_group_spans_all_domains(shape):
    link = 0.9 * BOX / N ** (1 / 3)
    (pos,) = _tie_free(_poisson_near_percolation, link)
    want = ref.fof_labels(pos, BOX, link)
    sizes = np.bincount(want)
    assert sizes.max() > N / 3, "the test needs a box-spanning group"
    mesh = make_mesh(shape)
    (p,) = _shard(mesh, pos)
    labels, _ = jh.fof(p, BOX, link, min_members=MIN_MEMBERS, config=FACES)
    np.testing.assert_array_equal(np.asarray(labels), want)


@pytest.mark.newest
def test_jit_takes_mesh_from_traced_input(adversarial):
    pos, _, _, want_labels, _ = adversarial
    mesh = make_mesh((2, 4))
    (p,) = _shard(mesh, pos)
    labels, cat = jax.jit(lambda x: jh.fof(x, BOX, L_LINK, min_members=MIN_MEMBERS, config=FACES))(
        p
    )
    np.testing.assert_array_equal(np.asarray(labels), want_labels)
    assert bool(cat.status.ok)


@pytest.mark.leg1
def test_centre_of_mass_and_velocity_gradients_match_finite_differences():
    rng = np.random.default_rng(3)
    box, n = 8.0, 1024
    centres = rng.uniform(1, box - 1, (4, 3))
    centres[0] = [box / 2, box / 2, 0.05]
    pts = [rng.uniform(0, box, (n // 2, 3))] + [
        c + rng.normal(0, 0.1, (n // 8, 3)) for c in centres
    ]
    pos = np.mod(np.concatenate(pts)[:n], box).astype(np.float32)
    vel = rng.normal(0, 1, (n, 3)).astype(np.float32)
    link = ref.unambiguous_linking_length(pos, box, 0.2 * box / n ** (1 / 3))
    mesh = make_mesh((2, 4))
    p0, v0 = _shard(mesh, pos, vel)
    # One weight per halo id: a halo keeps its id when a step moves its row to another device.
    weights = jnp.asarray(rng.normal(size=(n, 3)).astype(np.float32))
    # Half the particles sit in four clumps: the default buffers would overflow, and inside
    # jit nothing checks them. Checked once outside jit below.
    config = jh.FoFConfig(domain=jh.DomainConfig(capacity_factor=3.0, transfer_factor=2.0))
    jh.fof(p0, box, link, vel=v0, min_members=20, mesh=mesh, config=config)

    def objective(p, v):  # one term of the centres of mass, one of the mean velocities
        _, cat = jh.fof(p, box, link, vel=v, min_members=20, mesh=mesh, config=config)
        valid = (cat.id >= 0)[:, None]
        weight = weights[jnp.maximum(cat.id, 0)]
        return tuple(jnp.sum(jnp.where(valid, x * weight, 0)) for x in (cat.pos, cat.vel))

    # With membership fixed, the centres depend on p alone and the velocities on v alone:
    # the gradient of the sum is both (one program; a cross term would fail the checks).
    f = jax.jit(objective)
    grads = jax.jit(jax.grad(lambda p, v: sum(objective(p, v)), argnums=(0, 1)))(p0, v0)
    grad_p, grad_v = (np.asarray(g) for g in grads)
    labels = ref.fof_labels(pos, box, link)
    in_halo = np.nonzero(np.bincount(labels, minlength=n)[labels] >= 20)[0]
    assert len(in_halo) > 100
    outside = np.setdiff1d(np.arange(n), in_halo)
    assert np.all(grad_p[outside] == 0) and np.all(grad_v[outside] == 0)
    checked = 0
    for i in in_halo[::80]:
        for d in range(3):
            step = np.zeros_like(pos)
            step[i, d] = 0.1
            fdv = (f(p0, *_shard(mesh, vel + step))[1] - f(p0, *_shard(mesh, vel - step))[1]) / 0.2
            np.testing.assert_allclose(grad_v[i, d], fdv, rtol=0.02, atol=2e-4)
            step[i, d] = 1e-2
            if not (
                np.array_equal(ref.fof_labels(pos + step, box, link), labels)
                and np.array_equal(ref.fof_labels(pos - step, box, link), labels)
            ):
                continue  # the step changed membership
            fd = (f(*_shard(mesh, pos + step), v0)[0] - f(*_shard(mesh, pos - step), v0)[0]) / 2e-2
            np.testing.assert_allclose(grad_p[i, d], fd, rtol=0.05, atol=5e-4)
            checked += 1
    assert checked >= 5

    # Second order: jax.hessian (forward mode over the reverse pass) used to fail in the
    # linking's binary searches. Membership held fixed, a centre of mass moves by the mean
    # of its members' moves, so along p0 + c t the second derivative at c = 0 of
    # sum_h (w_h . pos_h)^2 is 2 sum_h (w_h . mean of t over h's members)^2.
    t = rng.normal(size=pos.shape).astype(np.float32)
    (t_sharded,) = _shard(mesh, t)

    def squares(c):
        _, cat = jh.fof(p0 + c * t_sharded, box, link, min_members=20, mesh=mesh, config=config)
        valid = (cat.id >= 0)[:, None]
        dots = jnp.sum(jnp.where(valid, cat.pos * weights[jnp.maximum(cat.id, 0)], 0), axis=1)
        return jnp.sum(dots**2)

    want = 0.0
    for h in np.unique(labels[in_halo]):
        members = labels == h
        want += (
            2
            * float(
                np.dot(np.asarray(weights)[np.nonzero(members)[0].min()], t[members].mean(axis=0))
            )
            ** 2
        )
    np.testing.assert_allclose(float(jax.jit(jax.hessian(squares))(0.0)), want, rtol=1e-4)


@pytest.mark.leg1
@pytest.mark.parametrize(
    "knob",
    ["capacity_factor"]
    + [
        pytest.param(knob, marks=pytest.mark.slow)
        for knob in ("ghost_factor", "image_factor", "transfer_factor", "max_halos")
    ],
)
def test_overflow_raises_with_a_value_that_then_works(adversarial, knob):
    pos, _, _, want_labels, _ = adversarial
    mesh = make_mesh((2, 4))
    (p,) = _shard(mesh, pos)
    tiny = {
        "transfer_factor": 0.01,
        "capacity_factor": 0.5,
        "ghost_factor": 0.001,
        "image_factor": 0.001,
        "max_halos": 2,
    }
    field = "max_halos" if knob == "max_halos" else knob

    def config_with(value):
        if knob == "max_halos":
            return dataclasses.replace(FACES, max_halos=value)
        return dataclasses.replace(FACES, domain=dataclasses.replace(FACES.domain, **{knob: value}))

    config = config_with(tiny[knob])
    with pytest.raises(jh.CapacityError, match=field) as info:
        jh.fof(p, BOX, L_LINK, min_members=MIN_MEMBERS, config=config, grow=False)
    assert info.value.failure.kind is jh.FailureKind.OVERFLOW
    assert str(info.value.failure.limit.knob).endswith(field)
    value = re.search(rf"{field}=([0-9.]+)", str(info.value)).group(1)
    value = int(value) if knob == "max_halos" else float(value)
    labels, cat = jh.fof(
        p, BOX, L_LINK, min_members=MIN_MEMBERS, config=config_with(value), grow=False
    )
    np.testing.assert_array_equal(np.asarray(labels), want_labels)
    # By default the call grows the buffer itself and warns once, naming a config that fits.
    with pytest.warns(jh.GrowthWarning, match=field) as warned:
        labels, cat = jh.fof(p, BOX, L_LINK, min_members=MIN_MEMBERS, config=config)
    assert len(warned) == 1
    np.testing.assert_array_equal(np.asarray(labels), want_labels)
    assert bool(cat.status.ok)


@pytest.mark.slow
def test_suggestions_applied_as_written_keep_earlier_fixes(adversarial):
    """Several knobs too small at once: each error's suggestion is the whole config with the
    overflowing knob fixed, so pasting it as written converges (it used to name the knob
    alone, and a config rebuilt from that lost the previous fix). The decomposition's
    particle buffers that overflowed together grow in one suggestion; the halo count,
    measured on cut groups, waits for its own."""
    pos, _, _, want_labels, _ = adversarial
    (p,) = _shard(make_mesh((2, 4)), pos)
    config = jh.FoFConfig(
        max_halos=2, domain=jh.DomainConfig(ghost_factor=0.001, image_factor=0.001)
    )
    fixed, messages = [], []
    for _ in range(4):
        try:
            labels, _ = jh.fof(p, BOX, L_LINK, min_members=MIN_MEMBERS, config=config, grow=False)
            break
        except jh.CapacityError as error:
            setting = re.search(r"Rerun with config=(FoFConfig\(.*?\))\.(?: |$)", str(error))
            assert setting, str(error)
            fixed.append(re.search(r"but (\w+\.\w+) gives", str(error)).group(1))
            messages.append(str(error))
            config = eval(
                setting.group(1), {"FoFConfig": jh.FoFConfig, "DomainConfig": jh.DomainConfig}
            )
    else:
        pytest.fail(f"still overflowing after fixing {fixed}")
    # The first suggestion grew the z images too, to what they needed on cut ghosts.
    assert "also grows 'z images'" in messages[0] and "image_factor=0.001" not in messages[0]
    assert fixed == [
        "DomainConfig.ghost_factor",
        "DomainConfig.image_factor",
        "FoFConfig.max_halos",
    ]
    np.testing.assert_array_equal(np.asarray(labels), want_labels)


@pytest.mark.leg1
def test_one_suggestion_fits_a_clump_that_overflows_transfer_and_capacity():
    """Every particle in one clump: the rows sent to its device overflow the transfer
    buffer, and the rows it holds its capacity. Both are particle counts (the cut transfer
    can only lower the capacity's need), so one suggestion grows both and fits."""
    rng = np.random.default_rng(0)
    pos = ((np.array([1.0, 0.5, 2.0]) + rng.normal(0, 0.15, (N, 3))) % BOX).astype(np.float32)
    (p,) = _shard(make_mesh((2, 4)), pos)
    with pytest.raises(jh.CapacityError, match="also grows 'capacity'") as info:
        jh.fof(p, BOX, L_LINK, min_members=MIN_MEMBERS, grow=False)
    assert info.value.failure.buffer == "transfer"
    labels, cat = jh.fof(
        p,
        BOX,
        L_LINK,
        min_members=MIN_MEMBERS,
        config=info.value.failure.grown(jh.FoFConfig()),
        grow=False,
    )
    np.testing.assert_array_equal(np.asarray(labels), ref.fof_labels(pos, BOX, L_LINK))


def test_inside_jit_the_overflow_is_a_flag_and_to_numpy_refuses_it(adversarial):
    """to_numpy of a catalogue whose status failed raised nothing: the halo rows that did
    not fit were silently missing. It raises the status's error, as gather_catalogue does."""
    pos, _, _, _, _ = adversarial
    mesh = make_mesh((2, 4))
    (p,) = _shard(mesh, pos)
    config = jh.FoFConfig(max_halos=2)
    _, cat = jax.jit(lambda x: jh.fof(x, BOX, L_LINK, min_members=MIN_MEMBERS, config=config))(p)
    assert not bool(cat.status.ok)
    assert int(cat.status.needed["halos"]) > 2
    with pytest.raises(
        jh.CapacityError, match=r"status failed: jaxpm_halos: buffer 'halos' overflowed"
    ) as error:
        cat.to_numpy()
    assert error.value.failure.limit.knob.field == "max_halos"
    assert len(cat.to_numpy(throw=False)["id"]) <= 2 * 8  # truncated, asked for


@pytest.mark.leg1
def test_non_finite_positions_are_reported_and_excluded(adversarial):
    pos, _, _, _, _ = adversarial
    bad = pos.copy()
    bad[7] = np.nan
    bad[9, 1] = np.inf
    with pytest.raises(jh.InvalidInputError, match="2 particle positions"):
        jh.fof(bad, BOX, L_LINK, min_members=MIN_MEMBERS)
    labels, cat = jax.jit(lambda x: jh.fof(x, BOX, L_LINK, min_members=MIN_MEMBERS))(bad)
    assert int(cat.status.nonfinite) == 2
    keep = np.ones(N, bool)
    keep[[7, 9]] = False
    want = ref.fof_labels(pos[keep], BOX, L_LINK)
    got = np.asarray(labels)[keep]
    # Labels are input indices: map the reference's compacted indices back.
    np.testing.assert_array_equal(got, np.nonzero(keep)[0][want])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(linking_length=0.0), "positive"),
        (dict(linking_length=-1.0), "positive"),
        (dict(linking_length=0.2, min_members=0), "min_members"),
        (dict(linking_length=0.2, b=0.2), "exactly one"),
        (
            dict(linking_length=3.0, mesh_shape=(1, 8)),
            r"wider than a pencil \(2.0\) of the \(1, 8\) mesh; use a linking length <= 1.9999 ",
        ),
        # The box's own limit is named first, where fewer devices cannot help.
        (
            dict(linking_length=BOX / 2, mesh_shape=(1, 1)),
            r"must be below a third of the box 16.0: use a linking length < 16 / 3$",
        ),
        (
            dict(linking_length=BOX / 2, mesh_shape=(1, 8)),  # with a length that fits both
            r"must be below a third of the box 16.0: use a linking length <= 1.9999$",
        ),
        # A domain nested in the SO or kNN settings (pasted from their own calls' messages) is
        # refused, not ignored: config.domain sizes fof's one decomposition.
        (
            dict(
                linking_length=0.2,
                config=jh.FoFConfig(so=jh.SOConfig(domain=jh.DomainConfig(ghost_factor=2.0))),
            ),
            r"pass config=FoFConfig\(domain=DomainConfig\(ghost_factor=2.0\), ...\) instead of so=",
        ),
        (
            dict(
                linking_length=0.2,
                centre="peak",
                config=jh.FoFConfig(knn=jh.KNNConfig(domain=jh.DomainConfig(capacity_factor=3.0))),
            ),
            r"instead of knn=\.\.\.\(domain=",
        ),
    ],
)
def test_bad_arguments_raise(adversarial, kwargs, message):
    pos = adversarial[0]
    mesh_shape = kwargs.pop("mesh_shape", None)
    mesh = make_mesh(mesh_shape) if mesh_shape else None
    with pytest.raises(ValueError, match=message):
        jh.fof(pos, BOX, mesh=mesh, **kwargs)


@pytest.mark.parametrize("shape", mesh_params([(2, 4), (1, 1)], ci=CI_MESHES), ids=mesh_id)
def test_velocity_dispersion_of_a_fast_cold_group(shape):
    """Velocity moments taken about zero cancelled: a group moving at 1e4 with a
    dispersion of 3 came back with 5.66 instead of 3.12 (|v| sqrt(eps) of error). They are
    taken about a member's velocity now. The group sits on a pencil corner of (2, 4), so
    partial rows from four devices are pooled."""
    rng = np.random.default_rng(7)
    centre = np.array([BOX / 2, BOX / 4, 3.0])
    pos = np.concatenate(
        [centre + rng.normal(0, 0.05, (40, 3)), rng.uniform(0, BOX, (88, 3))]
    ).astype(np.float32)
    vel = np.concatenate(
        [np.array([1e4, -7e3, 2e3]) + rng.normal(0, 3.0, (40, 3)), rng.normal(0, 300.0, (88, 3))]
    ).astype(np.float32)
    mass = rng.uniform(0.5, 2.0, 128).astype(np.float32)
    x, v, m = _shard(make_mesh(shape), pos, vel, mass)
    _, cat = jh.fof(x, BOX, 0.3, vel=v, mass=m, min_members=20)
    got = cat.to_numpy()
    np.testing.assert_array_equal(got["count"], [40])
    v, m = vel[:40].astype(np.float64), mass[:40].astype(np.float64)
    mean = (m[:, None] * v).sum(0) / m.sum()
    dispersion = np.sqrt((m * ((v - mean) ** 2).sum(1)).sum() / m.sum() / 3)
    np.testing.assert_allclose(got["vel"][0], mean, rtol=1e-6)
    np.testing.assert_allclose(got["vel_disp"][0], dispersion, rtol=1e-5)


@pytest.mark.leg1
@pytest.mark.parametrize("shape", [(2, 4), pytest.param((8, 1), marks=pytest.mark.slow)])
def test_particle_count_not_divisible_by_the_devices(adversarial, shape):
    """N = 4093 on 8 devices: padded to 4096 inside, the padding takes no part (labels,
    catalogue, the mean separation behind ``b``)."""
    pos, vel, mass = (a[: N - 3] for a in adversarial[:3])
    want_labels = ref.fof_labels(pos, BOX, L_LINK)
    labels, cat = jh.fof(
        pos,
        BOX,
        L_LINK,
        vel=vel,
        mass=mass,
        min_members=MIN_MEMBERS,
        mesh=make_mesh(shape),
        config=FACES,
    )
    assert labels.shape == (N - 3,)
    np.testing.assert_array_equal(np.asarray(labels), want_labels)
    _assert_catalogue(cat.to_numpy(), ref.catalogue(pos, BOX, want_labels, MIN_MEMBERS, vel, mass))
    b_link = 0.2 * (BOX / (N - 3) ** (1 / 3))  # b times the mean separation of 4093
    assert ref.unambiguous_linking_length(pos, BOX, b_link) == b_link
    by_b, _ = jh.fof(pos, BOX, b=0.2, min_members=MIN_MEMBERS, mesh=make_mesh(shape), config=FACES)
    np.testing.assert_array_equal(np.asarray(by_b), ref.fof_labels(pos, BOX, b_link))


# A linking length tiny against the box (a units slip: kpc positions, Mpc linking length)
# makes x-y columns outnumber the particles by many orders of magnitude.
TINY_LINK_CASES = [(100.0, 0.002), (1e6, 2.5)]


def _clumps_at_tiny_link(seed, box, link):
    """N points: clumps of 40 (sigma 0.4 l) on box and pencil faces, edges and corners of the
    test meshes, a chain spaced 0.9 l across the x = L/2 face, exact duplicates, uniform
    background."""
    rng = np.random.default_rng(seed)
    edges = [0.0, box / 8, box / 4, box / 2, 3 * box / 4]
    centres = [[x, y, z] for x in edges[::2] for y in edges for z in (0.0, box / 2)][:30]
    clumps = [np.asarray(c) + rng.normal(0, 0.4 * link, (40, 3)) for c in centres]
    chain = np.asarray([box / 2, box / 3, box / 5]) + np.outer(
        np.arange(-20, 20) * 0.9 * link, [1.0, 0.0, 0.0]
    )
    background = rng.uniform(0, box, (N - 40 * len(centres) - len(chain) - 16, 3))
    duplicates = np.repeat(background[:8], 2, axis=0)
    pos = np.mod(np.concatenate(clumps + [chain, background, duplicates]), box)
    return (np.where(pos >= box, 0.0, pos).astype(np.float32),)


@pytest.mark.parametrize("box, link", TINY_LINK_CASES)
@pytest.mark.leg1
def test_memory_follows_particles_not_box_over_linking_length(box, link):
    """Compiled only: 4,096 points with l / L = 2e-5 or 2.5e-6 need temporaries of the order
    of N, as with l / L = 1e-2. A histogram over every x-y column took 2.6 GB and 7.3 GB."""
    (p,) = _shard(make_mesh((2, 4)), *_clumps_at_tiny_link(0, box, link))
    compiled = jax.jit(lambda x: jh.fof(x, box, link, min_members=2)).lower(p).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < 1000 * N, f"{temp / N:.0f} bytes of temporaries per particle"


@pytest.mark.leg1
@pytest.mark.parametrize("shape, case", [((2, 4), 1), ((8, 1), 0)])
def test_labels_match_scipy_at_tiny_linking_length(shape, case):
    box, link = TINY_LINK_CASES[case]
    pos = next(
        pos
        for (pos,) in (_clumps_at_tiny_link(seed, box, link) for seed in range(20))
        if ref.unambiguous_linking_length(pos, box, link) == link
    )
    want = ref.fof_labels(pos, box, link)
    assert np.bincount(want).max() >= 40 and len(np.unique(want)) < N - 500
    (p,) = _shard(make_mesh(shape), pos)
    labels, cat = jh.fof(p, box, link, min_members=20, config=FACES)
    np.testing.assert_array_equal(np.asarray(labels), want)
    got, expected = cat.to_numpy(), ref.catalogue(pos, box, want, 20)
    np.testing.assert_array_equal(got["id"], expected["id"])
    np.testing.assert_array_equal(got["count"], expected["count"])


# Two pairs of a 256^3 JaxPM z = 0 snapshot (box 256 Mpc/h, l = 0.2 Mpc/h), found on a GPU
# run whose labels differed from scipy's for one particle of 16.7M when FoF decided every
# pair in float32 (found on the H200's 256^3 snapshot): in float64 they lie 1.8e-8 and
# 1.9e-8 (relative) beyond l, and their float32 squared distance rounds to float32(l^2).
KNIFE_EDGE_PAIRS = np.array(
    [
        [101.22163391113281, 65.6764907836914, 172.69638061523438],
        [101.14173889160156, 65.52056121826172, 172.79283142089844],
        [156.8112335205078, 116.94847869873047, 229.57008361816406],
        [156.73838806152344, 117.01930236816406, 229.7423553466797],
    ],
    np.float32,
)


def _pairs_at_the_linking_length(box, link, pairs, seed=0):
    """The knife-edge pairs above and ``pairs`` random float32 pairs whose float64 distance
    is within 2e-7 (relative) of ``link``, a third of them across the box's faces, the rest
    anywhere (pencil faces included): drawn at ``link`` and kept where float32 rounding of
    the positions left them that close."""
    rng = np.random.default_rng(seed)
    draws = 1000 * pairs
    first = rng.uniform(0, box, (draws, 3))
    first[: draws // 3, 0] = box - rng.uniform(0, link, draws // 3)
    direction = rng.normal(size=(draws, 3))
    direction /= np.linalg.norm(direction, axis=1, keepdims=True)
    direction[: draws // 3, 0] = np.abs(direction[: draws // 3, 0])
    pos = np.mod(np.stack([first, first + link * direction], 1), box).astype(np.float32)
    pos = np.where(pos >= box, np.float32(0), pos)  # (draws, 2, 3)
    d = pos[:, 0].astype(np.float64) - pos[:, 1]
    d -= box * np.round(d / box)
    close = np.abs(np.sqrt((d * d).sum(1)) / link - 1) < 2e-7
    keep = np.concatenate(
        [
            np.nonzero(close[: draws // 3])[0][: pairs // 3],
            np.nonzero(close[draws // 3 :])[0][: pairs - pairs // 3] + draws // 3,
        ]
    )
    return np.concatenate([KNIFE_EDGE_PAIRS, pos[keep].reshape(-1, 3)])


def test_labels_match_scipy_for_pairs_within_float32_rounding_of_the_linking_length(mesh):
    """Pairs whose float32 squared distance cannot tell them from l are decided exactly, as
    scipy decides them in float64 (docs/design.md, *Exactness*): without that, some of these link
    where scipy's do not, or the reverse. The same on every test mesh and one device."""
    box, link = 256.0, 0.2
    pos = _pairs_at_the_linking_length(box, link, 400)
    want = ref.fof_labels(pos, box, link)
    d2 = np.asarray(periodic_distance2(pos[0::2], pos[1::2], box))
    float32_links = d2 <= np.float32(link * link)
    assert np.sum(float32_links != (want[0::2] == want[1::2])) >= 3
    labels, cat = jh.fof(
        pos,
        box,
        link,
        min_members=2,
        mesh=mesh,
        config=jh.FoFConfig(domain=jh.DomainConfig(capacity_factor=3.0, ghost_factor=2.5)),
    )
    np.testing.assert_array_equal(np.asarray(labels), want)
    np.testing.assert_array_equal(
        cat.to_numpy()["count"], np.bincount(want)[np.bincount(want) >= 2]
    )


@pytest.mark.parametrize("pos", [np.zeros((10, 2), np.float32), np.zeros((4, 4, 3, 3), np.float32)])
def test_bad_shapes_raise(pos):
    with pytest.raises(ValueError, match="shape"):
        jh.fof(pos, BOX, 0.2)


def test_bad_box_and_mesh_raise(adversarial):
    pos = adversarial[0]
    with pytest.raises(ValueError, match="box_size"):
        jh.fof(pos, 0.0, 0.2)
    with pytest.raises(TypeError, match=r"box_size must be a Python number \(static\)"):
        jax.jit(lambda p, box: jh.fof(p, box_size=box, linking_length=0.2))(pos, BOX)
    with pytest.raises(ValueError, match="0 rows, and at least 1 particle is needed"):
        jh.fof(pos[:0], BOX, 0.2)  # it was an IndexError
    mesh3 = jax.make_mesh((2, 2, 2), ("a", "b", "c"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    with pytest.raises(ValueError, match="at most two mesh axes"):
        jh.fof(pos, BOX, 0.2, mesh=mesh3)
    grid = jax.device_put(
        np.zeros((8, 8, 8, 3), np.float32), NamedSharding(make_mesh((2, 4)), P(None, None, "x"))
    )
    with pytest.raises(ValueError, match="first two axes"):
        jh.fof(grid, BOX, 0.2)


def test_local_api_inside_user_shard_map(adversarial):
    pos, _, _, want_labels, want_cat = adversarial
    mesh = make_mesh((4, 2), names=("row", "col"))
    (p,) = _shard(mesh, pos)
    spec = P(("row", "col"))

    def program(config):
        def step(block):
            i = jax.lax.axis_index(("row", "col"))
            n = block.shape[0]
            parts = jh.Particles.create(block, BOX, id=i * n + jnp.arange(n))
            domain, labels, cat = jh.fof_local(
                parts, L_LINK, axes=("row", "col"), min_members=MIN_MEMBERS, config=config
            )
            return domain.id, labels, cat.id, cat.num[None], cat.status.ok[None]

        # shard_map's default check_vma=True: its loops used to be refused there.
        return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=spec, out_specs=(spec,) * 5))

    # Ghost buffers too small for clumps on every face: the flag must say so.
    small = jh.FoFConfig(domain=jh.DomainConfig(ghost_factor=0.05))
    assert not np.asarray(program(small)(p)[4]).any()
    ids, labels, cat_id, num, ok = map(np.asarray, program(FACES)(p))
    assert ok.all()
    valid = ids >= 0
    assert valid.sum() == N
    np.testing.assert_array_equal(labels[valid], want_labels[ids[valid]])
    rows = cat_id.reshape(8, -1)
    got = np.sort(np.concatenate([r[:k] for r, k in zip(rows, num)]))
    np.testing.assert_array_equal(got, want_cat["id"])
    # A linking length whose ghost layer is wider than a pencil (4 along "row") is refused.
    wide = jax.shard_map(
        lambda b: jh.fof_local(jh.Particles.create(b, BOX), BOX / 3.5, axes=("row", "col"))[1],
        mesh=mesh,
        in_specs=spec,
        out_specs=spec,
    )
    with pytest.raises(ValueError, match=r"wider than a pencil \(4.0\) of the \(4, 2\) mesh"):
        jax.eval_shape(wide, p)


@pytest.mark.leg1
@pytest.mark.parametrize(
    "shape", [(2, 4)] + [pytest.param(s, marks=pytest.mark.slow) for s in ((8, 1), (1, 1))]
)
def test_groups_reaching_half_the_box_are_flagged_percolating(shape):
    """A chain spanning the whole box along x and a diagonal chain reaching 0.6 L along y
    percolate or reach past L / 2; a chain of 0.4 L and compact clumps do not. The flag is
    computed from pieces on several devices, so every mesh must agree."""
    box, link = 16.0, 0.5
    step = 0.9 * link
    along = lambda start, length, axis: (
        np.asarray(start) + np.outer(np.arange(int(length / step)) * step, np.eye(3)[axis])
    )
    chains = {
        "whole box": along([0.0, 3.1, 5.2], box, 0),  # wraps onto itself
        "0.6 L": along([7.3, 9.0, 11.1], 0.6 * box, 1),  # crosses the y seam
        "0.4 L": along([2.2, 13.3, 1.4], 0.4 * box, 2),
    }
    rng = np.random.default_rng(1)
    clumps = [c + rng.normal(0, 0.1, (30, 3)) for c in ([12.0, 12.0, 8.0], [4.0, 0.0, 15.9])]
    pos = np.mod(np.concatenate(list(chains.values()) + clumps), box).astype(np.float32)
    mesh = None if shape == (1, 1) else make_mesh(shape)
    labels, cat = jh.fof(pos, box, link, min_members=10, mesh=mesh)
    table = cat.to_numpy()
    flag = dict(zip(table["id"].tolist(), table["percolates"].tolist()))
    np.testing.assert_array_equal(np.asarray(labels), ref.fof_labels(pos, box, link))
    start = 0
    for name, chain in chains.items():
        assert flag[start] == (name != "0.4 L"), name
        start += len(chain)
    assert [flag[start], flag[start + 30]] == [False, False]


@pytest.mark.leg1
def test_error_if_inside_jit_raises_on_every_mesh_device_and_the_process_survives():
    """Status.raise_if_failed() inside jit on 8 devices used to kill the process (a
    callback failing on device 0 while the others waited in an all-to-all). The check now
    runs on every device after the data it guards: a clean error, and the next call works."""
    rng = np.random.default_rng(0)
    pos = (
        np.concatenate([rng.normal([50, 25, 50], 0.3, (2048, 3)), rng.uniform(0, 100, (2048, 3))])
        % 100
    ).astype(np.float32)
    (p,) = _shard(make_mesh((2, 4)), pos)

    def labels_checked(p, config, threaded):
        labels, cat = jh.fof(p, 100.0, 2.5, min_members=2, config=config)
        if threaded:
            return cat.status.error_if(labels, config)
        cat.status.raise_if_failed()
        return labels

    run = jax.jit(labels_checked, static_argnums=(1, 2))
    mine = jh.FoFConfig(max_halos=64)
    # With the config it ran with, the suggestion is that config, pasteable; without, the knob's.
    with pytest.raises(
        Exception,
        match=r"buffer 'ghosts' overflowed.* Rerun with "
        r"config=FoFConfig\(max_halos=64, domain=DomainConfig\(ghost_factor=",
    ):
        jax.block_until_ready(run(p, mine, True))
    with pytest.raises(
        Exception,
        match=r"buffer 'ghosts' overflowed.* Rerun with "
        r"DomainConfig\(ghost_factor=",
    ):
        jax.block_until_ready(run(p, mine, False))
    fits = jh.FoFConfig(domain=jh.DomainConfig(ghost_factor=2.5))
    np.testing.assert_array_equal(np.asarray(run(p, fits, True)), ref.fof_labels(pos, 100.0, 2.5))


def test_compiler_options_are_a_fresh_dict_the_jaxlib_knows():
    """``jaxpm_halos.compiler_options()`` is XLA's memory-minimising scheduler on CPU, a
    fresh dict per call."""
    from jaxpm_halos.core.pipeline import _compiler_options

    # The jaxlib knows the option: the fallback (None) is not taken silently.
    options = jh.compiler_options()
    assert options == {"xla_cpu_enable_concurrency_optimized_scheduler": False}
    assert _compiler_options("gpu") is None
    options["changed"] = True
    assert "changed" not in jh.compiler_options()


@pytest.mark.optimised
@pytest.mark.leg1
def test_compiler_options_for_a_users_jit_give_the_same_bits():
    """In a user's own jit, ``compiler_options()`` changes the schedule, not the results."""
    pos = np.random.default_rng(3).uniform(0, 8.0, (512, 3)).astype(np.float32)
    step = lambda p: (jh.knn_density(p, 8.0, 8), jh.fof(p, 8.0, 0.5, min_members=2)[0])
    plain = jax.jit(step)(pos)
    tuned = jax.jit(step, compiler_options=jh.compiler_options())(pos)
    for a, b in zip(plain, tuned):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_pair_chunks_visit_every_pair_once_however_many_spans():
    """``for_each_pair_chunk`` with a span cap far below the total visits each ``(i, j)``
    of every row's ranges exactly once, as a device whose pairs pass int32 must."""
    from jaxpm_halos.core.cells import for_each_pair_chunk, saturating_cumsum

    rows, chunk = 60, 16
    cuts = np.sort(np.random.default_rng(0).integers(0, rows + 1, (rows, 6)), axis=1)
    starts, ends = cuts[:, 0::2], cuts[:, 1::2]  # (R, 3) disjoint ranges, some empty
    want = np.zeros((rows, rows), np.int32)
    for i in range(rows):
        for s, e in zip(starts[i], ends[i]):
            want[i, s:e] += 1
    assert want.sum() > 10 * rows

    def body(seen, i, j, live):
        return seen.at[i, j].add(live.astype(jnp.int32))

    for cap in (rows, 7 * rows, None):
        got = jax.jit(
            lambda a, b: for_each_pair_chunk(
                a, b, chunk, body, jnp.zeros((rows, rows), jnp.int32), cap
            )
        )(starts, ends)
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"cap {cap}")

    values = np.full(6, 2**29, np.int32)  # their running sum passes 2**31 at the fourth
    assert np.asarray(jnp.cumsum(values))[3] < 0  # what a plain int32 sum does
    np.testing.assert_array_equal(
        np.asarray(saturating_cumsum(values, 2**30 - 2)),
        [2**29, 2**30 - 1, 2**30 - 1, 2**30 - 1, 2**30 - 1, 2**30 - 1],
    )


@pytest.mark.slow
def test_labels_match_scipy_when_a_devices_pairs_take_many_spans(monkeypatch):
    """A dense clump with many times a (lowered) span cap of candidate pairs, as a device
    past int32 has: the labels are still scipy's."""
    from jaxpm_halos.core import cells as _cells

    cap = 10_000
    monkeypatch.setattr(_cells, "PAIR_COUNT_CAP", cap)
    # A lattice clump (spacing 0.06, 133 friends each) keeps pair distances off the link.
    lattice = 0.06 * np.stack(np.meshgrid(*[np.arange(10)] * 3), -1).reshape(-1, 3)
    background = np.random.default_rng(3).uniform(0, BOX, (837, 3))  # N unique
    pos = np.concatenate([BOX / 2 + lattice, background]).astype(np.float32)
    link = ref.unambiguous_linking_length(pos, BOX, 0.194)
    linked = len(cKDTree(pos, boxsize=BOX).query_pairs(link))
    assert linked > 4 * cap  # every linked pair is a candidate once: at least 5 spans
    labels, _ = jh.fof(pos, BOX, link, min_members=10)
    np.testing.assert_array_equal(np.asarray(labels), ref.fof_labels(pos, BOX, link))
