"""Mass-function theory and the mass-function plot (jaxpm_halos.plots).

The Tinker et al. 2008 values are worked out by hand from their Table 2 (Delta = 200:
A0 = 0.186, a0 = 1.47, b0 = 2.57, c = 1.19) and Eqs. 5-8:

- z = 0, sigma = 1: ``2.57^1.47 = exp(1.47 ln 2.57) = exp(1.38754) = 4.00499``;
  ``exp(-1.19) = 0.304221``; ``f = 0.186 * 5.00499 * 0.304221 = 0.283208``.
- z = 1, sigma = 1: ``log10(200/75) = 0.425969``, ``(0.75 / 0.425969)^1.2 = 1.97157``,
  ``alpha = 10^-1.97157 = 0.0106756``; ``A = 0.186 * 2^-0.14 = 0.168799``,
  ``a = 1.47 * 2^-0.06 = 1.410118``, ``b = 2.57 * 2^-alpha = 2.551051``;
  ``b^a = exp(1.410118 * 0.936505) = 3.74555``; ``f = 0.168799 * 4.74555 * 0.304221
  = 0.243697``.
"""

import math
import os

import numpy as np
import pytest
from conftest import requires

from jaxpm_halos import plots, units

COSMOLOGY = dict(
    Omega_c=0.25, Omega_b=0.0486, h=0.6774, n_s=0.9667, sigma8=0.8, Omega_k=0.0, w0=-1.0, wa=0.0
)


def test_tinker08_f_sigma_by_hand():
    # z = 0 and z = 1 (a = 0.5), sigma = 1: the module docstring's worked values
    assert plots.fitting_function(1.0, "tinker08", a=1.0) == pytest.approx(0.283208, rel=2e-6)
    assert plots.fitting_function(1.0, "tinker08", a=0.5) == pytest.approx(0.243697, rel=2e-6)
    # the same formula at other sigma, written out term by term
    for sigma, a in ((0.5, 1.0), (2.0, 1.0), (0.5, 0.5), (1.3, 0.7)):
        zp1 = 1 / a
        alpha = 0.0106756
        f = (
            0.186
            * zp1**-0.14
            * ((sigma / (2.57 * zp1**-alpha)) ** (-1.47 * zp1**-0.06) + 1)
            * math.exp(-1.19 / sigma**2)
        )
        assert plots.fitting_function(sigma, "tinker08", a=a) == pytest.approx(f, rel=1e-6)
    # z-dependence: at fixed sigma = 1 the amplitude falls with z (A ~ (1+z)^-0.14 dominates)
    assert plots.fitting_function(1.0, "tinker08", a=0.5) < plots.fitting_function(1.0, "tinker08")


def test_watson_and_sheth_tormen_f_sigma_by_hand():
    # Watson 2013 FoF at sigma = 1: 0.282 * (1.406^2.163 + 1) * exp(-1.21)
    # 1.406^2.163 = exp(2.163 * 0.340749) = exp(0.737040) = 2.089740; exp(-1.21) = 0.298197
    assert plots.fitting_function(1.0, "watson13") == pytest.approx(
        0.282 * 3.089740 * 0.298197, rel=2e-6
    )
    # Sheth-Tormen at sigma = 1.686 (nu = 1): 0.3222 sqrt(2 0.707 / pi) (1 + 0.707^-0.3)
    # exp(-0.3535); sqrt(0.450090) = 0.670888; 0.707^-0.3 = exp(0.3 * 0.346725) = 1.109620;
    # exp(-0.3535) = 0.702226
    assert plots.fitting_function(1.686, "sheth_tormen") == pytest.approx(
        0.3222 * 0.670888 * 2.109620 * 0.702226, rel=2e-6
    )
    with pytest.raises(ValueError, match="unknown fit"):
        plots.fitting_function(1.0, "despali16")
    with pytest.raises(ValueError, match="scale factor in"):
        plots.fitting_function(1.0, "tinker08", a=1.5)


