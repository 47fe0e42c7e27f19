"""Plots of a run's halos: the mass function against a fit, a density slice, and the mass
accretion histories of the main branches.

Uses matplotlib with the Agg backend (files only, no display). The measured mass function
and the fits (Watson et al. 2013, Sheth & Tormen 1999, Tinker et al. 2008) are
:mod:`jaxpm_halos.massfunction`'s, re-exported here; neither module is imported by
``import jaxpm_halos``.
"""

from __future__ import annotations

import math

import numpy as np

from .massfunction import (
    FITS,
    SHETH_TORMEN,
    TINKER08_200M,
    WATSON13_FOF,
    fitting_function,
    linear_power,
    mass_function_fit,
    measured_mass_function,
    sigma_of_mass,
)

__all__ = [
    "FITS",
    "SHETH_TORMEN",
    "TINKER08_200M",
    "WATSON13_FOF",
    "fitting_function",
    "linear_power",
    "mass_function_fit",
    "measured_mass_function",
    "plot_accretion_histories",
    "plot_density_slice",
    "plot_mass_function",
    "ratio_above",
    "sigma_of_mass",
]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _binned(mass, box_size, first, dex, cosmology, a, fits):
    """Bins of ``dex`` from ``first`` (Msun/h) up to the largest mass, the measurement
    there, and the fits on a fine curve and at the bin centres."""
    mass = np.asarray(mass, np.float64)
    lo = math.log10(first)
    hi = math.log10(mass.max()) if mass.size else lo + dex
    # The first edge is exactly `first`: 10**log10(20 m_p) can come out an ulp above 20 m_p
    # and leave out the haloes of exactly 20 particles.
    edges = first * 10 ** (dex * np.arange(int(math.ceil((hi - lo) / dex + 1e-9)) + 1))
    meas = measured_mass_function(mass, box_size, edges)
    curve_m = np.logspace(lo - 0.3, max(hi, lo + 1) + 0.5, 200)
    curves = {fit: mass_function_fit(curve_m, cosmology, a, fit) for fit in fits}
    for fit, curve in curves.items():  # log-log interpolation: exact to ~1e-4 in the tail
        meas[fit] = np.exp(
            np.interp(np.log(meas["centres"]), np.log(curve_m), np.log(np.maximum(curve, 1e-300)))
        )
    return meas, curve_m, curves


def _mass_panel(
    ax,
    rat,
    meas,
    curve_m,
    curves,
    labels,
    reference,
    point_label,
    colour,
    particle_mass,
    box_size,
    dex,
):
    for (fit, curve), (label, style) in zip(curves.items(), labels):
        ax.loglog(curve_m, curve, style, lw=1.5 if fit == reference else 1, label=label)
    ok = meas["count"] > 0
    ax.errorbar(
        meas["centres"][ok],
        meas["dndlog10m"][ok],
        yerr=meas["error"][ok],
        fmt="o",
        color=colour,
        ms=4,
        capsize=2,
        label=point_label,
    )
    ratio = meas["dndlog10m"] / meas[reference]
    rat.errorbar(
        meas["centres"][ok],
        ratio[ok],
        yerr=(meas["error"] / meas[reference])[ok],
        fmt="o",
        color=colour,
        ms=4,
        capsize=2,
    )
    rat.axhline(1, color="k", lw=1)
    rat.set_xscale("log")
    rat.set_ylim(0, 2)
    for axis in (ax, rat):
        axis.axvline(100 * particle_mass, color="0.6", ls=":", lw=1)
    ax.text(
        100 * particle_mass,
        0.03,
        "100 particles ",
        color="0.4",
        fontsize=8,
        ha="right",
        va="bottom",
        transform=ax.get_xaxis_transform(),
    )
    rat.set_xlabel(r"$M$  [$h^{-1}M_\odot$]")
    floor = 0.3 / (box_size**3 * dex)
    top = max(max(c.max() for c in curves.values()), meas["dndlog10m"].max(initial=0)) * 2
    ax.set_ylim(floor, top)
    ax.set_xlim(curve_m[0], curve_m[-1])
    ax.legend(fontsize=7, loc="upper right")


