"""Catalogue and run files: HDF5 written and read without gathering the particles on one host."""

from .catalogue import (
    INSITU_UNITS,
    LoadedCatalogue,
    gather_catalogue,
    load_catalogue,
    write_catalogue,
)
from .members import halo_members
from .run import LoadedRun, load_run, write_run

__all__ = [
    "INSITU_UNITS",
    "LoadedCatalogue",
    "LoadedRun",
    "gather_catalogue",
    "halo_members",
    "load_catalogue",
    "load_run",
    "write_catalogue",
    "write_run",
]
