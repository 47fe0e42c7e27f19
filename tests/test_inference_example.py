"""examples/infer_amplitude.py recovers the amplitude of the linear field: reverse mode
through a distributed JaxPM run with in-situ smooth SO masses and kNN-CDF, on (2, 4)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import requires_jaxpm

ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = 0.01  # |A - 1| the example's docstring states
FD_RATIO = 0.05  # dL/dA over its central difference (eps = 1e-3), less 1

pytestmark = [requires_jaxpm, pytest.mark.slow]


def test_amplitude_is_recovered_and_the_gradient_matches_finite_differences():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the script's 8 devices
    done = subprocess.run(
        [sys.executable, "examples/infer_amplitude.py", "--quick"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert "mesh (2, 4)" in out

    for part in ("loss", "kNN-CDF"):  # the counts part jumps: its FD is not its derivative
        ratio = re.search(rf"eps 0\.001: +{part}: .*, ratio (\S+)", out)
        assert ratio, out
        assert abs(float(ratio.group(1)) - 1) < FD_RATIO, out

    losses = [float(m.group(1)) for m in re.finditer(r"^\s*\d+\s+\S+\s+(\S+)", out, re.M)]
    assert len(losses) >= 2 and losses[-1] < 1e-2 * losses[0], out  # the loss fell

    final = re.search(r"final A = (\S+) after (\d+) steps", out)
    assert final, out
    assert abs(float(final.group(1)) - 1) < TOLERANCE, out
    assert int(final.group(2)) <= 10, out
