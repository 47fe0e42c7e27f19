"""Keep the work of a diffrax ``SaveAt`` function inside diffrax's save loop.

diffrax (0.7) evaluates ``SaveAt(ts=ts, fn=fn)`` inside each solver step, in an inner
``while`` loop that runs once per save time falling in that step (zero times in most
steps). Its body reads ``t = ts[index]`` and interpolates ``y`` at ``t``. With a single
save time, ``ts[index]`` of a length-1 array is ``ts[0]`` whatever the index, so ``t``,
the interpolated ``y`` and everything ``fn`` computes from them are invariant in that
inner loop. XLA's ``while-loop-invariant-code-motion`` then hoists all of ``fn`` out of
the inner loop into the step loop's body, where it runs unconditionally at every step
(the inner loop is left to copy the hoisted result when the save is due). Collectives
inside ``shard_map`` do not stop it: in an SPMD program they are not side effects.

XLA never hoists a side-effecting instruction, nor anything computed from one. Passing
the state through a select on a stateful random draw keeps ``fn``'s work where diffrax
put it, at one evaluation per save time, for any number of save times. The draw lies in
``[0, 1)``, so the select always returns the state itself, bit for bit.

With ``diffrax.DirectAdjoint`` and one save time this cannot help: equinox's bounded
loop then calls the save body directly at every step (``max_steps == 1``).

diffrax also traces ``fn`` a second time, after its step loop, for a solve with
``t0 == t1`` (which takes no step: ``fn`` of the initial state is saved at every save
time), under a ``lax.cond`` on that runtime test. Its predicate is constant whenever
``t0`` and ``t1`` are, yet XLA keeps the branch, since collectives across devices count as
side effects: the analyses were compiled twice (the recipe's solve: 24 sorts against the
analyses' 12). :func:`skip_no_step_save` gives that branch a
placeholder whose statuses say ``NOT_RUN`` instead, so the analyses are compiled once and
a solve that takes no step gets a clear error, not zeros.
"""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp

from ..core.status import is_status


def pin_to_save_loop(tree):
    """``tree`` unchanged (same values, shapes, dtypes), but computed from a stateful
    draw, so that XLA keeps everything computed from it inside the loop it sits in."""
    # lax.rng_uniform lowers to XLA's stateful RNG, which XLA treats as a side effect
    # (not hoisted, not CSE'd). jax.random keys are pure and would be hoisted with fn.
    # A host callback (io_callback) would also do, at the price of a host round trip.
    draw = jax.lax.rng_uniform(jnp.float32(0), jnp.float32(1), ())
    keep = draw < 2  # always true; XLA cannot know it
    return jax.tree.map(lambda x: jnp.where(keep, x, jnp.zeros_like(x)), tree)


def skip_no_step_save(fn):
    """``fn(t, y, args)`` for a diffrax ``SaveAt(ts=..., fn=...)``, except in diffrax's
    ``t0 == t1`` branch, where, when its outputs carry a :class:`Status`, it is a
    placeholder of zeros whose statuses are marked ``not_run`` (outputs without one are
    computed there: zeros would pass for results)."""

    def save(t, y, args):
        if _tracing_the_save_without_steps():
            shapes = jax.eval_shape(fn, t, y, args)  # traced, not compiled
            if _holds_status(shapes):
                return _not_run(shapes)
        return fn(t, y, args)

    return save


def _tracing_the_save_without_steps() -> bool:
    """Whether diffrax is tracing its save for a solve with ``t0 == t1`` (diffrax 0.7's
    ``_save_if_t0_equals_t1`` is on the stack). A diffrax without it compiles ``fn`` there,
    which is only slower."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_save_if_t0_equals_t1" and "diffrax" in code.co_filename:
            return True
        frame = frame.f_back
    return False


def _holds_status(tree) -> bool:
    return any(map(is_status, jax.tree.leaves(tree, is_leaf=is_status)))


def _not_run(shapes):
    """Zeros shaped as ``shapes`` (``jax.eval_shape``'s), every :class:`Status` among them
    marked ``not_run``."""

    def mark(x):
        return dataclasses.replace(x, not_run=jnp.ones_like(x.not_run)) if is_status(x) else x

    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    return jax.tree.map(mark, zeros, is_leaf=is_status)