@requires("jax_cosmo")
@pytest.mark.slow
def test_tinker08_mass_function_uses_the_same_sigma():
    """dn/dlog10M(tinker08) / dn/dlog10M(watson13) is f_T(sigma) / f_W(sigma) with sigma from
    jax_cosmo's P(k) at that a, at z = 0 and z = 1; and the Tinker abundance at 1e14 Msun/h
    and z = 0 is about 1e-4 per (Mpc/h)^3 per dex (sigma8 = 0.8)."""
    mass = np.array([1e13, 1e14, 5e14])
    for a in (1.0, 0.5):
        sigma = plots.sigma_of_mass(mass, COSMOLOGY, a)
        ratio = plots.mass_function_fit(mass, COSMOLOGY, a, "tinker08") / plots.mass_function_fit(
            mass, COSMOLOGY, a, "watson13"
        )
        expected = plots.fitting_function(sigma, "tinker08", a) / plots.fitting_function(
            sigma, "watson13"
        )
        np.testing.assert_allclose(ratio, expected, rtol=1e-3)
    assert 0.6 < plots.sigma_of_mass(1e14, COSMOLOGY, 1.0) < 1.2
    dn = plots.mass_function_fit(np.array([1e14]), COSMOLOGY, 1.0, "tinker08")[0]
    assert 5e-5 < dn < 2e-4


@requires("jax_cosmo")
def test_sigma_is_normalised_to_sigma8_and_grows_with_the_linear_growth_factor():
    """sigma(M) at the mass of an 8 Mpc/h sphere of mean matter density is sigma8, and
    sigma(M, a) / sigma(M, 1) is jax_cosmo's growth factor D(a) / D(1)."""
    import jax_cosmo as jc

    rho_m = (COSMOLOGY["Omega_c"] + COSMOLOGY["Omega_b"]) * units.RHO_CRIT
    m8 = 4 / 3 * math.pi * 8.0**3 * rho_m
    assert float(plots.sigma_of_mass(m8, COSMOLOGY)) == pytest.approx(0.8, rel=3e-3)
    cosmo = jc.Cosmology(**COSMOLOGY)
    growth = jc.background.growth_factor(cosmo, np.array([0.5, 1.0]))
    mass = np.array([1e12, 1e14])
    np.testing.assert_allclose(
        plots.sigma_of_mass(mass, COSMOLOGY, 0.5) / plots.sigma_of_mass(mass, COSMOLOGY, 1.0),
        float(growth[0] / growth[1]),
        rtol=1e-4,
    )


@requires("jax_cosmo", "matplotlib")
def test_plot_mass_function_with_so_masses(tmp_path):
    """The SO column bins its masses like the FoF one (here FoF masses stand in for SO
    masses, scaled by 0.8, NaN for haloes without one) and compares them with Tinker."""
    mp = units.particle_mass(0.2986, 128.0, 64)
    rng = np.random.default_rng(1)
    mass = mp * np.round(20 * (1 + rng.pareto(1.0, 300)))
    so = 0.8 * mass
    so[:5] = np.nan
    path = tmp_path / "mf.png"
    meas = plots.plot_mass_function(
        path,
        mass,
        box_size=128.0,
        cosmology=COSMOLOGY,
        a=1.0,
        particle_mass=mp,
        so_mass=so,
        title="test",
    )
    assert os.path.getsize(path) > 10_000
    edges = meas["so"]["edges"]
    assert edges[0] == pytest.approx(20 * mp)
    np.testing.assert_array_equal(meas["so"]["count"], np.histogram(so[5:], edges)[0])
    np.testing.assert_array_equal(meas["count"], np.histogram(mass, meas["edges"])[0])
    # the fit at the bin centres, where a 128 Mpc/h box can hold haloes (the derivative
    # d ln sigma / d ln M comes from a different grid: 1% apart at 1e-20 per (Mpc/h)^3)
    direct = plots.mass_function_fit(meas["so"]["centres"], COSMOLOGY, 1.0, "tinker08")
    near = direct > 1e-9
    assert near.sum() >= 8
    np.testing.assert_allclose(meas["so"]["tinker08"][near], direct[near], rtol=1e-3)
    with pytest.raises(ValueError, match="M200m"):
        plots.plot_mass_function(
            path,
            mass,
            box_size=128.0,
            cosmology=COSMOLOGY,
            particle_mass=mp,
            so_mass=so,
            so_definition="200c",
        )


