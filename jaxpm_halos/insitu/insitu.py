"""The JaxPM extension: registered analyses run in situ, inside diffrax's jitted solve.

JaxPM has no plugin mechanism of its own, so jaxpm_halos declares itself under the Python
entry-point group ``jaxpm.extensions`` (name ``halos``), pointing at :data:`EXTENSION`::

    from importlib.metadata import entry_points
    halos = entry_points(group="jaxpm.extensions")["halos"].load()
    insitu = halos.InSitu(box_size=128.0, analyses=("fof", "knn_density"))
    saveat = insitu.saveat(ts=[0.5, 1.0])      # a diffrax.SaveAt for diffeqsolve

At each saved time the state ``y = (displacement, momentum)`` is decomposed over the mesh
once (migration plus the widest ghost layer any selected analysis needs), every analysis
runs on that decomposition, and all per-particle outputs make one return trip together to
JaxPM's grid layout and sharding. FoF, whose layer is narrow, rebuilds only the ghosts of
its own width from the migrated particles when the shared layer is wider (kNN's).

Writing an analysis::

    @jaxpm_halos.register("mean_speed", outputs={"speed": "particle", "total": "device"})
    def mean_speed(snap: jaxpm_halos.Snapshot):
        v = snap.particles.vel                      # owned rows, km/s
        speed = jnp.linalg.norm(v, axis=-1)         # per particle (owned rows)
        return {"speed": speed, "total": jnp.sum(jnp.where(snap.valid, speed, 0))[None]}

Output kinds: ``"particle"`` leaves hold one value per owned row and come back in the
input's grid layout; ``"device"`` leaves are per-device arrays stacked along axis 0;
``"replicated"`` leaves are the same on every device (e.g. a :class:`Status`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ..core.catalogue import insitu_units
from ..core.config import DomainConfig, FoFConfig, KNNConfig, SOConfig
from ..core.domain import Decomposition
from ..core.ghosts import widest_linking_length
from ..fof._kernel import linking_length_misfit
from ..fof.fof import Extras, check_centre, halo_step, peak_densities, so_request
from ..core.frontend import local_fields, particles_of, prepare, program_cache
from ..core.geometry import grid_to_box
from .jaxpm import check_state_positions, resolve_pm_nc
from ..knn._search import ghost_width as knn_ghost_width, overdensity
from ..knn.knn import check_k, knn_density_on_plan, knn_on_decomposition
from ..core.layout import Pencils
from ..core.particles import Particles, _check_integer, check_real, check_scale_factor
from ..core.pipeline import (KINDS, JitProgram, Plan, Step, on_device, plan_for, replication_status,
                        run_sharded)
from ..so.so import resolve_radius
from ..core.retry import run_growing
from .saveloop import pin_to_save_loop, skip_no_step_save
from ..core.status import FailureKind, is_status, is_traced, spell_config
from .. import units


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """What an analysis sees on one device (inside ``shard_map``).

    Attributes:
      particles: the particles this device owns after migration (padded, valid first):
        positions in Mpc/h (box units), velocities in km/s, masses in Msun/h when the
        :class:`InSitu` knows ``omega_m`` (else 1), lattice ids.
      decomposition: the shared :class:`~jaxpm_halos.core.domain.Decomposition` (owned rows
        plus ghosts within ``plan.width``).
      plan: the decomposition's buffer sizes (:class:`~jaxpm_halos.core.pipeline.Plan`:
        ``pencils``, ``n0`` mean particles per device, ghost ``width``).
      a: the scale factor (traced scalar).
      insitu: the :class:`InSitu` settings.
      so_densities: ``(len(insitu.so),)`` threshold densities of ``insitu.so`` at ``a``
        (:func:`~jaxpm_halos.units.so_density`, comoving (Msun/h) / (Mpc/h)^3), computed
        as ``fof(so=..., a=...)`` computes them (see :meth:`InSitu.__call__`).
    """

    particles: Particles
    decomposition: Decomposition
    plan: Plan
    a: jax.Array
    insitu: "InSitu"
    memo: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    so_densities: jax.Array | None = None

    def shared(self, key: str, compute: Callable[[], Any]):
        """``compute()``, run once per snapshot however many analyses ask for ``key`` (the
        kNN search that both ``knn_density`` and FoF's density peaks use)."""
        if key not in self.memo:
            self.memo[key] = compute()
        return self.memo[key]

    def knn(self, k: int, *, mass=None, config: KNNConfig = KNNConfig()):
        """:func:`~jaxpm_halos.knn_on_decomposition` of the owned particles on this
        snapshot's own ghost layer (``self.width``). Spheres wider than the layer are
        completed across devices, so any width is exact; register the analysis with a
        ``width`` near the k-th neighbour distance to keep that pass small. Returns
        ``(result, status)``."""
        return knn_on_decomposition(self.pencils, self.decomposition, k, mass=mass,
                                    config=config, n0=self.n0)

    @property
    def pencils(self) -> Pencils:
        return self.plan.pencils

    @property
    def width(self) -> float:
        return self.plan.width

    @property
    def n0(self) -> int:
        return self.plan.n0

    @property
    def valid(self):
        """Owned-row mask."""
        return self.particles.valid()


@dataclasses.dataclass(frozen=True)
class Analysis:
    """A registered in-situ analysis.

    Attributes:
      name: registry key.
      run: ``run(snapshot) -> pytree`` on one device.
      outputs: output kinds, a prefix pytree of ``"particle" | "device" | "replicated"``.
      width: ``width(insitu, pencils) -> float``, the ghost layer the analysis needs (Mpc/h).
    """

    name: str
    run: Callable[[Snapshot], Any]
    outputs: Any
    width: Callable[["InSitu", Pencils], float]


REGISTRY: dict[str, Analysis] = {}
# Keys of InSitu's result beside the analyses' names: an analysis may not take them.
_RESERVED = ("a", "domain", "state")
# Bumped by every registration: compiled InSitu programs are keyed on it, so a name
# registered again runs its new function, not the program compiled with the old one.
_generation = [0]


def register(name: str, *, outputs: Any = "particle", width: Callable | float = 0.0):
    """Decorator registering ``fn(snapshot) -> pytree`` as an in-situ analysis.

    Registering a name again replaces that analysis (later calls run the new function).
    The names of the built-in analyses and of InSitu's other result keys (``"a"``,
    ``"domain"``, ``"state"``) are refused."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"an analysis name must be a non-empty string, not {name!r}")
    if name in _RESERVED:
        raise ValueError(f"{name!r} is a key of InSitu's result beside the analyses "
                         f"({', '.join(_RESERVED)}): choose another analysis name")
    builtin = REGISTRY.get(name)
    if builtin is not None and builtin.run.__module__ == __name__:
        raise ValueError(f"{name!r} is a built-in analysis of jaxpm_halos: register yours "
                         "under another name")

    unknown = [k for k in jax.tree.leaves(outputs) if k not in KINDS]
    if unknown:
        raise ValueError(f"analysis {name!r}: outputs= holds kinds {unknown}; each must be one "
                         f"of {KINDS}")

    def wrap(fn):
        width_fn = width if callable(width) else (lambda insitu, pencils, w=float(width): w)
        REGISTRY[name] = Analysis(name, fn, outputs, width_fn)
        _generation[0] += 1
        return fn

    return wrap


def analysis(name: str) -> Analysis:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"no in-situ analysis named {name!r}; registered: "
                         f"{sorted(REGISTRY)}") from None


# ----------------------------------------------------------------------------------------
# Built-in analyses


def _extras(insitu: "InSitu", pencils: Pencils) -> Extras:
    radius = resolve_radius(insitu.fof.so, insitu.box_size / insitu.nc, pencils) \
        if insitu.so else 0.0
    return Extras(insitu.so, insitu.centre, insitu.k, radius)


def _fof_width(insitu: "InSitu", pencils: Pencils) -> float:
    return _extras(insitu, pencils).width(insitu.linking_length, insitu.nc ** 3, pencils,
                                          insitu.knn)


@register("fof", outputs={"labels": "particle", "catalogue": "device"}, width=_fof_width)
def _fof_analysis(snap: Snapshot):
    """FoF labels (lattice index of each group's first particle) and the catalogue
    (positions Mpc/h, velocities km/s, masses Msun/h or particle counts), with SO masses
    (Msun/h) and radii (comoving Mpc/h) and density peaks when the InSitu asks."""
    insitu = snap.insitu
    extras = _extras(insitu, snap.pencils)
    densities = snap.so_densities if extras.so else None
    density = None
    if extras.centre == "peak":
        density = lambda dec: peak_densities(*_knn_density(snap))
    step = halo_step(snap.plan, insitu.linking_length, insitu.min_members, insitu.fof, extras,
                     densities, density)
    out = step.run(snap.decomposition)
    # Written into catalogue files: only here are the units of every field known.
    out["catalogue"] = dataclasses.replace(
        out["catalogue"], units=tuple(insitu_units(insitu.omega_m is not None, extras.so).items()))
    return out


def _knn_width(insitu: "InSitu", pencils: Pencils) -> float:
    return knn_ghost_width(insitu.k, insitu.nc ** 3, pencils, insitu.knn)


def _knn_density(snap: Snapshot):
    """``(density, status)`` of the owned particles, shared by ``knn_density`` and FoF's
    peaks (every particle has the same mass in situ: only the k-th neighbour is kept)."""
    insitu = snap.insitu
    plan = snap.plan.with_width(_knn_width(insitu, snap.pencils))
    return snap.shared("knn", lambda: knn_density_on_plan(plan, snap.decomposition, insitu.k,
                                                          insitu.knn, equal_masses=True))


@register("knn_density", outputs={"density": "particle", "status": "replicated"},
          width=_knn_width)
def _knn_density_analysis(snap: Snapshot):
    """kNN density ``(k - 1) m / (4/3 pi r_k^3)`` per particle, in (Msun/h) / (Mpc/h)^3 when
    the :class:`InSitu` knows ``omega_m`` (else particles per (Mpc/h)^3), or the overdensity
    ``rho / rho_mean - 1``. Exact: spheres that leave the ghost layer are completed across
    devices."""
    insitu = snap.insitu
    rho, status = _knn_density(snap)
    if insitu.overdensity:
        count = jnp.int32(insitu.nc ** 3)  # as the offline call counts them
        rho = overdensity(rho, count * snap.particles.mass[0], insitu.box_size)
    return {"density": rho, "status": status}


# ----------------------------------------------------------------------------------------
# The in-situ driver


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
    """

    box_size: float
    analyses: tuple[str, ...] = ("fof", "knn_density")
    b: float = 0.2
    min_members: int = 20
    k: int = 16
    omega_m: float | None = None
    overdensity: bool = False
    so: tuple[str, ...] = ()
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
        object.__setattr__(self, "analyses", (self.analyses,) if isinstance(self.analyses, str)
                           else tuple(self.analyses))
        for name in self.analyses:
            analysis(name)
        for name in ("box_size", "b") + (("omega_m",) if self.omega_m is not None else ()):
            object.__setattr__(self, name, _positive(name, getattr(self, name)))
        object.__setattr__(self, "min_members",
                           _check_integer("InSitu(min_members=...): min_members",
                                          self.min_members, 1))
        if "knn_density" in self.analyses or self.centre == "peak":
            object.__setattr__(self, "k", check_k(
                self.k, None if self.nc is None else self.nc ** 3, True, least=2,
                context=f"InSitu(k={self.k!r}): ", particles="the state holds nc**3 = {total}"))
        if self.nc is None:  # types only; pm_nc against nc once a state gives nc
            resolve_pm_nc(self.pm_nc or 1, self.pm_nc, self.paint_absolute_pos)
        else:
            object.__setattr__(self, "pm_nc",
                               resolve_pm_nc(self.nc, self.pm_nc, self.paint_absolute_pos))
        check_centre(self.centre)
        object.__setattr__(self, "so", (self.so,) if isinstance(self.so, str)
                           else tuple(self.so))
        if self.so:
            if self.omega_m is None:
                raise ValueError(f"InSitu(so={self.so!r}) needs omega_m= (the thresholds "
                                 "and the particle mass depend on it)")
            so_request(self.so, self.omega_m)  # names checked now, not in the solve
        if (self.so or self.centre != "com") and "fof" not in self.analyses:
            raise ValueError("InSitu(so=..., centre=...) add to the FoF catalogue: include "
                             "'fof' in analyses")
        for attr, inner in (("fof", self.fof.domain), ("knn", self.knn.domain),
                            ("fof", self.fof.so.domain)):
            if inner != DomainConfig():
                # Silently ignoring it would undo a fix pasted from an older message.
                raise ValueError(f"InSitu sizes its shared decomposition with its own "
                                 f"domain=; pass domain={spell_config(inner)} instead of "
                                 f"{attr}=...(domain=...)")
        if self.fof.knn != KNNConfig():
            raise ValueError(f"InSitu's density peaks use its knn= settings; pass "
                             f"knn={spell_config(self.fof.knn)} instead of fof=...(knn=...)")

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
        run = lambda insitu: _compiled(insitu, problem, jnp.dtype(y.dtype),
                                       _generation[0])(y, a, densities)
        if is_traced(y, a, densities):
            out = run(bound)
        else:
            out, _ = run_growing(run, bound, _first_failure, grow=grow, error=_error,
                                 spell=_spelling)
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
            raise TypeError("InSitu.saveat needs concrete save times (numbers or a numpy "
                            "array), not traced ones: they are checked, and the SO thresholds "
                            "computed, on the host. Build the SaveAt outside jit (or from "
                            "static times) and pass it into the jitted solve")
        ts = np.asarray(ts)
        check_real(ts, "snapshot times")  # not text (numpy would parse it), bool or complex
        ts = ts.astype(float)
        if ts.ndim > 1:
            raise ValueError(f"snapshot times must be one time or a 1-D sequence, got shape "
                             f"{ts.shape}")
        ts = ts.reshape(-1)
        if (t0 is None) != (t1 is None):
            raise ValueError(f"pass both of the solve's t0 and t1 (to check the snapshot times "
                             f"against them), or neither; got t0={t0}, t1={t1}")
        known = t0 is not None
        lo, hi = (min(t0, t1), max(t0, t1)) if known else (-np.inf, np.inf)
        if ts.size == 0 or not np.all(np.isfinite(ts) & (ts >= lo) & (ts <= hi)):
            raise ValueError(f"snapshot times {ts.tolist()} must be non-empty, finite and lie "
                             f"in [{t0}, {t1}]")
        steps = np.diff(ts)
        backward = t1 < t0 if known else bool(np.any(steps < 0))
        if np.any(steps > 0 if backward else steps < 0):
            order = "decreasing" if backward else "increasing"
            raise ValueError(f"snapshot times {ts.tolist()} must be sorted in the solve's "
                             f"direction ({order if known else 'one direction'}); pass "
                             f"{sorted(ts.tolist(), reverse=backward)}")
        return diffrax.SaveAt(ts=jnp.asarray(ts),
                              fn=skip_no_step_save(lambda t, y, args: self(y, t, times=ts)))


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
    number = (not isinstance(value, jax.core.Tracer) and np.ndim(value) == 0
              and np.asarray(value).dtype.kind in "iuf")  # not bool, str or complex
    if number and not isinstance(value, (int, float)):
        value = float(value)
    if not (number and value > 0 and math.isfinite(value)):
        raise ValueError(f"InSitu({name}={value!r}): {name} must be positive and finite "
                         "(a Python, numpy or concrete JAX scalar)")
    return value


def _check_linking_length(insitu: "InSitu", pencils: Pencils) -> None:
    """FoF's ghost layer (the linking length ``b * box_size / nc``) must fit in a pencil,
    and the linking length must stay below a third of the box, as :func:`jaxpm_halos.fof`
    requires."""
    l, box, nc = insitu.linking_length, insitu.box_size, insitu.nc
    misfit = linking_length_misfit(l, pencils)
    b_pencil = math.floor(widest_linking_length(pencils) * nc / box * 1000) / 1000
    if misfit == "box":  # with a b that fits the pencils too
        fits = f"b < nc / 3 = {nc / 3:g}" if b_pencil >= nc / 3 else f"b <= {b_pencil}"
        raise ValueError(f"InSitu(b={insitu.b}): the linking length b * box_size / nc = {l:g} "
                         f"must be below a third of the box {box:g}: use {fits}")
    if misfit == "pencil":
        raise ValueError(f"InSitu(b={insitu.b}): the linking length b * box_size / nc = {l:g} "
                         f"is wider than a pencil ({min(pencils.widths):g}) of the "
                         f"({pencils.px}, {pencils.py}) mesh; use b <= {b_pencil} or fewer "
                         "devices along that axis")


def _state_array(y):
    """``y`` checked to be a JaxPM state ``(2, nc, nc, nc, 3)``, in float32 unless wider."""
    if getattr(y, "ndim", None) != 5 or y.shape[0] != 2 or y.shape[-1] != 3 \
            or not y.shape[1] == y.shape[2] == y.shape[3]:
        raise ValueError(f"expected a JaxPM state of shape (2, nc, nc, nc, 3), got "
                         f"{getattr(y, 'shape', None)}")
    check_real(y, "the JaxPM state")  # a complex one would lose its imaginary part
    if jnp.issubdtype(y.dtype, jnp.floating) and jnp.finfo(y.dtype).bits >= 32:
        return y
    return y.astype(jnp.float32)


def check(outputs, insitu: "InSitu | None" = None) -> None:
    """Host-side: raise if any buffer of an in-situ run overflowed, at any snapshot.

    The error spells the setting as the ``InSitu`` argument holding the knob: the shared
    decomposition is sized by ``InSitu.domain``, FoF by ``InSitu.fof``, kNN by
    ``InSitu.knn``. Given the ``insitu`` that ran, the setting is that whole config with
    the overflowing knobs changed, next to the other configs it ran with that differ from
    the defaults (so earlier fixes are kept whichever config they changed); without it,
    the default config with those knobs. ``outputs`` may be the whole output or any part
    of it.
    """
    failure = _first_failure(outputs)
    if failure is not None:
        raise _error(failure, insitu)


_CONFIG_FIELD = {DomainConfig: "domain", FoFConfig: "fof", KNNConfig: "knn"}
_CONFIG_CLASS = {attr: cls for cls, attr in _CONFIG_FIELD.items()}


def _first_failure(outputs):
    """The first failure of any :class:`Status` in ``outputs`` (each analysis's own, which
    covers the shared decomposition too), or None. An overflow also grows the buffers of
    its config class that the other analyses' failures grow (``Failure.also``): each status
    sees the shared decomposition through its own buffers, so one suggestion holds them all
    and a pasted fix does not meet the next of them one rerun later."""
    failures = [status.failure() for status in jax.tree.leaves(
        outputs, is_leaf=is_status) if is_status(status)]
    failures = [f for f in failures if f is not None]
    if not failures or failures[0].kind is not FailureKind.OVERFLOW:
        return failures[0] if failures else None
    return failures[0].joined(failures[1:])


def _error(failure, insitu: "InSitu | None") -> Exception:
    if failure.limit is None:
        return failure.error()
    attr, config = insitu_config(failure, insitu)
    # The other configs the run changed are spelled too: a user who replaces an earlier
    # suggestion (say domain=...) with this one must not lose the earlier fix.
    changed = {} if insitu is None else changed_configs(insitu)
    parts = {a: text.replace("{", "{{").replace("}", "}}") for a, text in changed.items()}
    parts[attr] = f"{attr}={{}}"  # the grown config goes here
    spelled = ", ".join(parts[a] for a in _CONFIG_FIELD.values() if a in parts)
    return failure.error(config, f"InSitu({spelled})")


def insitu_config(failure, insitu: "InSitu | None") -> tuple[str, object]:
    """``(attr, config)``: the ``InSitu`` field holding the overflowing knob of ``failure``
    and the config it ran with (the default one without ``insitu``)."""
    owner = failure.limit.knob.owner
    attr = "fof" if owner is SOConfig else _CONFIG_FIELD[owner]  # SO settings: fof.so
    return attr, getattr(insitu, attr) if insitu is not None else _CONFIG_CLASS[attr]()


def changed_configs(insitu: InSitu) -> dict[str, str]:
    """``{attr: "attr=Config(...)"}`` for each config of ``insitu`` that differs from its
    default, in ``InSitu``'s order."""
    return {attr: f"{attr}={spell_config(getattr(insitu, attr))}"
            for attr in _CONFIG_FIELD.values()
            if getattr(insitu, attr) != type(getattr(insitu, attr))()}


def _spelling(insitu: InSitu) -> str:
    """The ``InSitu`` arguments of the configs that differ from the defaults."""
    return f"InSitu({', '.join(changed_configs(insitu).values())})"


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
                raise ValueError(f"the state must be sharded over its grid's first two axes, "
                                 f"like P(None, 'x', 'y'); got {sharding.spec}")
            mesh = sharding.mesh
    problem, _, _ = prepare(jax.ShapeDtypeStruct(y.shape[1:], y.dtype), insitu.box_size,
                            mesh=mesh)
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
                f"register it with a smaller width=, or run on fewer devices along an axis")


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
                return an.run(Snapshot(particles_of(dec.migrated, box), dec, plan, a, insitu,
                                       memo, so_densities))
            return Step(run, an.outputs)

        steps = {an.name: step(an) for an in selected}
        valid = jnp.ones(fields["pos"].shape[0], bool)
        outputs, kinds = on_device(plan, fields, valid, block, steps)
        # Same leaves as before (an empty flag array becomes one per checked output).
        outputs["domain"] = outputs["domain"].merge(replication_status(
            pencils, {an.name: outputs[an.name] for an in selected},
            {an.name: an.outputs for an in selected}))
        return {"a": a, **outputs}, {"a": "replicated", **kinds}

    state_spec = P(None, *layout.spec, None)
    # pin_to_save_loop: see _saveloop (one save time ran the analyses at every step).
    return JitProgram(lambda y, a, so_densities: run_sharded(
        layout, device, (pin_to_save_loop(y), a, so_densities), (state_spec, P(), P())))


def _grid_positions(disp, pencils: Pencils, nc: int):
    """Lattice point plus displacement, in grid units, for this device's block."""
    bx, by, bz = disp.shape[:3]
    i, j = pencils.coords()
    qx = (i * bx + jnp.arange(bx))[:, None, None]
    qy = (j * by + jnp.arange(by))[None, :, None]
    qz = jnp.arange(bz)[None, None, :]
    q = jnp.stack(jnp.broadcast_arrays(qx, qy, qz), axis=-1).astype(disp.dtype)
    return q + disp


@dataclasses.dataclass(frozen=True)
class Extension:
    """The object behind the ``jaxpm.extensions`` entry point ``halos``."""

    name: str
    registry: Mapping[str, Analysis]
    InSitu: type
    register: Callable

    @property
    def analyses(self) -> tuple[str, ...]:
        return tuple(sorted(self.registry))


EXTENSION = Extension("halos", REGISTRY, InSitu, register)
