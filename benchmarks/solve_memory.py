"""The recipe's solve temporaries in a user's plain ``jax.jit``, with every analysis.

The in-situ recipe's solve (``insitu_save_times.py``: 64^3, 10 steps, one save time),
compiled only, saving only the state, with FoF and kNN density, and with FoF, kNN density,
M200m and peak centres, on one device and on (2, 4) (8 CPU devices): XLA's temporaries per
particle (per device, times the devices). These are the figures ``run.py`` stores
(``solve_memory`` in ``results.json``); ``knn_memory.py`` gives kNN's own.

    python benchmarks/solve_memory.py
"""

import argparse
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run as bench  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.parse_args(argv)
    n = bench.RECIPE["nc"] ** 3
    for where, (without, fof_knn, every) in bench.solve_memory().items():
        print(
            f"solve, {where}: {without / n:.0f} B/particle; with FoF and kNN density "
            f"{fof_knn / n:.0f} ({fof_knn / without:.3f}x); with FoF, kNN density, M200m and "
            f"peaks {every / n:.0f} ({every / without:.3f}x)",
            flush=True,
        )


if __name__ == "__main__":
    main()
