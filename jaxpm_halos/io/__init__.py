"""Catalogue files: HDF5 written and read without gathering the particles on one host."""

from .catalogue import (
    INSITU_UNITS,
    LoadedCatalogue,
    gather_catalogue,
    load_catalogue,
    write_catalogue,
)

__all__ = [
    "INSITU_UNITS",
    "LoadedCatalogue",
    "gather_catalogue",
    "load_catalogue",
    "write_catalogue",
]
