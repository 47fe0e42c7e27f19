"""What the demo prints and writes: the timing table, catalogue files, plots and the counts
against the mass-function fits."""

from __future__ import annotations

import contextlib
import io
import os

from ..simulation import (
    SimulationResult,
)


def host(x):
    """A (possibly multi-process) global array as numpy on every process."""
    import numpy as np

    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def time_analyses(result: SimulationResult, timing: str, say):
    """``(t_off, t_snap, t_on)``: the compiled solve's time with the analyses off, the
    analyses' time at each snapshot, and (``timing="total"`` only) the solve's time with
    them all on. ``timing``: ``"snapshot"`` (each snapshot's analyses alone, one solve
    each), ``"total"`` (all on, shared evenly) or ``"none"`` (None each).

    Every snapshot is timed alike, by a rerun of the compiled solve. The first run after
    compiling (``result.run_s``) is not used: it carries one-time costs, and a snapshot
    timed as that run minus the others would also carry every other figure's noise."""
    import jax.numpy as jnp

    n_snap = len(result.snapshots)
    if timing == "none":
        return None, [None] * n_snap, None
    say(
        "timing: the same compiled solve with the analyses off and "
        + ("on at each snapshot alone" if timing == "snapshot" else "all on")
        + " ..."
    )

    def seconds(on):
        with contextlib.redirect_stdout(io.StringIO()):  # no more progress meters
            return result.rerun(on)[2]

    t_off = seconds(jnp.zeros(n_snap, bool))
    if timing == "total":
        t_on = seconds(jnp.ones(n_snap, bool))
        return t_off, [(t_on - t_off) / n_snap] * n_snap, t_on
    return t_off, [seconds(jnp.arange(n_snap) == i) - t_off for i in range(n_snap)], None


def write_run_directory(saved, snapshots, args, insitu, cosmology: dict):
    """The FoF catalogue of each snapshot (None without FoF), with the whole run (members,
    merger links and tree, light cone) written to ``args.out/run`` by
    :func:`jaxpm_halos.write_run`, and the accretion histories plotted."""
    from ..io.catalogue import gather_catalogue
    from ..io.run import write_run

    if "fof" not in saved:
        return [None] * len(snapshots)
    catalogues = [
        gather_catalogue(saved["fof"]["catalogue"], snapshot=i) for i in range(len(snapshots))
    ]
    cone = {"observer": (args.box / 2,) * 3, "z_max": args.lightcone_z}
    path = write_run(
        os.path.join(args.out, "run"),
        saved,
        insitu,
        times=snapshots,
        cosmology=cosmology,
        steps=args.steps,
        seed=args.seed,
        lightcone=cone if args.lightcone_z > 0 else None,
    )
    if path is not None and len(snapshots) > 1:
        from ..io.run import load_run
        from ..plots import plot_accretion_histories

        run = load_run(path)
        history = plot_accretion_histories(
            os.path.join(args.out, "accretion_histories.png"),
            run.a,
            run.tree["mass"],
            title=f"main branches of the 10 most massive haloes at a = {snapshots[-1]:g}",
        )
        cone_rows = 0 if run.lightcone is None else len(run.lightcone["id"])
        print(
            f"wrote {path}: {len(snapshots)} snapshots with members and merger links, the "
            f"tree of {len(run.tree['main_branch'])} haloes (the 10 largest held half their "
            f"final mass from a = {history['median_half_mass_a']:.3g}, median), and a light "
            f"cone of {cone_rows} haloes to z = {args.lightcone_z:g}"
        )
    return catalogues


def snapshot_rows(saved, snapshots, catalogues, t_snap):
    """One row of the printed table per snapshot: halos, the three largest masses, the
    median kNN density over the mean and the analyses' time."""
    import numpy as np

    rows = []
    for i, (a, cat) in enumerate(zip(snapshots, catalogues)):
        row = {"a": a, "halos": None, "largest": [], "rho": None, "t": t_snap[i]}
        if cat is not None:
            row["halos"] = len(cat["id"])
            row["largest"] = np.sort(cat["mass"])[::-1][:3].tolist()
        if "knn_density" in saved:
            row["rho"] = float(np.median(host(saved["knn_density"]["density"])[i] + 1))
        rows.append(row)
    return rows


