"""Merger trees: the links of every consecutive pair of snapshots, and the main branches.

:func:`snapshot_links` runs :func:`~jaxpm_halos.merger_links` between consecutive snapshots
of an in-situ output (jittable: the labels stay sharded); :func:`main_branches` follows
each final halo's main progenitors back to the first snapshot (host-side, numpy), and
:func:`along_branches` reads a catalogue field along them, e.g. the mass accretion history.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..core.config import MergerConfig
from .links import MergerLinks, links_and_config


def snapshot_links(
    labels, catalogue, *, mesh=None, config: MergerConfig = MergerConfig(), grow: bool = True
) -> MergerLinks:
    """The links between consecutive snapshots of one run, stacked: pair ``i`` links
    snapshot ``i`` to ``i + 1``.

    Args:
      labels: FoF labels stacked over snapshots ``(S, ...)``, as
        ``InSitu.saveat`` returns them (``out["fof"]["labels"]``), S >= 2.
      catalogue: the catalogue stacked over the same snapshots.
      mesh, config, grow: as for :func:`~jaxpm_halos.merger_links`.

    Returns a :class:`~jaxpm_halos.MergerLinks` whose arrays have a leading axis of S - 1
    pairs; take pair ``i`` with ``jax.tree.map(lambda x: x[i], links)``.
    """
    count = np.shape(labels)[0]
    if count < 2 or np.ndim(catalogue.id) != 2 or np.shape(catalogue.id)[0] != count:
        raise ValueError(
            "snapshot_links takes labels and a catalogue stacked over the same S >= 2 "
            f"snapshots; got labels {np.shape(labels)} and catalogue ids {np.shape(catalogue.id)}"
        )
    one = lambda i: jax.tree.map(lambda x: x[i], catalogue)
    pair = lambda i, cfg: links_and_config(
        labels[i], one(i), labels[i + 1], one(i + 1), mesh=mesh, config=cfg, grow=grow
    )
    links = []
    for i in range(count - 1):
        link, grown = pair(i, config)
        if grown != config:  # one buffer size for all pairs, so that they stack
            config, links = grown, [pair(j, grown)[0] for j in range(i)]
        links.append(link)
    return jax.tree.map(lambda *x: jnp.stack(x), *links)


def main_branches(links) -> np.ndarray:
    """Host-side: ``(H, S)`` ids, one row per valid halo of the last snapshot (sorted by
    id), column ``s`` its main progenitor at snapshot ``s`` (the halo itself in the last
    column), -1 once the branch has begun.

    ``links``: the links of consecutive snapshots, stacked (:func:`snapshot_links`), or a
    sequence of :class:`~jaxpm_halos.MergerLinks` (each pair's status is checked) or of
    their ``backward`` dicts.
    """
    if isinstance(links, MergerLinks):
        links = [jax.tree.map(lambda x, i=i: x[i], links) for i in range(np.shape(links.id)[0])]
    backward = [link if isinstance(link, dict) else link.to_numpy()[1] for link in links]
    branch = [backward[-1]["id"]]
    for step in reversed(backward):
        main = dict(zip(step["id"].tolist(), step["main_progenitor"].tolist()))
        branch.append(np.array([main.get(i, -1) for i in branch[-1].tolist()], np.int64))
    return np.stack(branch[::-1], axis=1)


def along_branches(branches: np.ndarray, catalogues, field: str = "mass") -> np.ndarray:
    """Host-side: ``(H, S)`` values of ``field`` along ``branches`` (from
    :func:`main_branches`), NaN where a branch has no halo.

    ``catalogues``: one numpy catalogue per snapshot (``Catalogue.to_numpy()`` or
    :func:`~jaxpm_halos.gather_catalogue`), sorted by id as those return them.
    """
    if len(catalogues) != branches.shape[1]:
        raise ValueError(
            f"{branches.shape[1]} snapshots in the branches, {len(catalogues)} catalogues"
        )
    out = np.full(branches.shape + np.shape(catalogues[0][field])[1:], np.nan)
    for s, catalogue in enumerate(catalogues):
        ids = branches[:, s]
        rows = np.searchsorted(catalogue["id"], ids)
        found = (ids >= 0) & (rows < len(catalogue["id"]))
        found[found] = catalogue["id"][rows[found]] == ids[found]
        out[found, s] = catalogue[field][rows[found]]
    return out
