"""Loops and branches that also trace inside a caller's ``shard_map(check_vma=True)``.

``jax.shard_map`` checks by default that a loop's carry and a branch's outputs vary over
the same mesh axes on entry and exit. The kernels start their loops from constants (which
vary over no axis) and fill them from the particles (which vary over every axis), so under
that check ``lax.while_loop`` refused them. These wrappers mark the carries and outputs
as varying over every manual axis, which is what a per-device kernel computes (loop
counters and flags reduced by ``psum`` included: casting an equal value to varying
changes no value). Where the check is off (the library's own ``shard_map``) or there is
no ``shard_map``, they call ``lax``'s own with the same carries, and the compiled program
is the same (the check's probe below is dead code that XLA removes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

# Older jax (0.7) spells the cast lax.pvary, newer (0.10) lax.pcast(..., to="varying").
if hasattr(lax, "pcast"):

    def _to_varying(x, axes):
        return lax.pcast(x, axes, to="varying")
else:
    _to_varying = lax.pvary


def _varying_over(x) -> frozenset:
    """The manual axes over which ``x`` varies, as JAX tracks them (none where it does not)."""
    aval = jax.typeof(x)
    axes = getattr(aval, "vma", None)  # newer jax keeps it in aval.mat.varying
    return aval.mat.varying if axes is None else axes


def _checked_axes() -> tuple:
    """The manual mesh axes whose variation JAX checks here; () where it checks none."""
    axes = tuple(jax.sharding.get_abstract_mesh().manual_axes)
    if not axes:
        return ()
    # The check is a property of the enclosing shard_map; only its effect is public: a
    # cast to varying shows in the value's type only where it is on. (The probe is unused,
    # so the compiler drops it.)
    return axes if _varying_over(_to_varying(jnp.zeros((), bool), axes)) else ()


def _varying(tree, axes: tuple):
    def leaf(x):
        missing = tuple(a for a in axes if a not in _varying_over(x))
        return _to_varying(x, missing) if missing else x

    return jax.tree.map(leaf, tree) if axes else tree


def while_loop(cond_fun, body_fun, init):
    """``lax.while_loop``, its carry varying over every checked axis."""
    axes = _checked_axes()
    return lax.while_loop(
        cond_fun, lambda state: _varying(body_fun(state), axes), _varying(init, axes)
    )


def fori_loop(lower, upper, body_fun, init):
    """``lax.fori_loop``, its carry varying over every checked axis."""
    axes = _checked_axes()
    return lax.fori_loop(
        lower, upper, lambda i, state: _varying(body_fun(i, state), axes), _varying(init, axes)
    )


def cond(pred, true_fun, false_fun, *operands):
    """``lax.cond``, both branches' outputs varying over every checked axis."""
    axes = _checked_axes()
    return lax.cond(
        pred,
        lambda *args: _varying(true_fun(*args), axes),
        lambda *args: _varying(false_fun(*args), axes),
        *operands,
    )
