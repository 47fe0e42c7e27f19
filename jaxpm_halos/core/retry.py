"""Outside ``jit``, public calls grow the buffer that overflowed and run again.

A capacity can only be known once the data has been seen, and a scipy user expects no
rounds of pasting suggestions. :func:`run_growing` runs a call, reads the first failure of
its :class:`~.status.Status` by kind, grows that knob (with the decomposition's knobs
that overflowed beside it, :attr:`~.status.Failure.also`) to a value that fits (with a
margin, so the next snapshot of a run likely fits too), and runs again, a few rounds at
most. When it grew anything it warns once, naming the config that fit so it can be
passed next time and the reruns skipped.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from .errors import FailureKind, spell_config

# Every round grows some knob, so rounds end; an SO radius too small to start with takes
# about three per doubling (the radius, then the ghosts and pairs its wider search needs).
MAX_ROUNDS = 16
# Grown buffers get this much more than the rows the failed run needed.
MARGIN = 1.1


class GrowthWarning(UserWarning):
    """Buffers were grown and the call rerun: pass the config named to skip the reruns."""


def run_growing(
    call: Callable,
    config,
    failure_of: Callable,
    *,
    grow: bool,
    error: Callable | None = None,
    spell: Callable | None = None,
    stacklevel: int = 3,
):
    """``call(config) -> result``, rerun with grown buffers until ``failure_of(result)``
    is None.

    Args:
      call: runs the computation with a config (outside ``jit``).
      config: the caller's config (a frozen dataclass holding every knob that can grow).
      failure_of: the first :class:`~.status.Failure` of a result, or None.
      grow: False raises at the first failure instead (``CapacityError`` naming a fit).
      error: ``error(failure, config) -> Exception``; default: the failure's own error,
        spelling the suggestion as ``config=...``.
      spell: ``spell(config) -> str``, the argument to pass next time; default
        ``config=...``.
      stacklevel: the warning's, counted from this function (3: the caller's caller).

    Returns ``(result, config)``: the result and the config it ran with.
    """
    error = error or (lambda failure, cfg: failure.error(cfg, "config={}"))
    spell = spell or (lambda cfg: f"config={spell_config(cfg)}")
    start, seen = config, set()
    for _ in range(MAX_ROUNDS):
        result = call(config)
        failure = failure_of(result)
        if failure is None:
            break
        if not grow or failure.kind is not FailureKind.OVERFLOW:
            raise error(failure, config)
        grown = failure.grown(config, MARGIN)
        # A knob that cannot give more rows (a capped buffer) would loop forever.
        key = (failure.buffer, failure.limit.rows)
        if grown == config or key in seen:
            raise error(failure, config)
        seen.add(key)
        config = grown
    else:
        last = error(failure, config)  # keeps its type and .failure
        last.args = (f"{last} (still overflowing after {MAX_ROUNDS} rounds of growth)",)
        raise last
    if config != start:
        warnings.warn(
            f"jaxpm_halos: buffers overflowed and were grown, and the call ran "
            f"again. Pass {spell(config)} to skip the reruns.",
            GrowthWarning,
            stacklevel=stacklevel,
        )
    return result, config
