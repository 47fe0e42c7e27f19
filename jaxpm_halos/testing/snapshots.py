"""Real JaxPM snapshots for tests and benchmarks, cached on disk.

A snapshot is the final state of a distributed JaxPM run (2LPT at a = 0.1, then PM steps to
a = 1 with diffrax's LeapfrogMidpoint; see :func:`jaxpm_halos.simulation.run_simulation`) on a
``(2, 4)`` mesh of 8 host CPU devices. The first call for a given (nc, box, steps, seed,
mesh) runs the simulation and stores ``disp`` and ``mom`` as ``.npz`` under the cache
folder; later calls (and later pytest sessions) load it.

The cache folder is ``$JAXPM_HALOS_CACHE`` if set, else ``benchmarks/cache/`` in the
repository (git-ignored).

Command line (e.g. for the benchmark snapshots)::

    python -m jaxpm_halos.testing.snapshots --nc 64 --box 64 --steps 20
    python -m jaxpm_halos.testing.snapshots --nc 128 --box 128 --steps 20
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import make_mesh

CACHE_VERSION = 1  # bump when the simulation recipe changes
DEFAULT_CACHE = Path(__file__).resolve().parents[2] / "benchmarks" / "cache"


@dataclasses.dataclass
class Snapshot:
    """The final state of a JaxPM run.

    Attributes:
      disp: numpy ``(nc, nc, nc, 3)`` float32 displacement in grid cells from the lattice
        point (unwrapped), as JaxPM's ``y[0]``.
      mom: numpy ``(nc, nc, nc, 3)`` float32 momentum in grid units, as JaxPM's ``y[1]``.
      disp_sharded, mom_sharded: the same, as jax arrays sharded ``P("x", "y")`` over ``mesh``.
      mesh: the ``(2, 4)`` Auto-axis mesh of the run.
      nc, box_size, steps, seed, a, omega_m, halo_size: the run's parameters.
      seconds: wall time to produce the snapshot (simulation or cache load).
      cached: whether it came from the disk cache.
    """

    disp: np.ndarray
    mom: np.ndarray
    disp_sharded: jax.Array
    mom_sharded: jax.Array
    mesh: object
    nc: int
    box_size: float
    steps: int
    seed: int
    a: float
    omega_m: float
    halo_size: int
    seconds: float
    cached: bool

    @property
    def sharding(self) -> NamedSharding:
        return self.disp_sharded.sharding


def cache_dir() -> Path:
    return Path(os.environ.get("JAXPM_HALOS_CACHE", DEFAULT_CACHE))


def cache_path(nc, box, steps, seed, mesh_shape) -> Path:
    px, py = mesh_shape
    return cache_dir() / (
        f"jaxpm_nc{nc}_box{box:g}_steps{steps}_seed{seed}_mesh{px}x{py}_v{CACHE_VERSION}.npz"
    )


def jaxpm_snapshot(
    nc: int, box: float, steps: int, seed: int = 0, mesh_shape=(2, 4), use_cache: bool = True
) -> Snapshot:
    """The z = 0 state of a distributed JaxPM run, from the disk cache when available.

    JaxPM draws a different random field on a different mesh, so the mesh is part of the
    cache key.
    """
    t = time.perf_counter()
    mesh = make_mesh(tuple(mesh_shape))
    sharding = NamedSharding(mesh, P(*mesh.axis_names))
    path = cache_path(nc, float(box), steps, seed, mesh_shape)
    if use_cache and path.exists():
        with np.load(path) as f:
            disp, mom = f["disp"], f["mom"]
            a, omega_m, halo_size = float(f["a"]), float(f["omega_m"]), int(f["halo_size"])
        cached = True
    else:
        from jaxpm_halos.simulation import run_simulation

        result = run_simulation(nc, float(box), steps, mesh=mesh, seed=seed)
        disp, mom = np.asarray(result.state[0]), np.asarray(result.state[1])
        a, omega_m, halo_size = result.a_final, result.omega_m, result.halo_size
        cached = False
        if use_cache:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.npz")
            np.savez(tmp, disp=disp, mom=mom, a=a, omega_m=omega_m, halo_size=halo_size)
            os.replace(tmp, path)
    return Snapshot(
        disp=disp,
        mom=mom,
        disp_sharded=jax.device_put(disp, sharding),
        mom_sharded=jax.device_put(mom, sharding),
        mesh=mesh,
        nc=nc,
        box_size=float(box),
        steps=steps,
        seed=seed,
        a=a,
        omega_m=omega_m,
        halo_size=halo_size,
        seconds=time.perf_counter() - t,
        cached=cached,
    )


def history_path(nc: int, box: float, steps: int, times=(0.5, 0.75, 1.0), seed: int = 0) -> Path:
    """Where :func:`jaxpm_history` caches its run."""
    key = "_".join(f"{a:g}" for a in times)
    return cache_path(nc, float(box), steps, seed, (2, 4)).with_suffix(f".a{key}.npz")


def jaxpm_history(
    nc: int, box: float, steps: int, times=(0.5, 0.75, 1.0), seed: int = 0
) -> dict[str, np.ndarray]:
    """One JaxPM run on a ``(2, 4)`` mesh at the scale factors ``times`` (the merger and
    run-product snapshots), from the disk cache when available: ``{"disp", "mom"}``, each
    ``(len(times), nc, nc, nc, 3)`` as JaxPM's ``y[0]`` and ``y[1]``, and ``"omega_m"``."""
    path = history_path(nc, box, steps, times, seed)
    if not path.exists():
        from jaxpm_halos.simulation import run_simulation

        run = run_simulation(nc, float(box), steps, times, mesh=make_mesh((2, 4)), seed=seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.npz")
        saved = np.asarray(run.saved)
        np.savez(tmp, disp=saved[:, 0], mom=saved[:, 1], omega_m=run.omega_m)
        os.replace(tmp, path)
    with np.load(path) as f:
        return {"disp": f["disp"], "mom": f["mom"], "omega_m": float(f["omega_m"])}


def snapshot_particles(nc: int, box: float, steps: int, mesh_shape=(2, 4)):
    """``(snapshot, particles)``: the cached snapshot's :class:`jaxpm_halos.Particles` on a
    mesh ``mesh_shape`` of host devices, from displacements sharded over ``("x", "y")``
    as JaxPM leaves them."""
    import jaxpm_halos

    snap = jaxpm_snapshot(nc, box, steps)
    disp = jax.device_put(snap.disp, NamedSharding(make_mesh(mesh_shape), P("x", "y")))
    return snap, jaxpm_halos.from_jaxpm(disp, box_size=box)


def main(argv=None):
    import argparse

    parser = argparse.ArgumentParser(description="make (or load) a cached JaxPM snapshot")
    parser.add_argument("--nc", type=int, default=32)
    parser.add_argument("--box", type=float, default=32.0)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="recompute even if cached")
    args = parser.parse_args(argv)
    if args.force:
        cache_path(args.nc, args.box, args.steps, args.seed, (2, 4)).unlink(missing_ok=True)
    snap = jaxpm_snapshot(args.nc, args.box, args.steps, args.seed)
    print(
        f"{cache_path(args.nc, args.box, args.steps, args.seed, (2, 4))}: "
        f"{'loaded' if snap.cached else 'computed'} in {snap.seconds:.1f} s, "
        f"halo_size {snap.halo_size}, |disp| max {np.abs(snap.disp).max():.2f} cells"
    )
    return 0


if __name__ == "__main__":
    from ..simulation import use_host_devices

    use_host_devices()  # the snapshots' (2, 4) mesh of host CPU devices
    jax.config.update("jax_platforms", os.environ.get("JAX_PLATFORMS") or "cpu")
    sys.exit(main())