def _whole_particles(mass, particle_mass):
    """Masses rounded to whole particles (of equal mass, as in JaxPM). A catalogue's mass
    is a float32 (``count * m`` rounded once), so a halo of exactly 20 particles can weigh a
    rounding error less than 20 particles (in float64) and fall out of a bin or range that
    starts there."""
    mass = np.asarray(mass, np.float64)
    bad = int(np.count_nonzero(~(np.isfinite(mass) & (mass >= 0))))
    if bad:  # a NaN would silently leave the binning range undefined
        raise ValueError(
            f"mass holds {bad} NaN, inf or negative values; pass the haloes' "
            "masses in Msun/h (a catalogue's padding rows weigh 0 and are "
            "left out of the bins)"
        )
    if particle_mass is None:
        return mass
    if not (np.ndim(particle_mass) == 0 and 0 < float(particle_mass) < math.inf):
        raise ValueError(f"particle_mass must be a positive finite mass, got {particle_mass!r}")
    return np.rint(mass / particle_mass) * particle_mass


def ratio_above(
    mass,
    *,
    box_size: float,
    cosmology,
    a: float = 1.0,
    fit: str = "watson13",
    min_mass: float,
    max_mass: float | None = None,
    particle_mass: float | None = None,
) -> dict:
    """The number of haloes with ``min_mass <= mass < max_mass`` (Msun/h) against ``fit``.

    Returns ``{"count", "expected", "ratio", "error"}`` with ``expected = V \\int dn/dlog10M
    dlog10M`` over that range (trapezoid, 600 points; without ``max_mass`` up to
    ``1000 min_mass``: haloes that much heavier are absent from such boxes),
    ``V = box_size^3``, and the Poisson error of the ratio ``sqrt(count) / expected``.
    With ``particle_mass`` (Msun/h; particles of equal mass), masses are first rounded to
    whole particles, so that limits at whole particles (``min_mass = 20 * particle_mass``)
    count the haloes of exactly that many particles whatever their float32 rounding.
    """
    mass = _whole_particles(mass, particle_mass)
    top = 1000 * min_mass if max_mass is None else max_mass
    count = int(np.count_nonzero((mass >= min_mass) & (mass < top)))
    lgm = np.linspace(math.log10(min_mass), math.log10(top), 600)
    dn = mass_function_fit(10**lgm, cosmology, a, fit)
    expected = float(np.trapezoid(dn, lgm)) * float(box_size) ** 3
    return {
        "count": count,
        "expected": expected,
        "ratio": count / expected,
        "error": math.sqrt(count) / expected,
    }


