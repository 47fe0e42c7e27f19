"""The JaxPM extension's entry point.

JaxPM has no plugin mechanism of its own, so jaxpm_halos declares itself under the Python
entry-point group ``jaxpm.extensions`` (name ``halos``), pointing at :data:`EXTENSION`::

    from importlib.metadata import entry_points
    halos = entry_points(group="jaxpm.extensions")["halos"].load()
    insitu = halos.InSitu(box_size=128.0, analyses=("fof", "knn_density"))
    saveat = insitu.saveat(ts=[0.5, 1.0])      # a diffrax.SaveAt for diffeqsolve

The machinery lives in :mod:`jaxpm_halos.insitu`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from .insitu import REGISTRY, InSitu, Snapshot, check, register
from .insitu.registry import Analysis

__all__ = ["EXTENSION", "REGISTRY", "InSitu", "Snapshot", "check", "register"]


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
