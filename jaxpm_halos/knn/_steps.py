"""kNN as pipeline steps on a decomposition: the searches behind every public kNN call
(:mod:`.knn`), FoF's density peaks and the in-situ ``knn_density``.

A :class:`Spec` says what a call returns (lists, distances, densities, or a reduction of
them); :func:`self_step` and :func:`query_step` run the search of :mod:`._search` on the
owned particles or on query points and return the results to the rows they belong to.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ..core.config import KNNConfig
from ..core.domain import Decomposition
from ..core.geometry import wrap
from ..core.pipeline import (
    Plan,
    Step,
    blank_rows,
)
from ..core.rows import pmax_all, psum_all, valued_with_derivative_of
from ._search import knn_density_of, knn_device, neighbour_distances, overdensity

int32 = jnp.int32


# The particle fields a reduce fn sees in data (query points carry only "pos").
ROW_FIELDS = ("pos", "id", "mass", "vel")


class Spec(NamedTuple):
    """Static settings of one kNN computation."""

    k: int
    config: KNNConfig
    output: str  # "neighbours", "density" or "reduce"
    reduce_fn: Callable | None
    overdensity: bool
    kth_only: bool = False  # a density of equal masses: keep only the k-th neighbour


def _finish(plan: Plan, spec: Spec, nb, qpos, data, total_mass):
    """Per-row outputs from the neighbours, on the device."""
    k, box = spec.k, plan.pencils.box_size
    if spec.output == "density":
        rho = knn_density_of(qpos, nb, k, box)
        if spec.overdensity:
            rho = overdensity(rho, total_mass, box)
        return {"rho": rho}
    dist = neighbour_distances(qpos, nb, box)
    if spec.output == "neighbours":
        return {"dist": dist, "idx": jnp.where(nb.ok[:, None], nb.id, -1)}
    data = dict(data, neighbour_mass=_masked_mass(nb))
    try:
        value = spec.reduce_fn(dist, jnp.where(nb.ok[:, None], nb.id, -1), data)
    except KeyError as error:
        # Query points carry only their positions: name the fields there are. A key that
        # is no row field is the user's own lookup, left as it was.
        key = error.args[0] if error.args else None
        if key not in ROW_FIELDS or key in data:
            raise
        raise KeyError(
            f"knn's reduce fn asked data for {key!r}; data holds {sorted(data)}"
        ) from error
    for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
        shape = tuple(jnp.shape(leaf))
        if not shape or shape[0] != dist.shape[0]:
            raise ValueError(
                f"knn's reduce fn must return per-row arrays, with the leading "
                f"axis of its dist argument ({dist.shape[0]} rows on a device); "
                f"output {jax.tree_util.keystr(path) or 'value'} has shape {shape}"
            )
    # A row not completed (overflow or too few inside jit) gave the fn partial neighbours;
    # whatever it made of them is blanked rather than returned finite and wrong.
    return {"value": blank_rows(value, nb.ok)}


def neighbours(plan: Plan, decomposition: Decomposition, spec: Spec, mass=None, queries=None):
    """``(neighbours, status, total_mass)`` of the owned rows (or of ``queries``, migrated
    query rows ``(pos, valid)``) on one decomposition."""
    if not 0 <= plan.width <= decomposition.width:
        # A search trusting a wider layer than the ghosts hold would miss neighbours and
        # still report ok.
        raise ValueError(
            f"kNN: width={plan.width} is not within the decomposition's ghost "
            f"layer ({decomposition.width}); pass a width at most that, or leave "
            "it out to use the layer's own"
        )
    mig = decomposition.migrated
    if mass is None:
        mass = mig.payload["mass"]
    ext_mass = decomposition.ghosts.forward(plan.pencils, mass)
    nb, status = knn_device(
        plan,
        decomposition.ext,
        decomposition.ext.pos,
        ext_mass,
        spec.k,
        spec.config,
        queries=queries,
        kth_only=spec.kth_only,
    )
    nb, status = _trusted(
        plan, decomposition, nb, status, mig.valid if queries is None else queries[1]
    )
    total_mass = None
    if spec.overdensity:
        count = psum_all(plan.pencils, jnp.sum(mig.valid, dtype=jnp.int32))
        total_mass = _total_mass(plan, mig.valid, mass, count, spec.kth_only)
        # No mass at all: every overdensity is NaN, and the masses are what is unusable.
        status = dataclasses.replace(
            status, nonfinite=jnp.maximum(status.nonfinite, jnp.where(total_mass > 0, 0, count))
        )
    return nb, status, total_mass


def _total_mass(plan: Plan, valid, mass, count, equal_masses: bool):
    """The particles' total mass, replicated, with the sum's derivative (each mass counts
    once). Equal masses: the value is N m, with N (``count``) exact, so the mean is the
    same bits on every mesh (a float sum depends on the order) and in situ (InSitu's
    nc**3 m); ``pmax`` has no derivative, so the sum carries it."""
    total = psum_all(plan.pencils, jnp.sum(jnp.where(valid, mass, 0)))
    if not equal_masses:
        return total
    each = pmax_all(plan.pencils, lax.stop_gradient(jnp.max(jnp.where(valid, mass, 0))))
    return valued_with_derivative_of(count * each, total)


def _trusted(plan: Plan, decomposition: Decomposition, nb, status, valid):
    """``(nb, status)`` with no row trusted after an overflow, and rows left short counted.

    A row that needed the full cross-device buffer is already marked; any other buffer of
    the particles (the decomposition's or the search's) that overflowed truncated data
    every row may have read, so inside jit all rows come back NaN / -1. With every buffer
    fitting, a ``valid`` row left incomplete had fewer particles to find than it needs
    (padding or excluded ones left out): ``status.too_few``, not a silent NaN.
    """
    nb = nb._replace(ok=nb.ok & decomposition.fits & status.buffers_fit(skip=("knn remote",)))
    short = psum_all(plan.pencils, jnp.sum(valid & ~nb.ok, dtype=jnp.int32))
    fitted = decomposition.fits & status.buffers_fit()
    return nb, dataclasses.replace(status, too_few=jnp.where(fitted, short, 0))


def _masked_mass(nb):
    """Neighbour masses (n, k), NaN in rows not completed."""
    return jnp.where(nb.ok[:, None], nb.mass, jnp.nan)


def self_step(plan: Plan, spec: Spec) -> Step:
    """kNN of the particles themselves: per-particle values and the status."""

    def run(decomposition):
        nb, status, total_mass = neighbours(plan, decomposition, spec)
        payload = decomposition.migrated.payload
        data = {key: payload[key] for key in ROW_FIELDS if key in payload}
        return {
            "values": _finish(plan, spec, nb, payload["pos"], data, total_mass),
            "status": status,
        }

    return Step(run, {"values": "particle", "status": "replicated"})


def query_step(plan: Plan, spec: Spec, qpos, qvalid, qn0: int) -> Step:
    """kNN at one device's query rows ``qpos`` (m, 3): the queries are migrated to their
    pencils and their values come back to this device's rows (kind ``"device"``)."""
    qplan = Plan(plan.pencils, spec.config.domain, qn0, 0.0, prefix="query ")
    nq = qpos.shape[0]

    def run(decomposition):
        qfields = {
            "pos": wrap(qpos, plan.pencils.box_size),
            "id": plan.pencils.device_index() * nq + jnp.arange(nq, dtype=int32),
        }
        qmig, qstatus = qplan.migrate(qfields, qvalid)
        mine = qmig.payload["pos"]
        nb, status, total_mass = neighbours(plan, decomposition, spec, queries=(mine, qmig.valid))
        values = _finish(plan, spec, nb, mine, {"pos": mine}, total_mass)
        return {"values": qplan.trip(values, qmig, nq), "status": qstatus.merge(status)}

    return Step(run, {"values": "device", "status": "replicated"})