def plot_mass_function(
    path,
    mass,
    *,
    box_size: float,
    cosmology,
    a: float = 1.0,
    particle_mass: float,
    min_members: int = 20,
    dex: float = 0.2,
    title: str | None = None,
    so_mass=None,
    so_definition: str = "200m",
    so_label: str | None = None,
) -> dict:
    """Plot the halo mass function of one snapshot against the Watson et al. 2013 FoF fit
    (and Sheth-Tormen), from jax_cosmo's linear power at scale factor ``a``; with
    ``so_mass``, beside it the spherical-overdensity masses against Tinker et al. 2008.

    Args:
      path: PNG file to write.
      mass: FoF halo masses in Msun/h.
      box_size: box side in Mpc/h.
      cosmology: a jax_cosmo Cosmology or a dict of its parameters.
      particle_mass: Msun/h per particle (marks the ``min_members`` and 100-particle limits;
        masses, FoF and SO, are rounded to whole particles of this mass before binning,
        see :func:`ratio_above`).
      dex: bin width in log10 M.
      so_mass: optional SO masses (Msun/h), e.g. M200m of the same haloes, NaN for none;
        binned from ``min_members`` particles like the FoF masses and drawn in a second
        column against Tinker et al. 2008 (``so_definition`` must be ``"200m"``, the only
        one that fit is given for here).
      so_label: legend label of the SO points.

    Returns the binned FoF measurement (see :func:`measured_mass_function`) with the fits at
    the bin centres (``"watson13"``, ``"sheth_tormen"``), and with ``so_mass`` under
    ``"so"`` the same for the SO masses (``"tinker08"``, ``"sheth_tormen"``).
    """
    if so_mass is not None and so_definition != "200m":
        raise ValueError(
            f"plot_mass_function compares SO masses with Tinker et al. 2008 for "
            f"M200m; got so_definition={so_definition!r}"
        )
    plt = _pyplot()
    mass = _whole_particles(mass, particle_mass)
    first = min_members * particle_mass
    meas, curve_m, curves = _binned(
        mass, box_size, first, dex, cosmology, a, ("watson13", "sheth_tormen")
    )
    columns = 1 if so_mass is None else 2
    fig, axes = plt.subplots(
        2,
        columns,
        figsize=(6.4 * columns, 6.4),
        sharex="col",
        squeeze=False,
        gridspec_kw=dict(height_ratios=(3, 1), hspace=0.05, wspace=0.25),
    )
    _mass_panel(
        axes[0, 0],
        axes[1, 0],
        meas,
        curve_m,
        curves,
        [("Watson et al. 2013 FoF fit", "k-"), ("Sheth & Tormen 1999", "k--")],
        "watson13",
        f"in-situ FoF, {mass.size} halos ($\\geq${min_members} particles)",
        "C3",
        particle_mass,
        box_size,
        dex,
    )
    axes[0, 0].set_ylabel(r"$dn/d\log_{10}M$  [$(h^{-1}\mathrm{Mpc})^{-3}$]")
    axes[1, 0].set_ylabel("sim / Watson")
    axes[0, 0].set_title(
        "FoF (b = 0.2) mass"
        if columns == 2
        else (title or f"halo mass function, a = {a:.3g} (z = {1 / a - 1:.2f})"),
        fontsize=10,
    )
    if so_mass is not None:
        so_all = np.asarray(so_mass, np.float64).reshape(-1)
        so = _whole_particles(so_all[np.isfinite(so_all) & (so_all > 0)], particle_mass)
        meas_so, curve_so, curves_so = _binned(
            so, box_size, first, dex, cosmology, a, ("tinker08", "sheth_tormen")
        )
        _mass_panel(
            axes[0, 1],
            axes[1, 1],
            meas_so,
            curve_so,
            curves_so,
            [("Tinker et al. 2008, $\\Delta$ = 200m", "k-"), ("Sheth & Tormen 1999", "k--")],
            "tinker08",
            so_label or f"M200m of the FoF haloes ({so.size} of {so_all.size} > 0)",
            "C0",
            particle_mass,
            box_size,
            dex,
        )
        axes[1, 1].set_ylabel("sim / Tinker")
        axes[0, 1].set_title("spherical overdensity $M_{200m}$", fontsize=10)
        meas["so"] = meas_so
        if title:
            fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return meas


