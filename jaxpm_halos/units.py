"""Physical units for JaxPM's grid quantities.

JaxPM works in grid units: a length of 1 is one cell of the particle-mesh grid, and time is
the scale factor ``a``. With a box of side ``box_size`` in Mpc/h holding ``nc**3``
particles on an ``nc**3`` grid, one cell is ``box_size / nc`` Mpc/h.

Every function here is plain arithmetic: it accepts Python numbers, numpy arrays or jax
arrays (also inside ``jit``), and never imports jaxpm or jax_cosmo.

Constants:
  RHO_CRIT: critical density today, ``3 H0^2 / (8 pi G)`` in h^2 Msun / Mpc^3. With
    ``H0 = 100 h km/s/Mpc`` and ``G = 4.3009e-9 Mpc (km/s)^2 / Msun`` it is
    ``3e4 / (8 pi 4.3009e-9) = 2.7754e11``; we use ``2.775e11``.
  H0: the Hubble constant in km/s per Mpc/h, i.e. ``100``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

import jax
import numpy as np

from .core.particles import check_scale_factor

RHO_CRIT = 2.775e11  # h^2 Msun / Mpc^3
H0 = 100.0  # km/s / (Mpc/h)

__all__ = ["H0", "RHO_CRIT", "grid_to_mpc", "momentum_to_velocity", "particle_mass", "so_density"]


def particle_mass(omega_m, box_size, nc):
    """Mass of one particle of an ``nc**3``-particle JaxPM run, in Msun/h.

    Each particle carries the mean matter density times the volume of one cell::

        m = Omega_m * rho_crit * (box_size / nc)**3

    With ``rho_crit = 2.775e11 h^2 Msun/Mpc^3`` and ``box_size`` in Mpc/h, the cell volume
    is in (Mpc/h)^3 and the two factors of h combine to Msun/h:
    ``h^2 Msun/Mpc^3 * Mpc^3/h^3 = Msun/h``.

    Args:
      omega_m: matter density parameter today (``Omega_c + Omega_b`` in jax_cosmo).
      box_size: box side in Mpc/h.
      nc: particles per side (JaxPM puts one particle per grid cell).

    Example: ``particle_mass(0.3, 64.0, 64) == 8.325e10`` Msun/h.
    """
    return omega_m * RHO_CRIT * (box_size / nc) ** 3


def grid_to_mpc(x, box_size, nc):
    """Convert a length (or position, or displacement) from grid cells to Mpc/h.

    ``x_mpc = x * box_size / nc`` with ``box_size`` in Mpc/h.
    """
    return x * (box_size / nc)


def momentum_to_velocity(p, a, box_size, nc):
    """Peculiar velocity in km/s from JaxPM's momentum ``p`` (grid units) at scale factor ``a``.

    JaxPM's ODE drifts the comoving position ``x`` (in grid cells) as::

        dx/da = p / (a^3 E(a)),    E(a) = H(a) / H0.

    The comoving position in Mpc/h is ``X = x * box_size / nc``, and ``da/dt = a H(a) =
    a H0 E(a)``, so::

        dX/dt = (box_size / nc) * dx/da * da/dt = (box_size / nc) * H0 * p / a^2.

    The peculiar velocity is the proper velocity relative to the Hubble flow,
    ``v = a dX/dt``::

        v = H0 * (box_size / nc) * p / a     [km/s],

    with ``H0 = 100 km/s per Mpc/h``. ``E(a)`` cancels, so no cosmology is needed.
    For 1LPT (``p = a^2 f E d``, ``d`` the displacement in cells) this is the linear-theory
    relation ``v = a H(a) f(a) Psi``, ``Psi = d * box_size / nc`` in Mpc/h.

    The derivation holds for any grid: the momentum is in the unit of the state's positions,
    so ``nc`` is the number of cells per side of the grid whose cells measure the positions.
    For an absolute-position state on a PM grid of ``pm_nc`` cells per side (JaxPM's
    ``paint_absolute_pos=True``; ``jaxpm_halos.simulation.run_simulation(pm_nc=...)``) that is
    ``pm_nc``: there ``x_pm = (pm_nc / nc) x_lattice``, so ``p_pm = (pm_nc / nc) p_lattice``
    and ``v = H0 (box_size / pm_nc) p_pm / a`` is the same velocity.

    Args:
      p: momentum in grid units, e.g. ``particles.vel`` from
        :func:`jaxpm_halos.from_jaxpm`, or ``y[1]`` of JaxPM's diffrax state.
      a: scale factor of the snapshot (scalar, or broadcastable to ``p``).
      box_size: box side in Mpc/h.
      nc: grid cells per side (``pm_nc`` for an absolute-position state).
    """
    return p * (H0 * box_size / nc) / a


_OVERDENSITY = re.compile(r"^(\d+(?:\.\d*)?)([cm])$")


def so_density(definition: str, *, omega_m, a=1.0):
    """Threshold mean density of a spherical-overdensity definition, comoving, in
    (Msun/h) / (Mpc/h)^3: pass it to :func:`jaxpm_halos.spherical_overdensity` with masses
    in Msun/h and comoving positions in Mpc/h.

    Flat LCDM without radiation, ``E(a)^2 = Omega_m a^-3 + 1 - Omega_m``. The critical
    density at ``a`` is ``rho_c(a) = RHO_CRIT E(a)^2`` (physical); comoving densities are
    physical ones times ``a^3``, and the mean matter density is ``Omega_m RHO_CRIT`` at
    every ``a``. With ``Delta`` a number:

    * ``"<Delta>c"`` (``"200c"``, ``"500c"``): ``Delta rho_c(a) a^3
      = Delta RHO_CRIT (Omega_m + (1 - Omega_m) a^3)``;
    * ``"<Delta>m"`` (``"200m"``): ``Delta Omega_m RHO_CRIT``;
    * ``"vir"`` (Bryan & Norman 1998, their Eq. 6 for a flat universe):
      ``Delta_c = 18 pi^2 + 82 x - 39 x^2`` with ``x = Omega_m(a) - 1`` and
      ``Omega_m(a) = Omega_m a^-3 / E(a)^2``, then ``Delta_c rho_c(a) a^3``. At ``a = 1``,
      ``Omega_m = 0.3``: ``Delta_c = 101.1`` (337 times the mean density).

    Args:
      definition: ``"200c"``, ``"500c"``, ``"200m"``, ``"vir"`` or any ``"<Delta>c"`` /
        ``"<Delta>m"``.
      omega_m: matter density parameter today.
      a: scale factor (a number or an array, also traced inside ``jit``). With ``a`` and
        ``omega_m`` concrete (numbers, numpy or JAX arrays) the threshold is computed in
        float64 from their values (a float32 ``a`` of 0.6 is its own value, not 0.6) and
        returned as a float, or a float64 array; with either traced it is computed in
        their precision, where float32 rounding can put it an ulp away.
    """
    if not isinstance(definition, str):
        raise ValueError(f"an SO definition is a string such as '200c', got {definition!r}")
    # Any concrete value (numpy and jax scalars too); a traced one cannot raise.
    if not isinstance(omega_m, jax.core.Tracer) and not np.all(
        (np.asarray(omega_m) > 0) & (np.asarray(omega_m) <= 1)
    ):
        raise ValueError(f"omega_m must lie in (0, 1] for flat LCDM, got {omega_m}")
    check_scale_factor(a)
    if isinstance(a, jax.core.Tracer) or isinstance(omega_m, jax.core.Tracer):
        return _so_density(definition, omega_m, a)
    value = _so_density(definition, np.asarray(omega_m, np.float64), np.asarray(a, np.float64))
    return float(value) if np.ndim(value) == 0 else value


def definition_densities(names, given, *, omega_m, a, argument: str, instead: str) -> list:
    """:func:`so_density` of each definition in ``names``, named by the caller's
    ``argument=given``; without ``omega_m``, a ValueError offering ``instead``."""
    if omega_m is None:
        raise ValueError(
            f"{argument}={given!r} needs omega_m= (and a=) for the thresholds "
            f"(jaxpm_halos.units.so_density); or pass {instead}"
        )
    return [so_density(n, omega_m=omega_m, a=a) for n in names]


def _so_density(definition: str, omega_m, a):
    """:func:`so_density`'s arithmetic, in the precision of its inputs."""
    a3 = a * a * a
    critical = RHO_CRIT * (omega_m + (1 - omega_m) * a3)  # rho_c(a) a^3
    if definition == "vir":
        omega_a = omega_m / (omega_m + (1 - omega_m) * a3)
        x = omega_a - 1
        return (18 * math.pi**2 + 82 * x - 39 * x * x) * critical
    match = _OVERDENSITY.match(definition)
    if match is None:
        raise ValueError(
            f"unknown SO definition {definition!r}: use '200c', '500c', '200m', "
            "'vir', or '<Delta>c' / '<Delta>m'"
        )
    delta = float(match.group(1))
    if not delta > 0:
        raise ValueError(f"SO definition {definition!r}: Delta must be positive")
    return delta * (critical if match.group(2) == "c" else omega_m * RHO_CRIT)