@requires("jax_cosmo")
def test_ratio_above():
    mass = np.array([1e13, 5e13, 1e14, 2e14, 3e14])
    r = plots.ratio_above(mass, box_size=100.0, cosmology=COSMOLOGY, fit="watson13", min_mass=1e14)
    assert r["count"] == 3
    # midpoint sum over 0.1 dex bins from 1e14 to 1e17, independently of the trapezoid
    lg = 14 + 0.1 * (np.arange(30) + 0.5)
    expected = np.sum(plots.mass_function_fit(10**lg, COSMOLOGY, 1.0, "watson13")) * 0.1 * 1e6
    assert r["expected"] == pytest.approx(expected, rel=0.01)
    assert r["ratio"] == pytest.approx(3 / r["expected"])
    assert r["error"] == pytest.approx(math.sqrt(3) / r["expected"])
    # a closed range: [5e13, 2e14) holds 5e13, 1e14 (2e14 excluded)
    r = plots.ratio_above(
        mass, box_size=100.0, cosmology=COSMOLOGY, fit="watson13", min_mass=5e13, max_mass=2e14
    )
    lg = np.log10(5e13) + (np.log10(2e14) - np.log10(5e13)) / 20 * (np.arange(20) + 0.5)
    width = (np.log10(2e14) - np.log10(5e13)) / 20
    expected = np.sum(plots.mass_function_fit(10**lg, COSMOLOGY, 1.0, "watson13")) * width * 1e6
    assert r["count"] == 2 and r["expected"] == pytest.approx(expected, rel=1e-3)


@requires("jax_cosmo")
def test_haloes_of_exactly_min_members_particles_are_counted_and_binned(tmp_path):
    """A catalogue sums equal masses in float32: 20 particles of the demo's mass weigh
    4e-8 less than 20 m_p, so the 20-100 range and the first bin (from 20 m_p) left out
    every 20-member halo."""
    mp = units.particle_mass(0.2986, 128.0, 64)
    members = np.array([20, 20, 20, 25, 99, 100, 150])
    mass = np.array(
        [np.sum(np.full(n, mp, np.float32), dtype=np.float32) for n in members], np.float64
    )
    assert mass[0] < 20 * mp and mass[4] < 99 * mp  # the rounding this is about
    r = plots.ratio_above(
        mass,
        box_size=128.0,
        cosmology=COSMOLOGY,
        min_mass=20 * mp,
        max_mass=100 * mp,
        particle_mass=mp,
    )
    assert r["count"] == 5
    # Another particle mass, for which 10**log10(20 m_p) is an ulp above 20 m_p.
    for m in (mp, 1199904977.9393477):
        mass = np.array(
            [np.sum(np.full(n, m, np.float32), dtype=np.float32) for n in members], np.float64
        )
        meas = plots.plot_mass_function(
            tmp_path / "mf.png", mass, box_size=128.0, cosmology=COSMOLOGY, particle_mass=m
        )
        assert meas["edges"][0] == 20 * m
        assert meas["count"][0] == 4  # 20, 20, 20, 25 of [20, 31.7) particles
        assert meas["count"].sum() == len(members)
    with pytest.raises(ValueError, match="particle_mass must be a positive finite mass"):
        plots.ratio_above(
            mass, box_size=128.0, cosmology=COSMOLOGY, min_mass=1.0, particle_mass=0.0
        )
    # A NaN mass left the binning range undefined (a raw "cannot convert float NaN to
    # integer" from the plot); the ratio would count around it.
    for bad in (np.nan, -mp):
        with pytest.raises(ValueError, match="mass holds 1 NaN, inf or negative"):
            plots.plot_mass_function(
                tmp_path / "bad.png",
                np.append(mass, bad),
                box_size=128.0,
                cosmology=COSMOLOGY,
                particle_mass=mp,
            )
        with pytest.raises(ValueError, match="mass holds 1 NaN, inf or negative"):
            plots.ratio_above(
                np.append(mass, bad), box_size=128.0, cosmology=COSMOLOGY, min_mass=20 * mp
            )


def test_plot_accretion_histories(tmp_path):
    from jaxpm_halos.plots import plot_accretion_histories

    a = np.array([0.5, 0.75, 1.0])
    mass = np.array([[np.nan, 2.0, 4.0], [1.0, 3.0, 8.0], [1.0, 1.0, 1.0], [np.nan, np.nan, 2.0]])
    out = plot_accretion_histories(tmp_path / "mah.png", a, mass, top=3)
    assert (tmp_path / "mah.png").stat().st_size > 1000
    assert out["rows"].tolist() == [1, 0, 3]  # the most massive at a = 1
    # half the final mass first held at a = 1.0 (row 1: 3 < 4), 0.75 (row 0), 1.0 (row 3)
    assert out["median_half_mass_a"] == 1.0
