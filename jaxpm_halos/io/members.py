"""Halo member ids from FoF labels, in Gadget-4's layout: offsets and counts per halo.

Each process reads only the label shards it holds and keeps the particles of catalogued
haloes; with several processes those members (never the other particles) are all-gathered
for process 0 to write. A member's id is its particle's index in the labels (the lattice
index ``(ix * nc + iy) * nc + iz`` of a JaxPM grid), the numbering of the halo ids.
"""

from __future__ import annotations

import numpy as np


def halo_members(labels, halo_ids) -> dict[str, np.ndarray]:
    """The members of the haloes ``halo_ids`` (sorted, as a catalogue's rows are).

    Args:
      labels: one snapshot's FoF labels, ``(N,)`` or ``(nc, nc, nc)``: a jax array (sharded
        over any processes) or numpy.
      halo_ids: the catalogue's ids, sorted.

    Returns:
      ``{"offset", "count", "ids"}``: halo ``i``'s members are
      ``ids[offset[i] : offset[i] + count[i]]``, sorted. Collective when
      ``jax.process_count() > 1``: every process must call it.
    """
    halo_ids = np.asarray(halo_ids)
    label, index = _local_members(labels, halo_ids)
    label, index = _all_processes(label, index)
    order = np.lexsort((index, label))
    label, index = label[order], index[order]
    count = np.searchsorted(label, halo_ids, side="right") - np.searchsorted(label, halo_ids)
    offset = np.concatenate([[0], np.cumsum(count)[:-1]]).astype(np.int64)
    return {"offset": offset, "count": count.astype(np.int64), "ids": index}


def _local_members(labels, halo_ids):
    """``(label, particle index)`` of this process's particles in a halo of ``halo_ids``."""
    shape = np.shape(labels)
    parts = []
    shards = getattr(labels, "addressable_shards", None)
    if shards is None:
        parts.append((np.asarray(labels), tuple(slice(0, n) for n in shape)))
    else:
        seen = set()
        for shard in shards:  # one copy of each block (replicated shards repeat)
            key = tuple(s.indices(n)[:2] for s, n in zip(shard.index, shape))
            if key not in seen:
                seen.add(key)
                parts.append((np.asarray(shard.data), shard.index))
    labels_out, index_out = [], []
    for data, index in parts:
        grids = np.meshgrid(
            *[np.arange(*s.indices(n)[:2]) for s, n in zip(index, shape)], indexing="ij"
        )
        flat = np.ravel_multi_index(tuple(g.ravel() for g in grids), shape)
        data = data.ravel()
        row = np.minimum(np.searchsorted(halo_ids, data), max(len(halo_ids) - 1, 0))
        keep = (data >= 0) & (halo_ids[row] == data) if len(halo_ids) else data < -1
        labels_out.append(data[keep].astype(np.int64))
        index_out.append(flat[keep].astype(np.int64))
    return np.concatenate(labels_out), np.concatenate(index_out)


def _all_processes(label, index):
    """Every process's members (one process: as they are)."""
    import jax

    if jax.process_count() == 1:
        return label, index
    from jax.experimental import multihost_utils

    counts = np.asarray(multihost_utils.process_allgather(np.int64(label.shape[0]))).reshape(-1)
    width = max(int(counts.max()), 1)
    padded = np.full((2, width), -1, np.int64)
    padded[0, : label.shape[0]], padded[1, : label.shape[0]] = label, index
    gathered = np.asarray(multihost_utils.process_allgather(padded))  # (P, 2, width)
    both = np.concatenate([gathered[p, :, :n] for p, n in enumerate(counts)], axis=1)
    _, first = np.unique(both[1], return_index=True)  # blocks two processes both hold
    return both[0, first], both[1, first]
