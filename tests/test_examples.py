"""The example scripts run as documented: the in-situ run on one process, and (marker
slow, for CI's time; ``test_multihost`` checks the library's two-process runs in CI) its
multi-host version through the local two-process launch, which must write the same run."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import requires_jaxpm, xla_flags_with_devices

import jaxpm_halos

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SMALL = ["--nc", "32", "--box", "64", "--steps", "5", "--pm-factor", "2", "--z-max", "0.05"]
pytestmark = requires_jaxpm


def run(command, env=None):
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=600, cwd=EXAMPLES.parent
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def assert_same_run(a, b):
    assert len(a) == len(b) and a.attrs["mesh_shape"].tolist() == b.attrs["mesh_shape"].tolist()
    for i in range(len(a)):
        for get in (a.catalogue, a.member_table, a.links):
            mine, theirs = get(i), getattr(b, get.__name__)(i)
            for name in mine.keys():
                np.testing.assert_array_equal(mine[name], theirs[name], err_msg=name)
    for part in ("tree", "lightcone"):
        for name, value in getattr(a, part).items():
            np.testing.assert_array_equal(value, getattr(b, part)[name], err_msg=name)


# Both runs compile as this process does (.ci/run's optimisation level halves their compile
# time), on 8 devices, then on launch_local.sh's 4 per process (the last count XLA reads wins).
ENV = dict(os.environ, XLA_FLAGS=xla_flags_with_devices(8))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    path = tmp_path_factory.mktemp("example") / "one"
    out = run([sys.executable, "examples/insitu_run.py", *SMALL, "--out", str(path)], ENV)
    return out, jaxpm_halos.load_run(path)


def test_single_process_run_writes_its_directory(one_process):
    out, one = one_process
    assert "3 snapshots on mesh (2, 4)" in out
    assert len(one.catalogue(-1)) > 20 and "m200m" in one.catalogue(-1)


@pytest.mark.slow
def test_two_process_run_writes_the_same_directory(one_process, tmp_path):
    launch = ["bash", "examples/launch_local.sh", *SMALL, "--out", str(tmp_path / "two")]
    out = run(launch, dict(ENV, PYTHON=sys.executable))
    assert out.count("wrote") == 1  # process 0 writes and reports
    assert_same_run(one_process[1], jaxpm_halos.load_run(tmp_path / "two"))
