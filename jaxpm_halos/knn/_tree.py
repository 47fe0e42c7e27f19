"""The first local kNN pass on the CPU: a k-d tree over the device's index, on the host.

XLA:CPU has no cheap per-query selection (``lax.top_k`` costs about a microsecond per row
whatever its width, and its gathers ~7 ns per element), so the batched scan of
:mod:`._scan` does several times the work of a tree walk (measured on 2 cores). On
the CPU the device buffers are host memory, so each device hands its index to a k-d tree
(``pykdtree``, else ``scipy.spatial.cKDTree``; both release the GIL, so the device
programs run their calls side by side) and takes back, for each query, its list and
whether it is certified.

The tree ranks rows by float64 distance in the device's frame (exact for float32
coordinates); the scan, and every mesh, rank them by (float32 squared distance from
:func:`~jaxpm_halos.core.geometry.periodic_distance2`, global id). A list is certified when both
must agree: consecutive float64 distances around what is kept (the k-th alone, or all k) and at
the list's boundary lie farther apart than float32's rounding of a distance can bridge
(2 ulp of the box plus a relative 8 eps), and the next row lies within half a box (so no
row is a second periodic image). Queries not certified (near ties, duplicates in the
list) are searched again by the scan about their k-th distance. Whether a result is
complete, local or cross-device, is then decided by :func:`~._local.classify` as for
the scan, with the whole frame as region and the k-th distance rounded up.

Shapes in comments: ``n`` queries, ``R`` index rows, ``F`` rows fetched per query, ``m``
queries of a block.
"""

from __future__ import annotations

import functools
import re

import jax.numpy as jnp
import numpy as np
from jax import core, lax

from ._frame import SENTINEL
from ._local import SearchState, classify

int32 = jnp.int32
_QUERY_BLOCK = 16384  # queries per tree query on the host (bounds its float64 outputs)
# Threads per tree query (cKDTree's; pykdtree takes OpenMP's default, all cores): the
# devices' queries differ in size (3x at 64^3 on (2, 4)), so without them the largest one
# would finish alone on one core.
_WORKERS = -1
# Rows per tree leaf: 24 in place of the libraries' 16 takes 3-5% off the builds and
# queries of k = 8, 16 and 32 (replayed calls at 64^3); it cannot change a list (the float64
# distances are the same, and near ties are never certified).
_LEAF_SIZE = 24


