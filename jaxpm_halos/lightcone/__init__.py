"""Light-cone halo catalogues from the snapshots of an in-situ run."""

from .lightcone import lightcone

__all__ = ["lightcone"]
