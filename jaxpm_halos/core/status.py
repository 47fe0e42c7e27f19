"""Capacity bookkeeping: what each fixed-size buffer needed, carried with every result.

Every fixed-shape buffer in jaxpm_halos has a capacity set by a config knob. The kernels
never drop data silently: they record the number of rows each buffer *needed* (the maximum
over devices). :class:`Status` carries those needs next to the static capacities. Outside
``jit`` the public functions grow the buffer that overflowed and run again (or, with
``grow=False``, raise an error naming the knob and a value that fits); inside ``jit`` the
caller reads ``status.ok`` or threads a runtime check through the data with
:meth:`Status.error_if`.

What a failure is, and the error it raises, is :mod:`.errors`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from .errors import Failure, FailureKind, Limit, grows_with, invalid_input


def refuse_nonfinite_points(points, what: str, fix: str) -> None:
    """Outside ``jit``, raise :func:`invalid_input` naming how many ``points`` (rows of the
    last axis) hold NaN or inf: ``"jaxpm_halos: {n} {what} are NaN or inf; {fix}"``.
    Traced points are left to the status, which counts them."""
    if is_traced(points):
        return
    bad = int(jnp.sum(~jnp.all(jnp.isfinite(points), axis=-1)))
    if bad:
        raise invalid_input(f"jaxpm_halos: {bad} {what} are NaN or inf; {fix}", bad)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Status:
    """Rows needed by each buffer of one computation (max over devices), with the capacities.

    ``needed`` maps a buffer name to an int32 scalar; ``limits`` (static) maps the same
    names to their :class:`Limit`, in pipeline order. ``nonfinite`` counts particles whose
    position (or mass) was NaN or inf, and SO centres that were: they were excluded from
    every result; also the padding rows of Particles with a traced ``num`` and the particles
    whose traced ids were out of range (both excluded too), and the particles of a kNN
    overdensity whose total mass is 0 (every value NaN). A status covers every buffer its
    result depends on, the shared decomposition included. ``unreplicated`` (bool, one per
    name in the static ``replicated``) flags the outputs of in-situ user analyses declared
    ``"replicated"`` that were not the same on every device. ``repeated_ids`` counts repeats
    FoF found: with ids the caller gave (flat input), every extra particle holding an id
    already held, over all particles whatever their groups (a hashed exchange of the ids);
    with a JaxPM grid, whose ids are its lattice indices, the groups found with more than
    one particle holding the group's smallest id. Groups that share their smallest id are
    merged in the catalogue (and share a label). ``too_few`` counts valid kNN rows left
    without k neighbours while every buffer
    fitted: there were fewer than k + 1 particles (k at query points) once padding and
    excluded ones were left out. ``not_run`` (bool) marks a placeholder for results that were
    never computed: diffrax's save for a solve that takes no step (``_saveloop``).
    """

    needed: Mapping[str, jax.Array]
    nonfinite: jax.Array
    limits: tuple[tuple[str, Limit], ...] = dataclasses.field(metadata=dict(static=True))
    unreplicated: jax.Array = dataclasses.field(default_factory=lambda: jnp.zeros((0,), bool))
    replicated: tuple[str, ...] = dataclasses.field(default=(), metadata=dict(static=True))
    repeated_ids: jax.Array = dataclasses.field(default_factory=lambda: jnp.int32(0))
    too_few: jax.Array = dataclasses.field(default_factory=lambda: jnp.int32(0))
    not_run: jax.Array = dataclasses.field(default_factory=lambda: jnp.bool_(False))

    @property
    def ok(self) -> jax.Array:
        """Scalar bool: every buffer fitted, every position was finite, no ids repeated in a
        way that merged groups, every kNN row found its k neighbours, and every output
        declared replicated was the same on every device, and the analyses ran at all."""
        good = (
            (self.nonfinite == 0)
            & (self.repeated_ids == 0)
            & (self.too_few == 0)
            & ~jnp.any(self.unreplicated, axis=-1)
            & ~self.not_run
        )
        return good & self.buffers_fit()

    def buffers_fit(self, skip: tuple[str, ...] = ()) -> jax.Array:
        """Scalar bool: every buffer fitted, except those named in ``skip``."""
        good = jnp.bool_(True)
        for name, limit in self.limits:
            if name not in skip:
                good = good & (self.needed[name] <= limit.rows)
        return good

    def merge(self, other: Status) -> Status:
        """Both statuses' buffers (``self``'s first) and the larger exclusion,
        repeated-id and too-few counts. A name in both must be the same buffer (the same limit)."""
        mine = dict(self.limits)
        for name, limit in other.limits:
            if name in mine and mine[name] != limit:
                raise ValueError(f"two different buffers are both named {name!r}")
        needed = {**self.needed, **other.needed}
        limits = self.limits + tuple(item for item in other.limits if item[0] not in mine)
        return Status(
            needed,
            jnp.maximum(self.nonfinite, other.nonfinite),
            limits,
            jnp.concatenate([self.unreplicated, other.unreplicated], axis=-1),
            self.replicated + other.replicated,
            jnp.maximum(self.repeated_ids, other.repeated_ids),
            jnp.maximum(self.too_few, other.too_few),
            self.not_run | other.not_run,
        )

    def renamed(self, prefix: str) -> Status:
        """The same status with ``prefix`` before every buffer name (to merge it with a
        status of other buffers of the same names)."""
        return Status(
            {prefix + name: value for name, value in self.needed.items()},
            self.nonfinite,
            tuple((prefix + name, limit) for name, limit in self.limits),
            self.unreplicated,
            self.replicated,
            self.repeated_ids,
            self.too_few,
            self.not_run,
        )

    def failure(self) -> Failure | None:
        """Host-side: the first failure, or None when all is well."""
        if np.any(np.asarray(self.not_run)):  # every other field is a placeholder's zero
            return Failure(FailureKind.NOT_RUN, 0)
        nonfinite = int(np.max(np.asarray(self.nonfinite)))
        if nonfinite:
            return Failure(FailureKind.NONFINITE, nonfinite)
        # Before any overflow: growing buffers cannot help, and truncated data only drops
        # rows, so a repeated id seen is one that exists.
        repeated = int(np.max(np.asarray(self.repeated_ids)))
        if repeated:
            return Failure(FailureKind.REPEATED_IDS, repeated)
        too_few = int(np.max(np.asarray(self.too_few)))  # counted only when all fitted
        if too_few:
            return Failure(FailureKind.TOO_FEW, too_few)
        needs = {name: int(np.max(np.asarray(self.needed[name]))) for name, _ in self.limits}

        def knob_need(limit: Limit) -> int:
            """Rows of ``limit``'s buffer for which every buffer sharing its knob fits: the
            knob resizes them together, each at its own rows per unit of the knob (a query
            buffer's 25 rows per unit are not a particle buffer's 512)."""
            return max(
                needs[n]
                if other.scale == limit.scale
                else math.ceil(needs[n] * limit.scale / other.scale)
                for n, other in self.limits
                if other.knob == limit.knob
            )

        for position, (name, limit) in enumerate(self.limits):
            if needs[name] <= limit.rows:
                continue
            also = tuple(
                (later, other, knob_need(other))
                for later, other in self.limits[position + 1 :]
                if needs[later] > other.rows
                and grows_with(limit, other)
                and other.knob != limit.knob
            )
            return Failure(
                FailureKind.OVERFLOW,
                needs[name],
                name,
                limit,
                knob_need(limit),
                last=position + 1 == len(self.limits),
                also=also,
            )
        if not self.replicated:
            return None
        # (..., R) when stacked over snapshots: an output that differed at any of them.
        differs = np.asarray(self.unreplicated).reshape(-1, len(self.replicated)).any(axis=0)
        names = [name for name, bad in zip(self.replicated, differs) if bad]
        return Failure(FailureKind.UNREPLICATED, len(names), ", ".join(names)) if names else None

    def message(self, config=None, argument: str = "{}") -> str | None:
        """Host-side: the error message for the first failure (see :meth:`Failure.message`),
        or None when all is well."""
        failure = self.failure()
        return None if failure is None else failure.message(config, argument)

    def check(self, config=None, argument: str = "{}") -> None:
        """Host-side: raise :class:`CapacityError` / :class:`InvalidInputError` on failure
        (``config`` and ``argument`` as in :meth:`Failure.message`)."""
        failure = self.failure()
        if failure is not None:
            raise failure.error(config, argument)

    def error_if(self, x, config=None):
        """``x``, passed through a check that raises if this status failed; usable inside
        ``jit`` on any mesh.

        The check runs after ``x`` is computed and before anything that uses the returned
        value, on every device at once, so a failure surfaces as an ``XlaRuntimeError``
        carrying this status's message and no device is left waiting in a collective.
        Use the returned value: ``labels = cat.status.error_if(labels, config)``. With the
        ``config`` the analysis ran with (e.g. its ``FoFConfig``), the message spells the
        whole ``config=...`` to rerun with, earlier settings kept; without it, the knob's
        own class alone (e.g. a ``DomainConfig``, to put inside yours).
        """
        x, status = lax.optimization_barrier((x, self))
        argument = "{}" if config is None else "config={}"
        token = _on_every_device(status, lambda concrete: concrete.check(config, argument))
        x, _ = lax.optimization_barrier((x, token))
        return x

    def raise_if_failed(self, config=None) -> None:
        """Runtime check usable inside ``jit``: like :meth:`error_if`, without data to
        thread. Prefer :meth:`error_if`, which also orders the check before later work.

        The error reaches Python with the outputs of the jitted function. One that returns
        nothing on a mesh returns before the check fails: call ``jax.effects_barrier()``
        after it to have the error raised there."""
        self.error_if(self.nonfinite, config)


def check_catalogue_status(status: Status, snapshot: int | None = None) -> None:
    """Raise the status's own error, at ``snapshot`` of a stacked one, if it failed: the
    catalogue it came with is incomplete or wrong."""
    # Every leaf is replicated (InSitu's and fof's are), so each process reads the same
    # status and raises the same error before any collective.
    if snapshot is not None:  # a leading snapshot axis
        status = jax.tree.map(lambda x: np.asarray(x)[snapshot], status)
    failure = status.failure()
    if failure is not None:
        error = failure.error()
        error.args = (
            f"the catalogue is incomplete or wrong, its status failed: {error} "
            "(the whole setting to rerun with: check_insitu(out, insitu) for an "
            "InSitu output, cat.status.check(config) for fof's; throw=False uses "
            "the catalogue anyway)",
        )
        raise error


def is_status(x) -> bool:
    """``is_leaf`` for a pytree holding :class:`Status` nodes (they are pytrees too)."""
    return isinstance(x, Status)


def _on_every_device(status: Status, check):
    """Run the host ``check(status)`` (the status with concrete values) on every device of
    the status's mesh (the status is replicated), returning a token that depends on it. A
    callback on one device only would fail there while the others wait in their next
    collective."""

    def local(status):
        jax.debug.callback(check, status)
        return jnp.zeros((1,), jnp.int32)

    mesh = _mesh_of(status.nonfinite)
    if mesh is None:
        return local(status)
    axes = tuple(mesh.axis_names)
    return jax.shard_map(local, mesh=mesh, in_specs=P(), out_specs=P(axes), check_vma=False)(status)


def _mesh_of(x):
    """The (abstract) mesh a traced value lives on, or None for one device or outside jit."""
    if not isinstance(x, jax.core.Tracer):
        return None
    mesh = getattr(jax.typeof(x).sharding, "mesh", None)
    return mesh if mesh is not None and mesh.size > 1 else None


def is_traced(*trees) -> bool:
    """True when any leaf is a tracer, i.e. we are inside a jax transformation."""
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(trees))
