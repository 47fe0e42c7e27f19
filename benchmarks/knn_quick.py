"""kNN density benchmark: 64^3 JaxPM z=0 snapshot (64 Mpc/h), 8 CPU devices, mesh (2, 4), k=16.

Times ``jaxpm_halos.knn_density`` (first call, including compilation, and warm calls)
against ``scipy.spatial.cKDTree(boxsize=L).query(k=k+1, workers=-1)`` in the same process,
and checks that the densities agree.

    python benchmarks/knn_quick.py [--nc 64] [--box 64] [--steps 20] [--k 16] [--mesh 2,4]
        [--search auto|tree|scan]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from scipy.spatial import cKDTree  # noqa: E402

import jaxpm_halos  # noqa: E402
from jaxpm_halos.testing.snapshots import snapshot_particles  # noqa: E402 (first: it sets up 8 host devices)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nc", type=int, default=64)
    parser.add_argument("--box", type=float, default=64.0)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--mesh", default="2,4")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--search", default="auto", help="KNNConfig.search: auto, tree or scan")
    parser.add_argument("--json", default=None, help="append the figures to this file")
    args = parser.parse_args(argv)
    shape = tuple(int(v) for v in args.mesh.split(","))

    _, particles = snapshot_particles(args.nc, args.box, args.steps, shape)
    jax.block_until_ready(particles.pos)
    pos = np.asarray(particles.pos, np.float64).reshape(-1, 3)
    k, box = args.k, args.box
    config = jaxpm_halos.KNNConfig(search=args.search)

    t = time.perf_counter()
    rho = jax.block_until_ready(jaxpm_halos.knn_density(particles, k=k, config=config))
    first = time.perf_counter() - t
    warm = []
    for _ in range(args.repeat):
        t = time.perf_counter()
        rho = jax.block_until_ready(jaxpm_halos.knn_density(particles, k=k, config=config))
        warm.append(time.perf_counter() - t)

    ref = []
    for _ in range(args.repeat):
        t = time.perf_counter()
        dist, _ = cKDTree(pos, boxsize=box).query(pos, k=k + 1, workers=-1)
        ref.append(time.perf_counter() - t)
    rk = dist[:, k]
    rho_ref = (k - 1) / (4 / 3 * np.pi * rk**3)
    rel = np.max(np.abs(np.asarray(rho, np.float64).reshape(-1) / rho_ref - 1))

    figures = dict(
        nc=args.nc,
        box=box,
        k=k,
        mesh=list(shape),
        devices=len(jax.devices()),
        first_call_s=round(first, 3),
        warm_s=round(min(warm), 3),
        warm_median_s=round(float(np.median(warm)), 3),
        ckdtree_s=round(min(ref), 3),
        ckdtree_median_s=round(float(np.median(ref)), 3),
        ratio=round(min(warm) / min(ref), 3),
        max_rel_diff=float(rel),
    )
    print(json.dumps(figures))
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(figures) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
