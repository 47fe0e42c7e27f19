"""Independent serial references (scipy, numpy) that the tests compare against."""

import numpy as np
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components
from scipy.spatial import cKDTree


def fof_components(pos, box, linking_length):
    """Serial FoF's connected components (scipy's numbering): cKDTree pairs within the
    linking length, periodic in ``box``, then connected components. ``pos`` must lie in
    [0, box). The call the benchmarks time."""
    pairs = cKDTree(pos, boxsize=box).query_pairs(linking_length, output_type="ndarray")
    n = len(pos)
    graph = coo_matrix((np.ones(len(pairs), np.int8), (pairs[:, 0], pairs[:, 1])), shape=(n, n))
    return connected_components(graph, directed=False)[1]


def smallest_member_labels(components):
    """Relabel components by their smallest member index, as jaxpm_halos labels groups."""
    n = len(components)
    smallest = np.full(components.max() + 1, n)
    np.minimum.at(smallest, components, np.arange(n))
    return smallest[components]


def fof_labels(pos, box, linking_length):
    """Serial FoF labels of any positions (wrapped into the box in float64): the smallest
    index in each group."""
    pos = np.mod(np.asarray(pos, np.float64), box)
    pos[pos >= box] -= box
    return smallest_member_labels(fof_components(pos, box, linking_length))


def unambiguous_linking_length(pos, box, linking_length, margin=2e-5):
    """Nudge the linking length until no pair distance lies within ``margin`` (relative) of
    it, so float32 and float64 evaluations of "d <= l" must agree."""
    pos = np.mod(np.asarray(pos, np.float64), box)
    tree = cKDTree(pos, boxsize=box)
    l = linking_length
    for _ in range(50):
        near = tree.query_pairs(l * (1 + margin), output_type="ndarray")
        if len(near):
            d = np.asarray(pos[near[:, 0]] - pos[near[:, 1]])
            d -= box * np.round(d / box)
            d = np.sqrt((d * d).sum(1))
            if not np.any(np.abs(d - l) <= margin * l):
                return l
        else:
            return l
        l *= 1 + 3 * margin
    raise RuntimeError("could not find an unambiguous linking length")


def catalogue(pos, box, labels, min_members, vel=None, mass=None):
    """Catalogue fields of groups with >= min_members, from the reference labels (float64)."""
    pos = np.mod(np.asarray(pos, np.float64), box)
    n = len(pos)
    mass = np.ones(n) if mass is None else np.broadcast_to(np.asarray(mass, np.float64), (n,))
    ids, counts = np.unique(labels, return_counts=True)
    rows = {k: [] for k in ("id", "count", "mass", "pos", "vel", "vel_disp", "radius")}
    for gid, count in zip(ids, counts):
        if count < min_members:
            continue
        members = np.nonzero(labels == gid)[0]
        m = mass[members]
        rel = pos[members] - pos[gid]
        rel -= box * np.round(rel / box)
        com_rel = (m[:, None] * rel).sum(0) / m.sum()
        rows["id"].append(gid)
        rows["count"].append(count)
        rows["mass"].append(m.sum())
        rows["pos"].append(np.mod(pos[gid] + com_rel, box))
        rows["radius"].append(np.sqrt((m * ((rel - com_rel) ** 2).sum(1)).sum() / m.sum()))
        if vel is not None:
            v = np.asarray(vel, np.float64)[members]
            vmean = (m[:, None] * v).sum(0) / m.sum()
            rows["vel"].append(vmean)
            rows["vel_disp"].append(np.sqrt((m * ((v - vmean) ** 2).sum(1)).sum() / m.sum() / 3))
    return {k: np.asarray(v) for k, v in rows.items() if v}


def periodic_difference(a, b, box):
    d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    return d - box * np.round(d / box)


def so_reference(pos, centres, box, density, mass, knife=None):
    """First-downcrossing SO masses (H, D) by brute force in float64.

    With ``knife`` (a relative width) it also returns where float32 arithmetic may
    legitimately find another first downcrossing (H, D): a point of the profile at or
    before the crossing within ``knife`` of the threshold, or two distances there that
    close (their order may flip) whose masses differ by more than the gap."""
    tol = knife or 0.0
    pos = np.mod(np.asarray(pos, np.float64), box)
    mass = np.broadcast_to(np.asarray(mass, np.float64), pos.shape[:1])
    density = np.atleast_1d(np.asarray(density, np.float64))
    out = np.zeros((len(centres), len(density)))
    edge = np.zeros(out.shape, bool)
    for h, c in enumerate(np.asarray(centres, np.float64)):
        d = pos - np.mod(c, box)
        d -= box * np.round(d / box)
        r = np.sqrt(np.sum(d * d, 1))
        order = np.argsort(r, kind="stable")
        r, m = r[order], mass[order]
        within = np.cumsum(m)
        volume = 4 / 3 * np.pi * r**3
        close = (np.abs(np.diff(r, append=np.inf)) <= tol * r) & (r > 0)
        swing = np.abs(np.diff(m, append=m[-1]))  # what swapping a close pair adds to within
        for k, rho in enumerate(density):
            below = within < rho * volume
            first = int(np.argmax(below))
            assert below[first]
            out[h, k] = within[first - 1] if first > 0 else 0.0
            gap = np.abs(within - rho * volume)
            flips = (gap <= tol * within) | (close & (gap <= swing + tol * within))
            edge[h, k] = np.any(flips[: first + 1])
    return out if knife is None else (out, edge)


