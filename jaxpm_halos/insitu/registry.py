"""The registry of in-situ analyses, and the built-in ones (``fof``, ``knn_density``).

At each saved time the state ``y = (displacement, momentum)`` is decomposed over the mesh
once (migration plus the widest ghost layer any selected analysis needs), every analysis
runs on that decomposition as a :class:`Snapshot`, and all per-particle outputs make one
return trip together to JaxPM's grid layout and sharding. FoF, whose layer is narrow,
rebuilds only the ghosts of its own width from the migrated particles when the shared layer
is wider (kNN's).

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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from ..core.catalogue import insitu_units
from ..core.config import KNNConfig
from ..core.domain import Decomposition
from ..core.layout import Pencils
from ..core.particles import Particles
from ..core.pipeline import KINDS, Plan
from ..fof.fof import Extras, halo_step, peak_densities
from ..knn._search import ghost_width as knn_ghost_width
from ..knn._search import overdensity
from ..knn._steps import knn_density_on_plan
from ..knn.knn import knn_on_decomposition
from ..so.so import resolve_radius

if TYPE_CHECKING:  # annotations only: insitu.py imports this module
    from .insitu import InSitu


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
    insitu: InSitu
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
        return knn_on_decomposition(
            self.pencils, self.decomposition, k, mass=mass, config=config, n0=self.n0
        )

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
    width: Callable[[InSitu, Pencils], float]


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
        raise ValueError(
            f"{name!r} is a key of InSitu's result beside the analyses "
            f"({', '.join(_RESERVED)}): choose another analysis name"
        )
    builtin = REGISTRY.get(name)
    if builtin is not None and builtin.run.__module__ == __name__:
        raise ValueError(
            f"{name!r} is a built-in analysis of jaxpm_halos: register yours under another name"
        )

    unknown = [k for k in jax.tree.leaves(outputs) if k not in KINDS]
    if unknown:
        raise ValueError(
            f"analysis {name!r}: outputs= holds kinds {unknown}; each must be one of {KINDS}"
        )

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
        raise ValueError(
            f"no in-situ analysis named {name!r}; registered: {sorted(REGISTRY)}"
        ) from None


# ----------------------------------------------------------------------------------------
# Built-in analyses


def _extras(insitu: InSitu, pencils: Pencils) -> Extras:
    radius = (
        resolve_radius(insitu.fof.so, insitu.box_size / insitu.nc, pencils) if insitu.so else 0.0
    )
    return Extras(insitu.so, insitu.centre, insitu.k, radius, insitu.so_smoothing)


def _fof_width(insitu: InSitu, pencils: Pencils) -> float:
    return _extras(insitu, pencils).width(insitu.linking_length, insitu.nc**3, pencils, insitu.knn)


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
    step = halo_step(
        snap.plan, insitu.linking_length, insitu.min_members, insitu.fof, extras, densities, density
    )
    out = step.run(snap.decomposition)
    # Written into catalogue files: only here are the units of every field known.
    out["catalogue"] = dataclasses.replace(
        out["catalogue"], units=tuple(insitu_units(insitu.omega_m is not None, extras.so).items())
    )
    return out


def _knn_width(insitu: InSitu, pencils: Pencils) -> float:
    return knn_ghost_width(insitu.k, insitu.nc**3, pencils, insitu.knn)


def _knn_density(snap: Snapshot):
    """``(density, status)`` of the owned particles, shared by ``knn_density`` and FoF's
    peaks (every particle has the same mass in situ: only the k-th neighbour is kept)."""
    insitu = snap.insitu
    plan = snap.plan.with_width(_knn_width(insitu, snap.pencils))
    return snap.shared(
        "knn",
        lambda: knn_density_on_plan(
            plan, snap.decomposition, insitu.k, insitu.knn, equal_masses=True
        ),
    )


@register("knn_density", outputs={"density": "particle", "status": "replicated"}, width=_knn_width)
def _knn_density_analysis(snap: Snapshot):
    """kNN density ``(k - 1) m / (4/3 pi r_k^3)`` per particle, in (Msun/h) / (Mpc/h)^3 when
    the :class:`InSitu` knows ``omega_m`` (else particles per (Mpc/h)^3), or the overdensity
    ``rho / rho_mean - 1``. Exact: spheres that leave the ghost layer are completed across
    devices."""
    insitu = snap.insitu
    rho, status = _knn_density(snap)
    if insitu.overdensity:
        count = jnp.int32(insitu.nc**3)  # as the offline call counts them
        rho = overdensity(rho, count * snap.particles.mass[0], insitu.box_size)
    return {"density": rho, "status": status}
