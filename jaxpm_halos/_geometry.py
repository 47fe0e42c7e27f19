"""Periodic-box arithmetic shared by every algorithm.

All pair distances in jaxpm_halos are computed by :func:`periodic_delta` from the canonical
wrapped float32 coordinates. The result is bitwise the same whichever device evaluates the
pair, so decisions such as "are these two particles friends" cannot depend on the mesh.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def _to_zero(x):
    """+0.0 where ``x`` is ±0 or the box side, with the derivative 1 of the wrap (a
    constant zero would cut the gradient of a particle at exactly L). ``x + (-x)`` is
    exactly +0 for every finite ``x``."""
    return x + lax.stop_gradient(-x)


def wrap(pos, box_size):
    """Wrap positions periodically into ``[0, box_size)``.

    Values already in the box pass through bitwise unchanged, so wrapping is idempotent
    whichever program evaluates it. Others are reduced by ``fmod``, which is exact for every
    finite float (no product ``L * floor(x / L)`` to round, or for XLA to contract into a
    fused multiply-add), so even ``|x| >> L`` lands on its true image; a negative remainder
    takes one rounding when ``L`` is added. Values equal to ``box_size`` map to 0, and so do
    values whose wrapped image rounds up to ``box_size``. NaN and inf give NaN.
    """
    general = jnp.fmod(pos, box_size)
    general = jnp.where(general < 0, general + box_size, general)
    # -0.0 (from -L) and images that rounded up to L become 0.
    general = jnp.where((general <= 0) | (general >= box_size), _to_zero(general), general)
    return jnp.where((pos >= 0) & (pos < box_size), pos, general)


def grid_to_box(x, nc: int, box_size: float):
    """Grid-unit positions (lattice point plus displacement) to box units in ``[0, L)``.

    Built only from operations with a single rounding each (adds of the integer ``nc``,
    selects, one multiply) and nothing XLA could contract into a fused multiply-add, so
    every program that calls it (``from_jaxpm``, the in-situ step) gets bitwise identical
    positions.
    """
    for _ in range(2):
        x = jnp.where(x < 0, x + nc, x)
        x = jnp.where(x >= nc, x - nc, x)
    x = wrap(x, nc)  # displacements beyond two boxes; a no-op otherwise
    pos = x * jnp.asarray(box_size / nc, x.dtype)
    return jnp.where(pos >= box_size, _to_zero(pos), pos)


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
    """Squared minimum-image distance between rows of ``a`` and ``b`` (..., 3) -> (...).

    The sum of products can be contracted into fused multiply-adds, and XLA:CPU does so at
    its default level. Bitwise identity between programs (meshes, in situ against offline)
    therefore rests on XLA compiling this, and its column form
    :func:`._knn_scan.distance2_columns`, alike in each of them (benchmarks/RESULTS.md,
    2026-11-27, later).
    """
    d = periodic_delta(a, b, box_size)
    return d[..., 0] * d[..., 0] + d[..., 1] * d[..., 1] + d[..., 2] * d[..., 2]
