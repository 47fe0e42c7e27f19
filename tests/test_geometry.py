"""The squared distance every algorithm ranks and links by is the same bits in every
program. XLA may contract ``a*b + c`` into a fused multiply-add in one program and not in
another (it did at ``--xla_backend_optimization_level=0`` once data movement was rewritten:
kNN's distances on a mesh then differed from one device's in the last bit). Contraction
cannot change a sum whose products are exact, so these tests check that each product is
exact and that a compiled program gives numpy's (uncontracted) bits."""

import subprocess
import sys
import textwrap
from fractions import Fraction
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpm_halos.core.geometry import _split_square, periodic_distance2


def _split(d):
    """numpy's hi, lo of ``_split_square``: hi rounded to the upper half of the significand
    (12 of float32's 24 bits, 26 of float64's 53)."""
    uint = {np.float32: np.uint32, np.float64: np.uint64}[d.dtype.type]
    low = (np.finfo(d.dtype).nmant + 2) // 2
    bits = d.view(uint)
    hi = ((bits + uint(1 << (low - 1))) & ~uint((1 << low) - 1)).view(d.dtype)
    return hi, d - hi


def _split_distance2(a, b, box):
    """numpy's minimum image of ``a - b`` (n, 3), in their dtype, and its squared norm as
    ``periodic_distance2`` sums it (each axis's split square, summed left to right)."""
    L = a.dtype.type(box)
    d = a - b
    d = np.where(d > L / 2, -((L - a) + b), np.where(d < -L / 2, a + (L - b), d))
    squares = [(hi * hi + lo * lo) + hi * (lo + lo) for hi, lo in map(_split, d.T)]
    return d, (squares[0] + squares[1]) + squares[2]


def _differences(n, dtype=np.float32, seed=0):
    """Differences over 16 decades, signed, with zeros and exact powers of two."""
    rng = np.random.default_rng(seed)
    d = rng.normal(size=n) * 10.0 ** rng.uniform(-8, 8, n)
    d[:8] = [0.0, -0.0, 1.0, -2.0, 2.0**-20, 3.0, 4095.0, 4097.0]
    return d.astype(dtype)


@pytest.mark.newest
def test_every_product_of_the_split_square_is_exact():
    d = _differences(200_000)
    hi, lo = _split(d)
    assert np.array_equal(hi + lo, d)  # lo = d - hi was exact
    h, l = hi.astype(np.float64), lo.astype(np.float64)
    for product, exact in ((hi * hi, h * h), (lo * lo, l * l), (hi * (lo + lo), 2 * h * l)):
        np.testing.assert_array_equal(product.astype(np.float64), exact)


def test_every_product_of_the_float64_split_square_is_exact():
    """Float64 has no wider type in numpy to check against: the products are compared with
    exact rationals."""
    d = _differences(3000, np.float64)
    d[8:12] = [np.nextafter(1.0, 2.0), np.nextafter(1.0, 0.0), 2.0**27 + 1, -(2.0**53 - 1)]
    hi, lo = _split(d)
    assert np.array_equal(hi + lo, d)
    for h, l in zip(hi.tolist(), lo.tolist()):
        for got, exact in (
            (h * h, Fraction(h) ** 2),
            (l * l, Fraction(l) ** 2),
            (h * (l + l), 2 * Fraction(h) * Fraction(l)),
        ):
            assert Fraction(got) == exact, (h, l)


X64_CHILD = textwrap.dedent("""
    import os
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    jax.config.update("jax_enable_x64", True)
    import numpy as np
    from test_geometry import _split_distance2
    from jaxpm_halos.core.geometry import periodic_distance2

    box = 100.0
    rng = np.random.default_rng(2)
    a = rng.uniform(0, box, (20_000, 3))
    b = np.mod(a + rng.normal(0, 1, a.shape) * 10.0 ** rng.uniform(-12, 1.5, a.shape), box)
    got = np.asarray(jax.jit(periodic_distance2, static_argnums=2)(a, b, box))
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, _split_distance2(a, b, box)[1])
    print("ok")
""")


