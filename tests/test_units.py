"""Unit helpers, each against an independent computation.

The velocity conversion is checked two ways: against the linear-theory relation
v = a H(a) f(a) Psi with jax_cosmo's H and f on JaxPM's 1LPT output, and against central
finite differences of positions along real JaxPM trajectories, converted with
v = a dX/dt = a^2 H(a) dX/da.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import requires_jaxpm

from jaxpm_halos import units

pytestmark = pytest.mark.newest  # all of it in .ci/run's leg 2, less its leg1 parts

# CODATA 2018 G, IAU 2015 nominal solar mass parameter / G, IAU 2012 au -> parsec
G_SI = 6.67430e-11  # m^3 kg^-1 s^-2
MSUN_KG = 1.32712440041e20 / G_SI
MPC_M = 3.0856775814913673e22

OMEGA_C, SIGMA8 = 0.25, 0.8  # the cosmology of jaxpm_halos.simulation.run_simulation


def test_particle_mass_from_newton():
    h0 = 100e3 / MPC_M  # 100 km/s/Mpc in 1/s (h = 1: masses in Msun/h, lengths in Mpc/h)
    rho_crit = 3 * h0**2 / (8 * np.pi * G_SI) * MPC_M**3 / MSUN_KG  # Msun / Mpc^3
    assert rho_crit == pytest.approx(units.RHO_CRIT, rel=2e-4)
    for omega_m, box, nc in ((0.3, 64.0, 64), (0.3089, 128.0, 64), (0.25, 500.0, 256)):
        expected = omega_m * rho_crit * (box / nc) ** 3
        assert units.particle_mass(omega_m, box, nc) == pytest.approx(expected, rel=2e-4)
    # total mass = Omega_m rho_crit V, independent of nc
    assert units.particle_mass(0.3, 100.0, 50) * 50**3 == pytest.approx(0.3 * units.RHO_CRIT * 1e6)


def test_grid_to_mpc():
    x = np.array([0.0, 1.0, 16.5, -2.0])
    np.testing.assert_allclose(units.grid_to_mpc(x, 64.0, 32), [0.0, 2.0, 33.0, -4.0])
    y = jax.jit(units.grid_to_mpc, static_argnums=(1, 2))(jnp.asarray(x, jnp.float32), 64.0, 32)
    np.testing.assert_allclose(np.asarray(y), [0.0, 2.0, 33.0, -4.0])
    assert units.grid_to_mpc(3, 100.0, 50) == 6.0


def test_momentum_to_velocity_values():
    # v = 100 km/s * (L / nc) * p / a
    assert units.momentum_to_velocity(1.0, 1.0, 64.0, 64) == pytest.approx(100.0)
    assert units.momentum_to_velocity(2.0, 0.5, 128.0, 64) == pytest.approx(800.0)
    p = jnp.ones((2, 3))
    a = jnp.array([[0.5], [1.0]])
    np.testing.assert_allclose(
        np.asarray(units.momentum_to_velocity(p, a, 10.0, 10)),
        [[200.0] * 3, [100.0] * 3],
        rtol=1e-6,
    )


@functools.cache
def _initial_state(nc, box, a):
    """A single-device 1LPT state (disp, mom) from JaxPM at scale factor a."""
    import jax_cosmo as jc
    from jaxpm.kernels import interpolate_power_spectrum
    from jaxpm.pm import linear_field, lpt

    @jax.jit
    def make():
        k = jnp.logspace(-4, 1, 128)
        pk = jc.power.linear_matter_power(jc.Planck15(Omega_c=OMEGA_C, sigma8=SIGMA8), k)
        field = linear_field(
            (nc,) * 3,
            [box] * 3,
            lambda x: interpolate_power_spectrum(x, k, pk),
            seed=jax.random.PRNGKey(3),
        )
        dx, p, _ = lpt(jc.Planck15(Omega_c=OMEGA_C, sigma8=SIGMA8), field, a=a, order=1)
        return dx, p

    dx, p = make()
    return np.asarray(dx), np.asarray(p)


def _hubble(a):
    """H(a) in km/s per Mpc/h, from jax_cosmo."""
    import jax_cosmo as jc

    return 100.0 * float(
        jnp.sqrt(
            jc.background.Esqr(jc.Planck15(Omega_c=OMEGA_C, sigma8=SIGMA8), jnp.atleast_1d(a))
        )[0]
    )


# jax_cosmo's growth ODE asks for int64 indices, which jax truncates to int32
jax_cosmo_int64 = pytest.mark.filterwarnings("ignore:Explicitly requested dtype.*int64:UserWarning")


@jax_cosmo_int64
@requires_jaxpm
def test_velocity_linear_theory():
    """1LPT: v = a H(a) f(a) Psi, with Psi the displacement in Mpc/h."""
    import jax_cosmo as jc

    nc, box, a = 32, 64.0, 0.1
    disp, mom = _initial_state(nc, box, a)
    f = float(
        jc.background.growth_rate(jc.Planck15(Omega_c=OMEGA_C, sigma8=SIGMA8), jnp.atleast_1d(a))[0]
    )
    expected = a * _hubble(a) * f * units.grid_to_mpc(disp.astype(np.float64), box, nc)
    v = units.momentum_to_velocity(mom, a, box, nc)
    assert np.abs(expected).max() > 10  # km/s: a real signal
    np.testing.assert_allclose(v, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


@functools.cache
def _trajectory_fn(nc):
    """Integrate JaxPM's own ODE (one device) and save y at a0, a0 + da, a0 + 2 da."""
    import diffrax
    import jax_cosmo as jc
    from jaxpm.pm import make_diffrax_ode

    @jax.jit
    def run(y0, a0, da):
        ts = a0 + da * jnp.arange(3.0)
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(make_diffrax_ode((nc,) * 3, paint_absolute_pos=False)),
            diffrax.Tsit5(),
            t0=ts[0],
            t1=ts[-1],
            dt0=None,
            y0=y0,
            args=jc.Planck15(Omega_c=OMEGA_C, sigma8=SIGMA8),
            saveat=diffrax.SaveAt(ts=ts),
            stepsize_controller=diffrax.StepTo(ts=a0 + da * jnp.linspace(0.0, 2.0, 9)),
        )
        return sol.ys

    return run


