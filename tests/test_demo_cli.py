"""The demo's command line refuses bad values with a usage error naming the flag, before
any JAX work (they used to end in tracebacks from jax.make_mesh, diffrax or the units)."""

import pytest

from jaxpm_halos.demo.cli import _parse_args


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nc", "0"], "--nc must be a positive integer, got 0"),
        (["--steps", "0"], "--steps must be a positive integer, got 0"),
        (["--k", "1"], "--k must be at least 2, got 1"),
        (["--box", "-1"], "--box must be positive and finite"),
        (["--b", "nan"], "--b must be positive and finite"),
        (["--mesh", "0,4"], "--mesh must be two positive integers"),
        (["--mesh", "2,x"], "--mesh must be two integers"),
        (["--mesh", "8"], "--mesh must be two positive integers"),
        (["--snapshots", "0.05"], "--snapshots must lie in"),
        (["--snapshots", "0.5,0.5,1.0"], "--snapshots repeats"),
        (["--max-halos", "0"], "--max-halos must be a positive integer"),
        (["--analyses", "knn_density", "--m200m"], "add fof to --analyses, or pass --no-m200m"),
    ],
)
def test_bad_values_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_m200m_follows_fof_unless_asked():
    assert _parse_args([])[1].m200m is True
    assert _parse_args(["--analyses", "knn_density"])[1].m200m is False
    assert _parse_args(["--no-m200m"])[1].m200m is False
    _, args, snapshots, pm_nc = _parse_args(
        ["--mesh", "4,2", "--nc", "32", "--pm-factor", "2", "--snapshots", "1.0,0.5"]
    )
    assert args.mesh == (4, 2) and snapshots == [0.5, 1.0] and pm_nc == 64


def test_buffers_take_a_capacity_errors_settings():
    """--buffers reads an InSitu keyword as a capacity error spells it (config classes and
    literals only, nothing evaluated)."""
    import jaxpm_halos as jh

    args = _parse_args(
        [
            "--buffers",
            "domain=DomainConfig(capacity_factor=3.0)",
            "--buffers",
            "fof = FoFConfig(max_halos=10, so=SOConfig(levels=5))",
        ]
    )[1]
    assert args.buffers == {
        "domain": jh.DomainConfig(capacity_factor=3.0),
        "fof": jh.FoFConfig(max_halos=10, so=jh.SOConfig(levels=5)),
    }
    assert _parse_args([])[1].buffers == {}


@pytest.mark.parametrize(
    "value, message",
    [
        ("dom=DomainConfig()", "must start with one of ['domain', 'fof', 'knn']"),
        ("knn=FoFConfig()", "knn= takes a KNNConfig"),
        ("fof=__import__('os').getcwd()", "expected one of"),
        ("domain=DomainConfig(capacity=3)", "unexpected keyword"),
        ("domain=DomainConfig(capacity_factor=3", "--buffers"),
    ],
)
def test_bad_buffers_are_usage_errors(value, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parse_args(["--buffers", value])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_capacity_errors_hint_pastes_into_the_demo():
    """The demo's hint for an overflow is a flag it takes, and reading it back gives the
    grown config with the run's other settings kept."""
    import jaxpm_halos as jh
    from jaxpm_halos.core.config import CAPACITY, MAX_HALOS, REMOTE
    from jaxpm_halos.core.errors import Failure, FailureKind, Limit
    from jaxpm_halos.demo.cli import _rerun_hint

    insitu = jh.InSitu(box_size=64.0, domain=jh.DomainConfig(ghost_factor=0.4))
    failure = Failure(FailureKind.OVERFLOW, 900, "exchange", Limit(CAPACITY, 512, 256.0), 900)
    hint = _rerun_hint(failure, insitu)
    flag = hint.split("--buffers ")[1].strip("'")
    assert _parse_args(["--buffers", flag])[1].buffers == {
        "domain": jh.DomainConfig(capacity_factor=3.52, ghost_factor=0.4)
    }
    # kNN's buffer after the domain's was grown: both flags, so the earlier fix stays.
    remote = Failure(FailureKind.OVERFLOW, 900, "remote", Limit(REMOTE, 512, 256.0), 900)
    flags = [f.strip().strip("'") for f in _rerun_hint(remote, insitu).split("--buffers ")[1:]]
    assert _parse_args([a for f in flags for a in ("--buffers", f)])[1].buffers == {
        "domain": jh.DomainConfig(ghost_factor=0.4),
        "knn": remote.grown(jh.KNNConfig()),
    }
    rows = Failure(FailureKind.OVERFLOW, 4208, "halos", Limit(MAX_HALOS, 1024), 4208)
    assert _rerun_hint(rows, insitu) == " Here: rerun with --max-halos 4208"
    bounded = Failure(
        FailureKind.OVERFLOW, 900, "exchange", Limit(CAPACITY, 512, 256.0, most=2.0), 900
    )
    assert _rerun_hint(bounded, insitu) == ""


@pytest.mark.parametrize("timing", ["snapshot", "total"])
def test_the_analyses_are_timed_from_reruns_not_from_the_first_run(timing):
    """Each snapshot's analyses are timed alike, from reruns of the compiled solve. The demo
    used to time the last snapshot as the first run (which carries one-time costs) minus
    the others. Here a solve takes 10 s plus each snapshot's cost where its analyses are
    on, and the first run 3 s more."""
    import types

    import numpy as np

    from jaxpm_halos.demo.report import time_analyses

    cost = np.array([1.0, 2.0, 4.0])
    calls = []

    def rerun(on):
        calls.append(np.asarray(on))
        return None, None, 10.0 + float(cost @ np.asarray(on))

    result = types.SimpleNamespace(
        snapshots=(0.5, 0.75, 1.0), run_s=10.0 + cost.sum() + 3.0, rerun=rerun
    )
    t_off, t_snap, t_on = time_analyses(result, timing, lambda text: None)
    assert t_off == 10.0
    if timing == "snapshot":
        np.testing.assert_array_equal(t_snap, cost)
        assert t_on is None and len(calls) == len(cost) + 1
    else:
        np.testing.assert_array_equal(t_snap, [cost.mean()] * 3)
        assert t_on == 10.0 + cost.sum() and len(calls) == 2
