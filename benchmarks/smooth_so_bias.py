"""The smooth SO masses' bias against the hard ones on a JaxPM snapshot (docs/statistics.md).

    python benchmarks/smooth_so_bias.py [--nc 64]

One a = 1 state of a JaxPM run (nc^3 particles, nc Mpc/h, 20 steps, the benchmarks' run)
on (2, 4); FoF (b = 0.2, 20 members) with m200m about the centre of mass, hard and with
``so_smoothing = h``. Prints, per h, the smooth over hard m200m (median, 10th and 90th
percentiles, over haloes with a hard m200m of 20 particles or more), and the soft counts of
the smooth masses against the hard counts of the hard ones in 0.25-dex bins.
"""

import argparse

from jaxpm_halos.simulation import use_host_devices

use_host_devices()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxpm_halos as jh  # noqa: E402
from jaxpm_halos.stats import soft_counts  # noqa: E402
from jaxpm_halos.testing import make_mesh  # noqa: E402
from jaxpm_halos.testing.snapshots import jaxpm_history  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nc", type=int, default=64)
    args = parser.parse_args(argv)
    nc = args.nc
    run = jaxpm_history(nc, float(nc), 20, (0.5, 0.75, 1.0))
    mesh = make_mesh((2, 4))
    disp = jax.device_put(run["disp"][-1], NamedSharding(mesh, P("x", "y")))
    pos = jh.from_jaxpm(disp, box_size=float(nc))
    mass = jh.units.particle_mass(run["omega_m"], float(nc), nc)
    common = dict(b=0.2, so=("200m",), omega_m=run["omega_m"], mass=mass)
    hard = jh.fof(pos, **common)[1].to_numpy()["m200m"]
    keep = hard >= 20 * mass
    edges = np.arange(np.floor(np.log10(20 * mass) * 4) / 4, 15.01, 0.25)
    counts = np.histogram(np.log10(hard[hard > 0]), edges)[0]
    print(f"{nc}^3, {keep.sum()} haloes with m200m >= 20 particles; hard counts {counts.tolist()}")
    for h in (0.02, 0.05, 0.1, 0.2):
        smooth = jh.fof(pos, so_smoothing=h, **common)[1].to_numpy()["m200m"]
        ratio = smooth[keep] / hard[keep]
        q10, q50, q90 = np.percentile(ratio, [10, 50, 90])
        soft = np.asarray(soft_counts(smooth, edges, width=0.1))
        print(
            f"h = {h}: smooth / hard m200m median {q50:.3f} (10% {q10:.3f}, 90% {q90:.3f}); "
            f"soft counts (w = 0.1 dex) {np.round(soft, 1).tolist()}"
        )


if __name__ == "__main__":
    main()
