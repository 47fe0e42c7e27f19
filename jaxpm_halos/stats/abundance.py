"""Soft halo counts: a mass function a forward model can differentiate.

Hard counts in log-mass bins ``[e_b, e_{b+1})`` jump when a halo crosses an edge, so their
derivative is zero. Here every edge is a smooth step of half-width ``w`` (dex), the C1 cubic
step ``S`` of :func:`jaxpm_halos.so._soft.smooth_step` (0 below -1, 1 above 1)::

    n_b = sum_haloes [ S((x - e_b) / w) - S((x - e_{b+1}) / w) ],   x = log10 M.

A halo farther than ``w`` from every edge counts 1 in its bin and 0 elsewhere, as in the
hard counts; one nearer shares its count between the two bins (the bins sum to the hard
total of haloes between the outer edges, less the share leaking past an outer edge).

Bias. With ``n(x)`` the haloes per unit ``x``, the soft count above one edge ``e`` differs
from the hard one by ``-(w^2 / 10) n'(e)`` to second order (the step is odd about the edge,
so the first order vanishes; ``int u (S(u) - H(u)) du = -1/10``). A bin's counts are
therefore biased by ``-(w^2 / 10) (n'(e_b) - n'(e_{b+1}))``: on a falling mass function,
slightly high in the low-mass bins and low in the high-mass ones. Compare soft counts
with soft counts, made with the same ``w``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ..so._soft import smooth_step


def check_edges(edges) -> np.ndarray:
    """Bin edges as a 1-D float64 array of at least two increasing, finite values."""
    e = np.asarray(edges, np.float64)
    if e.ndim != 1 or e.size < 2 or not np.all(np.isfinite(e)) or not np.all(np.diff(e) > 0):
        raise ValueError(
            "edges must be at least two increasing finite values (log10 of the mass), "
            f"got {edges!r}"
        )
    return e


def check_width(width, name: str = "width") -> float:
    if isinstance(width, bool) or not isinstance(width, (int, float)) or not width > 0:
        raise ValueError(f"{name}={width!r}: the smoothing width must be a positive number")
    return float(width)


def soft_counts(mass, edges, *, width: float, valid=None):
    """Soft halo counts in ``log10(mass)`` bins, differentiable with respect to ``mass``.

    Args:
      mass: halo masses, any shape (e.g. a catalogue's ``mass`` or ``so["m200m"]``, in
        Msun/h); rows that are not valid, not finite or not positive count nothing (an
        unresolved SO mass is NaN, an empty one 0).
      edges: ``(B + 1,)`` increasing bin edges in ``log10`` of the mass unit (e.g.
        ``np.arange(12.5, 15.01, 0.25)`` for Msun/h).
      width: the half-width ``w`` of each edge's step, in dex; as ``w -> 0`` the counts
        are the hard ones (``np.histogram``) for every halo farther than ``w`` from an
        edge. Their bias against the hard counts is ``-(w^2 / 10) (n'(e_b) - n'(e_{b+1}))``
        (module docstring).
      valid: optional mask of the rows to count (a catalogue's ``id >= 0``).

    Returns:
      ``(B,)`` counts (floats). Divide by ``box_size**3`` and the bin width in dex for
      ``dn/dlog10 M`` in (Mpc/h)^-3.

    Examples:
        >>> import numpy as np
        >>> from jaxpm_halos.stats import soft_counts
        >>> m = np.array([2e12, 3e13, 9.5e13, 5e14])  # Msun/h
        >>> counts = lambda w: np.float64(soft_counts(m, [12, 13, 14, 15], width=w)).round(2)
        >>> counts(0.01).tolist()  # the hard counts
        [1.0, 2.0, 1.0]
        >>> counts(0.2).tolist()  # 9.5e13 lies within 0.2 dex of 10^14
        [1.0, 1.58, 1.42]
    """
    e = jnp.asarray(check_edges(edges), jnp.result_type(float))
    w = check_width(width)
    m = jnp.asarray(mass)
    keep = jnp.isfinite(m) & (m > 0)
    if valid is not None:
        keep = keep & jnp.asarray(valid, bool)
    x = jnp.log10(jnp.where(keep, m, 1)).reshape(-1)  # (H,)
    above = smooth_step((x[:, None] - e[None, :].astype(x.dtype)) / w)  # (H, B + 1)
    above = jnp.where(keep.reshape(-1)[:, None], above, 0)
    per_edge = jnp.sum(above, axis=0)  # (B + 1,) haloes above each edge
    return per_edge[:-1] - per_edge[1:]