def _usable(module: str, oldest: tuple[int, ...] = ()) -> bool:
    """Whether ``module`` imports, from a release of its distribution no older than
    ``oldest`` (major, minor, patch)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        __import__(module)
        release = version(module.split(".")[0])
    except (ImportError, PackageNotFoundError):
        return False
    return tuple(int(n) for n in re.findall(r"\d+", release)[:3]) >= oldest


# The tree library: pykdtree's builds and queries take a third less CPU time than
# cKDTree's (replayed calls at 64^3), with the same float64 distances; before 1.4.1 it
# returned wrong distances on very large trees. None: neither library.
_BACKEND = (
    "pykdtree"
    if _usable("pykdtree.kdtree", (1, 4, 1))
    else "scipy"
    if _usable("scipy.spatial")
    else None
)


def _host_primitive():
    """A primitive that calls a numpy function on the host buffers themselves, or None.

    ``jax.pure_callback`` first puts its operands on CPU device 0; with the device programs
    in collectives after the callback, that transfer waits behind them and the program
    deadlocks (seen on 8 CPU devices in jax 0.7.2). The lowering below passes the buffers
    straight to the function, through the callback emitter pure_callback itself uses; it is
    a private JAX interface, so where it is missing the scan is used instead."""
    try:
        from jax._src.callback import _callback_op_sharding, emit_python_callback
        from jax.extend.core import Primitive
        from jax.interpreters import batching, mlir
    except ImportError:
        return None
    host_p = Primitive("jaxpm_halos_host_call")
    host_p.multiple_results = True
    host_p.def_abstract_eval(lambda *avals, fn, results: results)

    def lower(ctx, *args, fn, results):
        sharding = _callback_op_sharding(ctx.module_context.axis_context, None, ctx.avals_out)
        out, _, _ = emit_python_callback(
            ctx,
            lambda *a: tuple(fn(*a)),
            None,
            list(args),
            ctx.avals_in,
            ctx.avals_out,
            has_side_effect=False,
            sharding=sharding,
        )
        return out

    def batch(args, dims, fn, results):
        # One call per batch element (a vmapped kNN is a loop of kNN calls).
        size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
        args = [
            jnp.moveaxis(a, d, 0) if d is not None else jnp.broadcast_to(a, (size,) + a.shape)
            for a, d in zip(args, dims)
        ]
        out = lax.map(lambda a: host_p.bind(*a, fn=fn, results=results), tuple(args))
        return out, (0,) * len(out)

    mlir.register_lowering(host_p, lower, platform="cpu", cacheable=False)
    batching.primitive_batchers[host_p] = batch
    return host_p


_HOST_CALL = _host_primitive()


def available() -> bool:
    """Whether the host tree can be used: a tree library importable and the host call
    defined."""
    return _BACKEND is not None and _HOST_CALL is not None


def _frame_positions(cx, cy, cz, code, box: float):
    """Float64 frame positions (R, 3) of canonical coordinates and image codes (numpy);
    exact, unlike the float32 frame positions the scan recomputes."""
    code = code.astype(np.int32)
    shifts = [((code >> (2 * d)) & 3) - 1 for d in range(3)]
    return np.stack(
        [np.asarray(c, np.float64) + box * s for c, s in zip((cx, cy, cz), shifts)], axis=1
    )


def _separated(dist, first: int, last: int, slack: float, slack_rel: float):
    """Whether consecutive float64 distances (m, F) from column ``first`` to ``last`` are
    farther apart than float32 rounding can bridge, so that float32 distances order them
    alike."""
    lo, hi = dist[:, first:last], dist[:, first + 1 : last + 1]
    return np.all(hi - lo > 2 * (slack + slack_rel * hi), axis=1)


def _drop_self(dist, pick, own):
    """Fetched rows (m, F) without the query's own row ``own`` (m,): (m, F - 1), and
    whether it was among all but the last (else the list is not known)."""
    is_self = pick == own[:, None]
    ok = is_self[:, :-1].any(axis=1)
    order = np.argsort(is_self, axis=1, kind="stable")  # self to the end
    return (
        np.take_along_axis(dist, order, axis=1)[:, :-1],
        np.take_along_axis(pick, order, axis=1)[:, :-1],
        ok,
    )


def _list_of(dist, pick, *, k: int, kept: int, half: float, slack: float, slack_rel: float):
    """From each query's fetched rows (m, >= k + 1) by float64 distance, self excluded:
    the columns of its list (m, kept) (views of ``pick``), the k-th distance (m,) and
    whether the float32 (distance, id) order is certain to pick the same list (m,)."""
    # The next row after the k nearest must lie within half a box.
    ok = dist[:, k] < half
    # The list's boundary, and the order of what is kept (the k-th alone, or all k).
    ok &= _separated(dist, 0 if kept == k else k - 2, k, slack, slack_rel)
    return pick[:, k - kept : k], dist[:, k - 1], ok


def _certify(dist, pick, own, **settings):
    """:func:`_list_of` each query's fetched rows (m, F) (tree positions ``pick``), after
    dropping its own row ``own`` (m,) (None: point queries, which have none)."""
    if own is None:
        return _list_of(dist, pick, **settings)
    # Nearly always the query itself comes first, at distance 0: views, no copies.
    lists, kth, ok = _list_of(dist[:, 1:], pick[:, 1:], **settings)
    first = pick[:, 0] == own
    ok &= first
    other = np.flatnonzero(~first)
    if other.size:  # a duplicate at distance 0 came first: drop self wherever it is
        lists, kth = lists.copy(), kth.copy()
        dist, pick, found = _drop_self(dist[other], pick[other], own[other])
        lists[other], kth[other], ok[other] = _list_of(dist, pick, **settings)
        ok[other] &= found
    return lists, kth, ok


def _tree_query(data):
    """A k-d tree over ``data`` (T, 3) float64: returns ``query(points, k)`` giving the
    Euclidean distances (m, k) of each point's k nearest rows, ascending, and their rows."""
    if _BACKEND == "pykdtree":
        from pykdtree.kdtree import KDTree

        tree = KDTree(data, leafsize=_LEAF_SIZE)
        return lambda points, k: tree.query(points, k=k)
    from scipy.spatial import cKDTree

    tree = cKDTree(data, leafsize=_LEAF_SIZE, balanced_tree=False)
    return lambda points, k: tree.query(points, k=k, workers=_WORKERS)


