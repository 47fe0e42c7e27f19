"""Capacity bookkeeping: what each fixed-size buffer needed, carried with every result.

Every fixed-shape buffer in jaxpm_halos has a capacity set by a config knob. The kernels
never drop data silently: they record the number of rows each buffer *needed* (the maximum
over devices). :class:`Status` carries those needs next to the static capacities. Outside
``jit`` the public functions grow the buffer that overflowed and run again (or, with
``grow=False``, raise an error naming the knob and a value that fits); inside ``jit`` the
caller reads ``status.ok`` or threads a runtime check through the data with
:meth:`Status.error_if`.

A failure has a kind (:class:`FailureKind`), never to be recognised by its message text.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from .config import PARTICLE_KNOBS, Knob


@dataclasses.dataclass(frozen=True)
class Limit:
    """Static description of one capacity.

    Attributes:
      knob: the config field a user sets, e.g. ``Knob(DomainConfig, "transfer_factor")``.
      rows: rows the buffer holds (per device).
      scale: rows per unit of the knob (``rows == ceil(knob * scale)``); 1 for integer knobs.
      most: the largest value the knob can take here (None: no bound), and ``beyond``,
        why, for the error when a buffer needs more.
      searched: what is needed is only known once reached (the SO search radius: the
        need is twice the value, a step, not a value known to fit).
    """

    knob: Knob
    rows: int
    scale: float = 1.0
    most: float | None = None
    beyond: str = ""
    searched: bool = False

    def suggest(self, needed: int, margin: float = 1.0) -> float | int:
        """Smallest knob value (2 decimals for factors) whose capacity holds ``needed``
        rows times ``margin``, but at most :attr:`most`."""
        value = self.unbounded(needed, margin)
        return value if self.most is None else min(value, self.most)

    def unbounded(self, needed: int, margin: float = 1.0) -> float | int:
        """:meth:`suggest` without the bound."""
        needed = math.ceil(needed * margin)
        if self.scale == 1.0:
            return int(needed)
        value = math.ceil(needed / self.scale * 100) / 100
        while math.ceil(value * self.scale) < needed:
            value = round(value + 0.01, 2)
        return value


def with_setting(config, knob: Knob, value):
    """``config`` (a frozen dataclass) with ``knob`` set to ``value``: on ``config`` itself
    when it is of the knob's class, else on its first field of that class."""
    if type(config) is knob.owner:
        return dataclasses.replace(config, **{knob.field: value})
    for f in dataclasses.fields(config):
        inner = getattr(config, f.name)
        if type(inner) is knob.owner:
            return dataclasses.replace(config, **{f.name: with_setting(inner, knob, value)})
    raise ValueError(f"{type(config).__name__} holds no {knob.owner.__name__}")


def spell_config(config, keep: Knob | None = None) -> str:
    """``Class(field=value, ...)`` with the fields that differ from the defaults (and the
    knob ``keep`` in any case), nested configs spelled alike: an expression that rebuilds
    ``config``."""
    default = type(config)()
    parts = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        kept = keep is not None and type(config) is keep.owner and f.name == keep.field
        if value == getattr(default, f.name) and not kept:
            continue
        nested = dataclasses.is_dataclass(value) and not isinstance(value, type)
        parts.append(f"{f.name}={spell_config(value, keep) if nested else repr(value)}")
    return f"{type(config).__name__}({', '.join(parts)})"


def _grows_with(limit: Limit, other: Limit) -> bool:
    """Whether ``other``'s buffer is grown in the same round as ``limit``'s: it holds
    particle rows and its knob is of the same config class."""
    return other.knob in PARTICLE_KNOBS and other.knob.owner is limit.knob.owner


class FailureKind(enum.Enum):
    """What went wrong, with what to do about it."""

    NONFINITE = "positions, masses or ids that are NaN, inf or unusable (left out inside jit)"
    OVERFLOW = "a fixed-size buffer was too small"
    UNREPLICATED = "an analysis output declared 'replicated' differs between devices"
    REPEATED_IDS = "particle ids repeat, and groups that share their smallest id were merged"
    TOO_FEW = "fewer particles than a kNN row needs (k + 1; k at query points)"
    NOT_RUN = "the analyses did not run: the diffrax solve took no step (t0 == t1)"


