"""Halo mass functions: the measured one of a catalogue, and the fits it is compared with.

Uses jax_cosmo's linear power spectrum for the theory curves (imported when called).

The linear variance in a top-hat sphere of comoving radius ``R`` (Mpc/h) holding mass
``M = 4/3 pi R^3 rho_m`` (``rho_m = Omega_m rho_crit``, Msun/h per (Mpc/h)^3)::

    sigma^2(M, a) = 1 / (2 pi^2) \\int dk k^2 P_lin(k, a) W^2(k R),
    W(x) = 3 (sin x - x cos x) / x^3,

with ``P_lin(k, a)`` from ``jax_cosmo.power.linear_matter_power`` (Eisenstein & Hu
transfer function, normalised to the cosmology's ``sigma8``, grown to ``a``), integrated
on 4096 log-spaced k from 1e-4 to 1e2 h/Mpc. Then::

    dn/dlog10 M = ln(10) * f(sigma) * rho_m / M * |d ln sigma / d ln M|.

Watson et al. 2013 (MNRAS 433, 1230), universal FoF fit (b = 0.2), their eq. 12::

    f(sigma) = A [(beta / sigma)^alpha + 1] exp(-gamma / sigma^2),
    A = 0.282, alpha = 2.163, beta = 1.406, gamma = 1.210,

calibrated for -0.55 <= ln(1/sigma) <= 1.31, independent of redshift.

Sheth & Tormen 1999 (MNRAS 308, 119), with ``nu = delta_c / sigma``, ``delta_c = 1.686``::

    f(sigma) = A sqrt(2 a / pi) [1 + (a nu^2)^(-p)] nu exp(-a nu^2 / 2),
    A = 0.3222, a = 0.707, p = 0.3.

Tinker et al. 2008 (ApJ 688, 709), spherical-overdensity masses with ``Delta = 200``
times the mean matter density (M200m), their Eq. 3 with the Table 2 row ``Delta = 200``
and the redshift dependence of their Eqs. 5-8 (``z = 1/a - 1``; fitted for z <= 2.5)::

    f(sigma, z) = A(z) [(sigma / b(z))^(-a(z)) + 1] exp(-c / sigma^2),
    A(z) = A0 (1 + z)^-0.14,  a(z) = a0 (1 + z)^-0.06,  b(z) = b0 (1 + z)^-alpha,
    log10 alpha(Delta) = -[0.75 / log10(Delta / 75)]^1.2   (alpha = 0.01068 at Delta = 200),
    A0 = 0.186, a0 = 1.47, b0 = 2.57, c = 1.19,

calibrated for -0.6 <= ln(1/sigma) <= 0.4 at z = 0. Like Watson's, this f is the
multiplicity function of ``dn/dlog10 M`` above (``sigma`` at the snapshot's ``a``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from . import units

WATSON13_FOF = dict(A=0.282, alpha=2.163, beta=1.406, gamma=1.210)


SHETH_TORMEN = dict(A=0.3222, a=0.707, p=0.3, delta_c=1.686)


TINKER08_200M = dict(A0=0.186, a0=1.47, b0=2.57, c=1.19, delta=200.0)


FITS = ("watson13", "sheth_tormen", "tinker08")


_COSMO_KEYS = ("Omega_c", "Omega_b", "h", "n_s", "sigma8", "Omega_k", "w0", "wa")


def _cosmology(cosmology):
    """A fresh jax_cosmo Cosmology from a Cosmology or a dict of its parameters."""
    import jax_cosmo as jc

    if isinstance(cosmology, Mapping):
        params = {k: float(cosmology[k]) for k in _COSMO_KEYS if k in cosmology}
        missing = [k for k in _COSMO_KEYS if k not in params]
        defaults = jc.Planck15()
        params.update({k: float(getattr(defaults, k)) for k in missing})
        return jc.Cosmology(**params)
    return jc.Cosmology(**{k: float(getattr(cosmology, k)) for k in _COSMO_KEYS})


def linear_power(cosmology, k, a: float = 1.0) -> np.ndarray:
    """Linear matter power ``P(k, a)`` in (Mpc/h)^3 at ``k`` in h/Mpc (jax_cosmo)."""
    import warnings

    import jax_cosmo as jc

    with warnings.catch_warnings():
        # jax_cosmo's growth ODE asks for int64 indices, which jax truncates to int32.
        warnings.filterwarnings("ignore", "Explicitly requested dtype.*int64", UserWarning)
        pk = jc.power.linear_matter_power(
            _cosmology(cosmology), np.asarray(k, np.float32), a=float(a)
        )
    return np.asarray(pk, np.float64)


def _omega_m(cosmology) -> float:
    get = cosmology.get if isinstance(cosmology, Mapping) else lambda k: getattr(cosmology, k)
    return float(get("Omega_c")) + float(get("Omega_b"))


def sigma_of_mass(mass, cosmology, a: float = 1.0) -> np.ndarray:
    """Linear rms overdensity in top-hat spheres of mass ``mass`` (Msun/h) at scale factor a."""
    mass = np.asarray(mass, np.float64)
    rho_m = _omega_m(cosmology) * units.RHO_CRIT
    radius = np.cbrt(3 * mass / (4 * np.pi * rho_m))
    lnk = np.linspace(np.log(1e-4), np.log(1e2), 4096)
    k = np.exp(lnk)
    pk = linear_power(cosmology, k, a)
    x = k[None, :] * radius.reshape(-1, 1)
    w = np.where(
        x > 1e-3, 3 * (np.sin(x) - x * np.cos(x)) / np.maximum(x, 1e-3) ** 3, 1 - x * x / 10
    )
    integrand = k**3 * pk * w * w / (2 * np.pi**2)  # d sigma^2 / d ln k
    var = np.trapezoid(integrand, lnk, axis=1)
    return np.sqrt(var).reshape(mass.shape)


def fitting_function(sigma, fit: str = "watson13", a: float = 1.0) -> np.ndarray:
    """The multiplicity function ``f(sigma)`` of ``fit`` (formulas in the module docstring):
    ``"watson13"`` (FoF b = 0.2), ``"sheth_tormen"``, or ``"tinker08"`` (M200m, at scale
    factor ``a``; the others do not depend on ``a``)."""
    sigma = np.asarray(sigma, np.float64)
    if fit == "watson13":
        p = WATSON13_FOF
        return p["A"] * ((p["beta"] / sigma) ** p["alpha"] + 1) * np.exp(-p["gamma"] / sigma**2)
    if fit == "sheth_tormen":
        p = SHETH_TORMEN
        nu = p["delta_c"] / sigma
        return (
            p["A"]
            * np.sqrt(2 * p["a"] / np.pi)
            * (1 + (p["a"] * nu * nu) ** (-p["p"]))
            * nu
            * np.exp(-p["a"] * nu * nu / 2)
        )
    if fit == "tinker08":
        p = TINKER08_200M
        if not 0 < a <= 1:
            raise ValueError(f"tinker08 needs a scale factor in (0, 1], got a = {a}")
        zp1 = 1.0 / a
        alpha = 10 ** -((0.75 / math.log10(p["delta"] / 75)) ** 1.2)
        amp = p["A0"] * zp1**-0.14
        slope = p["a0"] * zp1**-0.06
        b = p["b0"] * zp1**-alpha
        return amp * ((sigma / b) ** -slope + 1) * np.exp(-p["c"] / sigma**2)
    raise ValueError(f"unknown fit {fit!r}; use one of {FITS}")


def mass_function_fit(mass, cosmology, a: float = 1.0, fit: str = "watson13") -> np.ndarray:
    """``dn/dlog10 M`` in (Mpc/h)^-3 at masses ``mass`` (Msun/h) from ``fit``:
    ``"watson13"`` (Watson et al. 2013 FoF), ``"sheth_tormen"`` or ``"tinker08"``
    (Tinker et al. 2008, M200m, with its redshift dependence)."""
    if fit not in FITS:
        raise ValueError(f"unknown fit {fit!r}; use one of {FITS}")
    mass = np.asarray(mass, np.float64)
    lnm = np.log(mass)
    # d ln sigma / d ln M on a fine grid around the requested masses
    grid = np.linspace(lnm.min() - 0.5, lnm.max() + 0.5, 400)
    lnsig = np.log(sigma_of_mass(np.exp(grid), cosmology, a))
    sigma = np.exp(np.interp(lnm, grid, lnsig))
    dlns_dlnm = np.interp(lnm, grid, np.gradient(lnsig, grid))
    f = fitting_function(sigma, fit, a)
    rho_m = _omega_m(cosmology) * units.RHO_CRIT
    return math.log(10) * f * rho_m / mass * np.abs(dlns_dlnm)


def measured_mass_function(mass, box_size: float, bins) -> dict:
    """Binned ``dn/dlog10 M`` of halo masses in a periodic box of side ``box_size`` Mpc/h.

    Returns ``{"edges", "centres" (geometric), "count", "dndlog10m", "error"}``, the
    error being Poisson, ``sqrt(count) / (V dlog10M)``.
    """
    edges = np.asarray(bins, np.float64)
    count, _ = np.histogram(np.asarray(mass, np.float64), edges)
    width = np.diff(np.log10(edges))
    volume = float(box_size) ** 3
    return {
        "edges": edges,
        "centres": np.sqrt(edges[1:] * edges[:-1]),
        "count": count,
        "dndlog10m": count / (volume * width),
        "error": np.sqrt(count) / (volume * width),
    }
