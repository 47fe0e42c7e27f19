"""The in-situ run of ``insitu_run.py`` on several processes: one per GPU on a cluster, or
a few groups of CPU devices on one machine. Every process runs the same program on the
global device mesh; ``jaxpm_halos.write_run`` is collective, and process 0 writes.

    srun python examples/multihost_run.py [insitu_run.py's options]   # see slurm.sbatch
    examples/launch_local.sh [insitu_run.py's options]                # 2 processes here

Without ``--coordinator``, ``jax.distributed.initialize()`` reads the cluster from the
environment (SLURM, Open MPI). With it, pass ``--num-processes`` and ``--process-id``:
CPU processes then talk through gloo.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def initialize(argv=None):
    """Join the other processes; returns the arguments left for ``insitu_run``."""
    import jax

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--coordinator", default=None, help="host:port of process 0")
    parser.add_argument("--num-processes", type=int, default=None)
    parser.add_argument("--process-id", type=int, default=None)
    known, rest = parser.parse_known_args(argv)
    if known.coordinator is None:
        jax.distributed.initialize()  # SLURM or Open MPI say who is who
    else:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            known.coordinator, known.num_processes, known.process_id, initialization_timeout=300
        )
    return rest


if __name__ == "__main__":
    rest = initialize()
    from insitu_run import main

    raise SystemExit(main(rest))
