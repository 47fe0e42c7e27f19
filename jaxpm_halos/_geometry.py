"""Periodic-box arithmetic shared by every algorithm.

All pair distances in jaxpm_halos are computed by :func:`periodic_delta` from the canonical
wrapped float32 coordinates. The result is bitwise the same whichever device evaluates the
pair, so decisions such as "are these two particles friends" cannot depend on the mesh.
"""

from __future__ import annotations

import jax.numpy as jnp


def wrap(pos, box_size):
    """Wrap positions periodically into ``[0, box_size)``.

    Values equal to ``box_size`` map to 0; float rounding of tiny negative values, which
    would otherwise land on ``box_size`` exactly, is folded back too.
    """
    wrapped = pos - box_size * jnp.floor(pos / box_size)
    return jnp.where(wrapped >= box_size, wrapped - box_size, wrapped)


def periodic_delta(a, b, box_size):
    """Minimum-image ``a - b`` for coordinates wrapped into ``[0, box_size)``.

    For pairs across the periodic seam the difference is formed as ``a + (L - b)`` (or its
    mirror): ``L - b`` is exact for ``b > L/2`` (Sterbenz), so the result carries only the
    rounding of a small sum instead of the ulp of ``L``. Antisymmetric in ``(a, b)``.
    """
    half = 0.5 * box_size
    d = a - b
    return jnp.where(d > half, -((box_size - a) + b), jnp.where(d < -half, a + (box_size - b), d))


def periodic_distance2(a, b, box_size):
    """Squared minimum-image distance between rows of ``a`` and ``b`` (..., 3) -> (...)."""
    d = periodic_delta(a, b, box_size)
    return d[..., 0] * d[..., 0] + d[..., 1] * d[..., 1] + d[..., 2] * d[..., 2]
