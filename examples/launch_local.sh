#!/usr/bin/env bash
# examples/multihost_run.py as two processes of 4 CPU devices each on this machine, joined
# through gloo: the multi-host code path without a cluster. Options go to insitu_run.py,
# e.g.  examples/launch_local.sh --nc 32 --box 64 --steps 10 --out halos_run
set -u
here="$(cd "$(dirname "$0")" && pwd)"
port="${PORT:-$("${PYTHON:-python}" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')}"
# Four host CPU devices per process (the last count XLA reads wins); other flags are kept.
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=4" JAX_PLATFORMS=cpu
pids=()
for rank in 0 1; do
    "${PYTHON:-python}" "$here/multihost_run.py" --coordinator "localhost:$port" --num-processes 2 \
        --process-id "$rank" "$@" &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
    wait "$pid" || status=1
done
exit "$status"
