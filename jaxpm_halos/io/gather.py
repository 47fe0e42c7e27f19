"""Catalogues as numpy on the host, gathered from the devices that hold them.

:func:`gather_catalogue` keeps each process's valid rows (taken from the shards it holds),
all-gathers those compact rows when there are several processes (a collective: every
process calls it), drops blocks held twice (replicated shards) and sorts by id. A
catalogue whose status failed is refused, never returned truncated.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping

import numpy as np

from ..core.status import check_catalogue_status


def gather_catalogue(
    catalogue, snapshot: int | None = None, *, throw: bool = True
) -> dict[str, np.ndarray]:
    """The valid halos of a (padded, sharded) catalogue as numpy arrays on every process.

    Args:
      catalogue: a :class:`~jaxpm_halos.Catalogue` from :func:`jaxpm_halos.fof` or from
        :class:`~jaxpm_halos.InSitu` (``outputs["fof"]["catalogue"]``), or a dict of numpy
        arrays such as ``Catalogue.to_numpy()`` gives (returned as is).
      snapshot: index of the snapshot for a catalogue stacked over snapshots (the output of
        ``InSitu.saveat`` inside ``diffeqsolve``, whose leaves have a leading snapshot axis);
        negative indices count from the end.
      throw: raise the status's error (:class:`~jaxpm_halos.CapacityError`, naming a
        setting that fits, or :class:`~jaxpm_halos.InvalidInputError`) when the
        catalogue's status (at that snapshot) failed: its halos may be missing or wrong.
        ``False``: gather it anyway.

    Returns:
      ``{field: array}`` of the valid halos, sorted by id, the same on every process.

    Collective: with several processes, every process must call it.
    """
    if isinstance(catalogue, Mapping):
        return {k: np.asarray(v) for k, v in catalogue.items()}
    leaves = catalogue.fields()
    num = catalogue.num
    stacked = np.ndim(num) == 2
    if stacked and snapshot is None:
        raise ValueError("the catalogue is stacked over snapshots: pass snapshot=i")
    if not stacked and snapshot is not None:
        raise ValueError("snapshot given, but the catalogue is not stacked over snapshots")
    if stacked:
        snapshot = _snapshot_index(snapshot, np.shape(num)[0])
    if throw:
        check_catalogue_status(catalogue.status, snapshot)
    if all(_addressable(x) for x in (num, *leaves.values())):
        pick = (lambda x: np.asarray(x)[snapshot]) if stacked else np.asarray
        so = {f: pick(x) for f, x in (catalogue.so or {}).items()}
        single = dataclasses.replace(
            catalogue,
            num=pick(num),
            so=so or None,
            **{f: pick(x) for f, x in leaves.items() if f not in so},
        )
        return single.to_numpy(throw=False)  # checked above, at the snapshot

    # Multi-process: compact this process's valid rows, all-gather them, dedupe blocks.
    from jax.experimental import multihost_utils

    ndev = num.shape[-1]
    rows = leaves["id"].shape[-1] // ndev
    counts = _local_blocks(num, 1, snapshot)
    parts = {f: _local_blocks(x, rows, snapshot) for f, x in leaves.items()}
    blocks = sorted(counts)
    local = {f: [parts[f][k][: int(counts[k][0])] for k in blocks] for f in leaves}
    local_block = np.concatenate(
        [np.full(int(counts[k][0]), k, np.int32) for k in blocks] or [np.zeros(0, np.int32)]
    )
    n_local = local_block.shape[0]
    n_all = np.asarray(multihost_utils.process_allgather(np.int32(n_local))).reshape(-1)
    width = max(int(n_all.max()), 1)

    def padded(arrays, trailing, dtype):
        x = np.concatenate(arrays) if arrays else np.zeros((0,) + trailing, dtype)
        out = np.zeros((width,) + x.shape[1:], x.dtype)
        out[:n_local] = x
        return out

    gathered = multihost_utils.process_allgather(
        {
            "block": padded([local_block], (), np.int32),
            **{f: padded(local[f], x.shape[num.ndim :], x.dtype) for f, x in leaves.items()},
        },
        tiled=False,
    )
    seen, keep = set(), {f: [] for f in leaves}
    for p, n in enumerate(n_all):
        block = np.asarray(gathered["block"][p][:n])
        mine = np.isin(block, list(seen), invert=True)
        seen.update(block.tolist())
        for f in leaves:
            keep[f].append(np.asarray(gathered[f][p][:n])[mine])
    fields = {f: np.concatenate(v) for f, v in keep.items()}
    order = np.argsort(fields["id"], kind="stable")
    return {f: v[order] for f, v in fields.items()}


def _addressable(x) -> bool:
    return not hasattr(x, "is_fully_addressable") or x.is_fully_addressable


def _bounds(sl: slice, size: int) -> tuple[int, int]:
    start, stop, step = sl.indices(size)
    if step != 1:
        raise ValueError("unexpected strided shard")
    return start, stop


def _snapshot_index(snapshot, n: int) -> int:
    """``snapshot`` as an index in ``[0, n)`` (negative ones count from the end, as numpy's
    do; the multi-process path compares it with shard bounds)."""
    try:
        i = operator.index(snapshot)
    except TypeError:
        raise ValueError(f"snapshot must be an integer, got {snapshot!r}") from None
    if not -n <= i < n:
        raise ValueError(f"snapshot={i} is out of range: the catalogue holds {n} snapshots")
    return i % n


def _local_blocks(x, rows: int, snapshot: int | None) -> dict[int, np.ndarray]:
    """``{k: rows of device block k}`` for the blocks this process holds a shard of."""
    axis = 0 if snapshot is None else 1
    out = {}
    for shard in x.addressable_shards:
        index = tuple(shard.index) + (slice(None),) * x.ndim
        if snapshot is not None:
            s0, s1 = _bounds(index[0], x.shape[0])
            if not s0 <= snapshot < s1:
                continue
        for dim in range(axis + 1, x.ndim):
            if _bounds(index[dim], x.shape[dim]) != (0, x.shape[dim]):
                raise ValueError(f"catalogue leaf of shape {x.shape} is split along axis {dim}")
        data = np.asarray(shard.data)
        if snapshot is not None:
            data = data[snapshot - s0]
        start, stop = _bounds(index[axis], x.shape[axis])
        for k in range(-(-start // rows), stop // rows):
            if k not in out:
                out[k] = data[k * rows - start : (k + 1) * rows - start]
    return out
