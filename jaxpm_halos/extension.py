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
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ._config import FoFConfig, KNNConfig
from ._domain import (Decomposition, decompose, domain_status, pmax_all, return_trip,
                      with_ghosts)
from ._fof import fof_on_decomposition, ghost_width as fof_ghost_width
from ._knn import density_from, ghost_width as knn_ghost_width, knn_on_decomposition
from ._frontend import local_fields, prepare, program_cache
from ._geometry import grid_to_box
from ._layout import Pencils, width_fraction
from ._particles import Particles
from ._saveloop import pin_to_save_loop
from ._status import Limit, Status, is_traced
from . import units

_KINDS = ("particle", "device", "replicated")


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """What an analysis sees on one device (inside ``shard_map``).

    Attributes:
      particles: the particles this device owns after migration (padded, valid first):
        positions in Mpc/h (box units), velocities in km/s, masses in Msun/h when the
        :class:`InSitu` knows ``omega_m`` (else 1), lattice ids.
      decomposition: the shared :class:`~jaxpm_halos._domain.Decomposition` (owned rows
        plus ghosts within ``width``).
      pencils: the static pencil decomposition (mesh axis names, sizes, box).
      a: the scale factor (traced scalar).
      width: the ghost layer width of the decomposition.
      n0: mean particles per device.
      insitu: the :class:`InSitu` settings.
    """

    particles: Particles
    decomposition: Decomposition
    pencils: Pencils
    a: jax.Array
    width: float
    n0: int
    insitu: "InSitu"

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


def register(name: str, *, outputs: Any = "particle", width: Callable | float = 0.0):
    """Decorator registering ``fn(snapshot) -> pytree`` as an in-situ analysis."""

    def wrap(fn):
        width_fn = width if callable(width) else (lambda insitu, pencils, w=float(width): w)
        REGISTRY[name] = Analysis(name, fn, outputs, width_fn)
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


def _fof_width(insitu: "InSitu", pencils: Pencils) -> float:
    return fof_ghost_width(insitu.linking_length, insitu.box_size)


@register("fof", outputs={"labels": "particle", "catalogue": "device"}, width=_fof_width)
def _fof_analysis(snap: Snapshot):
    """FoF labels (lattice index of each group's first particle) and the catalogue
    (positions Mpc/h, velocities km/s, masses Msun/h or particle counts)."""
    insitu = snap.insitu
    pencils, decomposition, width = snap.pencils, snap.decomposition, snap.width
    own = _fof_width(insitu, pencils)
    ghost_status = None
    if width > own * (1 + 1e-6):
        # A wider layer (kNN's) would only add rows for FoF to sort and scan: FoF took
        # 0.79 s on kNN's layer against 0.36 s on its own (64^3, 8 devices).
        rows = _ghost_rows(insitu, pencils, snap.n0, own)
        shared = decomposition
        decomposition = with_ghosts(pencils, decomposition.migrated, own, rows)
        width = own
        # The shared layer rides along so that an overflow here suggests a ghost_factor
        # that fits both buffers: setting it sizes them alike.
        needs = {"fof ghosts": decomposition.need_ghosts, "shared ghosts": shared.need_ghosts}
        knob = "DomainConfig.ghost_factor"
        limits = (("fof ghosts", Limit(knob, rows, snap.n0)),
                  ("shared ghosts", Limit(knob, _ghost_rows(insitu, pencils, snap.n0,
                                                            snap.width), snap.n0)))
        ghost_status = Status(pmax_all(pencils, needs), jnp.int32(0), limits)
    labels, catalogue = fof_on_decomposition(pencils, decomposition, insitu.linking_length,
                                             width, insitu.min_members, insitu.fof, snap.n0)
    if ghost_status is not None:
        catalogue = dataclasses.replace(catalogue, status=catalogue.status.merge(ghost_status))
    return {"labels": labels, "catalogue": dataclasses.replace(catalogue, num=catalogue.num[None])}


def _knn_width(insitu: "InSitu", pencils: Pencils) -> float:
    return knn_ghost_width(insitu.k, insitu.nc ** 3, pencils, insitu.knn)


@register("knn_density", outputs={"density": "particle", "status": "replicated"},
          width=_knn_width)
def _knn_density_analysis(snap: Snapshot):
    """kNN density ``(k - 1) m / (4/3 pi r_k^3)`` per particle, in (Msun/h) / (Mpc/h)^3 when
    the :class:`InSitu` knows ``omega_m`` (else particles per (Mpc/h)^3), or the overdensity
    ``rho / rho_mean - 1``. Exact: spheres that leave the ghost layer are completed across
    devices."""
    insitu = snap.insitu
    result, status = knn_on_decomposition(snap.pencils, snap.decomposition, insitu.k,
                                          _knn_width(insitu, snap.pencils), config=insitu.knn,
                                          n0=snap.n0)
    rho = density_from(result["dist"], result["neighbour_mass"], insitu.k)
    if insitu.overdensity:
        mean = insitu.nc ** 3 * snap.particles.mass[0] / insitu.box_size ** 3
        rho = rho / mean - 1
    return {"density": rho, "status": status}