def plot_density_slice(
    path,
    pos,
    *,
    box_size: float,
    halo_pos=None,
    halo_mass=None,
    axis: int = 2,
    thickness: float | None = None,
    start: float = 0.0,
    bins: int = 128,
    max_halos: int | None = None,
    title: str | None = None,
) -> dict:
    """Projected density of a slab, with the halos whose centres lie in it.

    The slab holds the particles with ``start <= pos[:, axis] < start + thickness``
    (periodic; default thickness ``box_size / 8``). The image is
    ``log10(1 + delta)`` of their 2D histogram (``bins`` pixels per side), with ``delta``
    relative to the slab's mean count per pixel. Halos are open circles of radius
    proportional to ``M^(1/3)`` (the virial radius scaling).

    Returns ``{"image", "halos_in_slab", "particles_in_slab"}``.
    """
    plt = _pyplot()
    pos = np.asarray(pos, np.float64).reshape(-1, 3)
    thickness = box_size / 8 if thickness is None else float(thickness)
    others = [d for d in range(3) if d != axis]
    in_slab = lambda p: np.mod(p[:, axis] - start, box_size) < thickness
    slab = pos[in_slab(pos)]
    hist, xe, ye = np.histogram2d(
        slab[:, others[0]], slab[:, others[1]], bins=bins, range=[[0, box_size], [0, box_size]]
    )
    image = np.log10(hist / max(hist.mean(), 1e-30) + 1)
    fig, ax = plt.subplots(figsize=(6.4, 5.6))
    im = ax.imshow(
        image.T,
        origin="lower",
        extent=(0, box_size, 0, box_size),
        cmap="magma",
        interpolation="nearest",
    )
    fig.colorbar(im, ax=ax, label=r"$\log_{10}(1 + \Sigma/\bar\Sigma)$")
    n_halos = 0
    if halo_pos is not None and len(halo_pos):
        hp = np.asarray(halo_pos, np.float64).reshape(-1, 3)
        hm = np.ones(len(hp)) if halo_mass is None else np.asarray(halo_mass, np.float64)
        sel = in_slab(hp)
        hp, hm = hp[sel], hm[sel]
        if max_halos is not None and len(hm) > max_halos:
            top = np.argsort(hm)[::-1][:max_halos]
            hp, hm = hp[top], hm[top]
        n_halos = len(hm)
        if n_halos:
            size = 40 * (hm / hm.min()) ** (2 / 3)  # marker area ~ R^2 ~ M^(2/3)
            ax.scatter(
                hp[:, others[0]],
                hp[:, others[1]],
                s=size,
                facecolors="none",
                edgecolors="cyan",
                linewidths=0.8,
                label=f"FoF halos in slab ({n_halos}), area $\\propto M^{{2/3}}$",
            )
            ax.legend(loc="upper right", fontsize=8, framealpha=0.6)
    names = "xyz"
    ax.set_xlabel(f"{names[others[0]]}  [Mpc/h]")
    ax.set_ylabel(f"{names[others[1]]}  [Mpc/h]")
    ax.set_xlim(0, box_size)
    ax.set_ylim(0, box_size)
    ax.set_title(title or f"{names[axis]} in [{start:g}, {start + thickness:g}) Mpc/h", fontsize=10)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return {"image": image, "halos_in_slab": n_halos, "particles_in_slab": len(slab)}


def plot_accretion_histories(
    path,
    a,
    mass,
    *,
    top: int = 10,
    normalise: bool = False,
    mass_unit: str = "Msun/h",
    title: str | None = None,
) -> dict:
    """Mass accretion histories: the main-branch masses of the ``top`` most massive haloes
    of the last snapshot against the scale factor.

    Args:
      path: PNG file to write.
      a: ``(S,)`` the snapshots' scale factors.
      mass: ``(H, S)`` masses along the main branches, NaN before a branch began:
        :func:`jaxpm_halos.along_branches` of :func:`jaxpm_halos.main_branches`, or a run
        directory's ``load_run(d).tree["mass"]``.
      top: how many haloes to draw (the most massive at the last snapshot).
      normalise: draw ``M(a) / M(a_last)`` instead of the masses.
      mass_unit: the masses' unit, for the axis label.

    Returns ``{"rows", "median_half_mass_a"}``: the rows drawn, and the median over them of
    the earliest snapshot's ``a`` at which the branch held half its final mass (NaN when
    none did at a snapshot).
    """
    plt = _pyplot()
    a = np.asarray(a, np.float64)
    mass = np.asarray(mass, np.float64).reshape(-1, len(a))
    final = np.nan_to_num(mass[:, -1], nan=-np.inf)
    rows = np.argsort(final, kind="stable")[::-1][: min(top, len(final))]
    shown = mass[rows] / (mass[rows, -1:] if normalise else 1.0)
    half = mass[rows] >= 0.5 * mass[rows, -1:]
    first = np.where(half.any(axis=1), a[np.argmax(half, axis=1)], np.nan)
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    for values in shown:
        ax.plot(a, values, marker="o", markersize=3, linewidth=1)
    ax.set_yscale("log")
    ax.set_xlabel("scale factor a")
    ax.set_ylabel(r"$M(a) / M(a_{\rm last})$" if normalise else f"main-branch mass [{mass_unit}]")
    ax.set_title(title or f"main branches of the {len(rows)} most massive haloes", fontsize=10)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    median = float(np.nanmedian(first)) if np.isfinite(first).any() else float("nan")
    return {"rows": rows, "median_half_mass_a": median}