def plot_final(
    result: SimulationResult,
    final,
    a: float,
    args,
    cosmology: dict,
    mass: float,
    pm_nc: int,
    lead: bool,
):
    """The last snapshot's mass function (with the counts against the fits) and density
    slice, written to ``args.out`` (by the lead process, when there is a catalogue)."""
    from .. import from_jaxpm

    particles = from_jaxpm(
        result.state,
        box_size=args.box,
        mass=mass,
        paint_absolute_pos=result.paint_absolute_pos,
        pm_nc=result.pm_nc,
    )
    pos = host(particles.pos)  # every process takes part in the gather
    if not lead or final is None:
        return
    from ..plots import plot_density_slice, plot_mass_function

    so_mass = final.get("m200m")
    mf = os.path.join(args.out, "mass_function.png")
    plot_mass_function(
        mf,
        final["mass"],
        box_size=args.box,
        cosmology=cosmology,
        a=a,
        particle_mass=mass,
        min_members=args.min_members,
        so_mass=so_mass,
        title=f"{args.nc}$^3$ particles, {args.box:g} Mpc/h, PM grid "
        f"{pm_nc}$^3$, {args.steps} steps, a = {a:g}: in-situ FoF "
        f"b = {args.b:g}",
    )
    print_fit_ratios(final["mass"], so_mass, args, cosmology, mass, a)
    sl = os.path.join(args.out, "density_slice.png")
    plot_density_slice(
        sl,
        pos,
        box_size=args.box,
        halo_pos=final["pos"],
        halo_mass=final["mass"],
        bins=min(args.nc, 512),
        title=f"a = {a:g}: projected density of z in [0, {args.box / 8:g}) Mpc/h, FoF halo centres",
    )
    written = ["run", "accretion_histories.png", os.path.basename(mf), os.path.basename(sl)]
    written = [f for f in written if os.path.exists(os.path.join(args.out, f))]
    print(f"wrote {', '.join(os.path.join(args.out, f) for f in written)}")


def print_fit_ratios(fof_mass, so_mass, args, cosmology: dict, mass: float, a: float):
    """Halo counts below and above 100 particles against the Watson (FoF) and Tinker
    (M200m) fits."""
    from ..plots import ratio_above

    print(
        f"\nhaloes at a = {a:g} against the fits (counts / expected, Poisson errors; "
        f"100 particles = {100 * mass:.3g} Msun/h):"
    )
    for label, masses, fit in (
        ("FoF   / Watson 2013", fof_mass, "watson13"),
        ("M200m / Tinker 2008", so_mass, "tinker08"),
    ):
        if masses is None:
            continue
        for lo, hi in ((args.min_members, 100), (100, None)):
            r = ratio_above(
                masses,
                box_size=args.box,
                cosmology=cosmology,
                a=a,
                fit=fit,
                min_mass=lo * mass,
                max_mass=None if hi is None else hi * mass,
                particle_mass=mass,
            )
            span = f"{lo}-{hi} particles" if hi else f">= {lo} particles"
            print(
                f"  {label}, {span:>16}: {r['count']:4d} / {r['expected']:6.1f} = "
                f"{r['ratio']:.2f} +- {r['error']:.2f}"
            )


def print_table(rows, t_off, steps, t_on, timing, k):
    per_step = None if t_off is None else t_off / steps
    head = f"{'a':>5} {'z':>5} {'halos':>6}  {'largest masses [Msun/h]':<30}"
    if any(r["rho"] is not None for r in rows):
        head += f" {'median rho/rho_mean':>19}"  # over particles
    if per_step is not None:
        head += f" {'analyses [s]':>12} {'PM step [s]':>11} {'ratio':>6}"
    print()
    print(head)
    for r in rows:
        largest = ", ".join(f"{m:.2e}" for m in r["largest"]) or "-"
        halos = r["halos"] if r["halos"] is not None else "-"
        line = f"{r['a']:5.3f} {1 / r['a'] - 1:5.2f} {halos:>6}  {largest:<30}"
        if any(x["rho"] is not None for x in rows):
            line += f" {r['rho']:19.3f}" if r["rho"] is not None else f" {'-':>19}"
        if per_step is not None:
            line += f" {r['t']:12.2f} {per_step:11.3f} {r['t'] / per_step:6.1f}"
        print(line)
    if any(r["rho"] is not None for r in rows):
        print(
            f"median rho/rho_mean: the in-situ kNN density (k = {k}) over the mean density, "
            "median over particles (mass-weighted, hence above 1)."
        )
    if per_step is not None:
        print(
            f"PM step: the solve with every analysis switched off ({t_off:.2f} s) / {steps} steps. "
            "Analyses: "
            + (
                "the solve with the analyses on at that snapshot only, minus the "
                "solve with them off"
                if timing == "snapshot"
                else f"(the solve with all on ({t_on:.2f} s) - the solve with all off) / snapshots"
            )
            + ". The same compiled program runs each time (a traced flag and lax.cond switch "
            "the analyses), so compilation is not counted."
        )
