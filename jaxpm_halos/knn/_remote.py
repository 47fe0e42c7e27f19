"""Cross-device completion of kNN spheres that leave the ghost layer.

The few queries whose sphere leaves the ghost layer (voids near a pencil face, or k-th
neighbours beyond a narrow pencil) are gathered on every device; each device whose pencil
their sphere reaches returns its own particles' kk nearest (brute force over the chunks of
its rows the sphere reaches), and the home device merges the answers. Every particle is
owned once, so the merge is exact.

Shapes in comments: ``F`` remote query capacity per device, ``D`` devices, ``Q = D * F``
gathered queries, ``kk`` list length, ``H`` chunks of owned rows, ``C`` rows per chunk,
``Bq`` queries searched side by side.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ..core import control
from ..core.geometry import periodic_distance2
from ..core.layout import Pencils
from ..core.rows import psum_all, selection
from ._frame import Index, SearchFrame
from ._local import REMOTE, finish_lists
from ._scan import merge_nearest

int32 = jnp.int32


def all_gather(pencils: Pencils, x):
    """Stack ``x`` from every device, in device order ``i * py + j``: (D, ...)."""
    x = lax.all_gather(x, pencils.y_axis) if pencils.y_axis else x[None]
    x = lax.all_gather(x, pencils.x_axis) if pencils.x_axis else x[None]
    return x.reshape((pencils.num_devices,) + x.shape[2:])


def all_to_all(pencils: Pencils, x):
    """``x`` (D, ...): send ``x[d]`` to device ``d``; returns what each device sent here."""
    shape = x.shape
    x = x.reshape((pencils.px, pencils.py) + shape[1:])
    if pencils.x_axis:
        x = lax.all_to_all(x, pencils.x_axis, 0, 0)
    if pencils.y_axis:
        x = lax.all_to_all(x, pencils.y_axis, 1, 1)
    return x.reshape(shape)


def interval_gap(q, lo, hi, box):
    """Periodic distance from coordinate ``q`` to the interval [lo, hi] (hi - lo < box)."""
    gaps = [jnp.maximum(jnp.maximum(lo - (q + s), (q + s) - hi), 0) for s in (-box, 0.0, box)]
    return jnp.minimum(jnp.minimum(gaps[0], gaps[1]), gaps[2])


class OwnedChunks(NamedTuple):
    """This device's owned sorted rows (H, C) (``R`` past the end), their liveness and
    the bounding box (H, 3) of each chunk."""

    rows: jax.Array
    live: jax.Array
    lo: jax.Array
    hi: jax.Array

    @classmethod
    def of(cls, index: Index, own_rows, own_count, chunk: int):
        R = index.rows
        n_own = own_rows.shape[0]
        n_chunks = -(-n_own // chunk)
        rows = jnp.concatenate([own_rows, jnp.full((n_chunks * chunk - n_own,), R, int32)])
        rows = rows.reshape(n_chunks, chunk)
        live = (rows < R) & (jnp.arange(n_chunks * chunk).reshape(n_chunks, chunk) < own_count)
        pos = index.canon(jnp.clip(rows, 0, R - 1))  # (H, C, 3)
        big = jnp.asarray(jnp.inf, pos.dtype)
        return cls(
            rows,
            live,
            jnp.min(jnp.where(live[..., None], pos, big), axis=1),
            jnp.max(jnp.where(live[..., None], pos, -big), axis=1),
        )


def _search_block(
    index: Index,
    box: float,
    chunks: OwnedChunks,
    block_pos,
    reach,
    kk: int,
    top_k_limit: int | None,
):
    """The kk nearest owned rows of queries at ``block_pos`` (Bq, 3) within ``reach`` (Bq,) (-1 for
    an empty slot), over the chunks their spheres reach. Returns (Bq, kk) d2 and rows.
    ``top_k_limit``: as :func:`~._scan.merge_nearest`'s."""
    R = index.rows
    gaps = [
        interval_gap(block_pos[:, None, d], chunks.lo[None, :, d], chunks.hi[None, :, d], box)
        for d in range(3)
    ]
    near = jnp.sqrt(gaps[0] ** 2 + gaps[1] ** 2 + gaps[2] ** 2) <= reach[:, None]  # (Bq, H)
    n_chunks = chunks.rows.shape[0]
    todo, n_todo = selection(jnp.any(near, axis=0), n_chunks)

    def step(state):
        i, run_d2, run_row = state
        c = todo[i]
        rows = chunks.rows[c]  # (C,)
        d2 = periodic_distance2(
            block_pos[:, None, :], index.canon(jnp.clip(rows, 0, R - 1))[None], box
        )  # (Bq, C)
        ok = chunks.live[c][None, :] & near[:, c][:, None]
        return (i + 1,) + merge_nearest(
            run_d2,
            run_row,
            jnp.where(ok, d2, jnp.inf),
            rows,
            lambda r: index.id(jnp.minimum(r, R - 1)),
            top_k_limit,
        )

    B = block_pos.shape[0]
    init = (jnp.int32(0), jnp.full((B, kk), jnp.inf, block_pos.dtype), jnp.full((B, kk), R, int32))
    _, d2, rows = control.while_loop(lambda s: s[0] < n_todo, step, init)
    return d2, rows