def test_compiled_float64_squared_distances_equal_numpys_bits():
    """With ``jax_enable_x64`` (a global flag, so in a child process), float64 squared
    distances are numpy's split sum bit for bit too."""
    out = subprocess.run(
        [sys.executable, "-c", X64_CHILD],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent,
        timeout=300,
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


@pytest.mark.newest
def test_compiled_squared_distances_equal_numpys_bits_and_the_true_square():
    """Under jit, fused with the minimum image and summed over three axes, the squared
    distance is numpy's split sum bit for bit, within 2.5e-7 of the float64 square."""
    box = 100.0
    rng = np.random.default_rng(1)
    a = rng.uniform(0, box, (100_000, 3)).astype(np.float32)
    b = np.mod(a + rng.normal(0, 1, a.shape) * 10.0 ** rng.uniform(-5, 1.5, a.shape), box).astype(
        np.float32
    )
    got = np.asarray(jax.jit(periodic_distance2, static_argnums=2)(a, b, box))

    d, want = _split_distance2(a, b, box)
    assert want.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    exact = np.sum(d.astype(np.float64) ** 2, axis=1)
    assert np.max(np.abs(got - exact) / exact) < 2.5e-7


def test_the_square_passes_inf_and_nan_and_has_the_derivative_2d():
    d = jnp.asarray([np.inf, -np.inf, np.nan, 0.0, -3.0, 1e-3], jnp.float32)
    out = np.asarray(_split_square(d))
    assert np.isposinf(out[:2]).all() and np.isnan(out[2])
    np.testing.assert_array_equal(out[3:], np.float32([0.0, 3.0, 1e-3]) ** 2)
    grad = jax.grad(lambda x: _split_square(x).sum())(d[3:])
    np.testing.assert_array_equal(np.asarray(grad), 2 * np.asarray(d[3:]))


def _exactly_within_reference(a, b, box, squared_length):
    """Exact rationals: the minimum-image squared distance of float32 rows <= the float64
    ``squared_length``."""
    half, L, limit = Fraction(box) / 2, Fraction(box), Fraction(squared_length)
    out = []
    for p, q in zip(a, b):
        total = Fraction(0)
        for x, y in zip(p.tolist(), q.tolist()):
            d = Fraction(x) - Fraction(y)
            d = d - L if d > half else d + L if d < -half else d
            total += d * d
        out.append(total <= limit)
    return np.asarray(out)


@pytest.mark.newest
def test_exactly_within_decides_as_exact_rationals():
    """FoF's test for pairs within float32's rounding of the linking length: pairs drawn
    within 3e-7 of l (near 0, near L and across the box's faces), pairs at exactly l (a
    3-4-5 triangle, across a face too), duplicates. float32 alone gets some wrong."""
    from jaxpm_halos.core.geometry import exactly_within

    rng = np.random.default_rng(7)
    box, link = 256.0, 0.2
    a = rng.uniform(0, box, (3000, 3))
    a[:600] = rng.uniform(0, 0.3, (600, 3))
    a[600:1200] = rng.uniform(box - 0.3, box, (600, 3))
    direction = rng.normal(size=a.shape)
    direction /= np.linalg.norm(direction, axis=1, keepdims=True)
    b = a + direction * link * (1 + rng.uniform(-3e-7, 3e-7, (len(a), 1)))
    a, b = (np.mod(x, box).astype(np.float32) for x in (a, b))
    b[b >= box] = 0
    b[:20] = a[:20]
    # Differences (0.1875, 0.25, 0), the second across x = L: 0.3125 apart exactly.
    a = np.concatenate([a, np.float32([[0.25, 0.5, 0.0], [255.875, 3.0, 7.0]])])
    b = np.concatenate([b, np.float32([[0.4375, 0.75, 0.0], [0.0625, 3.25, 7.0]])])
    for squared_length in (link * link, 0.3125**2):
        want = _exactly_within_reference(a, b, box, squared_length)
        got = np.asarray(jax.jit(lambda a, b: exactly_within(a, b, box, squared_length))(a, b))
        np.testing.assert_array_equal(got, want)
    assert want[-2:].all()  # at exactly 0.3125: within (<=)
    float32 = np.asarray(periodic_distance2(a, b, box)) <= np.float32(link * link)
    assert np.sum(float32 != _exactly_within_reference(a, b, box, link * link)) >= 3