def merger_links_reference(labels_a, ids_a, labels_b, ids_b):
    """Serial merger links, counted particle by particle in dictionaries: ``(forward,
    backward)`` as :meth:`jaxpm_halos.merger.MergerLinks.to_numpy` returns them, for the
    catalogued haloes ``ids_a`` (earlier) and ``ids_b`` (later)."""
    from collections import Counter

    in_a, in_b = set(np.asarray(ids_a).tolist()), set(np.asarray(ids_b).tolist())
    pairs = Counter(
        (a, b)
        for a, b in zip(np.ravel(labels_a).tolist(), np.ravel(labels_b).tolist())
        if a in in_a and b in in_b
    )
    best = {}  # earlier id -> (shared, descendant), most shared then smallest id
    for (a, b), shared in pairs.items():
        if a not in best or (shared, -b) > (best[a][0], -best[a][1]):
            best[a] = (shared, b)
    forward = {"id": sorted(in_a)}
    forward["descendant"] = [best.get(a, (0, -1))[1] for a in forward["id"]]
    forward["shared"] = [best.get(a, (0, -1))[0] for a in forward["id"]]
    main = {}  # later id -> (shared, progenitor, count)
    for a in forward["id"]:
        if a in best:
            shared, b = best[a]
            old = main.get(b, (-1, -1, 0))
            better = (shared, -a) > (old[0], -old[1])
            main[b] = ((shared, a) if better else old[:2]) + (old[2] + 1,)
    backward = {"id": sorted(in_b)}
    backward["main_progenitor"] = [main.get(b, (0, -1, 0))[1] for b in backward["id"]]
    backward["n_progenitors"] = [main.get(b, (0, -1, 0))[2] for b in backward["id"]]
    as_arrays = lambda d: {k: np.asarray(v, np.int64) for k, v in d.items()}
    return as_arrays(forward), as_arrays(backward)


def lightcone_reference(catalogues, times, observer, z_max, omega_m, box_size):
    """Brute-force light cone (flat LCDM): every halo in every image of a cube of boxes
    wider than the cone, its crossing found by fixed-point iteration, distances by scipy's
    quad and brentq. Rows ``(snapshot, id, chi, ra, dec, z_cos, z_obs)``, sorted by ``chi``."""
    from scipy.integrate import quad
    from scipy.optimize import brentq

    c = 299792.458

    def chi_of_z(z):
        e = lambda x: (omega_m * (1 + x) ** 3 + 1 - omega_m) ** -0.5
        return c / 100 * quad(e, 0, z, epsabs=0, epsrel=1e-12)[0]

    chis = [chi_of_z(1 / a - 1) for a in times]
    chi_max = chi_of_z(z_max)
    span = int(np.ceil(chi_max / box_size)) + 1
    shifts = (np.indices((2 * span + 1,) * 3).reshape(3, -1).T - span) * box_size  # (I, 3)
    rows = []
    for s, (catalogue, chi_s) in enumerate(zip(catalogues, chis)):
        lo = 0.5 * (chi_s + chis[s + 1]) if s + 1 < len(chis) else 0.0
        hi = min(0.5 * (chi_s + chis[s - 1]) if s > 0 else np.inf, chi_max)
        for x, v, halo in zip(catalogue["pos"], catalogue["vel"], catalogue["id"]):
            v = np.asarray(v, float)
            r = np.asarray(x, float) + shifts - observer  # (I, 3)
            chi = np.linalg.norm(r, axis=1)
            for _ in range(20):  # |v| / c ~ 1e-3: converged long before
                chi = np.linalg.norm(r - np.outer(chi - chi_s, v) / c, axis=1)
            for p_, d in zip(r - np.outer(chi - chi_s, v) / c, chi):
                if lo <= d < hi:
                    z = brentq(lambda z, d=d: chi_of_z(z) - d, 0, 20, xtol=1e-14)
                    ra = np.degrees(np.arctan2(p_[1], p_[0])) % 360
                    dec = 90 - np.degrees(np.arccos(p_[2] / d))
                    z_obs = (1 + z) * (1 + float(v @ p_) / d / c) - 1
                    rows.append((s, halo, d, ra, dec, z, z_obs))
    return np.array(sorted(rows, key=lambda row: row[2]))


def soft_so_reference(pos, centres, box, density, mass, smoothing):
    """Smooth SO masses (H,) by brute force in float64 (``spherical_overdensity``'s
    ``smoothing``): ``M = m sum_j prod_{i <= j} S((1 - r_i / R_i) / h)``, with
    ``R_i = (3 i m / (4 pi density))^(1/3)`` and S the C1 cubic step. Also returns, per
    centre, whether some weight lies strictly between 0 and 1 (else M is the hard mass)."""
    pos = np.mod(np.asarray(pos, np.float64), box)
    out, fractional = np.zeros(len(centres)), np.zeros(len(centres), bool)
    for h, c in enumerate(np.asarray(centres, np.float64)):
        d = pos - np.mod(c, box)
        d -= box * np.round(d / box)
        r = np.sort(np.sqrt(np.sum(d * d, 1)))
        radius_i = np.cbrt(3 * np.arange(1, len(r) + 1) * mass / (4 * np.pi * density))
        u = np.clip((1 - r / radius_i) / smoothing, -1, 1)
        weight = 0.5 + u * (0.75 - 0.25 * u * u)
        out[h] = mass * np.sum(np.cumprod(weight))
        closed = int(np.argmax(weight == 0))
        fractional[h] = np.any((weight[:closed] > 0) & (weight[:closed] < 1))
    return out, fractional