def remote_search(
    pencils: Pencils,
    frame: SearchFrame,
    index: Index,
    chunks: OwnedChunks,
    query_pos,
    query_id,
    bound2,
    kk: int,
    block: int,
    top_k_limit: int | None,
):
    """The ``kk`` nearest owned particles of this device for every device's remote queries
    ``query_pos`` (Q, 3) (``query_id`` -3 for none) within ``sqrt(bound2)`` (Q,). Only the queries
    whose sphere reaches this pencil are searched, ``block`` at a time. Returns (Q, kk)
    squared distances and sorted rows (``R`` where none)."""
    dtype = query_pos.dtype
    box = frame.box
    Q = query_pos.shape[0]
    reach = jnp.sqrt(bound2) + jnp.asarray(frame.margin, dtype)  # inf stays inf
    lo, hi = pencils.bounds()
    gap = [
        interval_gap(query_pos[:, d], lo[d].astype(dtype), hi[d].astype(dtype), box)
        if n > 1
        else jnp.zeros((Q,), dtype)
        for d, n in ((0, pencils.px), (1, pencils.py))
    ]
    relevant = (jnp.sqrt(gap[0] ** 2 + gap[1] ** 2) <= reach) & (query_id != -3)
    todo, n_todo = selection(relevant, Q)
    todo = jnp.concatenate([todo, jnp.full((block,), Q, int32)])

    def step(state):
        b, out_d2, out_row = state
        picked = lax.dynamic_slice_in_dim(todo, b * block, block)  # (Bq,)
        safe = jnp.clip(picked, 0, Q - 1)
        d2, rows = _search_block(
            index,
            box,
            chunks,
            query_pos[safe],
            jnp.where(picked < Q, reach[safe], -1),
            kk,
            top_k_limit,
        )
        return b + 1, out_d2.at[picked].set(d2), out_row.at[picked].set(rows)

    init = (
        jnp.int32(0),
        jnp.full((Q + 1, kk), jnp.inf, dtype),
        jnp.full((Q + 1, kk), index.rows, int32),
    )
    n_blocks = (n_todo + block - 1) // block
    _, out_d2, out_row = control.while_loop(lambda s: s[0] < n_blocks, step, init)
    return out_d2[:Q], out_row[:Q]


class RemoteAnswers(NamedTuple):
    """Finished lists of this device's remote queries: the query rows ``target`` (F,)
    (``n`` where none), their neighbour ``codes`` (F, kept) into ``[extended rows | none |
    answers]``, ``ok`` (F,), and the answers' ``id``, ``pos``, ``mass`` (F * kk, ...)."""

    target: jax.Array
    codes: jax.Array
    ok: jax.Array
    id: jax.Array
    pos: jax.Array
    mass: jax.Array
    needed: jax.Array


_MERGE_BLOCK = 16  # remote queries merged together


