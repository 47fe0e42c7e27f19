"""jaxpm_halos: in-situ, distributed friends-of-friends and kNN density for JaxPM.

Importing this package imports only jax and numpy (never jaxpm or jaxdecomp).
"""

from . import units
from .core.catalogue import Catalogue
from .core.config import DomainConfig, FoFConfig, KNNConfig, MergerConfig, SOConfig
from .core.errors import CapacityError, Failure, FailureKind, InvalidInputError
from .core.frontend import clear_caches
from .core.particles import Particles
from .core.pipeline import compiler_options
from .core.retry import GrowthWarning
from .core.status import Status
from .extension import EXTENSION
from .fof import fof, fof_local
from .insitu import InSitu, Snapshot, correct_jaxpm_adjoints, from_jaxpm, register
from .insitu import check as check_insitu
from .io import (
    LoadedCatalogue,
    LoadedRun,
    gather_catalogue,
    halo_members,
    load_catalogue,
    load_run,
    write_catalogue,
    write_run,
)
from .knn import knn, knn_density, knn_local, knn_on_decomposition
from .lightcone import lightcone
from .merger import MergerLinks, along_branches, main_branches, merger_links, snapshot_links
from .so import spherical_overdensity

__all__ = [
    # data and configuration
    "Particles",
    "DomainConfig",
    "FoFConfig",
    "KNNConfig",
    "MergerConfig",
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
    # merger trees
    "MergerLinks",
    "along_branches",
    "main_branches",
    "merger_links",
    "snapshot_links",
    # light cone
    "lightcone",
    # in situ (the JaxPM extension)
    "EXTENSION",
    "InSitu",
    "Snapshot",
    "check_insitu",
    "compiler_options",
    "register",
    # JaxPM reverse mode
    "correct_jaxpm_adjoints",
    # catalogue and run files
    "LoadedCatalogue",
    "LoadedRun",
    "gather_catalogue",
    "halo_members",
    "load_catalogue",
    "load_run",
    "write_catalogue",
    "write_run",
    # errors and buffers
    "CapacityError",
    "Failure",
    "FailureKind",
    "GrowthWarning",
    "InvalidInputError",
    "Status",
    "clear_caches",
]
