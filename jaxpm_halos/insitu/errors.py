"""Host-side checks of an in-situ run's statuses, and errors whose suggestion is the
``InSitu`` argument to paste (the whole grown config, beside the others the run changed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax

from ..core.config import DomainConfig, FoFConfig, KNNConfig, SOConfig
from ..core.errors import FailureKind, spell_config
from ..core.status import is_status

if TYPE_CHECKING:  # annotations only: insitu.py imports this module
    from .insitu import InSitu


def check(outputs, insitu: InSitu | None = None) -> None:
    """Host-side: raise if any buffer of an in-situ run overflowed, at any snapshot.

    The error spells the setting as the ``InSitu`` argument holding the knob: the shared
    decomposition is sized by ``InSitu.domain``, FoF by ``InSitu.fof``, kNN by
    ``InSitu.knn``. Given the ``insitu`` that ran, the setting is that whole config with
    the overflowing knobs changed, next to the other configs it ran with that differ from
    the defaults (so earlier fixes are kept whichever config they changed); without it,
    the default config with those knobs. ``outputs`` may be the whole output or any part
    of it.
    """
    failure = first_failure(outputs)
    if failure is not None:
        raise insitu_error(failure, insitu)


_CONFIG_FIELD = {DomainConfig: "domain", FoFConfig: "fof", KNNConfig: "knn"}


_CONFIG_CLASS = {attr: cls for cls, attr in _CONFIG_FIELD.items()}


def first_failure(outputs):
    """The first failure of any :class:`Status` in ``outputs`` (each analysis's own, which
    covers the shared decomposition too), or None. An overflow also grows the buffers of
    its config class that the other analyses' failures grow (``Failure.also``): each status
    sees the shared decomposition through its own buffers, so one suggestion holds them all
    and a pasted fix does not meet the next of them one rerun later."""
    failures = [
        status.failure()
        for status in jax.tree.leaves(outputs, is_leaf=is_status)
        if is_status(status)
    ]
    failures = [f for f in failures if f is not None]
    if not failures or failures[0].kind is not FailureKind.OVERFLOW:
        return failures[0] if failures else None
    return failures[0].joined(failures[1:])


def insitu_error(failure, insitu: InSitu | None) -> Exception:
    if failure.limit is None:
        return failure.error()
    attr, config = insitu_config(failure, insitu)
    # The other configs the run changed are spelled too: a user who replaces an earlier
    # suggestion (say domain=...) with this one must not lose the earlier fix.
    changed = {} if insitu is None else changed_configs(insitu)
    parts = {a: text.replace("{", "{{").replace("}", "}}") for a, text in changed.items()}
    parts[attr] = f"{attr}={{}}"  # the grown config goes here
    spelled = ", ".join(parts[a] for a in _CONFIG_FIELD.values() if a in parts)
    return failure.error(config, f"InSitu({spelled})")


def insitu_config(failure, insitu: InSitu | None) -> tuple[str, object]:
    """``(attr, config)``: the ``InSitu`` field holding the overflowing knob of ``failure``
    and the config it ran with (the default one without ``insitu``)."""
    owner = failure.limit.knob.owner
    attr = "fof" if owner is SOConfig else _CONFIG_FIELD[owner]  # SO settings: fof.so
    return attr, getattr(insitu, attr) if insitu is not None else _CONFIG_CLASS[attr]()


def changed_configs(insitu: InSitu) -> dict[str, str]:
    """``{attr: "attr=Config(...)"}`` for each config of ``insitu`` that differs from its
    default, in ``InSitu``'s order."""
    return {
        attr: f"{attr}={spell_config(getattr(insitu, attr))}"
        for attr in _CONFIG_FIELD.values()
        if getattr(insitu, attr) != type(getattr(insitu, attr))()
    }


def spelling(insitu: InSitu) -> str:
    """The ``InSitu`` arguments of the configs that differ from the defaults."""
    return f"InSitu({', '.join(changed_configs(insitu).values())})"
