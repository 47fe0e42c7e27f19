"""The main job: a distributed JaxPM run with in-situ halo finding and kNN density.

Run it with::

    python -m jaxpm_halos.demo [--nc 64] [--box 128] [--steps 20] [--snapshots 0.5,1.0]
        [--mesh 2,4] [--pm-factor 2] [--no-m200m] [--centre peak] [--b 0.2] [--min-members 20]
        [--k 16] [--out halos_out]

On a machine with only a CPU, the run is spread over 8 XLA host devices (a ``(2, 4)``
mesh) unless ``XLA_FLAGS`` already chooses a device count; otherwise it uses all local
devices. The simulation follows JaxPM's distributed recipe: a linear field, 2LPT to
``a = 0.1``, then ``--steps`` PM steps with diffrax's ``LeapfrogMidpoint`` (with diffrax's
text progress meter) to the last snapshot, on a PM grid of ``--pm-factor`` cells per
particle spacing (:func:`jaxpm_halos.pm.refined_pm_ode` when above 1). At each snapshot,
inside the jitted solve (``diffrax.SaveAt(ts=snapshots, fn=...)``),
:class:`jaxpm_halos.InSitu` runs FoF (``--b``, ``--min-members``) and the kNN density
(``--k``) on the sharded state.

At the end it prints, per snapshot, the number of halos, the largest masses (Msun/h), the
median kNN density, and the time of the analyses against one PM step: the compiled solve
is run again with the analyses switched off by a traced flag (``lax.cond``), and once per
snapshot with them on at that snapshot only (``--timing``). It writes one HDF5 catalogue
per snapshot (``halos_a1.0000.h5``, see :mod:`jaxpm_halos.io`), ``mass_function.png``
(FoF masses against the Watson et al. 2013 FoF fit and, unless ``--no-m200m``, beside
them the in-situ spherical-overdensity M200m of the same haloes, about their density peaks or
centres of mass (``--centre``), against Tinker et al. 2008) and
``density_slice.png`` to ``--out``, and prints the counts above 100 particles against
the fits.

This module is only the command line: the run itself is
:func:`jaxpm_halos.simulation.run_simulation`.

This module imports jaxpm, jaxdecomp, jax_cosmo and diffrax; ``import jaxpm_halos`` does not.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import io
import math
import os
import sys
import time
from collections.abc import Sequence

from .pm import default_halo_size, refined_pm_ode
from .simulation import (
    PM_FACTOR,
    SimulationResult,
    default_mesh_shape,
    demo_cosmology,
    describe_layout,
    run_simulation,
    switchable_saveat_fn,
    use_host_devices,
)

# Scripts written before the driver left this module import these names from it.
__all__ = [
    "default_halo_size",
    "describe_layout",
    "main",
    "refined_pm_ode",
    "run_simulation",
    "switchable_saveat_fn",
    "use_host_devices",
    "default_mesh_shape",
    "demo_cosmology",
]


def _host(x):
    """A (possibly multi-process) global array as numpy on every process."""
    import numpy as np

    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jaxpm_halos.demo",
        description="A distributed JaxPM run with in-situ FoF halo finding and kNN density "
        "(jaxpm_halos.InSitu inside diffrax's jitted solve). Writes one HDF5 halo "
        "catalogue per snapshot, a mass function plot and a density slice.",
    )
    parser.add_argument("--nc", type=int, default=64, help="particles per side (default 64)")
    parser.add_argument("--box", type=float, default=128.0, help="box side in Mpc/h (default 128)")
    parser.add_argument(
        "--steps",
        type=int,
        default=20,
        help="PM steps from a=0.1 to the last snapshot (default 20)",
    )
    parser.add_argument(
        "--snapshots",
        default="0.5,1.0",
        help="scale factors of the in-situ snapshots; the run ends at the last (default 0.5,1.0)",
    )
    parser.add_argument(
        "--mesh",
        default=None,
        help="device mesh 'px,py' (default: all devices, e.g. 2,4 for 8 CPU devices)",
    )
    parser.add_argument(
        "--pm-factor",
        type=int,
        default=PM_FACTOR,
        help="PM grid cells per particle spacing along each axis: the PM grid "
        "has (pm-factor * nc)^3 cells (default %(default)s; 1 is JaxPM's "
        "own displacement mode, >1 the demo's refined_pm_ode)",
    )
    parser.add_argument(
        "--m200m",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="measure the spherical-overdensity M200m of every FoF halo in "
        "situ (InSitu(so=('200m',))) and plot it against Tinker et al. "
        "2008 beside the FoF masses (default on when --analyses holds "
        "fof; --no-m200m skips it)",
    )
    parser.add_argument(
        "--centre",
        choices=("peak", "com"),
        default="peak",
        help="SO centre with --m200m: the member with the highest kNN density "
        "(peak) or the centre of mass (com) (default peak)",
    )
    parser.add_argument(
        "--b",
        type=float,
        default=0.2,
        help="FoF linking length in mean particle separations (default 0.2)",
    )
    parser.add_argument(
        "--min-members",
        type=int,
        default=20,
        help="smallest FoF group in the catalogues (default 20)",
    )
    parser.add_argument(
        "--max-halos",
        type=int,
        default=None,
        help="catalogue rows per device (FoFConfig.max_halos; default "
        "max(1024, particles per device / 16)); a small --min-members "
        "may need more",
    )
    parser.add_argument(
        "--buffers",
        action="append",
        default=[],
        metavar="FIELD=CONFIG",
        help="an InSitu buffer setting as a capacity error spells it, e.g. "
        "'domain=DomainConfig(capacity_factor=3.0)' (fields domain, fof, "
        "knn); may be repeated",
    )
    parser.add_argument(
        "--k", type=int, default=16, help="neighbours for the kNN density (default 16)"
    )
    parser.add_argument(
        "--analyses",
        default="fof,knn_density",
        help="registered analyses to run in situ (default fof,knn_density)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--timing",
        choices=("snapshot", "total", "none"),
        default="snapshot",
        help="time the analyses per snapshot (one more solve per snapshot), in "
        "total (one more solve, analyses off), or not at all "
        "(default snapshot)",
    )
    parser.add_argument(
        "--out",
        default="halos_out",
        help="output folder for the catalogues and plots (default halos_out)",
    )
    return parser


def _parse_args(argv):
    """The command line: ``(parser, args, snapshots (sorted), pm_nc)``."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        snapshots = sorted(float(v) for v in args.snapshots.split(","))
    except ValueError:
        parser.error(f"--snapshots must be comma-separated scale factors, got {args.snapshots!r}")
    if not snapshots or snapshots[0] <= 0.1 or snapshots[-1] > 1.0:
        parser.error(f"--snapshots must lie in (0.1, 1], got {args.snapshots}")
    if len(set(snapshots)) < len(snapshots):
        parser.error(f"--snapshots repeats a scale factor, got {args.snapshots}")
    for flag in ("nc", "steps", "pm_factor", "min_members", "max_halos"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(
                f"--{flag.replace('_', '-')} must be a positive integer, got {getattr(args, flag)}"
            )
    if args.k < 2:  # the kNN density (and the peak) count k - 1 neighbours in the ball
        parser.error(f"--k must be at least 2, got {args.k}")
    for flag in ("box", "b"):
        if not 0 < getattr(args, flag) < math.inf:
            parser.error(f"--{flag} must be positive and finite, got {getattr(args, flag)}")
    if args.mesh is not None:
        try:
            args.mesh = tuple(int(v) for v in args.mesh.split(","))
        except ValueError:
            parser.error(f"--mesh must be two integers 'px,py', got {args.mesh!r}")
        if len(args.mesh) != 2 or min(args.mesh) < 1:
            parser.error(f"--mesh must be two positive integers 'px,py', got {args.mesh}")
    try:
        args.buffers = _parse_buffers(args.buffers)
    except (ValueError, TypeError, SyntaxError) as error:
        parser.error(f"--buffers: {error}")
    with_fof = "fof" in args.analyses.split(",")
    if args.m200m and not with_fof:
        parser.error("--m200m measures the FoF haloes: add fof to --analyses, or pass --no-m200m")
    args.m200m = with_fof if args.m200m is None else args.m200m
    return parser, args, snapshots, args.pm_factor * args.nc


def _parse_buffers(values: Sequence[str]) -> dict:
    """``--buffers`` values, ``"field=Config(knob=value, ...)"`` as a capacity error spells
    an ``InSitu`` keyword, as ``{field: config}``. Only config classes and literal values
    are read (nothing is evaluated)."""
    from .core import config as _config

    classes = {
        cls.__name__: cls
        for cls in (_config.DomainConfig, _config.FoFConfig, _config.KNNConfig, _config.SOConfig)
    }
    fields = {"domain": _config.DomainConfig, "fof": _config.FoFConfig, "knn": _config.KNNConfig}

    def build(node):
        if not isinstance(node, ast.Call):
            return ast.literal_eval(node)
        if not isinstance(node.func, ast.Name) or node.func.id not in classes or node.args:
            raise ValueError(
                f"expected one of {sorted(classes)} with keyword arguments, got "
                f"{ast.unparse(node)!r}"
            )
        return classes[node.func.id](**{kw.arg: build(kw.value) for kw in node.keywords})

    buffers = {}
    for value in values:
        field, _, text = value.partition("=")
        field = field.strip()
        if field not in fields:
            raise ValueError(f"{value!r} must start with one of {sorted(fields)} and '='")
        config = build(ast.parse(text.strip(), mode="eval").body)
        if type(config) is not fields[field]:
            raise ValueError(f"{field}= takes a {fields[field].__name__}, got {text.strip()!r}")
        buffers[field] = config
    return buffers


def _rerun_hint(failure, insitu) -> str:
    """What to pass the demo for a capacity ``failure`` of its in-situ run: ``--max-halos``
    for the catalogue's rows, else ``--buffers`` with the whole grown config, beside those
    of the other configs the run changed ('' when no setting fits)."""
    from .core.config import MAX_HALOS
    from .core.status import spell_config
    from .insitu.errors import changed_configs, insitu_config

    if failure.beyond_bound:
        return ""
    settings = failure.settings()
    if list(settings) == [MAX_HALOS]:
        return f" Here: rerun with --max-halos {settings[MAX_HALOS]}"
    attr, config = insitu_config(failure, insitu)
    # with the other configs this run changed, so that an earlier fix is not dropped
    buffers = {**changed_configs(insitu), attr: f"{attr}={spell_config(failure.grown(config))}"}
    return " Here: rerun with " + " ".join(f"--buffers '{b}'" for b in buffers.values())


def main(argv=None) -> int:
    parser, args, snapshots, pm_nc = _parse_args(argv)
    t_start = time.perf_counter()
    use_host_devices()
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType

    from . import units
    from .core.config import DomainConfig, FoFConfig, KNNConfig
    from .core.status import CapacityError
    from .insitu import REGISTRY, InSitu, check

    analyses = tuple(a for a in args.analyses.split(",") if a)
    if "knn_density" in analyses and "knn_density" not in REGISTRY:
        print(
            "note: the knn_density analysis is not registered in this version; running "
            f"{[a for a in analyses if a != 'knn_density']}",
            flush=True,
        )
        analyses = tuple(a for a in analyses if a != "knn_density")
    devices = jax.devices()
    shape = args.mesh or default_mesh_shape(len(devices))
    if math.prod(shape) > len(devices):
        parser.error(f"--mesh {shape} needs at most {len(devices)} devices")
    mesh = jax.make_mesh(
        shape,
        ("x", "y"),
        axis_types=(AxisType.Auto, AxisType.Auto),
        devices=devices[: math.prod(shape)],
    )
    cosmology = demo_cosmology()
    omega_m = cosmology["Omega_c"] + cosmology["Omega_b"]
    mass = units.particle_mass(omega_m, args.box, args.nc)
    fof = args.buffers.get("fof", FoFConfig())
    if args.max_halos is not None:
        fof = dataclasses.replace(fof, max_halos=args.max_halos)
    insitu = InSitu(
        box_size=args.box,
        analyses=analyses,
        b=args.b,
        min_members=args.min_members,
        k=args.k,
        omega_m=omega_m,
        overdensity=True,
        paint_absolute_pos=pm_nc != args.nc,
        pm_nc=pm_nc,
        so=("200m",) if args.m200m else (),
        centre=args.centre if args.m200m else "com",
        domain=args.buffers.get("domain", DomainConfig()),
        knn=args.buffers.get("knn", KNNConfig()),
        fof=fof,
    )
    lead = jax.process_index() == 0
    say = (lambda *a, **k: print(*a, **k, flush=True)) if lead else (lambda *a, **k: None)
    say(
        f"jaxpm_halos demo: {args.nc}^3 particles ({mass:.3g} Msun/h each), box {args.box:g} "
        f"Mpc/h, {args.steps} PM steps to a = {snapshots[-1]:g}, in-situ {list(analyses)} at "
        f"a = {snapshots} (b = {args.b:g}, >= {args.min_members} members, k = {args.k}), PM grid "
        f"{pm_nc}^3 ({args.box / pm_nc:g} Mpc/h cells"
        + (", JaxPM displacement mode" if pm_nc == args.nc else ", absolute positions")
        + f"), mesh {dict(mesh.shape)} on {len(devices)} {devices[0].platform} devices"
    )

    say("compiling the solve with the analyses inside (diffrax SaveAt fn) ...")
    result = run_simulation(
        args.nc,
        args.box,
        args.steps,
        snapshots,
        mesh=mesh,
        saveat_fn=switchable_saveat_fn(insitu, snapshots),
        seed=args.seed,
        a_final=snapshots[-1],
        progress=True,
        saveat_inputs=jnp.ones(len(snapshots), bool),
        pm_nc=pm_nc,
    )
    say(f"compiled in {result.compile_s:.1f} s; solve with in-situ analyses: {result.run_s:.2f} s")
    try:  # raises, naming the knob, if any buffer overflowed at any snapshot
        check(result.saved, insitu)
    except CapacityError as error:
        raise SystemExit(f"{error}{_rerun_hint(error.failure, insitu)}") from None
    t_off, t_snap = _time_analyses(result, args.timing, say)

    if lead:
        os.makedirs(args.out, exist_ok=True)
    catalogues = _write_catalogues(
        result.saved, snapshots, args, insitu, cosmology, mass, shape, pm_nc
    )
    rows = _snapshot_rows(result.saved, snapshots, catalogues, t_snap)
    if lead:
        _print_table(rows, t_off, args.steps, result.run_s, args.timing, args.k)
    _plot_final(result, catalogues[-1], snapshots[-1], args, cosmology, mass, pm_nc, lead)
    if lead:
        print(f"total wall time {time.perf_counter() - t_start:.1f} s")
    return 0


def _time_analyses(result: SimulationResult, timing: str, say):
    """``(t_off, t_snap)``: the compiled solve's time with the analyses off, and the
    analyses' time at each snapshot (``timing``: ``"snapshot"``, ``"total"`` or
    ``"none"``: None each)."""
    import jax.numpy as jnp

    n_snap = len(result.snapshots)
    if timing == "none":
        return None, [None] * n_snap
    say(
        "timing: the same compiled solve with the analyses off"
        + (" and with them on at single snapshots" if timing == "snapshot" and n_snap > 1 else "")
        + " ..."
    )
    with contextlib.redirect_stdout(io.StringIO()):  # no more progress meters
        _, _, t_off = result.rerun(jnp.zeros(n_snap, bool))
        if timing == "total":
            return t_off, [(result.run_s - t_off) / n_snap] * n_snap
        # on at snapshot i alone, for all but the last; the last one by difference with the
        # main run (all on), which saves a solve
        t_snap = [result.rerun(jnp.arange(n_snap) == i)[2] - t_off for i in range(n_snap - 1)]
    return t_off, t_snap + [result.run_s - t_off - sum(t_snap)]


def _write_catalogues(
    saved, snapshots, args, insitu, cosmology: dict, mass: float, shape, pm_nc: int
):
    """The FoF catalogue of each snapshot (None without FoF), each written to
    ``halos_a{a:.4f}.h5`` in ``args.out``."""
    import numpy as np

    from .io.catalogue import gather_catalogue, write_catalogue

    if "fof" not in saved:
        return [None] * len(snapshots)
    catalogues = []
    for i, a in enumerate(snapshots):
        cat = gather_catalogue(saved["fof"]["catalogue"], snapshot=i)
        write_catalogue(
            os.path.join(args.out, f"halos_a{a:.4f}.h5"),
            cat,
            box_size=args.box,
            nc=args.nc,
            a=a,
            cosmology=cosmology,
            linking_length=insitu.b * args.box / args.nc,
            b=insitu.b,
            min_members=insitu.min_members,
            units=dict(saved["fof"]["catalogue"].units),
            attrs=dict(
                particle_mass=mass,
                steps=args.steps,
                seed=args.seed,
                mesh=np.asarray(shape),
                pm_nc=pm_nc,
            ),
        )
        catalogues.append(cat)
    return catalogues


def _snapshot_rows(saved, snapshots, catalogues, t_snap):
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
            row["rho"] = float(np.median(_host(saved["knn_density"]["density"])[i] + 1))
        rows.append(row)
    return rows


def _plot_final(
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
    from . import from_jaxpm

    particles = from_jaxpm(
        result.state,
        box_size=args.box,
        mass=mass,
        paint_absolute_pos=result.paint_absolute_pos,
        pm_nc=result.pm_nc,
    )
    pos = _host(particles.pos)  # every process takes part in the gather
    if not lead or final is None:
        return
    from .plots import plot_density_slice, plot_mass_function

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
    _print_fit_ratios(final["mass"], so_mass, args, cosmology, mass, a)
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
    files = sorted(f for f in os.listdir(args.out) if f.startswith("halos_a"))
    written = files + [os.path.basename(mf), os.path.basename(sl)]
    print(f"wrote {', '.join(os.path.join(args.out, f) for f in written)}")


def _print_fit_ratios(fof_mass, so_mass, args, cosmology: dict, mass: float, a: float):
    """Halo counts below and above 100 particles against the Watson (FoF) and Tinker
    (M200m) fits."""
    from .plots import ratio_above

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


def _print_table(rows, t_off, steps, t_on, timing, k):
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
                "solve with them off (the last snapshot: the solve with all on "
                f"({t_on:.2f} s), minus the others)"
                if timing == "snapshot"
                else f"(the solve with all on ({t_on:.2f} s) - the solve with all off) / snapshots"
            )
            + ". The same compiled program runs each time (a traced flag and lax.cond switch "
            "the analyses), so compilation is not counted."
        )


if __name__ == "__main__":
    sys.exit(main())
