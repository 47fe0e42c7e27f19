"""Comoving distances of a flat or curved w0-wa cosmology without radiation (jax_cosmo's
background), in numpy float64 on the host."""

from __future__ import annotations

import numpy as np

C_KMS = 299792.458  # speed of light, km/s
HUBBLE_DISTANCE = C_KMS / 100.0  # c / H0 in Mpc/h


def hubble_rate(a, cosmology: dict):
    """``E(a) = H(a) / H0`` for ``Omega_m``, ``Omega_k`` (default 0), ``w0``, ``wa``
    (defaults -1, 0); dark energy fills the rest."""
    a = np.asarray(a, np.float64)
    omega_m = float(cosmology["Omega_m"])
    omega_k = float(cosmology.get("Omega_k", 0.0))
    w0, wa = float(cosmology.get("w0", -1.0)), float(cosmology.get("wa", 0.0))
    omega_de = 1.0 - omega_m - omega_k
    # rho_de(a) / rho_de(1) for w(a) = w0 + wa (1 - a)
    de = a ** (-3 * (1 + w0 + wa)) * np.exp(-3 * wa * (1 - a))
    return np.sqrt(omega_m * a**-3 + omega_k * a**-2 + omega_de * de)


class Distances:
    """Radial comoving distance (Mpc/h) and its inverse, tabulated from ``a = 1`` down to
    ``a_min`` on a fine grid in ``ln a`` (trapezoid rule: relative error below 1e-9)."""

    def __init__(self, cosmology: dict, a_min: float, points: int = 200_001):
        self.ln_a = np.linspace(0.0, np.log(a_min), points)  # decreasing
        a = np.exp(self.ln_a)
        integrand = 1.0 / (a * hubble_rate(a, cosmology))  # d chi / d(-ln a), in c / H0
        steps = 0.5 * (integrand[1:] + integrand[:-1]) * -np.diff(self.ln_a)
        self.chi = HUBBLE_DISTANCE * np.concatenate([[0.0], np.cumsum(steps)])  # increasing

    def of_a(self, a):
        """Comoving distance to scale factor ``a``."""
        return np.interp(-np.log(np.asarray(a, np.float64)), -self.ln_a, self.chi)

    def a_of(self, chi):
        """Scale factor at comoving distance ``chi``."""
        return np.exp(np.interp(np.asarray(chi, np.float64), self.chi, self.ln_a))
