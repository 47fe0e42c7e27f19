"""Failures and the errors they raise, whose messages name the setting that fits.

A buffer's :class:`Limit` ties it to the config knob that sizes it. A :class:`Failure` has
a kind (:class:`FailureKind`), never to be recognised by its message text: an overflow
becomes a :class:`CapacityError` whose message is the grown config, spelled so that it
pastes as written (:func:`spell_config`); unusable input becomes an
:class:`InvalidInputError`.
"""

from __future__ import annotations

import dataclasses
import enum
import math

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


def grows_with(limit: Limit, other: Limit) -> bool:
    """Whether ``other``'s buffer is grown in the same round as ``limit``'s: it holds
    particle rows and its knob is of the same config class."""
    return other.knob in PARTICLE_KNOBS and other.knob.owner is limit.knob.owner


class FailureKind(enum.Enum):
    """What went wrong, with what to do about it."""

    NONFINITE = "positions, masses or ids that are NaN, inf or unusable (left out inside jit)"
    OVERFLOW = "a fixed-size buffer was too small"
    UNREPLICATED = "an analysis output declared 'replicated' differs between devices"
    REPEATED_IDS = "particle ids repeat (groups that share their smallest id would merge)"
    TOO_FEW = "fewer particles than a kNN row needs (k + 1; k at query points)"
    NOT_RUN = "the analyses did not run: the diffrax solve took no step (t0 == t1)"


@dataclasses.dataclass(frozen=True)
class Failure:
    """The first failure recorded in a :class:`Status` (host-side, concrete numbers).

    Attributes:
      kind: a :class:`FailureKind`.
      count: excluded particles or unusable inputs (NONFINITE), rows the buffer needed per
        device (OVERFLOW), outputs that differ between devices (UNREPLICATED), repeats
        found (REPEATED_IDS: see :class:`~jaxpm_halos.Status`), or kNN rows
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
                if grows_with(self.limit, limit) and name not in names:
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
                f"jaxpm_halos: particle ids repeat ({self.count} repeats found): FoF "
                "labels a group by its smallest id, so groups that share it are merged "
                "into one catalogue row. Give every particle "
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


def invalid_input(message: str, count: int) -> InvalidInputError:
    """An :class:`InvalidInputError` with ``message`` for ``count`` unusable inputs (raised
    outside ``jit`` before any work), carrying its :class:`Failure` like a status's error."""
    error = InvalidInputError(message)
    error.failure = Failure(FailureKind.NONFINITE, count)
    return error
