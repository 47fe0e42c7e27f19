"""The demo's command line: arguments, the run, and what to rerun with after an overflow."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import math
import os
import time
from collections.abc import Sequence

from ..simulation import (
    PM_FACTOR,
    default_mesh_shape,
    demo_cosmology,
    run_simulation,
    switchable_saveat_fn,
    use_host_devices,
)
from .report import (
    plot_final,
    print_table,
    snapshot_rows,
    time_analyses,
    write_run_directory,
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jaxpm_halos.demo",
        description="A distributed JaxPM run with in-situ FoF halo finding and kNN density "
        "(jaxpm_halos.InSitu inside diffrax's jitted solve). Writes a run directory (each "
        "snapshot's halo catalogue with member ids and merger links, the merger tree and a "
        "halo light cone, in HDF5) and plots of accretion histories, the mass function "
        "and a density slice.",
    )
    _simulation_arguments(parser)
    _halo_arguments(parser)
    _output_arguments(parser)
    return parser


def _simulation_arguments(parser: argparse.ArgumentParser) -> None:
    """The run: particles, box, steps, snapshots, mesh and PM grid."""
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
        default="0.5,0.625,0.75,0.875,1.0",
        help="scale factors of the in-situ snapshots; the run ends at the last (default "
        "0.5,0.625,0.75,0.875,1.0)",
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
    parser.add_argument("--seed", type=int, default=0, help="seed of the linear field")


def _halo_arguments(parser: argparse.ArgumentParser) -> None:
    """The in-situ analyses and their buffers."""
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


def _output_arguments(parser: argparse.ArgumentParser) -> None:
    """What is timed and where the files go."""
    parser.add_argument(
        "--timing",
        choices=("snapshot", "total", "none"),
        default="snapshot",
        help="time the analyses per snapshot (one more solve per snapshot and one with "
        "them off), in total (two more solves: all on, all off), or not at all "
        "(default snapshot)",
    )
    parser.add_argument(
        "--out",
        default="halos_out",
        help="output folder for the run directory (out/run) and plots (default halos_out)",
    )
    parser.add_argument(
        "--compilation-cache",
        default=os.path.join("~", ".cache", "jaxpm_halos", "xla"),
        help="folder of JAX's persistent compilation cache, which makes a rerun's first "
        "calls skip XLA's compilation ('none': off; default %(default)s)",
    )
    parser.add_argument(
        "--lightcone-z",
        type=float,
        default=0.1,
        help="redshift to which the run directory's halo light cone reaches, for an observer "
        "at the box centre (default 0.1; 0: none)",
    )


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
    from ..core import config as _config

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
    from ..core.config import MAX_HALOS
    from ..core.errors import spell_config
    from ..insitu.errors import changed_configs, insitu_config

    if failure.beyond_bound:
        return ""
    settings = failure.settings()
    if list(settings) == [MAX_HALOS]:
        return f" Here: rerun with --max-halos {settings[MAX_HALOS]}"
    attr, config = insitu_config(failure, insitu)
    # with the other configs this run changed, so that an earlier fix is not dropped
    buffers = {**changed_configs(insitu), attr: f"{attr}={spell_config(failure.grown(config))}"}
    return " Here: rerun with " + " ".join(f"--buffers '{b}'" for b in buffers.values())


def _analyses(args) -> tuple[str, ...]:
    """The registered analyses of ``--analyses``."""
    from ..insitu import REGISTRY

    analyses = tuple(a for a in args.analyses.split(",") if a)
    if "knn_density" in analyses and "knn_density" not in REGISTRY:
        print(
            "note: the knn_density analysis is not registered in this version; running "
            f"{[a for a in analyses if a != 'knn_density']}",
            flush=True,
        )
        analyses = tuple(a for a in analyses if a != "knn_density")
    return analyses


def _device_mesh(parser, args):
    """``(mesh, shape, devices)``: the ``--mesh`` over the first of the local devices."""
    import jax
    from jax.sharding import AxisType

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
    return mesh, shape, devices


def _insitu(args, analyses, omega_m: float, pm_nc: int):
    """The ``InSitu`` of the command line: FoF, kNN density and (``--m200m``) M200m."""
    from ..core.config import DomainConfig, FoFConfig, KNNConfig
    from ..insitu import InSitu

    fof = args.buffers.get("fof", FoFConfig())
    if args.max_halos is not None:
        fof = dataclasses.replace(fof, max_halos=args.max_halos)
    return InSitu(
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


def main(argv=None) -> int:
    parser, args, snapshots, pm_nc = _parse_args(argv)
    t_start = time.perf_counter()
    use_host_devices()
    import jax
    import jax.numpy as jnp

    if args.compilation_cache != "none":
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(args.compilation_cache))

    from .. import units
    from ..core.errors import CapacityError
    from ..insitu import check

    analyses = _analyses(args)
    mesh, shape, devices = _device_mesh(parser, args)
    cosmology = demo_cosmology()
    omega_m = cosmology["Omega_c"] + cosmology["Omega_b"]
    mass = units.particle_mass(omega_m, args.box, args.nc)
    insitu = _insitu(args, analyses, omega_m, pm_nc)
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
    t_off, t_snap, t_on = time_analyses(result, args.timing, say)

    if lead:
        os.makedirs(args.out, exist_ok=True)
    catalogues = write_run_directory(result.saved, snapshots, args, insitu, cosmology)
    rows = snapshot_rows(result.saved, snapshots, catalogues, t_snap)
    if lead:
        print_table(rows, t_off, args.steps, t_on, args.timing, args.k)
    plot_final(result, catalogues[-1], snapshots[-1], args, cosmology, mass, pm_nc, lead)
    if lead:
        print(f"total wall time {time.perf_counter() - t_start:.1f} s")
    return 0
