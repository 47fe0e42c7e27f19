"""The scan's merge step with and without TopK, on one CPU device.

``jaxpm_halos.knn._scan.merge_nearest`` keeps the ``kk`` nearest of running lists (P, kk)
and a chunk of candidates (P, C) with one ``lax.top_k``. Two alternatives with no sort and
no TopK are timed against it:

- ``rank_merge`` takes the chunk ``m`` candidates at a time and places each value by
  counting, in (distance, id) order, the values before it; it returns the same lists.
- ``kth_by_counting`` finds only each list's ``kk``-th smallest distance, by selection
  with a threshold and a count: 31 passes that fix one bit of the float's pattern each
  (non-negative floats order as their int32 bits). A merge needs this and more (the
  values below the threshold, gathered and ordered), so its time is a lower bound for a
  merge built on it.

The script checks each against numpy and prints microseconds per merge of 16 lists of
17 with 256 candidates (the CPU scan's block).

    python benchmarks/knn_merge.py
"""

import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxpm_halos.knn._scan import merge_nearest  # noqa: E402

P, KK, C = 16, 17, 256


def _before(ad, ai, bd, bi):
    """a strictly before b in (distance, id) order."""
    return (ad < bd) | ((ad == bd) & (ai < bi))


def rank_merge(run_d2, run_id, c_d2, c_id):
    """The kk first by (d2, id) of sorted lists (P, kk) and candidates (P, m), placed by
    counting (ties between a list entry and a candidate: the list's first)."""
    kk, m = run_d2.shape[1], c_d2.shape[1]
    c_first = _before(c_d2[:, :, None], c_id[:, :, None], run_d2[:, None], run_id[:, None])
    slot = jnp.arange(m)
    same = (c_d2[:, None] == c_d2[:, :, None]) & (c_id[:, None] == c_id[:, :, None])
    earlier = _before(c_d2[:, None], c_id[:, None], c_d2[:, :, None], c_id[:, :, None]) | (
        same & (slot[None, None] < slot[None, :, None])
    )  # (P, m, m): candidate j before candidate i
    rank_c = kk - jnp.sum(c_first, 2, dtype=jnp.int32) + jnp.sum(earlier, 2, dtype=jnp.int32)
    rank_r = jnp.arange(kk) + jnp.sum(c_first, 1, dtype=jnp.int32)  # (P, kk)
    ranks = jnp.concatenate([rank_r, rank_c], 1)
    rows = jnp.broadcast_to(jnp.arange(run_d2.shape[0])[:, None], ranks.shape)
    place = lambda a, b: (
        jnp.zeros_like(a).at[rows, ranks].set(jnp.concatenate([a, b], 1), mode="drop")
    )
    return place(run_d2, c_d2), place(run_id, c_id)


def kth_by_counting(d2, kk):
    """The ``kk``-th smallest of each row of non-negative ``d2`` (P, W), by bisection on
    its bit pattern: each pass counts the values below a threshold."""
    bits = jax.lax.bitcast_convert_type(d2, jnp.int32)
    kth = jnp.zeros(d2.shape[:1], jnp.int32)
    for bit in range(30, -1, -1):
        trial = kth | (1 << bit)
        below = jnp.sum(bits < trial[:, None], axis=1, dtype=jnp.int32)
        kth = jnp.where(below >= kk, kth, trial)
    return jax.lax.bitcast_convert_type(kth, jnp.float32)


def microseconds(fn, *args, repeats=100):
    fn = jax.jit(fn)
    jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / repeats * 1e6


def main():
    rng = np.random.default_rng(0)
    run = jnp.full((P, KK), jnp.inf, jnp.float32)
    run_id = jnp.full((P, KK), 2**30, jnp.int32)
    cand = jnp.asarray(rng.random((P, C)), jnp.float32)
    cand_id = jnp.asarray(rng.permutation(10**6)[: P * C].reshape(P, C), jnp.int32)
    top_k = lambda r, ri, c, ci: merge_nearest(r, ri, c, ci, lambda rows: rows)
    ref = np.sort(np.asarray(cand), 1)[:, :KK]
    assert np.array_equal(np.asarray(jax.jit(top_k)(run, run_id, cand, cand_id)[0]), ref)
    print(f"top_k merge: {microseconds(top_k, run, run_id, cand, cand_id):.0f} us")
    both = jnp.concatenate([run, cand], 1)
    kth = lambda d2: kth_by_counting(d2, KK)
    assert np.array_equal(np.asarray(jax.jit(kth)(both)), ref[:, -1])
    print(f"kk-th distance alone by counting: {microseconds(kth, both):.0f} us")
    for m in (16, 32):

        def by_ranks(r, ri, c, ci, m=m):
            for s in range(0, C, m):
                r, ri = rank_merge(r, ri, c[:, s : s + m], ci[:, s : s + m])
            return r, ri

        assert np.array_equal(np.asarray(jax.jit(by_ranks)(run, run_id, cand, cand_id)[0]), ref)
        us = microseconds(by_ranks, run, run_id, cand, cand_id)
        print(f"rank merge, {m} candidates at a time: {us:.0f} us")


if __name__ == "__main__":
    main()
