"""Friends-of-friends: :func:`fof` (distributed, with the catalogue's extras) and
:func:`fof_local` (one device's particles)."""

from .fof import fof, fof_local

__all__ = ["fof", "fof_local"]
