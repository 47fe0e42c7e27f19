"""A light-cone halo catalogue from the catalogues of an in-situ run's snapshots.

Each snapshot ``i`` owns a shell of comoving distance about the observer, bounded half-way
between its distance and its neighbours' (the last snapshot's shell starts at the observer;
the earliest one's ends at ``z_max``). The box is replicated periodically; every image of
every halo of snapshot ``i`` is drifted along its peculiar velocity to where it meets the
past light cone, and kept when that crossing lies in the shell.

The drift is linear in conformal time: from ``x_i`` at distance ``chi_i``, the halo is at
``x_i - v (chi - chi_i) / c`` when light from it leaves at distance ``chi``, so the crossing
solves ``|x_i - o - v (chi - chi_i) / c| = chi``, a quadratic in ``chi``. The catalogue is
only as accurate as the snapshots are close: between them halos move along straight lines
and their masses stay those of the nearest snapshot in distance.
"""

from __future__ import annotations

import numpy as np

from ..units import cosmology_dict
from .distances import C_KMS, Distances


def lightcone(
    catalogues,
    times,
    *,
    observer,
    z_max: float,
    cosmology,
    box_size: float,
) -> dict[str, np.ndarray]:
    """Host-side: the haloes on the past light cone of ``observer``, out to ``z_max``.

    Args:
      catalogues: one catalogue per snapshot, numpy dicts with ``pos`` (Mpc/h, in
        ``[0, box_size)``) and ``vel`` (peculiar, km/s): :func:`~jaxpm_halos.gather_catalogue`
        or ``Catalogue.to_numpy()`` of an :class:`~jaxpm_halos.InSitu` output,
        :meth:`~jaxpm_halos.LoadedRun.catalogue`, or :func:`~jaxpm_halos.load_catalogue`.
      times: the snapshots' scale factors, increasing.
      observer: ``(3,)`` the observer's comoving position, Mpc/h.
      z_max: the largest cosmological redshift kept.
      cosmology: a jax_cosmo ``Cosmology`` or a dict with ``Omega_m`` (or ``Omega_c`` and
        ``Omega_b``), and optionally ``Omega_k``, ``w0``, ``wa``.
      box_size: the box side, Mpc/h.

    Returns:
      ``{field: array}`` with one row per halo image on the cone: every catalogue field
      at its snapshot (``pos`` is the snapshot's position), plus ``snapshot`` (index),
      ``chi`` (comoving distance, Mpc/h), ``cone_pos`` (position at the crossing relative
      to the observer, Mpc/h), ``ra`` and ``dec`` (degrees, from the box axes: RA in
      ``[0, 360)`` about z, Dec from the x-y plane), ``z_cos`` (cosmological redshift) and
      ``z_obs`` (with the line-of-sight peculiar velocity, ``(1 + z_cos)(1 + v_r / c) - 1``).
      Sorted by ``chi``.
    """
    times = np.asarray(times, np.float64)
    if len(catalogues) != len(times) or np.any(np.diff(times) <= 0):
        raise ValueError(f"give one catalogue per snapshot and increasing times; got {times}")
    for i, catalogue in enumerate(catalogues):
        if "vel" not in catalogue or "pos" not in catalogue:
            raise ValueError(f"catalogue {i} lacks pos or vel: the drift needs both")
    if not z_max > 0:
        raise ValueError(f"z_max must be positive, got {z_max}")
    distances = Distances(cosmology_dict(cosmology), min(1 / (1 + z_max), times[0]))
    chi_max = float(distances.of_a(1 / (1 + z_max)))
    edges = _shell_edges(distances.of_a(times), chi_max)
    observer = np.asarray(observer, np.float64).reshape(3)
    parts = [
        _shell(catalogue, i, distances.of_a(a), edges[i], observer, box_size)
        for i, (catalogue, a) in enumerate(zip(catalogues, times))
        if edges[i][0] < edges[i][1]
    ]
    out = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]} if parts else {}
    if not out:
        return out
    order = np.argsort(out["chi"], kind="stable")
    out = {k: v[order] for k, v in out.items()}
    return {**out, **_sky(out["cone_pos"], out["vel"], out["chi"], distances)}