def _nearest_rows(
    cx,
    cy,
    cz,
    code,
    valid,
    qpos,
    qvalid,
    qrow,
    *,
    box: float,
    k: int,
    kept: int,
    self_mode: bool,
    half: float,
    slack: float,
    slack_rel: float,
    dtype,
):
    """Host side: each valid query's list from the tree, certified or not. ``qpos`` (n, 3)
    holds query points' frame positions, and is empty for self queries (placed from their
    rows ``qrow``). Returns rows (n, kept) (R where none), an upper bound of the k-th
    distance (n,) and the flag (n,)."""
    valid = np.asarray(valid)
    rows = np.flatnonzero(valid).astype(np.int32)  # (T,) the tree's rows
    n, R = np.shape(qvalid)[0], valid.shape[0]
    out_rows = np.full((n, kept), R, np.int32)
    out_kth = np.full((n,), np.inf, np.float64)
    out_ok = np.zeros((n,), bool)
    live = np.flatnonzero(np.asarray(qvalid))
    fetch = k + 1 + self_mode  # the k nearest, the next one, and the query itself
    if rows.size < fetch or live.size == 0:
        return out_rows, out_kth.astype(dtype), out_ok
    data = _frame_positions(cx[rows], cy[rows], cz[rows], code[rows], box)  # (T, 3)
    query = _tree_query(data)
    if self_mode:  # the queries are valid index rows: their tree positions, and places
        own = (np.cumsum(valid, dtype=np.int32) - 1)[np.minimum(np.asarray(qrow), R - 1)]
        points = data[own]
    else:
        own, points = None, np.asarray(qpos, np.float64)
    settings = dict(k=k, kept=kept, half=half, slack=slack, slack_rel=slack_rel)
    for lo in range(0, live.size, _QUERY_BLOCK):
        q = live[lo : lo + _QUERY_BLOCK]
        dist, pick = query(points[q], fetch)
        lists, out_kth[q], out_ok[q] = _certify(
            dist, pick, None if own is None else own[q], **settings
        )
        out_rows[q] = rows[lists]
    # Rounded up: an upper bound, for the coverage test and the cross-device radius.
    kth = out_kth.astype(dtype)
    kth = np.where(kth < out_kth, np.nextafter(kth, np.asarray(np.inf, dtype)), kth)
    return out_rows, kth, out_ok


def tree_lists(search):
    """Each query's list from the host tree: rows (n, kept) (``R`` where none), an upper
    bound of its k-th distance (n,), and whether the list is certified (n,)."""
    index, queries, s = search.index, search.queries, search.settings
    n, dtype = queries.size, index.cx.dtype
    eps = float(np.finfo(dtype).eps)
    host = functools.partial(
        _nearest_rows,
        box=search.frame.box,
        k=s.k,
        kept=s.kept,
        self_mode=s.self_mode,
        half=0.5 * search.frame.box - search.frame.margin,
        slack=2 * eps * search.frame.box,
        slack_rel=8 * eps,
        dtype=np.dtype(dtype),
    )
    stop = lax.stop_gradient
    # Self queries are index rows, placed on the host from the index itself: no (n, 3)
    # array of their positions is formed.
    qpos = (
        jnp.zeros((0, 3), dtype) if s.self_mode else stop(queries.local(jnp.arange(n, dtype=int32)))
    )
    results = (
        core.ShapedArray((n, s.kept), int32),
        core.ShapedArray((n,), dtype),
        core.ShapedArray((n,), jnp.bool_),
    )
    return _HOST_CALL.bind(
        stop(index.cx),
        stop(index.cy),
        stop(index.cz),
        index.image,
        index.key != SENTINEL,
        qpos,
        queries.valid,
        queries.rows,
        fn=host,
        results=results,
    )


def _frame_coverage(search):
    """Distance (n,) from each query to the boundary of the region the whole frame holds
    complete (its ghost cover, and half a box, beyond which a row may be a second image)."""
    q = search.queries
    local = q.local(jnp.arange(q.size, dtype=int32))  # (n, 3)
    half = jnp.asarray(0.5 * search.frame.box - search.frame.margin, local.dtype)
    inside = jnp.minimum(local - search.cover_lo, search.cover_hi - local)
    return jnp.minimum(jnp.min(inside, axis=1), half)


def tree_pass(search, state: SearchState, scale: float) -> SearchState:
    """The first local pass from the host tree: certified lists are kept and classified over
    the whole frame (exact, or needing the cross-device pass); the others stay ``AGAIN``,
    for the scanned passes to search about their k-th distance (or, with none, from an
    estimate)."""
    index = search.index
    rows, kth, certified = tree_lists(search)  # (n, kept), (n,), (n,)
    bound2 = jnp.nextafter(kth * kth, jnp.inf)  # still an upper bound, rounded
    full = jnp.full(kth.shape, search.frame.full, kth.dtype)
    status, radius = classify(search.frame, bound2[:, None], _frame_coverage(search), full, scale)
    certified = certified & search.queries.valid
    codes = jnp.where(
        rows < index.rows, index.ext_row[jnp.minimum(rows, index.rows - 1)], search.n_ext
    )  # (n, kept)
    radius = jnp.where(jnp.isfinite(kth), radius, -1)  # negative: estimate one
    return SearchState(
        radius,
        jnp.where(certified, bound2, jnp.inf),
        jnp.where(certified, status, state.status),
        jnp.where(certified[:, None], codes, state.codes),
    )
