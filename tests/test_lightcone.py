"""Light-cone halo catalogues against a brute-force reference, on real JaxPM catalogues."""

import numpy as np
import pytest
from conftest import make_mesh

import jaxpm_halos
from jaxpm_halos.lightcone.distances import Distances
from jaxpm_halos.testing.reference import lightcone_reference
from jaxpm_halos.units import cosmology_dict

pytestmark = pytest.mark.newest
NC, BOX, STEPS, OMEGA_M = 32, 32.0, 10, 0.2986


@pytest.fixture(scope="module")
def catalogues(jaxpm_history_32):
    """FoF catalogues (positions in Mpc/h, velocities in km/s) of three real snapshots."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    out = []
    for disp in jaxpm_history_32:
        disp = jax.device_put(disp, NamedSharding(make_mesh((2, 4)), P("x", "y")))
        particles = jaxpm_halos.from_jaxpm(disp, box_size=BOX)
        rng = np.random.default_rng(len(out))  # velocities of halo size, any direction
        vel = jax.device_put(rng.normal(0, 400, (NC,) * 3 + (3,)).astype(np.float32), disp.sharding)
        out.append(jaxpm_halos.fof(particles, b=0.2, min_members=10, vel=vel)[1].to_numpy())
    return out


@pytest.mark.parametrize(
    "observer", [(16.0, 16.0, 16.0), pytest.param((0.0, 3.5, 31.9), marks=pytest.mark.leg1)]
)
def test_lightcone_matches_brute_force(catalogues, observer):
    times = (0.95, 0.975, 1.0)  # shells at 0-38, 38-115 and 115-z_max Mpc/h
    cone = jaxpm_halos.lightcone(
        catalogues,
        times,
        observer=observer,
        z_max=0.06,
        cosmology={"Omega_m": OMEGA_M},
        box_size=BOX,
    )
    ref = lightcone_reference(catalogues, times, np.asarray(observer), 0.06, OMEGA_M, BOX)
    assert len(ref) > 500 and set(ref[:, 0]) == {0, 1, 2}
    got = np.stack([cone[k] for k in ("snapshot", "id", "chi", "ra", "dec", "z_cos", "z_obs")], 1)
    assert got.shape == ref.shape
    np.testing.assert_array_equal(got[:, :2], ref[:, :2])
    np.testing.assert_allclose(got[:, 2], ref[:, 2], rtol=1e-10)
    np.testing.assert_allclose(got[:, 3:5], ref[:, 3:5], atol=1e-7)
    np.testing.assert_allclose(got[:, 5:], ref[:, 5:], rtol=1e-7, atol=1e-9)
    # A whole number of boxes from the snapshot's position, up to the drift (< 0.1 Mpc/h)
    shift = cone["cone_pos"] + np.asarray(observer) - cone["pos"]
    np.testing.assert_allclose(shift, BOX * np.round(shift / BOX), atol=0.1)
    assert np.abs(shift - BOX * np.round(shift / BOX)).max() > 1e-3  # the drift is applied


def test_distances_match_jax_cosmo():
    jc = pytest.importorskip("jax_cosmo")
    cosmo = jc.Planck15(Omega_c=0.25, sigma8=0.8)
    a = np.array([1.0, 0.75, 0.5, 0.25])
    ours = Distances(cosmology_dict(cosmo), 0.2).of_a(a)
    # jax_cosmo integrates in float32 on a coarse table: 4e-4 off at a = 0.75 (ours is
    # exact to 1e-10 against scipy's quad, in test_lightcone_matches_brute_force)
    np.testing.assert_allclose(
        ours, np.asarray(jc.background.radial_comoving_distance(cosmo, a)), rtol=1e-3
    )
    np.testing.assert_allclose(Distances(cosmology_dict(cosmo), 0.2).a_of(ours), a, rtol=1e-9)


def test_lightcone_refuses_what_it_cannot_use(catalogues):
    args = dict(observer=(0, 0, 0), z_max=0.05, cosmology={"Omega_m": OMEGA_M}, box_size=BOX)
    with pytest.raises(ValueError, match="increasing"):
        jaxpm_halos.lightcone(catalogues, (1.0, 0.9, 0.8), **args)
    no_vel = [{k: v for k, v in c.items() if k != "vel"} for c in catalogues]
    with pytest.raises(ValueError, match="lacks pos or vel"):
        jaxpm_halos.lightcone(no_vel, (0.8, 0.9, 1.0), **args)
