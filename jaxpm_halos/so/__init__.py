"""Spherical-overdensity masses and radii about given centres."""

from .so import spherical_overdensity

__all__ = ["spherical_overdensity"]