@jax_cosmo_int64
@requires_jaxpm
@pytest.mark.parametrize("when", ["lpt_a0.1", "pm_z0"])
def test_velocity_finite_differences(when, jaxpm_snapshot_32):
    """Central differences of JaxPM positions between two nearby saved times."""
    if when == "pm_z0":  # the end of the distributed 32^3 PM run, continued on one device
        snap = jaxpm_snapshot_32
        nc, box, a0, da = snap.nc, snap.box_size, snap.a, 2e-3
        y0 = np.stack([snap.disp, snap.mom])
    else:
        nc, box, a0, da = 32, 64.0, 0.1, 2e-4
        y0 = np.stack(_initial_state(nc, box, a0))
    ys = np.asarray(_trajectory_fn(nc)(jnp.asarray(y0), a0, da), np.float64)
    a_mid = a0 + da
    # displacements are unwrapped, so X(a0 + 2 da) - X(a0) is the comoving distance travelled
    dX_da = units.grid_to_mpc(ys[2, 0] - ys[0, 0], box, nc) / (2 * da)  # Mpc/h per unit a
    v_fd = a_mid**2 * _hubble(a_mid) * dX_da  # a dX/dt with dt = da / (a H)
    v = units.momentum_to_velocity(ys[1, 1], a_mid, box, nc)
    scale = np.sqrt(np.mean(v_fd**2))
    assert scale > 50  # km/s
    assert np.sqrt(np.mean((v - v_fd) ** 2)) < 2e-3 * scale
    assert np.abs(v - v_fd).max() < 2e-2 * scale
