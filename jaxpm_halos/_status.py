"""Capacity bookkeeping: what each fixed-size buffer needed, carried with every result.

Every fixed-shape buffer in jaxpm_halos has a capacity set by a config knob. The kernels
never drop data silently: they record the number of rows each buffer *needed* (the maximum
over devices). :class:`Status` carries those needs next to the static capacities, so
outside ``jit`` the public functions can raise a clear error naming the knob and a value
that fits, and inside ``jit`` the caller can read ``status.ok`` or opt in to a runtime error
with :meth:`Status.raise_if_failed`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Limit:
    """Static description of one capacity.

    Attributes:
      knob: the config field a user sets, e.g. ``"DomainConfig.transfer_factor"``.
      rows: rows the buffer holds (per device).
      scale: rows per unit of the knob (``rows == ceil(knob * scale)``); 1 for integer knobs.
    """

    knob: str
    rows: int
    scale: float = 1.0

    def suggest(self, needed: int) -> float | int:
        """Smallest knob value (2 decimals for factors) whose capacity holds ``needed`` rows."""
        if self.scale == 1.0:
            return int(needed)
        value = math.ceil(needed / self.scale * 100) / 100
        while math.ceil(value * self.scale) < needed:
            value = round(value + 0.01, 2)
        return value


def with_setting(config, knob: str, value):
    """``config`` (a frozen config dataclass) with ``knob`` (``"Class.field"``) set to
    ``value``, where ``Class`` is ``config``'s own class or that of one of its fields."""
    owner, field = knob.split(".")
    if type(config).__name__ == owner:
        return dataclasses.replace(config, **{field: value})
    for f in dataclasses.fields(config):
        inner = getattr(config, f.name)
        if type(inner).__name__ == owner:
            inner = dataclasses.replace(inner, **{field: value})
            return dataclasses.replace(config, **{f.name: inner})
    raise ValueError(f"{type(config).__name__} holds no {owner}")


def spell_config(config, keep: str = "") -> str:
    """``Class(field=value, ...)`` with the fields that differ from the defaults (and the
    knob ``keep``, ``"Class.field"``, in any case), nested configs spelled alike: an
    expression that rebuilds ``config``."""
    default = type(config)()
    parts = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        kept = f"{type(config).__name__}.{f.name}" == keep
        if value == getattr(default, f.name) and not kept:
            continue
        nested = dataclasses.is_dataclass(value) and not isinstance(value, type)
        parts.append(f"{f.name}={spell_config(value, keep) if nested else repr(value)}")
    return f"{type(config).__name__}({', '.join(parts)})"


class CapacityError(RuntimeError):
    """A fixed-size buffer was too small. The message names the knob and a value that fits."""


class InvalidInputError(ValueError):
    """The input holds non-finite positions or is otherwise unusable."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Status:
    """Rows needed by each buffer of one computation (max over devices), with the capacities.

    ``needed`` maps a buffer name to an int32 scalar; ``limits`` (static) maps the same names
    to their :class:`Limit`, in pipeline order. ``nonfinite`` counts particles whose position
    was NaN or inf: they were excluded from every result.
    """

    needed: Mapping[str, jax.Array]
    nonfinite: jax.Array
    limits: tuple[tuple[str, Limit], ...] = dataclasses.field(metadata=dict(static=True))

    @property
    def ok(self) -> jax.Array:
        """Scalar bool: every buffer fitted and every position was finite."""
        good = self.nonfinite == 0
        for name, limit in self.limits:
            good = good & (self.needed[name] <= limit.rows)
        return good

    def merge(self, other: "Status") -> "Status":
        needed = dict(self.needed)
        needed.update(other.needed)
        return Status(needed, jnp.maximum(self.nonfinite, other.nonfinite),
                      self.limits + other.limits)

    def message(self, config=None, argument: str = "{}") -> str | None:
        """Host-side: the error message for the first failure, or None when all is well.

        With the caller's ``config`` (e.g. the ``FoFConfig`` it ran with), the suggested
        setting is that whole config with the one knob changed, so it keeps every earlier
        fix: ``FoFConfig(domain=DomainConfig(ghost_factor=0.5, image_factor=0.6))``.
        Without it, the knob alone: ``DomainConfig(image_factor=0.6)``. ``argument``
        formats the setting as the caller's argument, e.g. ``"config={}"``.
        """
        nonfinite = int(np.max(np.asarray(self.nonfinite)))
        if nonfinite:
            return (f"jaxpm_halos: {nonfinite} particle positions are NaN or inf; they were "
                    "excluded. Clean the input (or mask those particles) and rerun.")
        needs = {name: int(np.max(np.asarray(self.needed[name]))) for name, _ in self.limits}
        for position, (name, limit) in enumerate(self.limits):
            if needs[name] <= limit.rows:
                continue
            # Buffers sharing a knob are resized together.
            needed = max(needs[n] for n, other in self.limits if other.knob == limit.knob)
            value = limit.suggest(needed)
            if config is None:
                owner, field = limit.knob.split(".")
                setting = f"{owner}({field}={value})"
            else:
                setting = spell_config(with_setting(config, limit.knob, value), keep=limit.knob)
            text = (f"jaxpm_halos: buffer '{name}' overflowed: {needs[name]} rows were needed per "
                    f"device but {limit.knob} gives {limit.rows}. Rerun with "
                    f"{argument.format(setting)}.")
            if position + 1 < len(self.limits):
                text += (" Buffers after this one saw truncated data; if one of them overflows "
                         "next, its error will say so.")
            return text
        return None

    def check(self, config=None, argument: str = "{}") -> None:
        """Host-side: raise :class:`CapacityError` / :class:`InvalidInputError` on failure
        (``config`` and ``argument`` as in :meth:`message`)."""
        text = self.message(config, argument)
        if text is None:
            return
        if "NaN or inf" in text:
            raise InvalidInputError(text)
        raise CapacityError(text)

    def raise_if_failed(self) -> None:
        """Opt-in runtime error usable inside ``jit``: raises (via a host callback) on failure."""

        def _raise(needed, nonfinite):
            Status(needed, nonfinite, self.limits).check()

        jax.debug.callback(_raise, dict(self.needed), self.nonfinite)


def is_traced(*trees) -> bool:
    """True when any leaf is a tracer, i.e. we are inside a jax transformation."""
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(trees))
