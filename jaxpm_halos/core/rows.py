"""Row movement and reductions over the mesh, run per device inside ``shard_map``.

Selecting and compacting rows into fixed-size buffers (:func:`selection`, :func:`compact`,
:func:`take`: one int32 index is scattered, every field gathered through it), and
reductions over every device of the caller's mesh axes (:func:`psum_all`,
:func:`pmax_all`, :func:`pmin_all`, :func:`common_mass`), with ``jax.lax`` collectives
only.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from .layout import Pencils

int32 = jnp.int32


def sources(target, rows: int):
    """The inverse of a scatter to distinct slots: for each of ``rows`` slots, the row
    whose ``target`` it is, or ``len(target)`` where none is (targets out of range drop).

    Data movement scatters this one int32 index and then gathers every field through it:
    a gather compiles to a kernel half the cost of a scatter's (and fuses with what reads
    it), which matters with tens of fields in every migration."""
    n = target.shape[0]
    # Both arrays are tied to ``target``: a plain ``jax.jit`` would form input-free arrays
    # (an ``arange``, a ``full``) at the start and keep every migration's live at once.
    # Neither expression can be folded, and neither changes a value: a row whose target is
    # the smallest int32 is dropped, and max(n, min(t, n)) is n.
    row = jnp.where(target == jnp.iinfo(int32).min, 0, jnp.arange(n, dtype=int32))
    none = jnp.maximum(n, jnp.minimum(target[:1], n)).astype(int32) if n else jnp.zeros(1, int32)
    return jnp.broadcast_to(none, (rows,)).at[target].set(row, mode="drop")


def after(index, values):
    """``values`` unchanged, formed only once the int32 ``index`` is: work so ordered (two
    selections, one level's sorts after another's) keeps one part's temporaries live at a
    time in a plain ``jax.jit``, whose scheduler forms independent work early. No index is
    the smallest int32, which XLA cannot know, so the test is not folded away (an
    optimization barrier would not order them: XLA:CPU's compiled program keeps none)."""
    return jnp.where(jnp.all(index[:1] != jnp.iinfo(int32).min), values, jnp.zeros_like(values))


def selection(mask, rows: int):
    """Indices of the rows where ``mask`` holds, in order, padded with ``len(mask)``, and
    their number (which exceeds ``rows`` on overflow)."""
    slot = jnp.cumsum(mask, dtype=int32) - 1
    return sources(jnp.where(mask & (slot < rows), slot, rows), rows), jnp.sum(mask, dtype=int32)


def compact(mask, tree, rows: int):
    """Move the rows where ``mask`` holds to the front of fresh ``rows``-row buffers.

    Returns the buffers (zero after the kept rows) and the number of rows that *should*
    have been kept, which exceeds ``rows`` on overflow.
    """
    picked, count = selection(mask, rows)
    return take(tree, picked), count


def take(values, indices):
    """Gather rows, with zeros where an index is out of range (padding)."""
    return jax.tree.map(lambda a: jnp.take(a, indices, axis=0, mode="fill", fill_value=0), values)


def by_dtype(tree):
    """Pack a tree of per-row arrays side by side, one ``(rows, width)`` array per dtype,
    so that moving them costs one gather and one collective per dtype, not per field (each
    is a kernel to compile, and the migrations move tens of fields).

    Returns the packed arrays (a dict by dtype name) and a function that unpacks arrays so
    packed, of any number of rows, into the tree's structure."""
    leaves, treedef = jax.tree.flatten(tree)
    names = [jnp.dtype(a.dtype).name for a in leaves]
    widths = [math.prod(a.shape[1:]) for a in leaves]
    packed = {
        name: jnp.concatenate(
            [a.reshape(a.shape[0], w) for a, n, w in zip(leaves, names, widths) if n == name], 1
        )
        for name in dict.fromkeys(names)
    }

    def unpack(arrays):
        start = dict.fromkeys(arrays, 0)
        out = []
        for a, name, w in zip(leaves, names, widths):
            block = arrays[name][:, start[name] : start[name] + w]
            start[name] += w
            out.append(block.reshape(block.shape[:1] + a.shape[1:]))
        return jax.tree.unflatten(treedef, out)

    return packed, unpack


def _over_all_devices(collective, pencils: Pencils, value):
    """``collective(value, axes)`` over the pencils' mesh axes (None: a size-one axis)."""
    axes = tuple(a for a in (pencils.x_axis, pencils.y_axis) if a)
    return collective(value, axes) if axes else value


def pmax_all(pencils: Pencils, value):
    return _over_all_devices(lax.pmax, pencils, value)


def pmin_all(pencils: Pencils, value):
    return _over_all_devices(lax.pmin, pencils, value)


def psum_all(pencils: Pencils, value):
    return _over_all_devices(lax.psum, pencils, value)


def common_mass(pencils: Pencils, mass, valid):
    """``(equal, m)``: whether every valid row on every device has the same mass ``m``
    (JaxPM's particles do). Sums of equal masses are then ``count * m``, one rounding,
    the same on every mesh; a float sum rounds in an order that depends on the mesh.
    Outside autodiff: it chooses a value, not a derivative."""
    m = lax.stop_gradient(mass)
    extremes = jnp.stack(
        [jnp.max(jnp.where(valid, m, -jnp.inf)), jnp.max(jnp.where(valid, -m, -jnp.inf))]
    )
    heaviest, negated_lightest = pmax_all(pencils, extremes)  # one collective
    return heaviest == -negated_lightest, heaviest


def valued_with_derivative_of(value, like):
    """``value``, with the derivative of ``like``: exact counts times a common mass keep
    their bits while taking the float sum's derivative (``like - like`` is exactly 0, for
    any rounding of the sum, where ``value - like`` need not be)."""
    return value + (like - lax.stop_gradient(like))
