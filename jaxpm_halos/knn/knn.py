"""The public kNN calls: ``knn``, ``knn_density``, ``knn_local`` and ``knn_on_decomposition``.

They are thin entry points over the per-device pipeline (:mod:`jaxpm_halos.core.pipeline`) and the
search kernel (:func:`._search.knn_device`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..core.config import KNNConfig
from ..core.domain import Decomposition, pmax_all, psum_all, valued_with_derivative_of
from ..core.frontend import (
    Problem,
    local_fields,
    local_valid,
    particle_fields,
    particles_of,
    prepare,
    program_cache,
    row_masses,
    trim_padding,
)
from ..core.geometry import wrap
from ..core.layout import Pencils
from ..core.particles import Particles, integer_value, real_floats
from ..core.pipeline import (
    JitProgram,
    Plan,
    Step,
    analyse,
    blank_rows,
    on_device,
    plan_for,
    run_sharded,
)
from ..core.retry import run_growing
from ..core.status import is_traced, refuse_nonfinite_points
from ._search import ghost_width, knn_density_of, knn_device, neighbour_distances, overdensity

int32 = jnp.int32
# The particle fields a reduce fn sees in data (query points carry only "pos").
_ROW_FIELDS = ("pos", "id", "mass", "vel")


class _Spec(NamedTuple):
    """Static settings of one kNN computation."""

    k: int
    config: KNNConfig
    output: str  # "neighbours", "density" or "reduce"
    reduce_fn: Callable | None
    overdensity: bool
    kth_only: bool = False  # a density of equal masses: keep only the k-th neighbour


def _finish(plan: Plan, spec: _Spec, nb, qpos, data, total_mass):
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
        if key not in _ROW_FIELDS or key in data:
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


def _neighbours(plan: Plan, decomposition: Decomposition, spec: _Spec, mass=None, queries=None):
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


def self_step(plan: Plan, spec: _Spec) -> Step:
    """kNN of the particles themselves: per-particle values and the status."""

    def run(decomposition):
        nb, status, total_mass = _neighbours(plan, decomposition, spec)
        payload = decomposition.migrated.payload
        data = {key: payload[key] for key in _ROW_FIELDS if key in payload}
        return {
            "values": _finish(plan, spec, nb, payload["pos"], data, total_mass),
            "status": status,
        }

    return Step(run, {"values": "particle", "status": "replicated"})


def query_step(plan: Plan, spec: _Spec, qpos, qvalid, qn0: int) -> Step:
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
        nb, status, total_mass = _neighbours(plan, decomposition, spec, queries=(mine, qmig.valid))
        values = _finish(plan, spec, nb, mine, {"pos": mine}, total_mass)
        return {"values": qplan.trip(values, qmig, nq), "status": qstatus.merge(status)}

    return Step(run, {"values": "device", "status": "replicated"})


@program_cache(32)
def _knn_program(problem: Problem, in_specs, spec: _Spec, query_rows: int):
    """Jitted pipeline; ``query_rows`` > 0 for query points (padded total)."""
    layout = problem.layout
    plan = plan_for(
        problem,
        spec.config.domain,
        ghost_width(spec.k, problem.total, problem.pencils, spec.config),
    )
    qn0 = query_rows // problem.pencils.num_devices
    if query_rows:
        in_specs = tuple(in_specs) + (layout.device_spec, layout.device_spec)

    def device(*blocks):
        blocks = list(blocks)
        if query_rows:
            qvalid, qpos = blocks.pop(), blocks.pop()
            step = query_step(plan, spec, qpos, qvalid, qn0)
        else:
            step = self_step(plan, spec)
        fields, shape = local_fields(problem, *blocks)
        fields["mass"] = row_masses(problem, fields)
        valid = local_valid(problem, fields["pos"].shape[0])
        return on_device(plan, fields, valid, shape, {"knn": step})

    return JitProgram(lambda *args: run_sharded(layout, device, args, in_specs)["knn"])


def check_k(
    k,
    total: int | None,
    self_mode: bool,
    least: int = 1,
    context: str = "",
    particles: str = "there are {total}",
) -> int:
    """``k`` as an int: an integer of at least ``least`` (2 for a density: the estimator
    uses k - 1) and, where the particle count ``total`` is known, at most the particles
    there are to find (k + 1 in self mode). Errors start with ``context``; ``particles``
    words the count."""
    given, k = k, integer_value(k)
    if k is None:
        raise ValueError(f"{context}k must be an integer, got {given!r}")
    if k < least:
        raise ValueError(
            f"{context}k must be at least 1, got {k}"
            if least == 1
            else f"{context}a kNN density needs k >= {least} (the estimator uses k - 1), got {k}"
        )
    need = k + 1 if self_mode else k
    if total is not None and need > total:
        most = total - 1 if self_mode else total
        fix = (
            f"Use k <= {most}"
            if most >= least
            else f"No k fits: {least + self_mode} particles at least are needed"
        )
        raise ValueError(
            f"{context}k = {k} neighbours need at least "
            f"{'k + 1' if self_mode else 'k'} particles; "
            f"{particles.format(total=total)}. {fix}"
        )
    return k


def _check_total_mass(problem, mass):
    """``overdensity=True`` divides by the mean density: a concrete total mass of zero
    raises (inside ``jit`` the result would be NaN)."""
    if mass is None or is_traced((mass,)):
        return
    mass = np.asarray(mass, np.float64)
    total = float(mass.sum() if mass.ndim else mass * problem.total)
    if not total > 0:
        raise ValueError(
            "knn_density(overdensity=True) divides by the mean density, but the "
            f"particles' total mass is {total:g}; give positive masses (or "
            "overdensity=False)"
        )


def _query_rows(query, devices: int):
    """Flatten query points to (M, 3) and pad them to a multiple of the device count."""
    query = jnp.asarray(real_floats(query, "query points"))
    if query.ndim < 1 or query.shape[-1] != 3:
        raise ValueError(f"query points must have a trailing axis of size 3, got {query.shape}")
    lead = tuple(query.shape[:-1])
    flat = query.reshape(-1, 3)
    m = flat.shape[0]
    if m == 0:
        raise ValueError("query holds no points")
    # Named here: the status would count them with the particles as "positions".
    refuse_nonfinite_points(
        flat, "query points", "pass finite query points (inside jit their rows give NaN and id -1)"
    )
    pad = -m % devices
    if pad:
        flat = jnp.concatenate([flat, jnp.zeros((pad, 3), flat.dtype)])
    return flat, lead, m


def _run(
    pos, box_size, k, mass, mesh, query, config, output, reduce_fn, overdensity, with_status, grow
):
    problem, args, in_specs = prepare(pos, box_size, None, mass, mesh)
    self_mode = query is None
    k = check_k(k, problem.total, self_mode, least=2 if output == "density" else 1)
    if overdensity:
        _check_total_mass(
            problem, pos.mass if isinstance(pos, Particles) and mass is None else mass
        )
    query_rows, lead, m = 0, None, 0
    if not self_mode:
        flat, lead, m = _query_rows(query, problem.pencils.num_devices)
        query_rows = flat.shape[0]
        args = args + (flat.astype(args[0].dtype), jnp.arange(query_rows) < m)

    equal_masses = problem.mass_kind in ("static", "scalar")

    def run(cfg):
        spec = _Spec(
            k, cfg, output, reduce_fn, bool(overdensity), output == "density" and equal_masses
        )
        return _knn_program(problem, in_specs, spec, query_rows)(*args)

    if is_traced(args):
        out = run(config)
    else:
        out, _ = run_growing(run, config, lambda o: o["status"].failure(), grow=grow, stacklevel=4)
    values, status = out["values"], out["status"]
    key = {"neighbours": None, "density": "rho", "reduce": "value"}[output]
    result = (values["dist"], values["idx"]) if key is None else values[key]
    if self_mode:
        result = trim_padding(problem, result)
    else:
        result = jax.tree.map(lambda a: a[:m].reshape(lead + a.shape[1:]), result)
        result = _in_query_sharding(result, query, len(lead))
    return (result, status) if with_status else result


def _in_query_sharding(result, query, lead_dims: int):
    """Outside ``jit``, per-query results laid out like a ``NamedSharding`` query along its
    leading axes (the flattened query rows come back in the program's own layout)."""
    sharding = getattr(query, "sharding", None)
    if not isinstance(sharding, NamedSharding) or is_traced(result):
        return result
    spec = tuple(sharding.spec)[:lead_dims]
    spec = spec + (None,) * (lead_dims - len(spec))
    return jax.tree.map(lambda a: jax.device_put(a, NamedSharding(sharding.mesh, P(*spec))), result)


def knn(
    pos,
    box_size=None,
    k: int = 8,
    *,
    mesh=None,
    query=None,
    reduce: Callable | None = None,
    config: KNNConfig = KNNConfig(),
    with_status: bool = False,
    grow: bool = True,
):
    """Exact k nearest neighbours in a periodic box, distributed over the input's mesh.

    Args:
      pos: positions ``(N, 3)`` (sharded along axis 0 over the mesh axes, or unsharded:
        then any N, padded inside to a multiple of the device count), a JaxPM-layout grid
        ``(nc, nc, nc, 3)`` sharded over its first two axes, or the
        :class:`~jaxpm_halos.Particles` from :func:`~jaxpm_halos.from_jaxpm`. Integer
        and half-precision (float16, bfloat16) positions and masses are computed in float32.
      box_size: periodic box side (taken from Particles; a different value raises).
      k: number of neighbours, ``1 <= k < N`` (``k <= N`` with ``query``).
      mesh: device mesh; default: the input's sharding (or the abstract mesh under ``jit``).
      query: optional points ``(..., 3)``, sharded along axis 0 or not. Then the result is
        for these points, with no particle excluded, in the query's leading shape.
      reduce: optional ``fn(dist, idx, data) -> pytree`` run on each device while the
        particles are in their domains, on ``(n, k)`` distances and ids of ``n`` rows and
        ``data``, a dict of ``(n, ...)`` arrays: ``pos``, ``id``, ``mass`` (and ``vel``) of
        the particles (``pos`` only for query points) and ``neighbour_mass`` ``(n, k)``. Its
        per-row outputs (leading axis ``n``) are returned instead of ``(dist, idx)``; rows
        of non-finite positions, and rows not completed inside ``jit`` (below), carry NaN
        (floats), -1 (integers) or False (booleans), whatever the fn made of them.
      config: :class:`~jaxpm_halos.KNNConfig`.
      with_status: also return the :class:`~jaxpm_halos.Status`.
      grow: outside ``jit``, grow a buffer that overflowed and run again (see
        :func:`~jaxpm_halos.fof`); ``False`` raises :class:`~jaxpm_halos.CapacityError`.

    Returns:
      ``(dist, idx)``: ``(..., k)`` distances (ascending, periodic minimum image) to the k
      nearest *other* particles and their global ids (input index, or lattice index for
      JaxPM grids), in the input's leading shape and sharding; or the ``reduce`` output.
      Distances and ids are the same on every mesh: neighbours are chosen and listed by
      (distance, id), so of more particles than fit at exactly the k-th distance the
      lowest ids are listed. ``jax.grad`` of a
      function of ``dist`` flows to the positions with the neighbour selection held fixed.

    Outside ``jit``, a non-finite position raises :class:`~jaxpm_halos.InvalidInputError`;
    inside ``jit``, rows that could not be completed are NaN (ids -1) and
    ``with_status=True`` gives the status to check (or to thread with ``status.error_if``).
    A row is left incomplete when the cross-device buffer (``'knn remote'``) had no room
    for it, or a query point when the queries' own buffers had none; when any other
    buffer (of the particles' decomposition or of the search) overflowed, every row is
    NaN (ids -1, ``reduce``'s outputs blank as above): none is returned finite and wrong.
    """
    output = "neighbours" if reduce is None else "reduce"
    return _run(
        pos, box_size, k, None, mesh, query, config, output, reduce, False, with_status, grow
    )


def knn_density(
    pos,
    box_size=None,
    k: int = 8,
    *,
    mass=None,
    mesh=None,
    overdensity: bool = False,
    query=None,
    config: KNNConfig = KNNConfig(),
    with_status: bool = False,
    grow: bool = True,
):
    """kNN density ``rho = (k - 1) m / (4/3 pi r_k^3)`` at each particle (or query point).

    ``r_k`` is the distance to the k-th nearest other particle (nearest particle for query
    points). With per-particle masses, ``(k - 1) m`` is the mass of the k - 1 nearest
    neighbours (``mass`` given here is used instead of a Particles' own; left out, the
    Particles' masses, or 1). ``overdensity=True`` returns ``rho / rho_mean - 1`` with
    ``rho_mean`` the total mass over ``box_size**3``. Needs ``k >= 2``. Masses must be
    finite and >= 0: outside ``jit`` others raise :class:`~jaxpm_halos.InvalidInputError`;
    inside, their particles are excluded and counted like non-finite positions, and a
    total mass of zero gives NaN overdensities with its particles counted as unusable
    (the status fails). Where k particles coincide (``r_k = 0``) the density is inf, or 0
    when the k - 1 nearest are massless. Other arguments and the rows left NaN inside
    ``jit`` as :func:`knn`.

    Examples:
        Unit masses spread uniformly over a 10 Mpc/h box, sharded over a ``(2, 4)`` mesh:

        >>> import jax, numpy as np
        >>> import jaxpm_halos
        >>> from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
        >>> mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
        >>> pos = np.random.default_rng(1).uniform(0, 10, (4096, 3)).astype(np.float32)
        >>> pos = jax.device_put(pos, NamedSharding(mesh, P(("x", "y"))))
        >>> rho = jaxpm_halos.knn_density(pos, box_size=10.0, k=16)
        >>> rho.shape, rho.sharding.spec  # one value per particle, sharded like pos
        ((4096,), PartitionSpec(('x', 'y'),))
        >>> print(f"median {float(np.median(rho)):.2f}, mean density {4096 / 10**3:.2f}")
        median 3.90, mean density 4.10
    """
    return _run(
        pos, box_size, k, mass, mesh, query, config, "density", None, overdensity, with_status, grow
    )


def knn_local(
    particles: Particles,
    k: int,
    *,
    axes=(None, None),
    total: int | None = None,
    query=None,
    query_valid=None,
    reduce: Callable | None = None,
    config: KNNConfig = KNNConfig(),
    n0: int | None = None,
    independent_axes=(),
):
    """kNN on one device's particles, for use inside the caller's own ``shard_map``.

    Args:
      particles: this device's padded :class:`~jaxpm_halos.Particles` (rows, valid first);
        ids must be global and unique.
      k: number of neighbours.
      axes: the caller's mesh axis names that cut the box along x and y (None for an axis
        that is not cut). Device ``(i, j)`` of those axes owns pencil ``(i, j)``.
      total: the global number of particles (sets the default ghost width, and k is
        checked against it; default: the rows of ``particles`` times the number of
        devices). Rows that find fewer than k neighbours all the same (padding counted in
        the default) fail the status (``FailureKind.TOO_FEW``) and are NaN.
      query: optional ``(m, 3)`` query points held by this device (any positions), with
        ``query_valid`` (m,) marking the real ones (default all).
      reduce: optional ``fn(dist, idx, data)`` as in :func:`knn`.
      n0: the mean particles per device that the capacity factors refer to (default: the
        number of rows of ``particles``).
      independent_axes: the ``shard_map``'s other manual axes, along which each index
        holds a separate simulation (an ensemble). A manual axis of size > 1 in neither
        ``axes`` nor here raises ``ValueError``: the particles would be split over it
        unseen, and neighbours missed.

    Returns:
      Without ``query``: ``(domain, result, status)``: the particles this device owns after
      migration (padded, valid first), the result for them in that order (``(dist, idx)``
      or the ``reduce`` output), and the :class:`~jaxpm_halos.Status`. With ``query``:
      ``(result, status)`` for the query rows in the caller's order. No error is raised
      inside ``shard_map``: check ``status.ok`` (rows that could not be completed are NaN,
      ids -1; all rows when a buffer of the particles other than ``'knn remote'``
      overflowed, as in :func:`knn`). The status covers the decomposition as well as the search.
    """
    pencils = Pencils.from_axes(axes, particles.box_size, independent_axes)
    n0 = particles.size if n0 is None else int(n0)
    total = n0 * pencils.num_devices if total is None else int(total)
    k = check_k(k, total, query is None)
    spec = _Spec(k, config, "neighbours" if reduce is None else "reduce", reduce, False)
    plan = Plan(pencils, config.domain, n0, ghost_width(k, total, pencils, config))
    if query is None:
        step = self_step(plan, spec)
    else:
        query = jnp.asarray(real_floats(query, "query points"))
        query = query.reshape(-1, 3).astype(particles.pos.dtype)
        qvalid = (
            jnp.ones(query.shape[0], bool)
            if query_valid is None
            else jnp.asarray(query_valid, bool).reshape(-1)
        )
        step = query_step(plan, spec, query, qvalid, query.shape[0])
    decomposition, domain = plan.decompose(particle_fields(particles), particles.valid())
    outputs, _ = analyse(decomposition, domain, {"knn": step})
    values, status = outputs["knn"]["values"], outputs["knn"]["status"]
    result = (values["dist"], values["idx"]) if reduce is None else values["value"]
    if query is not None:
        return result, status
    return particles_of(decomposition.migrated, particles.box_size), result, status


def knn_on_plan(plan: Plan, decomposition: Decomposition, k: int, config: KNNConfig, mass=None):
    """kNN of a decomposition's owned rows, ghost layer ``plan.width``; see
    :func:`knn_on_decomposition`."""
    spec = _Spec(int(k), config, "neighbours", None, False)
    nb, status, _ = _neighbours(plan, decomposition, spec, mass=mass)
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
    spec = _Spec(int(k), config, "density", None, False, kth_only=bool(equal_masses))
    nb, status, _ = _neighbours(plan, decomposition, spec)
    rho = knn_density_of(decomposition.migrated.payload["pos"], nb, spec.k, plan.pencils.box_size)
    return rho, status


def knn_on_decomposition(
    pencils: Pencils,
    decomposition: Decomposition,
    k: int,
    width: float | None = None,
    *,
    mass=None,
    config: KNNConfig = KNNConfig(),
    n0: int,
):
    """kNN of the owned particles of a shared :class:`~jaxpm_halos.core.domain.Decomposition`.

    ``width`` (box units) is the ghost layer the search trusts: by default the layer the
    decomposition was built with; a narrower one is allowed (more spheres are completed
    across devices), a wider one raises ``ValueError`` (it would miss neighbours and still
    report success). ``mass`` gives per-owned-row masses (default: the migrated ``mass``
    field).

    Returns ``(result, status)``: ``result`` holds, per owned row in the decomposition's
    order, ``dist`` (rows, k) (differentiable, NaN in padding), ``idx`` (global ids, -1 in
    padding), ``neighbour_mass`` (rows, k) and ``ok`` (rows,). ``status`` covers the
    search only (the decomposition's buffers are the caller's). ``ok`` is False (and the
    row NaN, -1, its ``neighbour_mass`` NaN) for a row the cross-device buffer had no room
    for, and for every row when another search buffer overflowed or
    ``decomposition.fits`` is False.
    """
    if width is None:
        width = decomposition.width
    mig = decomposition.migrated
    if mass is None:
        mass = mig.payload.get(
            "mass", jnp.ones(mig.payload["id"].shape, decomposition.ext.pos.dtype)
        )
    mass = jnp.broadcast_to(jnp.asarray(mass, decomposition.ext.pos.dtype), mig.payload["id"].shape)
    plan = Plan(pencils, config.domain, int(n0), float(width))
    return knn_on_plan(plan, decomposition, k, config, mass)
