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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def pin_to_save_loop(tree):
    """``tree`` unchanged (same values, shapes, dtypes), but computed from a stateful
    draw, so that XLA keeps everything computed from it inside the loop it sits in."""
    # lax.rng_uniform lowers to XLA's stateful RNG, which XLA treats as a side effect
    # (not hoisted, not CSE'd). jax.random keys are pure and would be hoisted with fn.
    # A host callback (io_callback) would also do, at the price of a host round trip.
    draw = jax.lax.rng_uniform(jnp.float32(0), jnp.float32(1), ())
    keep = draw < 2  # always true; XLA cannot know it
    return jax.tree.map(lambda x: jnp.where(keep, x, jnp.zeros_like(x)), tree)