# ----------------------------------------------------------------------------------------
# The in-situ driver


@dataclasses.dataclass(frozen=True)
class InSitu:
    """In-situ halo finding and kNN density for a JaxPM run.

    Attributes:
      box_size: box side in Mpc/h.
      analyses: names of registered analyses to run at every snapshot.
      b: FoF linking length in units of the mean particle separation ``box_size / nc``.
      min_members: smallest FoF group in the catalogue.
      k: neighbours for ``knn_density``.
      omega_m: total matter density; when given, masses are in Msun/h (else 1 per particle).
      overdensity: ``knn_density`` returns ``rho / rho_mean - 1`` instead of rho.
      save_state: also save the state ``y`` itself at each snapshot.
      mesh: the device mesh; default: the state's (abstract) mesh.
      fof, knn: buffer configurations.
    """

    box_size: float
    analyses: tuple[str, ...] = ("fof", "knn_density")
    b: float = 0.2
    min_members: int = 20
    k: int = 16
    omega_m: float | None = None
    overdensity: bool = False
    save_state: bool = False
    mesh: Any = None
    fof: FoFConfig = dataclasses.field(default_factory=FoFConfig)
    knn: KNNConfig = dataclasses.field(default_factory=KNNConfig)
    nc: int | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "analyses", tuple(self.analyses))
        for name in self.analyses:
            analysis(name)
        if not self.box_size > 0:
            raise ValueError(f"box_size must be positive, got {self.box_size}")
        if not self.b > 0:
            raise ValueError(f"b must be positive, got {self.b}")
        if int(self.min_members) < 1:
            raise ValueError(f"min_members must be at least 1, got {self.min_members}")

    @property
    def linking_length(self) -> float:
        return self.b * self.box_size / self._nc

    @property
    def _nc(self) -> int:
        if self.nc is None:
            raise ValueError("the grid size is known once a state is given")
        return self.nc

    def __call__(self, y, a=1.0):
        """Run the analyses on a state ``y`` of shape ``(2, nc, nc, nc, 3)`` at scale factor
        ``a``. Returns ``{name: outputs, "a": a, "domain": Status[, "state": y]}``.

        Works inside ``jit`` (e.g. in a diffrax ``SaveAt`` function) and outside, where a
        buffer overflow raises an error naming the knob and a value that fits.
        """
        if getattr(y, "ndim", None) != 5 or y.shape[0] != 2 or y.shape[-1] != 3 \
                or not y.shape[1] == y.shape[2] == y.shape[3]:
            raise ValueError(f"expected a JaxPM state of shape (2, nc, nc, nc, 3), got "
                             f"{getattr(y, 'shape', None)}")
        bound = dataclasses.replace(self, nc=int(y.shape[1]))
        out = _compiled(bound, _state_layout(bound, y), jnp.dtype(y.dtype))(
            y, jnp.asarray(a, y.dtype))
        if bound.save_state:
            out["state"] = y
        if not is_traced(y, a):
            check(out, bound)
        return out

    def saveat(self, ts, *, t0: float | None = None, t1: float | None = None):
        """A ``diffrax.SaveAt(ts=ts, fn=...)`` running the analyses at each time in ``ts``.

        Pass the solve's ``t0``/``t1`` to have times outside ``[t0, t1]`` rejected here.
        Outputs come back stacked over snapshots; check them with :func:`check`.
        """
        import diffrax

        ts = np.asarray(ts, dtype=float).reshape(-1)
        lo = -np.inf if t0 is None else t0
        hi = np.inf if t1 is None else t1
        if ts.size == 0 or np.any((ts < lo) | (ts > hi)):
            raise ValueError(f"snapshot times {ts.tolist()} must be non-empty and lie in "
                             f"[{t0}, {t1}]")
        return diffrax.SaveAt(ts=jnp.asarray(ts), fn=lambda t, y, args: self(y, t))


def check(outputs, insitu: "InSitu | None" = None) -> None:
    """Host-side: raise if any buffer of an in-situ run overflowed, at any snapshot.

    Given the whole output of an :class:`InSitu` call, the error spells the setting as an
    ``InSitu`` argument: the shared decomposition and FoF are sized by ``InSitu.fof``,
    kNN by ``InSitu.knn``. Given the ``insitu`` that ran, the setting is its whole config
    with the one knob changed (earlier fixes kept); without it, the default config with
    that knob.
    """
    parts = outputs.items() if isinstance(outputs, Mapping) else [(None, outputs)]
    for name, part in parts:
        attr = _CONFIG_OF.get(name)
        if attr is None:
            config, argument = None, "{}"
        else:
            config = getattr(insitu, attr) if insitu is not None else _DEFAULT_CONFIG[attr]()
            argument = f"InSitu({attr}={{}})"
        for status in jax.tree.leaves(part, is_leaf=lambda x: isinstance(x, Status)):
            if isinstance(status, Status):
                status.check(config, argument)