def _merge_devices(pencils: Pencils, answers, kk: int, live: jax.Array):
    """Merge the D answers (D, F, kk, ...) that came back to each remote query (squared
    distances, ids, then payloads): the kk nearest by (distance, id), as (F, kk, ...)
    arrays. Each device sent its own kk nearest by the same order, so these are exact.
    Only the first ``live`` queries are merged (the rest are empty), a block at a time:
    the capacity is sized for the worst case, and a sort of every row costs ~30 ms a
    device at 64^3."""
    D = pencils.num_devices
    F = answers[0].shape[1]
    block = min(_MERGE_BLOCK, F)
    fills = (jnp.inf, -1, 0, 0)
    flat = [jnp.moveaxis(a, 0, 1).reshape((F, D * kk) + a.shape[3:]) for a in answers]
    flat = [
        jnp.concatenate([a, jnp.full((block,) + a.shape[1:], fill, a.dtype)])
        for a, fill in zip(flat, fills)
    ]  # (F + block, D * kk, ...): whole last blocks
    slot = jnp.broadcast_to(jnp.arange(D * kk, dtype=int32), (block, D * kk))

    def step(b, pick):
        d2, ids = (lax.dynamic_slice_in_dim(a, b * block, block) for a in flat[:2])
        merged = lax.sort((d2, ids, slot), dimension=1, num_keys=2)[2][:, :kk]  # (block, kk)
        return lax.dynamic_update_slice_in_dim(pick, merged, b * block, 0)

    # Which answers, in a loop; the values are gathered after it, so that gradients flow.
    pick = jnp.full((F + block, kk), D * kk - 1, int32)  # rows not merged: the last, empty
    pick = control.fori_loop(0, (live + block - 1) // block, step, pick)[:F]
    return tuple(
        jnp.take_along_axis(a[:F], pick.reshape(pick.shape + (1,) * (a.ndim - 2)), axis=1)
        for a in flat
    )


def complete_remote(
    pencils: Pencils,
    frame: SearchFrame,
    index: Index,
    ext,
    ext_pos,
    ext_mass,
    queries,
    status,
    bound2,
    k: int,
    kk: int,
    kept: int,
    capacity: int,
    chunk: int,
    top_k_limit: int | None,
    self_mode: bool,
) -> RemoteAnswers:
    """Search the queries of ``status == REMOTE`` (at most ``capacity``) on every device
    and merge the answers (differentiable positions and masses travel with them)."""
    n_q = status.shape[0]
    E = ext.pos.shape[0]
    R = index.rows
    D = pencils.num_devices
    dtype = ext.pos.dtype
    pick, n_far = selection(status == REMOTE, capacity)  # (F,)
    live = jnp.arange(capacity) < n_far
    safe = jnp.clip(pick, 0, n_q - 1)
    q_canon = queries.canon(safe)  # (F, 3)
    q_id = jnp.where(live, queries.id(safe), -3)
    q_bound = jnp.where(live, bound2[safe], 0)
    own_rows, own_count = selection(index.owned, ext.owned)

    def search(_):
        chunks = OwnedChunks.of(index, own_rows, own_count, chunk)
        gathered = [all_gather(pencils, a) for a in (q_canon, q_id, q_bound)]  # (D, F, ...)
        return remote_search(
            pencils,
            frame,
            index,
            chunks,
            gathered[0].reshape(-1, 3),
            gathered[1].reshape(-1),
            gathered[2].reshape(-1),
            kk,
            min(64, D * capacity),
            top_k_limit,
        )

    none = lambda _: (
        jnp.full((D * capacity, kk), jnp.inf, dtype),
        jnp.full((D * capacity, kk), R, int32),
    )
    d2, rows = control.cond(psum_all(pencils, n_far) > 0, search, none, None)  # (Q, kk)
    # The answers go back to the asking devices with differentiable positions.
    safe_rows = jnp.clip(rows, 0, R - 1)
    ext_row = index.ext_row[safe_rows]
    answers = (
        d2,
        jnp.where(rows < R, index.id(safe_rows), -1),
        ext_pos[ext_row],
        ext_mass[ext_row],
    )
    answers = jax.tree.map(
        lambda a: all_to_all(pencils, a.reshape((D, capacity) + a.shape[1:])), answers
    )
    d2, ids, pos, mass = _merge_devices(pencils, answers, kk, n_far)  # (F, kk, ...)
    found = jnp.isfinite(d2)
    ids = jnp.where(found, ids, -1)
    codes = E + 1 + jnp.arange(capacity * kk, dtype=int32).reshape(capacity, kk)
    codes = finish_lists(d2, ids, jnp.where(found, codes, E), q_id, k, self_mode, kept)
    return RemoteAnswers(
        jnp.where(live, pick, n_q),
        codes,
        found[:, kk - 1],
        ids.reshape(-1),
        pos.reshape(-1, 3),
        mass.reshape(-1),
        n_far,
    )
