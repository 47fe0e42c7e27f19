"""The public kNN calls: ``knn``, ``knn_density``, ``knn_local`` and ``knn_on_decomposition``.

They are thin entry points over the per-device pipeline (:mod:`jaxpm_halos.core.pipeline`) and the
search kernel (:func:`._search.knn_device`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..core.config import KNNConfig
from ..core.domain import Decomposition
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
from ..core.layout import Pencils
from ..core.particles import Particles, integer_value, real_floats
from ..core.pipeline import (
    JitProgram,
    Plan,
    analyse,
    on_device,
    plan_for,
    run_sharded,
)
from ..core.retry import run_growing
from ..core.status import is_traced, refuse_nonfinite_points
from ._search import ghost_width
from ._steps import (
    Spec,
    knn_on_plan,
    query_step,
    self_step,
)

int32 = jnp.int32


@program_cache(32)
def _knn_program(problem: Problem, in_specs, spec: Spec, query_rows: int):
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
        spec = Spec(
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
        >>> rho.shape, rho.sharding.spec == pos.sharding.spec  # a value per particle, like pos
        ((4096,), True)
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
    spec = Spec(k, config, "neighbours" if reduce is None else "reduce", reduce, False)
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