COSMOLOGY = ("Omega_c", "Omega_b", "h", "sigma8", "n_s", "w0", "wa", "Omega_k")
"""The parameters :func:`cosmology_dict` reads from a jax_cosmo ``Cosmology``."""


def cosmology_dict(cosmology, omega_m=None) -> dict:
    """The parameters of a jax_cosmo ``Cosmology`` or a dict, with ``Omega_m``; checked
    against the InSitu's ``omega_m`` that set the masses."""
    if isinstance(cosmology, Mapping):
        out = {str(k): v for k, v in cosmology.items()}
    else:
        missing = [n for n in COSMOLOGY if not hasattr(cosmology, n)]
        if missing:
            raise ValueError(
                f"cosmology must be a jax_cosmo Cosmology or a dict; {cosmology!r} lacks {missing}"
            )
        out = {n: float(getattr(cosmology, n)) for n in COSMOLOGY}
    if "Omega_m" not in out and {"Omega_c", "Omega_b"} <= set(out):
        out["Omega_m"] = float(out["Omega_c"]) + float(out["Omega_b"])
    if omega_m is not None and "Omega_m" in out and abs(out["Omega_m"] - omega_m) > 1e-6:
        raise ValueError(
            f"the cosmology's Omega_m = {out['Omega_m']:g}, but the InSitu's omega_m = "
            f"{omega_m:g} set the masses: give the cosmology of the run"
        )
    return out
