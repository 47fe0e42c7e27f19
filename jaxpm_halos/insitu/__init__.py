"""In situ: analyses run inside JaxPM's jitted diffrax solve (:class:`InSitu`), the
registry of analyses (:func:`register`), the host-side status check (:func:`check`), the
JaxPM state adapter (:func:`from_jaxpm`) and the reverse-mode correction of a distributed
JaxPM run (:func:`correct_jaxpm_adjoints`)."""

from .adjoint import correct_jaxpm_adjoints
from .errors import check
from .insitu import InSitu
from .jaxpm import from_jaxpm
from .registry import REGISTRY, Snapshot, register

__all__ = [
    "REGISTRY",
    "InSitu",
    "Snapshot",
    "check",
    "correct_jaxpm_adjoints",
    "from_jaxpm",
    "register",
]