@dataclasses.dataclass(frozen=True)
class Failure:
    """The first failure recorded in a :class:`Status` (host-side, concrete numbers).

    Attributes:
      kind: a :class:`FailureKind`.
      count: excluded particles or unusable inputs (NONFINITE), rows the buffer needed per
        device (OVERFLOW), outputs that differ between devices (UNREPLICATED), groups
        holding more than one particle with their smallest id (REPEATED_IDS), or kNN rows
        left without k neighbours (TOO_FEW), 0 (NOT_RUN).
      buffer: the buffer's name (OVERFLOW), the outputs' names (UNREPLICATED), else None.
      limit: its :class:`Limit` (OVERFLOW), else None.
      needed: the rows of this buffer for which every buffer sharing its knob fits (each
        at its own rows per unit of the knob).
      last: whether this was the last buffer of the pipeline (later ones saw truncated data).
      also: later buffers of the same config class that overflowed too and hold particle
        rows (``PARTICLE_KNOBS``), as ``(name, limit, needed)``: grown in the same round.
    """

    kind: FailureKind
    count: int
    buffer: str | None = None
    limit: Limit | None = None
    needed: int = 0
    last: bool = True
    also: tuple[tuple[str, Limit, int], ...] = ()

    def settings(self, margin: float = 1.0) -> dict:
        """``{knob: value that fits}`` for the overflowing knob and those of :attr:`also`."""
        settings = {self.limit.knob: self.limit.suggest(self.needed, margin)}
        for _, limit, needed in self.also:  # a knob two buffers share: what both need
            settings[limit.knob] = max(settings.get(limit.knob, 0), limit.suggest(needed, margin))
        return settings

    def joined(self, others) -> Failure:
        """This overflow, also growing the particle buffers of its config class that the
        overflows ``others`` (of other statuses of the same data) name, each to the most
        any of them needs."""
        also, names = list(self.also), {self.buffer} | {name for name, _, _ in self.also}
        for other in others:
            if other.kind is not FailureKind.OVERFLOW:
                continue
            for name, limit, needed in ((other.buffer, other.limit, other.needed), *other.also):
                if _grows_with(self.limit, limit) and name not in names:
                    also.append((name, limit, needed))
                    names.add(name)
        return dataclasses.replace(self, also=tuple(also))

    @property
    def beyond_bound(self) -> bool:
        """Whether the overflowing knob would have to exceed its bound (no setting fits)."""
        return (
            self.limit is not None
            and self.limit.most is not None
            and self.limit.unbounded(self.needed) > self.limit.most
        )

    def grown(self, config, margin: float = 1.0):
        """``config`` with the overflowing knobs set to values that fit."""
        for knob, value in self.settings(margin).items():
            config = with_setting(config, knob, value)
        return config

    def message(self, config=None, argument: str = "{}") -> str:
        """The error message. With the caller's ``config`` (e.g. the ``FoFConfig`` it ran
        with), the suggestion is that whole config with the overflowing knobs changed (the
        knob and those of :attr:`also`), so earlier fixes are kept; without it, those knobs
        alone. ``argument`` formats the setting as the
        caller's argument, e.g. ``"config={}"``."""
        if self.kind is FailureKind.NONFINITE:
            return (
                f"jaxpm_halos: {self.count} particle positions (or masses, query points "
                "or SO centres) are NaN, inf or unusable (inside jit they are left out of "
                "the results; so are the padding rows of Particles whose num is "
                "traced). Clean the input (or pass only the valid rows) and rerun."
            )
        if self.kind is FailureKind.REPEATED_IDS:
            return (
                f"jaxpm_halos: particle ids repeat: FoF groups ({self.count}) hold more "
                "than one particle with the group's smallest id, and groups that share "
                "their smallest id are merged into one catalogue row. Give every particle "
                "a unique id in [0, 2**31 - 2] (Particles.create(pos, box_size) numbers "
                "the rows; unique 64-bit ids can be relabelled with np.unique(ids, "
                "return_inverse=True)) and rerun."
            )
        if self.kind is FailureKind.TOO_FEW:
            return (
                f"jaxpm_halos: {self.count} kNN rows found fewer than k neighbours: "
                "there are fewer than k + 1 particles (k at query points) once padding "
                "and non-finite ones are left out; those rows are NaN (ids -1). Use a "
                "smaller k or more particles (knn_local: pass total=, the number of "
                "valid particles, to have k checked before the search)."
            )
        if self.kind is FailureKind.NOT_RUN:
            return (
                "jaxpm_halos: the in-situ analyses did not run: the diffrax solve took "
                "no step (its t0 equals t1), and InSitu.saveat's function (and "
                "run_simulation's saveat_fn) runs inside the solve's steps. Run the "
                "analyses on the state itself instead: insitu(y0, a)."
            )
        if self.kind is FailureKind.UNREPLICATED:
            return (
                f"jaxpm_halos: {self.buffer} declared 'replicated' but not the same on "
                "every device (only one device's value would come back). Reduce it over "
                "the snapshot's mesh axes (snap.pencils.x_axis and y_axis, e.g. "
                "lax.psum), or declare it 'device' to get every device's value."
            )
        knob = self.limit.knob
        if self.beyond_bound:
            return (
                f"jaxpm_halos: buffer '{self.buffer}' needs {knob} = "
                f"{self.limit.unbounded(self.needed)!r}, but it can be at most "
                f"{self.limit.most:.3g} here: {self.limit.beyond}"
            )
        if config is None:
            fields = ", ".join(f"{k.field}={v!r}" for k, v in self.settings().items())
            setting = f"{knob.owner.__name__}({fields})"
        else:
            setting = spell_config(self.grown(config), keep=knob)
        if self.limit.searched:
            return (
                f"jaxpm_halos: {knob} was not enough ('{self.buffer}'): what it needs is "
                "only known once reached. "
                f"Rerun with {argument.format(setting)} or more (twice the value; "
                "grow=True, the default outside jit, finds it)."
            )
        text = (
            f"jaxpm_halos: buffer '{self.buffer}' overflowed: {self.count} rows were needed "
            f"per device but {knob} gives {self.limit.rows}. Rerun with "
            f"{argument.format(setting)}."
        )
        if self.also:
            names = ", ".join(f"'{name}'" for name, _, _ in self.also)
            text += (
                f" It also grows {names}, which overflowed too (to what they needed "
                "here, on data an earlier buffer cut: they may need more)."
            )
        if not self.last:
            text += (
                " Buffers after this one saw truncated data; if one of them overflows "
                "next, its error will say so."
            )
        return text

    def error(self, config=None, argument: str = "{}") -> Exception:
        kind = {
            FailureKind.NONFINITE: InvalidInputError,
            FailureKind.REPEATED_IDS: InvalidInputError,
            FailureKind.TOO_FEW: InvalidInputError,
            FailureKind.UNREPLICATED: ValueError,
            FailureKind.NOT_RUN: ValueError,
        }.get(self.kind, CapacityError)
        error = kind(self.message(config, argument))
        error.failure = self
        return error


