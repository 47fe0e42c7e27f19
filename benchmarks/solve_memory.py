"""The recipe's solve temporaries in a user's plain ``jax.jit``, with every analysis.

The in-situ recipe's solve (``insitu_save_times.py``: 64^3, 10 steps, one save time),
compiled only, with FoF, kNN density, M200m and peak centres against the same solve saving
only the state, on one device and on (2, 4) (8 CPU devices): XLA's temporaries per
particle (per device, times the devices). ``run.py`` measures the same with FoF and kNN
density; ``knn_memory.py`` gives kNN's own.

    python benchmarks/solve_memory.py
"""

import argparse
import dataclasses
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import diffrax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run as bench  # noqa: E402
from insitu_save_times import analyses, solve_temporaries  # noqa: E402

import jaxpm_halos as jh  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.parse_args(argv)
    mesh = bench.mesh_of((2, 4))
    nc, steps = bench.RECIPE["nc"], bench.RECIPE["steps"]
    insitu = dataclasses.replace(analyses(bench.RECIPE["box"]), so=("200m",), centre="peak")
    for where, layout in (("1 dev", None), ("8 dev (2,4)", mesh)):
        without = solve_temporaries(nc, steps, layout, diffrax.SaveAt(ts=jnp.asarray([1.0])))
        with_ = solve_temporaries(nc, steps, layout, insitu.saveat([1.0], t0=0.1, t1=1.0))
        print(
            f"solve, {where}: {without / nc**3:.0f} -> {with_ / nc**3:.0f} B/particle "
            f"with FoF, kNN density, M200m and peaks: {with_ / without:.3f}x",
            flush=True,
        )
        jh.clear_caches()


if __name__ == "__main__":
    main()
