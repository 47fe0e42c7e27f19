"""Periodic-box arithmetic shared by every algorithm.

All pair distances in jaxpm_halos are computed by :func:`periodic_delta` from the canonical
wrapped coordinates and squared by :func:`squared_norm`. The result is bitwise the same
whichever device or program evaluates the pair, so decisions such as "are these two
particles friends" cannot depend on the mesh or on the compiler's choices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import control


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


@jax.custom_jvp
def _split_square(d):
    """``d * d`` (...) as the sum of three products that are each exact, so that no
    compiler can change the result by contracting a product and a sum into a fused
    multiply-add (the rounding of an exact product is nothing to skip).

    ``d = hi + lo``: ``hi`` keeps the upper half of the significand (rounded to nearest on
    the bit pattern, so the lower half ``lo = d - hi`` is exact and at most half as wide),
    which makes ``hi*hi``, ``hi*(lo+lo)`` and ``lo*lo`` fit a float32 (or float64)
    significand. The sum ``(hi*hi + lo*lo) + hi*(lo+lo)`` rounds twice; ``hi*hi`` and
    ``lo*lo`` share no factor, so no factoring rewrite applies either. Exact unless a
    product underflows (``|d|`` below ~1e-19 in float32), where every form gives ~0.
    """
    hi, lo = _halves(d)
    # inf and NaN would meet inf * 0 below; their square needs no care.
    return jnp.where(jnp.isfinite(d), (hi * hi + lo * lo) + hi * (lo + lo), d * d)


def _halves(d):
    """``(hi, lo)`` with ``d = hi + lo`` exactly: ``hi`` the upper half of the significand
    (rounded to nearest on the bit pattern), ``lo`` the rest, at most half as wide, so the
    product of any two halves is exact."""
    info = jnp.finfo(d.dtype)
    uint = jnp.dtype(f"uint{info.bits}").type
    low = (info.nmant + 2) // 2  # bits dropped from hi: 12 of float32's 24, 27 of float64's 53
    bits = lax.bitcast_convert_type(d, uint)
    hi = lax.bitcast_convert_type((bits + uint(1 << (low - 1))) & ~uint((1 << low) - 1), d.dtype)
    return hi, d - hi


@_split_square.defjvp
def _split_square_jvp(primals, tangents):
    (d,), (t,) = primals, tangents
    return _split_square(d), (d + d) * t


def squared_norm(dx, dy, dz):
    """``dx**2 + dy**2 + dz**2`` with bits that no compiler can change (:func:`_split_square`)."""
    return _split_square(dx) + _split_square(dy) + _split_square(dz)


def periodic_distance2(a, b, box_size):
    """Squared minimum-image distance between rows of ``a`` and ``b`` (..., 3) -> (...).

    Every program computes the same bits for a pair, whichever fusions and contractions
    its compiler chooses (:func:`squared_norm`): kNN's, FoF's and SO's bitwise identity
    across meshes and between in-situ and offline calls rests on this (docs/design.md,
    *Exactness*).
    """
    d = periodic_delta(a, b, box_size)
    return squared_norm(d[..., 0], d[..., 1], d[..., 2])


# ----------------------------------------------------------------------------------------
# Exact comparison with a squared length (FoF's friends test near the linking length)

_ROUNDING = 2.0**-24  # float32's unit roundoff
_BAND = 32 * _ROUNDING  # relative: periodic_distance2 is within 7 roundings of exact
_DISTIL_PASSES = 12  # a cap: two settled each of 20,000 pairs within 3e-7 of l


def safe_sqrt(d2):
    """sqrt of squared distances with a zero (not NaN) derivative at 0 (duplicate
    positions, a centre on a particle)."""
    positive = d2 > 0
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, d2, 1)), 0)


def squared_length_limits(squared_length: float, dtype):
    """``(certain, upper)`` in ``dtype`` for the test ``d2 <= squared_length`` (float64):
    a float32 :func:`periodic_distance2` at most ``certain`` is within for sure, one above
    ``upper`` beyond for sure, and one between is within float32's rounding of the limit
    and needs :func:`exactly_within`. For float64 positions both are the limit itself."""
    if jnp.dtype(dtype) != jnp.float32:
        limit = jnp.asarray(squared_length, dtype)
        return limit, limit
    return (jnp.float32(squared_length * (1 - _BAND)), jnp.float32(squared_length * (1 + _BAND)))


def _two_sum(a, b):
    """``(s, e)`` with ``s = fl(a + b)`` and ``s + e = a + b`` exactly (Knuth's TwoSum:
    adds only, so no contraction applies, and XLA does not reassociate floats)."""
    s = a + b
    b_part = s - a
    a_part = s - b_part
    return s, (a - a_part) + (b - b_part)


def _exact_delta(a, b, box_size):
    """:func:`periodic_delta` unrounded: ``(s, e)`` (...), ``s + e`` the exact minimum-image
    difference. The same branches; the sum each forms is split by :func:`_two_sum` (``L - a``
    and ``L - b`` are exact there, by Sterbenz)."""
    half = 0.5 * box_size
    d = a - b
    up, down = d > half, d < -half  # -((L - a) + b), a + (L - b)
    s, e = _two_sum(
        jnp.where(up, box_size - a, a), jnp.where(up, b, jnp.where(down, box_size - b, -b))
    )
    return jnp.where(up, -s, s), jnp.where(up, -e, e)


def _square_terms(s, e):
    """Ten exact products (..., 10) whose exact sum is ``(s + e)**2``: every factor is a
    half of :func:`_halves` (doubling is exact)."""
    sh, sl = _halves(s)
    eh, el = _halves(e)
    return jnp.stack(
        [
            sh * sh,
            (sh + sh) * sl,
            sl * sl,
            (sh + sh) * eh,
            (sh + sh) * el,
            (sl + sl) * eh,
            (sl + sl) * el,
            eh * eh,
            (eh + eh) * el,
            el * el,
        ],
        -1,
    )


def _sum_is_at_most_zero(terms):
    """(M,) whether the exact sum of the float32 ``terms`` (M, n) is <= 0.

    Distillation: each pass replaces the terms by the rounding errors of their running sum
    and that sum last (Rump, Ogita and Oishi's VecSum), which keeps the exact sum. Once the
    rounded sum outweighs every other term together, with room for the rounding of that
    bound, its sign is the exact sum's (or the others are all zero and it is the sum)."""
    n = terms.shape[-1]
    t = jnp.moveaxis(terms, -1, 0)  # (n, M)

    def settled(t):
        rest = jnp.sum(jnp.abs(t[:-1]), axis=0)  # (M,)
        return (jnp.abs(t[-1]) > rest * (1 + 4 * n * _ROUNDING)) | (rest == 0)

    def distil(state):
        t, passes = state
        last, errors = lax.scan(lambda s, x: _two_sum(s, x), t[0], t[1:])  # (M,), (n-1, M)
        return jnp.concatenate([errors, last[None]]), passes + 1

    t, _ = control.while_loop(
        lambda state: jnp.any(~settled(state[0])) & (state[1] < _DISTIL_PASSES),
        distil,
        (t, jnp.int32(0)),
    )
    return t[-1] <= 0


def exactly_within(a, b, box_size, squared_length: float):
    """(M,) whether the exact squared minimum-image distance of the float32 rows ``a``,
    ``b`` (M, 3) is <= ``squared_length`` (a float64 number). scipy's ``cKDTree`` makes
    this decision in float64, where the differences of float32 coordinates and their
    squares are exact and only the sum of three can round (by ~1e-16 relative). Exact
    unless a product underflows (a coordinate difference below ~1e-19)."""
    c = float(squared_length)
    c1 = np.float32(c)
    c2 = np.float32(c - float(c1))
    c3 = np.float32(c - float(c1) - float(c2))  # c1 + c2 + c3 = c exactly
    s, e = _exact_delta(a, b, jnp.float32(box_size))  # (M, 3) each
    terms = _square_terms(s, e).reshape(s.shape[0], 30)
    limit = jnp.broadcast_to(-jnp.asarray([c1, c2, c3]), (s.shape[0], 3))
    return _sum_is_at_most_zero(jnp.concatenate([terms, limit], -1))