_CONFIG_OF = {"domain": "fof", "fof": "fof", "knn_density": "knn"}
_DEFAULT_CONFIG = {"fof": FoFConfig, "knn": KNNConfig}


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


@program_cache(16)
def _compiled(insitu: InSitu, problem, dtype):
    layout, pencils = problem.layout, problem.pencils
    n0 = layout.local_size
    selected = [analysis(name) for name in insitu.analyses]
    width = max([a.width(insitu, pencils) for a in selected] + [0.0])
    dom = insitu.fof.domain
    transfer, capacity = dom.transfer_rows(n0, True), dom.capacity_rows(n0)
    ghost = _ghost_rows(insitu, pencils, n0, width)
    nc = insitu.nc
    mass = units.particle_mass(insitu.omega_m, insitu.box_size, nc) if insitu.omega_m else 1.0

    def device(state, a):
        disp, mom = state[0], state[1]
        block = disp.shape[:-1]
        fields, _ = local_fields(problem, grid_to_box(_grid_positions(disp, pencils, nc), nc,
                                                      insitu.box_size))
        fields["vel"] = units.momentum_to_velocity(mom.reshape(-1, 3), a, insitu.box_size, nc)
        fields["mass"] = jnp.full(fields["pos"].shape[0], mass, disp.dtype)
        n = fields["pos"].shape[0]
        decomposition = decompose(pencils, fields, jnp.ones(n, bool), width, transfer, capacity,
                                  ghost)
        migrated = decomposition.migrated
        payload = migrated.payload
        particles = Particles(payload["pos"], payload["id"], migrated.count, payload["vel"],
                              payload["mass"], insitu.box_size)
        snap = Snapshot(particles, decomposition, pencils, a, width, n0, insitu)
        results = {a_.name: a_.run(snap) for a_ in selected}
        flat, tree = jax.tree.flatten(results)
        flat_kinds = jax.tree.leaves(_leaf_kinds(selected, results))
        particle = [x for x, kind in zip(flat, flat_kinds) if kind == "particle"]
        back = return_trip(pencils, particle, payload["origin"], migrated.count, n, transfer,
                           capacity)
        back = iter(x.reshape(block + x.shape[1:]) for x in back)
        flat = [next(back) if kind == "particle" else x for x, kind in zip(flat, flat_kinds)]
        domain = domain_status(pencils, decomposition, transfer, capacity, ghost, n0)
        return {"a": a, "domain": domain, **jax.tree.unflatten(tree, flat)}

    state_spec = P(None, *layout.spec, None)
    spec_of = {"particle": layout.spec, "device": layout.device_spec, "replicated": P()}
    args = (jax.ShapeDtypeStruct((2,) + layout.shape + (3,), dtype), jax.ShapeDtypeStruct((), dtype))
    # The output structure (catalogues, statuses, user pytrees) is known once traced.
    shapes = jax.eval_shape(lambda y, a: layout.run(device, (y, a), (state_spec, P()), P()), *args)
    kinds = _leaf_kinds(selected, shapes)
    out_specs = {"a": P(), "domain": P(),
                 **jax.tree.map(lambda kind: spec_of[kind], kinds)}
    # Pinned: inside a diffrax SaveAt with one save time, XLA would otherwise hoist the
    # analyses out of diffrax's save loop and run them at every solver step.
    return jax.jit(lambda y, a: layout.run(device, (pin_to_save_loop(y), a),
                                           (state_spec, P()), out_specs))


def _ghost_rows(insitu: InSitu, pencils: Pencils, n0: int, width: float) -> int:
    return insitu.fof.domain.ghost_rows(n0, width_fraction(pencils, width))


def _leaf_kinds(selected, results):
    """One output kind per leaf: the analyses' declared kinds, except that every leaf of a
    :class:`Status` is replicated (its needs are already maxima over devices)."""
    is_status = lambda x: isinstance(x, Status)
    kinds = {}
    for a_ in selected:
        result = results[a_.name]
        declared = jax.tree.leaves(_expand(a_.outputs, result))
        in_status = jax.tree.leaves(jax.tree.map(
            lambda node: jax.tree.map(lambda _: True, node) if is_status(node) else False,
            result, is_leaf=is_status))
        kinds[a_.name] = jax.tree.unflatten(
            jax.tree.structure(result),
            ["replicated" if status else kind for kind, status in zip(declared, in_status)])
    return kinds


def _expand(kinds, result):
    """Expand a prefix tree of output kinds to one kind per leaf of ``result``."""
    expanded = jax.tree.map(lambda kind, sub: jax.tree.map(lambda _: kind, sub), kinds, result,
                            is_leaf=lambda x: isinstance(x, str))
    for kind in jax.tree.leaves(expanded):
        if kind not in _KINDS:
            raise ValueError(f"output kind must be one of {_KINDS}, got {kind!r}")
    return expanded


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