def _shell_edges(chi, chi_max: float) -> list[tuple[float, float]]:
    """``(inner, outer)`` distances of each snapshot's shell (snapshots earliest first,
    so ``chi`` decreases): half-way to each neighbour, the outermost cut at ``chi_max``."""
    mid = 0.5 * (chi[1:] + chi[:-1])  # between snapshot i and i + 1
    outer = np.minimum(np.concatenate([[np.inf], mid]), chi_max)
    inner = np.minimum(np.concatenate([mid, [0.0]]), chi_max)
    return list(zip(inner.tolist(), outer.tolist()))


def _shell(catalogue, snapshot: int, chi_i: float, edges, observer, box_size: float) -> dict:
    """The images of one snapshot's haloes whose crossing lies in its shell."""
    pos = np.asarray(catalogue["pos"], np.float64)
    vel = np.asarray(catalogue["vel"], np.float64)
    w = vel / C_KMS  # (H, 3)
    inner, outer = edges
    # How far a drift moves a halo at most (|v| / c is ~1e-3): images this much beyond
    # the shell may still cross inside it.
    drift = np.linalg.norm(w, axis=-1).max(initial=0.0) * (outer + chi_i) + 1e-6
    shifts = _images(observer, box_size, inner - drift, outer + drift)  # (I, 3)
    chunk = max(1, _CHUNK // max(len(pos), 1))  # images per step: bounded temporaries
    kept = {k: [] for k in ("row", "chi", "cone_pos")}
    for start in range(0, len(shifts), chunk):
        rel = pos + (shifts[start : start + chunk, None] - observer)  # (C, H, 3)
        chi = _crossing(rel, w, chi_i)  # (C, H)
        image, row = np.nonzero((chi >= inner) & (chi < outer))
        kept["row"].append(row)
        kept["chi"].append(chi[image, row])
        drifted = rel[image, row] - w[row] * (chi[image, row] - chi_i)[:, None]
        kept["cone_pos"].append(drifted)
    joined = {k: np.concatenate(v) if v else None for k, v in kept.items()}
    rows = joined["row"] if joined["row"] is not None else np.zeros(0, int)
    out = {k: np.asarray(v)[rows] for k, v in catalogue.items()}
    out["snapshot"] = np.full(rows.shape, snapshot, np.int32)
    out["chi"] = joined["chi"] if joined["chi"] is not None else np.zeros(0)
    out["cone_pos"] = joined["cone_pos"] if joined["cone_pos"] is not None else np.zeros((0, 3))
    return out


# Halo images handled at once: 4M, about 100 MB of float64 temporaries.
_CHUNK = 2**22


def _images(observer, box_size: float, inner: float, outer: float):
    """(I, 3) shifts ``n * box_size`` of the box images holding points at distances in
    ``[inner, outer]`` from the observer."""
    span = int(np.ceil(outer / box_size)) + 1
    n = np.indices((2 * span + 1,) * 3).reshape(3, -1).T - span  # (I, 3)
    lo = n * box_size - observer  # each image's lower corner, from the observer
    nearest = np.linalg.norm(np.clip(0.0, lo, lo + box_size), axis=1)
    farthest = np.linalg.norm(np.maximum(np.abs(lo), np.abs(lo + box_size)), axis=1)
    return n[(nearest <= outer) & (farthest >= inner)] * float(box_size)


def _crossing(rel, w, chi_i):
    """The distance ``chi`` with ``|rel - w (chi - chi_i)| = chi`` (rows of ``rel``, ``w``)."""
    d = rel + w * chi_i
    dw, ww, dd = (d * w).sum(-1), (w * w).sum(-1), (d * d).sum(-1)
    return (-dw + np.sqrt(dw**2 + (1 - ww) * dd)) / (1 - ww)


def _sky(cone_pos, vel, chi, distances) -> dict:
    """RA, Dec (degrees) and the cosmological and observed redshifts."""
    x, y, z = cone_pos.T
    radial = (vel * cone_pos).sum(-1) / np.maximum(chi, 1e-300)
    z_cos = 1 / distances.a_of(chi) - 1
    return {
        "ra": np.degrees(np.arctan2(y, x)) % 360.0,
        "dec": np.degrees(np.arcsin(np.clip(z / np.maximum(chi, 1e-300), -1, 1))),
        "z_cos": z_cos,
        "z_obs": (1 + z_cos) * (1 + radial / C_KMS) - 1,
    }
