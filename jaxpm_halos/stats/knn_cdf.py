"""kNN-CDF summaries (Banerjee & Abel 2021): for each neighbour rank k and radius r, the
fraction of query points whose k-th nearest particle lies within r.

``CDF_k(r) = (1/Q) #{q : d_k(q) <= r}``, with ``d_k(q)`` the periodic minimum-image
distance from query point ``q`` to its k-th nearest particle (no particle excluded).
Distances and radii are in the unit of the positions (Mpc/h for JaxPM).

Invariants:

- the hard CDF is a count of exact kNN distances (:func:`jaxpm_halos.knn`), summed in
  int32 and divided once by Q: the same bits on every mesh, offline and in situ;
- ``smoothing=h`` replaces the step ``1[d_k <= r]`` by :func:`smooth_step`
  ``((r - d_k) / h)``, a C1 step of compact support on ``[-1, 1]``: it equals the hard CDF
  exactly at every radius farther than ``h`` from every ``d_k``, and is differentiable
  with respect to the positions (the neighbour selection held fixed, as for ``knn``);
- a query row the search could not complete inside ``jit`` (NaN in ``knn``) is never
  counted as a miss: every CDF value of its rank is NaN, and the status reports why.

:func:`knn_cdf` is the offline call; :func:`knn_cdf_on_snapshot` computes the same on an
in-situ :class:`~jaxpm_halos.Snapshot`'s shared decomposition, and
:func:`register_knn_cdf` registers it as an :class:`~jaxpm_halos.InSitu` analysis.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..core.config import KNNConfig
from ..core.geometry import wrap
from ..core.particles import check_real, integer_value
from ..core.rows import psum_all, selection, take
from ..core.status import is_traced
from ..insitu.registry import Snapshot, register
from ..knn._search import ghost_width, neighbour_distances
from ..knn._steps import Spec, neighbours
from ..knn.knn import check_k, knn
from ..so._soft import smooth_step

int32 = jnp.int32


# ----------------------------------------------------------------------------------------
# Arguments


def check_ranks(k) -> tuple[int, ...]:
    """``k`` as a tuple of neighbour ranks: non-empty, positive integers, strictly
    ascending (so the rows of the result are in a known order)."""
    if integer_value(k) is not None:
        raise ValueError(f"k must be a tuple of neighbour ranks, e.g. k=({integer_value(k)},)")
    try:
        given = tuple(k)
    except TypeError:
        raise ValueError(
            f"k must be a tuple of positive ints, e.g. k=(1, 2, 4, 8); got {k!r}"
        ) from None
    ranks = tuple(integer_value(r) for r in given)
    if not ranks or any(r is None or r < 1 for r in ranks):
        raise ValueError(
            f"k must be a non-empty tuple of positive ints, e.g. (1, 2, 4, 8); got {k!r}"
        )
    if len(set(ranks)) != len(ranks) or list(ranks) != sorted(ranks):
        raise ValueError(
            f"k must hold distinct ranks in ascending order; pass k={tuple(sorted(set(ranks)))}"
        )
    return ranks


def check_radii(radii):
    """``radii`` as a 1-D array of positive finite floats (traced radii: shape only)."""
    if not hasattr(radii, "shape"):
        radii = np.asarray(radii)
    check_real(radii, "radii")
    if radii.ndim != 1 or radii.shape[0] == 0:
        raise ValueError(
            f"radii must be a non-empty 1-D array of radii, got shape {radii.shape}; "
            "for one radius pass radii=[r]"
        )
    if not is_traced(radii):
        values = np.asarray(radii, np.float64)
        if not np.all(np.isfinite(values) & (values > 0)):
            raise ValueError(f"radii must be positive and finite, got {values.tolist()}")
    return radii


def check_smoothing(smoothing):
    """``smoothing``: None, or a positive finite length (a traced scalar: shape only)."""
    if smoothing is None:
        return None
    if not hasattr(smoothing, "shape"):
        smoothing = np.asarray(smoothing)
    check_real(smoothing, "smoothing")
    if smoothing.ndim != 0:
        raise ValueError(f"smoothing must be one length (a scalar), got shape {smoothing.shape}")
    if not is_traced(smoothing):
        h = float(smoothing)
        if not (h > 0 and math.isfinite(h)):
            raise ValueError(
                f"smoothing must be a positive finite length, got {h}; "
                "pass smoothing=None for the hard CDF"
            )
    return smoothing


def _check_query(query):
    """A concrete ``(Q, 3)`` array of finite query points (they are baked into the
    in-situ program)."""
    if is_traced(query):
        raise ValueError(
            "register_knn_cdf needs concrete query points (a numpy array): they are "
            "fixed in the compiled in-situ program"
        )
    query = np.asarray(query)
    check_real(query, "query points")
    if query.ndim != 2 or query.shape[1] != 3 or query.shape[0] == 0:
        raise ValueError(f"query must be a non-empty (Q, 3) array, got shape {query.shape}")
    if not np.all(np.isfinite(query)):
        raise ValueError("query points must be finite; drop the rows holding NaN or inf")
    return query


def random_queries(n: int, box_size: float, seed: int = 0, dtype=np.float32) -> np.ndarray:
    """``n`` query points drawn uniformly in ``[0, box_size)^3`` (a numpy ``(n, 3)``
    array, the same for a given ``seed``): the volume-weighted sampling the kNN-CDFs
    are defined on."""
    n = integer_value(n)
    if n is None or n < 1:
        raise ValueError(f"random_queries needs a positive integer n, got {n!r}")
    points = np.random.default_rng(seed).uniform(0.0, float(box_size), (n, 3))
    # Rounding to float32 can land on box_size itself: the box is half open.
    return np.where(points.astype(dtype) >= box_size, 0, points).astype(dtype)


# ----------------------------------------------------------------------------------------
# The CDF from distances (shared by the offline call and the in-situ analysis)


def cdf_sums(d, valid, radii, smoothing=None):
    """``(sums, blank)``: per rank and radius, the sum over the ``valid`` (n,) rows of
    ``d`` (n, K) of ``1[d <= r]`` (int32, exact in any order) or, with ``smoothing`` h,
    of ``smooth_step((r - d) / h)``: ``sums`` (K, R); ``blank`` (K,) counts the valid rows
    whose distance is NaN (not computed), which are left out of ``sums``."""
    missing = valid[:, None] & jnp.isnan(d)  # (n, K)
    counted = valid[:, None] & ~missing  # (n, K)
    # A NaN inside the where would still send NaN into the gradient of every row.
    safe = jnp.where(counted, d, 0)  # (n, K)

    def at(r):  # one radius at a time: (n, K) in memory, not (n, K, R)
        if smoothing is None:
            return jnp.sum(counted & (safe <= r), axis=0, dtype=int32)  # (K,)
        step = smooth_step((r - safe) / smoothing)  # (n, K)
        return jnp.sum(jnp.where(counted, step, 0), axis=0)  # (K,)

    sums = lax.map(at, radii).T  # (K, R)
    return sums, jnp.sum(missing, axis=0, dtype=int32)


def cdf_fractions(sums, blank, count: int, dtype):
    """``sums / count`` (K, R) in ``dtype``, NaN for every radius of a rank where a row
    was not computed (``blank`` (K,) > 0)."""
    # A constant divisor would become a product with its rounded reciprocal: the barrier
    # keeps the one correctly rounded division (count / Q as numpy gives it; an XLA
    # compiled without optimisation may still divide through the reciprocal, one rounding).
    count = lax.optimization_barrier(jnp.asarray(count, dtype))
    return jnp.where(blank[:, None] > 0, jnp.nan, sums.astype(dtype) / count)


@functools.partial(jax.jit, static_argnames=("ranks",))
def _cdf_of_distances(dist, radii, smoothing, ranks):
    """The CDF (K, R) of query distances ``dist`` (Q, kmax)."""
    d = dist[:, np.asarray(ranks) - 1]  # (Q, K)
    if smoothing is not None:
        smoothing = jnp.asarray(smoothing, d.dtype)
    valid = jnp.ones(d.shape[0], bool)
    sums, blank = cdf_sums(d, valid, jnp.asarray(radii, d.dtype), smoothing)
    return cdf_fractions(sums, blank, d.shape[0], d.dtype)


# ----------------------------------------------------------------------------------------
# Offline


def knn_cdf(
    pos,
    query,
    radii,
    *,
    k=(1, 2, 4, 8),
    box_size=None,
    mesh=None,
    smoothing=None,
    config: KNNConfig = KNNConfig(),
    with_status: bool = False,
    grow: bool = True,
):
    """kNN-CDFs (Banerjee & Abel 2021): the fraction of ``query`` points whose k-th nearest
    particle lies within each radius.

    ``cdf[a, b] = (1/Q) #{q : d_{k[a]}(q) <= radii[b]}`` with ``d_k(q)`` the periodic
    minimum-image distance from query point ``q`` to its k-th nearest particle, exact
    (:func:`~jaxpm_halos.knn` with ``query``; no particle is excluded). Distances and
    radii are in the unit of ``pos`` (Mpc/h for JaxPM). Uniform ``query`` points
    (:func:`random_queries`) give the volume-weighted CDFs of the paper.

    With ``smoothing=h`` each step ``1[d <= r]`` becomes :func:`smooth_step`
    ``((r - d) / h)``, differentiable in the positions (``jax.grad`` flows through the
    distances, the neighbour selection held fixed). Then ``cdf = CDF * K_h``, the hard CDF
    convolved with the kernel ``K(u) = 3/4 (1 - u^2)`` on ``[-h, h]``: values at radii
    farther than ``h`` from every distance are the hard ones exactly, and since ``K`` is
    symmetric the bias is ``h^2/10 CDF''(r) + O(h^4)`` (no first-order term). Choose ``h``
    below the scale on which the CDF bends, but above the spacing of the ``Q`` distances
    near ``r`` (else the gradient comes from a few queries).

    Args:
      pos: positions as :func:`~jaxpm_halos.knn` takes them (``(N, 3)`` sharded or not, a
        JaxPM grid, or :class:`~jaxpm_halos.Particles`).
      query: query points ``(..., 3)``, replicated or sharded along axis 0; wrapped
        into the box.
      radii: ``(R,)`` positive radii, any order.
      k: neighbour ranks, a non-empty tuple of distinct positive ints, ascending.
      box_size: periodic box side (taken from Particles).
      mesh, config, grow: as :func:`~jaxpm_halos.knn` (one search of ``max(k)``
        neighbours).
      smoothing: None (the hard CDF) or the length ``h``.
      with_status: also return the :class:`~jaxpm_halos.Status`.

    Returns:
      ``(len(k), len(radii))`` fractions in ``[0, 1]`` (with ``with_status``, ``(cdf,
      status)``). Inside ``jit``, a rank whose distance a query row could not complete
      (see :func:`~jaxpm_halos.knn`) is NaN at every radius; check the status.

    Examples:
        The CDF of the nearest and 4th-nearest particle of 2000 uniform query points,
        among 4096 uniform particles in a 10 Mpc/h box on a ``(2, 4)`` mesh, beside the
        Poisson expectation of the first, ``1 - exp(-n 4/3 pi r^3)``:

        >>> import jax, numpy as np
        >>> from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
        >>> from jaxpm_halos.stats.knn_cdf import knn_cdf, random_queries
        >>> mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
        >>> pos = np.random.default_rng(1).uniform(0, 10, (4096, 3)).astype(np.float32)
        >>> pos = jax.device_put(pos, NamedSharding(mesh, P(("x", "y"))))
        >>> query = random_queries(2000, 10.0, seed=2)
        >>> radii = np.array([0.2, 0.4, 0.6, 0.8])
        >>> cdf = knn_cdf(pos, query, radii, k=(1, 4), box_size=10.0)
        >>> cdf.shape
        (2, 4)
        >>> print(np.round(np.asarray(cdf), 3))
        [[0.126 0.67  0.98  1.   ]
         [0.    0.027 0.512 0.976]]
        >>> print(np.round(1 - np.exp(-4.096 * 4 / 3 * np.pi * radii**3), 3))
        [0.128 0.666 0.975 1.   ]
    """
    ranks = check_ranks(k)
    radii = check_radii(radii)
    smoothing = check_smoothing(smoothing)
    kmax = ranks[-1]
    (dist, _), status = knn(
        pos,
        box_size,
        k=kmax,
        mesh=mesh,
        query=query,
        config=config,
        with_status=True,
        grow=grow,
    )
    cdf = _cdf_of_distances(dist.reshape(-1, kmax), radii, smoothing, ranks)
    return (cdf, status) if with_status else cdf


# ----------------------------------------------------------------------------------------
# In situ


def _pencil_queries(snap: Snapshot, query):
    """The query points (Q, 3) inside this device's pencil, compacted to the front of Q
    rows (all Q fit: no buffer to overflow), and their mask (Q,)."""
    pencils = snap.pencils
    q = wrap(query, pencils.box_size)  # (Q, 3) as knn wraps its query points
    i, j = pencils.block_of(q)
    ci, cj = pencils.coords()
    picked, _ = selection((i == ci) & (j == cj), q.shape[0])  # (Q,)
    return take(q, picked), picked < q.shape[0]


def knn_cdf_on_snapshot(snap: Snapshot, query, radii, *, k=(1, 2, 4, 8), smoothing=None):
    """:func:`knn_cdf` of an in-situ :class:`~jaxpm_halos.Snapshot`'s particles, inside an
    analysis (on one device, inside ``shard_map``). Returns ``(cdf, status)``, both
    replicated: declare them ``"replicated"`` when registering.

    ``query`` (Q, 3) holds the same points on every device (in Mpc/h); each device
    searches those inside its own pencil on the shared decomposition (spheres that leave
    its ghost layer are completed across devices, with ``snap.insitu.knn``'s buffers),
    and the per-device sums are added over the mesh. Each device holds Q query rows.
    Hard CDFs are the bits of the offline :func:`knn_cdf` on the same positions.
    """
    ranks = check_ranks(k)
    insitu, pencils = snap.insitu, snap.pencils
    total = insitu.nc**3
    kmax = check_k(ranks[-1], total, False, context="knn_cdf in situ: ")
    dtype = snap.decomposition.ext.pos.dtype
    if smoothing is not None:
        smoothing = jnp.asarray(smoothing, dtype)
    # The layer kNN asks for, within the shared one (any width is exact).
    width = min(ghost_width(kmax, total, pencils, insitu.knn), snap.width)
    plan = snap.plan.with_width(width)
    mine, valid = _pencil_queries(snap, jnp.asarray(query, dtype))
    spec = Spec(kmax, insitu.knn, "neighbours", None, False)
    nb, status, _ = neighbours(plan, snap.decomposition, spec, queries=(mine, valid))
    d = neighbour_distances(mine, nb, pencils.box_size)[:, np.asarray(ranks) - 1]  # (Q, K)
    sums, blank = cdf_sums(d, valid, jnp.asarray(radii, dtype), smoothing)
    # Two collectives: one psum of a float and an int32 fails under jax.jvp (the int's
    # float0 tangent).
    sums, blank = psum_all(pencils, sums), psum_all(pencils, blank)
    return cdf_fractions(sums, blank, mine.shape[0], dtype), status


def register_knn_cdf(name: str = "knn_cdf", *, query, radii, k=(1, 2, 4, 8), smoothing=None):
    """Register the in-situ analysis ``name``: :func:`knn_cdf_on_snapshot` at every
    snapshot, with outputs ``{"cdf": (len(k), len(radii)), "status": Status}``, both
    replicated (check them with :func:`~jaxpm_halos.check_insitu`). ``query`` (Q, 3),
    ``radii`` and ``smoothing`` are fixed here (concrete, in Mpc/h) and compiled into
    the program; registering ``name`` again replaces the analysis. Its ghost layer is
    kNN's for ``max(k)`` neighbours. Returns ``name``, to pass in
    ``InSitu(analyses=(..., name))``.

    Registered once, before the ``InSitu`` is built (a sketch; ``y`` is JaxPM's state)::

        name = register_knn_cdf(query=random_queries(1000, 32.0), radii=[0.5, 1.0, 2.0])
        out = jaxpm_halos.InSitu(box_size=32.0, analyses=(name,))(y, a=1.0)
        jaxpm_halos.check_insitu(out)
        cdf = out[name]["cdf"]  # (4, 3): k = 1, 2, 4, 8 by radius
    """
    ranks = check_ranks(k)
    query = _check_query(query)
    radii, smoothing = check_radii(radii), check_smoothing(smoothing)
    if is_traced((radii, smoothing)):
        raise ValueError("register_knn_cdf needs concrete radii and smoothing (numbers)")
    radii = np.asarray(radii)
    smoothing = None if smoothing is None else float(smoothing)

    def width(insitu, pencils):
        return ghost_width(ranks[-1], insitu.nc**3, pencils, insitu.knn)

    @register(name, outputs={"cdf": "replicated", "status": "replicated"}, width=width)
    def run(snap: Snapshot):
        cdf, status = knn_cdf_on_snapshot(snap, query, radii, k=ranks, smoothing=smoothing)
        return {"cdf": cdf, "status": status}

    return name
