"""``InSitu``: registered analyses run inside diffrax's jitted solve of a JaxPM run.

``insitu.saveat(ts=...)`` gives the ``diffrax.SaveAt`` whose ``fn`` runs the analyses at
each saved time (:mod:`jaxpm_halos.insitu.registry` says what an analysis sees); calling
``insitu(y, a)`` runs them on one state. One compiled program per state layout, settings
and registry generation; buffers that overflow outside ``jit`` are grown and the call
rerun (:mod:`jaxpm_halos.core.retry`).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from .. import units
from ..core.config import DomainConfig, FoFConfig, KNNConfig
from ..core.errors import spell_config
from ..core.frontend import local_fields, particles_of, prepare, program_cache
from ..core.geometry import grid_to_box
from ..core.ghosts import widest_linking_length
from ..core.layout import Pencils
from ..core.particles import _check_integer, check_real, check_scale_factor
from ..core.pipeline import JitProgram, Step, on_device, plan_for, replication_status, run_sharded
from ..core.retry import run_growing
from ..core.status import is_traced
from ..fof._kernel import linking_length_misfit
from ..fof.fof import check_centre, so_request
from ..knn.knn import check_k
from ..so.so import check_smoothing
from .errors import first_failure, insitu_error, spelling
from .jaxpm import check_state_positions, resolve_pm_nc
from .registry import Analysis, Snapshot, _generation, analysis
from .saveloop import pin_to_save_loop, skip_no_step_save


@dataclasses.dataclass(frozen=True)
class InSitu:
    """In-situ halo finding and kNN density for a JaxPM run.

    Attributes:
      box_size: box side in Mpc/h.
      analyses: names of registered analyses to run at every snapshot.
      b: FoF linking length in units of the mean particle separation ``box_size / nc``
        (positive; the linking length must fit in a pencil of the mesh and stay below a
        third of the box).
      min_members: smallest FoF group in the catalogue (an integer >= 1).
      k: neighbours for ``knn_density``, an integer with ``2 <= k < nc**3``.
      omega_m: total matter density; when given, masses are in Msun/h (else 1 per particle).
      overdensity: ``knn_density`` returns ``rho / rho_mean - 1`` instead of rho.
      so: spherical-overdensity definitions for the FoF catalogue, e.g.
        ``("200c", "200m", "vir")`` (:func:`~jaxpm_halos.units.so_density` at each
        snapshot's ``a``; needs ``omega_m``): the catalogue's ``so`` holds ``m200c``
        (Msun/h) and ``r200c`` (comoving Mpc/h), and so on, about the halo's centre. The
        largest radius searched is ``fof.so.radius``.
      so_smoothing: the smooth SO definition's relative width (``smoothing`` of
        :func:`~jaxpm_halos.spherical_overdensity`): the catalogue's SO masses and radii
        then have derivatives with respect to the state (FoF membership held fixed).
      centre: ``"com"`` (centre of mass) or ``"peak"`` (the member with the highest kNN
        density of ``k`` neighbours, from the same search as ``knn_density``): the SO
        centre, stored as the catalogue's ``peak``.
      save_state: also save the state ``y`` itself at each snapshot.
      mesh: the device mesh; default: the state's (abstract) mesh.
      domain: the buffers of the decomposition shared by every analysis (FoF's z images
        and kNN's included).
      fof, knn: the analyses' own buffers (leave their ``domain`` unset: ``domain`` above
        sizes the one decomposition, and a nested one is refused).
      paint_absolute_pos: the state's ``y[0]`` holds absolute positions in cells of the PM
        grid (JaxPM's ``paint_absolute_pos=True``; the demo's ``run_simulation(pm_nc=...)``)
        instead of displacements in lattice cells (the default, JaxPM's distributed mode).
        The array index of a particle is still its lattice point, which gives its id.
      pm_nc: PM grid cells per side (default: the lattice's ``nc``); with
        ``paint_absolute_pos`` it may differ from ``nc`` (e.g. ``2 * nc``). Positions are
        ``wrap(y[0] * box_size / pm_nc)`` Mpc/h and velocities ``H0 (box_size / pm_nc)
        y[1] / a`` km/s (see :func:`jaxpm_halos.units.momentum_to_velocity`: the momentum
        is in PM cells). The particle mass and the linking length ``b box_size / nc``
        still use the particle lattice's ``nc``.

    A state whose mode or ``pm_nc`` is wrong raises ValueError when it is concrete (the
    mean-position test of :func:`jaxpm_halos.insitu.jaxpm.check_state_positions`); inside
    ``jit`` it cannot be checked.

    Examples:
        The analyses on one JaxPM state ``(displacements, momenta)`` of 16^3 particles in
        a 32 Mpc/h box, sharded as JaxPM shards it (in a run, pass
        ``saveat=insitu.saveat(ts=[0.5, 1.0])`` to ``diffrax.diffeqsolve`` instead):

        >>> import jax, numpy as np
        >>> import jaxpm_halos
        >>> from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
        >>> mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
        >>> y = np.zeros((2, 16, 16, 16, 3), np.float32)  # particles on their lattice points
        >>> y = jax.device_put(y, NamedSharding(mesh, P(None, "x", "y")))
        >>> insitu = jaxpm_halos.InSitu(box_size=32.0, analyses=("fof", "knn_density"), k=8)
        >>> out = insitu(y, a=1.0)
        >>> jaxpm_halos.check_insitu(out)  # raises if any buffer overflowed
        >>> sorted(out), out["knn_density"]["density"].shape  # densities in the state's layout
        (['a', 'domain', 'fof', 'knn_density'], (16, 16, 16))
        >>> len(out["fof"]["catalogue"].to_numpy()["id"])  # a uniform lattice has no haloes
        0
    """

    box_size: float
    analyses: tuple[str, ...] = ("fof", "knn_density")
    b: float = 0.2
    min_members: int = 20
    k: int = 16
    omega_m: float | None = None
    overdensity: bool = False
    so: tuple[str, ...] = ()
    so_smoothing: float | None = None
    centre: str = "com"
    save_state: bool = False
    mesh: Any = None
    domain: DomainConfig = dataclasses.field(default_factory=DomainConfig)
    fof: FoFConfig = dataclasses.field(default_factory=FoFConfig)
    knn: KNNConfig = dataclasses.field(default_factory=KNNConfig)
    paint_absolute_pos: bool = False
    pm_nc: int | None = None
    nc: int | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self):
        object.__setattr__(
            self,
            "analyses",
            (self.analyses,) if isinstance(self.analyses, str) else tuple(self.analyses),
        )
        for name in self.analyses:
            analysis(name)
        for name in ("box_size", "b") + (("omega_m",) if self.omega_m is not None else ()):
            object.__setattr__(self, name, _positive(name, getattr(self, name)))
        object.__setattr__(
            self,
            "min_members",
            _check_integer("InSitu(min_members=...): min_members", self.min_members, 1),
        )
        if "knn_density" in self.analyses or self.centre == "peak":
            object.__setattr__(
                self,
                "k",
                check_k(
                    self.k,
                    None if self.nc is None else self.nc**3,
                    True,
                    least=2,
                    context=f"InSitu(k={self.k!r}): ",
                    particles="the state holds nc**3 = {total}",
                ),
            )
        if self.nc is None:  # types only; pm_nc against nc once a state gives nc
            resolve_pm_nc(self.pm_nc or 1, self.pm_nc, self.paint_absolute_pos)
        else:
            object.__setattr__(
                self, "pm_nc", resolve_pm_nc(self.nc, self.pm_nc, self.paint_absolute_pos)
            )
        check_centre(self.centre)
        object.__setattr__(self, "so", (self.so,) if isinstance(self.so, str) else tuple(self.so))
        if self.so:
            if self.omega_m is None:
                raise ValueError(
                    f"InSitu(so={self.so!r}) needs omega_m= (the thresholds "
                    "and the particle mass depend on it)"
                )
            so_request(self.so, self.omega_m)  # names checked now, not in the solve
        object.__setattr__(self, "so_smoothing", check_smoothing(self.so_smoothing))
        if self.so_smoothing is not None and not self.so:
            raise ValueError("InSitu(so_smoothing=...) smooths the SO masses of so=: pass so=")
        if (self.so or self.centre != "com") and "fof" not in self.analyses:
            raise ValueError(
                "InSitu(so=..., centre=...) add to the FoF catalogue: include 'fof' in analyses"
            )
        for attr, inner in (
            ("fof", self.fof.domain),
            ("knn", self.knn.domain),
            ("fof", self.fof.so.domain),
        ):
            if inner != DomainConfig():
                # Silently ignoring it would undo a fix pasted from an older message.
                raise ValueError(
                    f"InSitu sizes its shared decomposition with its own "
                    f"domain=; pass domain={spell_config(inner)} instead of "
                    f"{attr}=...(domain=...)"
                )
        if self.fof.knn != KNNConfig():
            raise ValueError(
                f"InSitu's density peaks use its knn= settings; pass "
                f"knn={spell_config(self.fof.knn)} instead of fof=...(knn=...)"
            )

    @property
    def linking_length(self) -> float:
        return self.b * self.box_size / self._nc

    @property
    def _nc(self) -> int:
        if self.nc is None:
            raise ValueError("the grid size is known once a state is given")
        return self.nc

    def __call__(self, y, a=1.0, *, grow: bool = True, times=None):
        """Run the analyses on a state ``y`` of shape ``(2, nc, nc, nc, 3)`` at scale factor
        ``a``. Returns ``{name: outputs, "a": a, "domain": Status[, "state": y]}``.

        Works inside ``jit`` (e.g. in a diffrax ``SaveAt`` function), where the statuses
        report overflows (:func:`check`), and outside, where a buffer that overflowed is
        grown and the analyses run again (``grow=False``: raise an error naming a setting
        that fits). An integer
        or half-precision state is computed in float32; a boolean or complex one raises
        ``ValueError``.

        SO thresholds (``so=``) are those of ``fof(so=..., omega_m=..., a=a)``, computed
        in float64 from ``a`` when it is concrete, and, when ``a`` is traced, from the
        one of ``times`` (the save times, as given: :meth:`saveat` passes its own) that
        it equals in the state's precision. A traced ``a`` that is none of them is computed
        in the state's precision, which can put a threshold an ulp away.
        """
        y = _state_array(y)
        bound = dataclasses.replace(self, nc=int(y.shape[1]))
        problem = _state_layout(bound, y)
        check_state_positions(y[0], bound.nc, bound.pm_nc, bound.paint_absolute_pos)
        if "fof" in bound.analyses:
            _check_linking_length(bound, problem.pencils)
        # Velocities are momenta over a: a = 0, NaN or -1 gave NaN or flipped velocities.
        given, a = a, jnp.asarray(a, y.dtype)
        if a.size != 1:
            raise ValueError(f"a must be one scale factor, got an array of shape {a.shape}")
        check_scale_factor(a)  # in the state's precision: 1e-50 is 0 in float32
        densities = _so_densities(bound, given, a, times)
        run = lambda insitu: _compiled(insitu, problem, jnp.dtype(y.dtype), _generation[0])(
            y, a, densities
        )
        if is_traced(y, a, densities):
            out = run(bound)
        else:
            out, _ = run_growing(
                run, bound, first_failure, grow=grow, error=insitu_error, spell=spelling
            )
        if bound.save_state:
            out["state"] = y
        return out

    def saveat(self, ts, *, t0: float | None = None, t1: float | None = None):
        """A ``diffrax.SaveAt(ts=ts, fn=...)`` running the analyses at each time in ``ts``.

        ``ts`` must be finite and in the solve's direction (increasing from ``t0`` to
        ``t1``, decreasing for a backward solve). Pass the solve's ``t0`` and ``t1`` (both
        or neither) to have times outside them or against the solve's direction rejected
        here; without them, either order is taken. diffrax checks them only inside the
        solve, and on a mesh its check fails on one device while the others wait in a
        collective, which aborts the process.
        Outputs come back stacked over snapshots; check them with :func:`check`.
        """
        import diffrax

        if is_traced(ts):
            raise TypeError(
                "InSitu.saveat needs concrete save times (numbers or a numpy "
                "array), not traced ones: they are checked, and the SO thresholds "
                "computed, on the host. Build the SaveAt outside jit (or from "
                "static times) and pass it into the jitted solve"
            )
        ts = np.asarray(ts)
        check_real(ts, "snapshot times")  # not text (numpy would parse it), bool or complex
        ts = ts.astype(float)
        if ts.ndim > 1:
            raise ValueError(
                f"snapshot times must be one time or a 1-D sequence, got shape {ts.shape}"
            )
        ts = ts.reshape(-1)
        if (t0 is None) != (t1 is None):
            raise ValueError(
                f"pass both of the solve's t0 and t1 (to check the snapshot times "
                f"against them), or neither; got t0={t0}, t1={t1}"
            )
        known = t0 is not None
        lo, hi = (min(t0, t1), max(t0, t1)) if known else (-np.inf, np.inf)
        if ts.size == 0 or not np.all(np.isfinite(ts) & (ts >= lo) & (ts <= hi)):
            raise ValueError(
                f"snapshot times {ts.tolist()} must be non-empty, finite and lie in [{t0}, {t1}]"
            )
        steps = np.diff(ts)
        backward = t1 < t0 if known else bool(np.any(steps < 0))
        if np.any(steps > 0 if backward else steps < 0):
            order = "decreasing" if backward else "increasing"
            raise ValueError(
                f"snapshot times {ts.tolist()} must be sorted in the solve's "
                f"direction ({order if known else 'one direction'}); pass "
                f"{sorted(ts.tolist(), reverse=backward)}"
            )
        _quiet_integer_fill()
        return diffrax.SaveAt(
            ts=jnp.asarray(ts), fn=skip_no_step_save(lambda t, y, args: self(y, t, times=ts))
        )


def _quiet_integer_fill() -> None:
    """Silence numpy's "invalid value encountered in cast" from JAX's ``lax`` module.

    diffrax fills its output buffers with inf (and refills unsaved rows with it); for the
    integer outputs (labels, ids, counts) JAX casts that inf to int while tracing, and numpy
    warns at every trace of the user's solve. The rows are overwritten. The filter matches
    only that message from that module."""
    warnings.filterwarnings(
        "ignore", "invalid value encountered in cast", RuntimeWarning, r"jax\._src\.lax\.lax"
    )


def _so_densities(insitu: InSitu, given, a, times):
    """``(D,)`` threshold densities of ``insitu.so`` at the scale factor ``a`` (in its
    dtype), as ``fof(so=..., a=given)`` computes them: in float64 on the host when ``given``
    is concrete, and when it is traced but one of the save ``times``, by looking the
    host's values at those times up (diffrax passes the time traced); else in ``a``'s
    precision."""
    at = lambda t: [units.so_density(name, omega_m=insitu.omega_m, a=t) for name in insitu.so]
    if not insitu.so:
        return jnp.zeros((0,), a.dtype)
    if not isinstance(given, jax.core.Tracer):
        return jnp.asarray(np.asarray(at(np.asarray(given).item())), a.dtype)
    traced = jnp.stack([jnp.asarray(d, a.dtype) for d in at(a)])
    if times is None:
        return traced
    times = np.asarray(times, float).reshape(-1)
    if times.size == 0:
        raise ValueError("times: the save times a traced a may be one of; got none")
    table = jnp.asarray(np.asarray([at(float(t)) for t in times]), a.dtype)  # (S, D)
    saved = jnp.asarray(times, a.dtype)  # (S,) as diffrax holds them
    nearest = jnp.argmin(jnp.abs(saved - a))
    return jnp.where(saved[nearest] == a, table[nearest], traced)


def _positive(name: str, value) -> float:
    """``value`` (a concrete JAX or numpy scalar as a float: the config is hashed),
    refused unless a positive finite number."""
    number = (
        not isinstance(value, jax.core.Tracer)
        and np.ndim(value) == 0
        and np.asarray(value).dtype.kind in "iuf"
    )  # not bool, str or complex
    if number and not isinstance(value, (int, float)):
        value = float(value)
    if not (number and value > 0 and math.isfinite(value)):
        raise ValueError(
            f"InSitu({name}={value!r}): {name} must be positive and finite "
            "(a Python, numpy or concrete JAX scalar)"
        )
    return value


def _check_linking_length(insitu: InSitu, pencils: Pencils) -> None:
    """FoF's ghost layer (the linking length ``b * box_size / nc``) must fit in a pencil,
    and the linking length must stay below a third of the box, as :func:`jaxpm_halos.fof`
    requires."""
    l, box, nc = insitu.linking_length, insitu.box_size, insitu.nc
    misfit = linking_length_misfit(l, pencils)
    b_pencil = math.floor(widest_linking_length(pencils) * nc / box * 1000) / 1000
    if misfit == "box":  # with a b that fits the pencils too
        fits = f"b < nc / 3 = {nc / 3:g}" if b_pencil >= nc / 3 else f"b <= {b_pencil}"
        raise ValueError(
            f"InSitu(b={insitu.b}): the linking length b * box_size / nc = {l:g} "
            f"must be below a third of the box {box:g}: use {fits}"
        )
    if misfit == "pencil":
        raise ValueError(
            f"InSitu(b={insitu.b}): the linking length b * box_size / nc = {l:g} "
            f"is wider than a pencil ({min(pencils.widths):g}) of the "
            f"({pencils.px}, {pencils.py}) mesh; use b <= {b_pencil} or fewer "
            "devices along that axis"
        )


def _state_array(y):
    """``y`` checked to be a JaxPM state ``(2, nc, nc, nc, 3)``, in float32 unless wider."""
    if (
        getattr(y, "ndim", None) != 5
        or y.shape[0] != 2
        or y.shape[-1] != 3
        or not y.shape[1] == y.shape[2] == y.shape[3]
    ):
        raise ValueError(
            f"expected a JaxPM state of shape (2, nc, nc, nc, 3), got {getattr(y, 'shape', None)}"
        )
    check_real(y, "the JaxPM state")  # a complex one would lose its imaginary part
    if jnp.issubdtype(y.dtype, jnp.floating) and jnp.finfo(y.dtype).bits >= 32:
        return y
    return y.astype(jnp.float32)


def _state_layout(insitu: InSitu, y):
    mesh = insitu.mesh
    if mesh is None and is_traced(y):
        abstract = jax.typeof(y).sharding.mesh
        mesh = abstract if abstract.size > 1 else None
    if mesh is None and not is_traced(y):
        sharding = getattr(y, "sharding", None)
        if hasattr(sharding, "mesh") and sharding.mesh.size > 1:
            spec = tuple(sharding.spec) + (None,) * 5
            if spec[0] is not None or any(s is not None for s in spec[3:]):
                raise ValueError(
                    f"the state must be sharded over its grid's first two axes, "
                    f"like P(None, 'x', 'y'); got {sharding.spec}"
                )
            mesh = sharding.mesh
    problem, _, _ = prepare(jax.ShapeDtypeStruct(y.shape[1:], y.dtype), insitu.box_size, mesh=mesh)
    return problem


def _check_widths(widths: dict, pencils: Pencils) -> None:
    """Every analysis's ghost layer must fit in a pencil: name the one that does not."""
    most = min(pencils.widths)
    for name, width in widths.items():
        if not 0 <= width <= most:
            raise ValueError(
                f"in-situ analysis {name!r} asks for a ghost layer of {width:g} (Mpc/h, the "
                f"box's unit), but it must lie in [0, {most:g}], the narrower pencil side of "
                f"the ({pencils.px}, {pencils.py}) mesh in a box of {pencils.box_size:g}: "
                f"register it with a smaller width=, or run on fewer devices along an axis"
            )


