"""jaxpm_halos: in-situ, distributed friends-of-friends and kNN density for JaxPM.

Importing this package imports only jax and numpy (never jaxpm or jaxdecomp).
"""

from . import units
from ._adjoint import correct_jaxpm_adjoints
from ._catalogue import Catalogue
from ._config import DomainConfig, FoFConfig, KNNConfig, SOConfig
from ._fof import fof_local
from ._halos import fof
from ._frontend import clear_caches
from ._jaxpm import from_jaxpm
from ._knn_api import knn, knn_density, knn_local, knn_on_decomposition
from ._particles import Particles
from ._pipeline import compiler_options
from ._retry import GrowthWarning
from ._so import spherical_overdensity
from ._status import CapacityError, Failure, FailureKind, InvalidInputError, Status
from .extension import EXTENSION, InSitu, Snapshot, register
from .extension import check as check_insitu
from .io import LoadedCatalogue, gather_catalogue, load_catalogue, write_catalogue

__all__ = [
    # data and configuration
    "Particles",
    "DomainConfig",
    "FoFConfig",
    "KNNConfig",
    "SOConfig",
    "from_jaxpm",
    "units",
    # analyses
    "Catalogue",
    "fof",
    "fof_local",
    "knn",
    "knn_density",
    "knn_local",
    "knn_on_decomposition",
    "spherical_overdensity",
    # in situ (the JaxPM extension)
    "EXTENSION",
    "InSitu",
    "Snapshot",
    "check_insitu",
    "compiler_options",
    "register",
    # JaxPM reverse mode
    "correct_jaxpm_adjoints",
    # catalogue files
    "LoadedCatalogue",
    "gather_catalogue",
    "load_catalogue",
    "write_catalogue",
    # errors and buffers
    "CapacityError",
    "Failure",
    "FailureKind",
    "GrowthWarning",
    "InvalidInputError",
    "Status",
    "clear_caches",
]
