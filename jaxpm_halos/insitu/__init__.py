"""In situ: analyses run inside JaxPM's jitted diffrax solve (:class:`InSitu`), the
registry of analyses (:func:`register`), the JaxPM state adapter (:func:`from_jaxpm`) and
the reverse-mode correction of a distributed JaxPM run (:func:`correct_jaxpm_adjoints`)."""

from .adjoint import correct_jaxpm_adjoints
from .insitu import EXTENSION, REGISTRY, InSitu, Snapshot, check, register
from .jaxpm import from_jaxpm

__all__ = ["EXTENSION", "REGISTRY", "InSitu", "Snapshot", "check", "correct_jaxpm_adjoints",
           "from_jaxpm", "register"]
