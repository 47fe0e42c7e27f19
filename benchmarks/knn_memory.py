"""XLA temporaries of kNN and FoF (per device x devices, per particle) from ``memory_analysis``.

    python benchmarks/knn_memory.py [--nc 64] [--k 16] [--what density neighbours fof]
        [--top 12] [--search auto|tree|scan] [--abstract] [--devices 1] [--as-gpu]

Compiles ``knn_density`` (``knn`` returning full lists, FoF with b = 0.2 and 20 members) on
a JaxPM z = 0 snapshot, mesh (2, 4) of 8 CPU devices (or unsharded on one device with
``--devices 1``, which needs ``--abstract``), without running it, and prints XLA's
temporary bytes per particle:
as the call compiles it outside ``jit`` (with the library's compiler options) and inside a
plain ``jax.jit`` (XLA's defaults).
``--top`` lists the largest buffers of the compiled program (from its buffer assignment).
``--as-gpu`` compiles kNN with the settings it picks on a GPU (XLA:CPU still compiles it:
the figures estimate a GPU's).
"""

from __future__ import annotations

import argparse
import os
import re

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

import jaxpm_halos  # noqa: E402
from jaxpm_halos.core.pipeline import JitProgram  # noqa: E402
from jaxpm_halos.testing import make_mesh  # noqa: E402
from jaxpm_halos.testing.snapshots import snapshot_particles  # noqa: E402 (first: it sets up 8 host devices)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nc", type=int, default=64)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--what", nargs="+", default=["density", "neighbours"])
    parser.add_argument("--top", type=int, default=0)
    parser.add_argument("--search", default="auto", help="KNNConfig.search: auto, tree or scan")
    parser.add_argument(
        "--abstract",
        action="store_true",
        help="no snapshot: compile from_jaxpm + the call on an abstract "
        "displacement grid (shapes are all the compiled program needs)",
    )
    parser.add_argument("--devices", type=int, default=8, choices=(1, 8))
    parser.add_argument("--as-gpu", action="store_true", help="kNN with a GPU's settings")
    args = parser.parse_args(argv)
    if args.as_gpu:
        from jaxpm_halos.knn import _search

        _search._backend = lambda: "gpu"
    if args.devices == 1 and not args.abstract:
        parser.error("--devices 1 compiles from shapes only: add --abstract")
    sharding = None if args.devices == 1 else NamedSharding(make_mesh((2, 4)), P("x", "y"))
    box = float(args.nc)
    n = args.nc**3
    if args.abstract:
        x = jax.ShapeDtypeStruct((args.nc,) * 3 + (3,), jax.numpy.float32, sharding=sharding)
        prep = lambda d: jaxpm_halos.from_jaxpm(d, box_size=box)
    else:
        _, x = snapshot_particles(args.nc, box, 20)
        prep = lambda p: p
    config = jaxpm_halos.KNNConfig(search=args.search)
    fns = {
        "density": lambda p: jaxpm_halos.knn_density(prep(p), k=args.k, config=config),
        "neighbours": lambda p: jaxpm_halos.knn(prep(p), k=args.k, config=config),
        "fof": lambda p: jaxpm_halos.fof(prep(p), b=0.2, min_members=20)[0],
    }
    for what in args.what:
        plain = jax.jit(fns[what]).lower(x).compile().memory_analysis().temp_size_in_bytes
        compiled = JitProgram(fns[what]).lower(x).compile()
        stats = compiled.memory_analysis()
        temp = stats.temp_size_in_bytes * args.devices
        print(
            f"{args.nc}^3 {args.devices} dev k={args.k} {what}: XLA temp {temp / n:.0f} B/particle "
            f"({stats.temp_size_in_bytes / 2**20:.1f} MiB per device) as the call compiles "
            f"it; {plain * args.devices / n:.0f} B/particle in a plain jax.jit",
            flush=True,
        )
        if args.top:
            text = compiled.as_text()
            sizes = []
            for m in re.finditer(r"(\w+)\[([\d,]*)\]\{[^}]*\} %?([\w.\-]+)", text):
                dims = [int(d) for d in m.group(2).split(",") if d]
                size = 1
                for d in dims:
                    size *= d
                sizes.append((size, m.group(1), m.group(2), m.group(3)))
            seen = set()
            for _size, dt, dims, name in sorted(sizes, reverse=True):
                if (dt, dims) in seen:
                    continue
                seen.add((dt, dims))
                print(f"   {dt}[{dims}]  {name}")
                if len(seen) >= args.top:
                    break


if __name__ == "__main__":
    main()
