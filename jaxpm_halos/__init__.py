"""jaxpm_halos: in-situ, distributed friends-of-friends and kNN density for JaxPM.

Importing this package imports only jax and numpy (never jaxpm or jaxdecomp).
"""

from ._config import DomainConfig, FoFConfig
from ._frontend import clear_caches
from ._particles import Particles
from ._status import CapacityError, InvalidInputError, Status

__all__ = [
    "CapacityError",
    "DomainConfig",
    "FoFConfig",
    "InvalidInputError",
    "clear_caches",
    "Particles",
    "Status",
]

from ._catalogue import Catalogue  # noqa: E402
from ._fof import fof, fof_local  # noqa: E402

__all__ += ["Catalogue", "fof", "fof_local"]

from . import units  # noqa: E402
from ._jaxpm import from_jaxpm  # noqa: E402

__all__ += ["from_jaxpm", "units"]

from ._config import KNNConfig  # noqa: E402
from ._knn import knn, knn_density, knn_local, knn_on_decomposition  # noqa: E402

__all__ += ["KNNConfig", "knn", "knn_density", "knn_local", "knn_on_decomposition"]

from .extension import EXTENSION, InSitu, Snapshot, register  # noqa: E402
from .extension import check as check_insitu  # noqa: E402

__all__ += ["EXTENSION", "InSitu", "Snapshot", "check_insitu", "register"]

from .io import LoadedCatalogue, gather_catalogue, load_catalogue, write_catalogue  # noqa: E402

__all__ += ["LoadedCatalogue", "gather_catalogue", "load_catalogue", "write_catalogue"]