@program_cache(16)
def _compiled(insitu: InSitu, problem, dtype, generation: int):
    """The jitted InSitu program; ``generation`` (the registry's) keys it on the analyses'
    functions."""
    layout, pencils = problem.layout, problem.pencils
    selected = [analysis(name) for name in insitu.analyses]
    widths = {a.name: a.width(insitu, pencils) for a in selected}
    _check_widths(widths, pencils)
    width = max(list(widths.values()) + [0.0])
    plan = plan_for(problem, insitu.domain, width)
    nc, box, pm_nc = insitu.nc, insitu.box_size, insitu.pm_nc
    mass = units.particle_mass(insitu.omega_m, box, nc) if insitu.omega_m else 1.0

    def device(state, a, so_densities):
        disp, mom = state[0], state[1]
        if insitu.paint_absolute_pos:
            # absolute positions in PM cells; the block's array indices stay lattice points
            pos = grid_to_box(disp, pm_nc, box)
        else:
            pos = grid_to_box(_grid_positions(disp, pencils, nc), nc, box)
        fields, block = local_fields(problem, pos)
        # the momentum is in the state's length unit (PM cells) per unit of a^3 E(a)
        fields["vel"] = units.momentum_to_velocity(mom.reshape(-1, 3), a, box, pm_nc)
        fields["mass"] = jnp.full(fields["pos"].shape[0], mass, disp.dtype)

        memo = {}  # one per snapshot: work analyses share (the kNN search)

        def step(an: Analysis) -> Step:
            def run(dec):
                return an.run(
                    Snapshot(
                        particles_of(dec.migrated, box), dec, plan, a, insitu, memo, so_densities
                    )
                )

            return Step(run, an.outputs)

        steps = {an.name: step(an) for an in selected}
        valid = jnp.ones(fields["pos"].shape[0], bool)
        outputs, kinds = on_device(plan, fields, valid, block, steps)
        # Same leaves as before (an empty flag array becomes one per checked output).
        outputs["domain"] = outputs["domain"].merge(
            replication_status(
                pencils,
                {an.name: outputs[an.name] for an in selected},
                {an.name: an.outputs for an in selected},
            )
        )
        return {"a": a, **outputs}, {"a": "replicated", **kinds}

    state_spec = P(None, *layout.spec, None)
    # pin_to_save_loop: see _saveloop (one save time ran the analyses at every step).
    return JitProgram(
        lambda y, a, so_densities: run_sharded(
            layout, device, (pin_to_save_loop(y), a, so_densities), (state_spec, P(), P())
        )
    )


def _grid_positions(disp, pencils: Pencils, nc: int):
    """Lattice point plus displacement, in grid units, for this device's block."""
    bx, by, bz = disp.shape[:3]
    i, j = pencils.coords()
    qx = (i * bx + jnp.arange(bx))[:, None, None]
    qy = (j * by + jnp.arange(by))[None, :, None]
    qz = jnp.arange(bz)[None, None, :]
    q = jnp.stack(jnp.broadcast_arrays(qx, qy, qz), axis=-1).astype(disp.dtype)
    return q + disp