def knn_on_plan(plan: Plan, decomposition: Decomposition, k: int, config: KNNConfig, mass=None):
    """kNN of a decomposition's owned rows, ghost layer ``plan.width``; see
    :func:`knn_on_decomposition`."""
    spec = Spec(int(k), config, "neighbours", None, False)
    nb, status, _ = neighbours(plan, decomposition, spec, mass=mass)
    dist = neighbour_distances(decomposition.migrated.payload["pos"], nb, plan.pencils.box_size)
    result = {
        "dist": dist,
        "idx": jnp.where(nb.ok[:, None], nb.id, -1),
        "neighbour_mass": _masked_mass(nb),
        "ok": nb.ok,
    }
    return result, status


def knn_density_on_plan(
    plan: Plan, decomposition: Decomposition, k: int, config: KNNConfig, equal_masses: bool = False
):
    """``(density, status)``: kNN density of a decomposition's owned rows (their migrated
    ``mass``), ghost layer ``plan.width``. ``equal_masses`` (every particle has the same
    mass) keeps only the k-th neighbour of each row, with the same values."""
    spec = Spec(int(k), config, "density", None, False, kth_only=bool(equal_masses))
    nb, status, _ = neighbours(plan, decomposition, spec)
    rho = knn_density_of(decomposition.migrated.payload["pos"], nb, spec.k, plan.pencils.box_size)
    return rho, status