class CapacityError(RuntimeError):
    """A fixed-size buffer was too small. The message names the knob and a value that fits;
    ``error.failure`` (a :class:`Failure`) holds the same in fields."""

    failure: Failure | None = None


class InvalidInputError(ValueError):
    """The input holds non-finite positions, repeated ids or is otherwise unusable.
    ``error.failure`` is a :class:`Failure` of kind ``NONFINITE`` counting the unusable
    values, ``REPEATED_IDS`` counting the groups merged through a repeated id, or
    ``TOO_FEW`` counting the kNN rows that had fewer than k particles to find."""

    failure: Failure | None = None


def refuse_nonfinite_points(points, what: str, fix: str) -> None:
    """Outside ``jit``, raise :func:`invalid_input` naming how many ``points`` (rows of the
    last axis) hold NaN or inf: ``"jaxpm_halos: {n} {what} are NaN or inf; {fix}"``.
    Traced points are left to the status, which counts them."""
    if is_traced(points):
        return
    bad = int(jnp.sum(~jnp.all(jnp.isfinite(points), axis=-1)))
    if bad:
        raise invalid_input(f"jaxpm_halos: {bad} {what} are NaN or inf; {fix}", bad)


def invalid_input(message: str, count: int) -> InvalidInputError:
    """An :class:`InvalidInputError` with ``message`` for ``count`` unusable inputs (raised
    outside ``jit`` before any work), carrying its :class:`Failure` like a status's error."""
    error = InvalidInputError(message)
    error.failure = Failure(FailureKind.NONFINITE, count)
    return error


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
    ``"replicated"`` that were not the same on every device. ``repeated_ids`` counts FoF
    groups found with more than one particle holding the group's smallest id (a group can be
    counted on two devices): ids repeat, and groups that share their smallest id are merged
    in the catalogue (and share a label). Every such merge in the catalogue is counted, and
    so is a repeat inside one group, in the catalogue or not. Repeats that change no
    catalogue row can go unseen: an id that is no group's smallest, or two groups sharing
    one that are each whole on a device and not both in the catalogue (they share a label
    only). ``too_few`` counts valid kNN rows left without k neighbours while every buffer
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
                and _grows_with(limit, other)
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
