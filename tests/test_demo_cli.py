"""The demo's command line refuses bad values with a usage error naming the flag, before
any JAX work (they used to end in tracebacks from jax.make_mesh, diffrax or the units)."""

import pytest

from jaxpm_halos.demo import _parse_args


@pytest.mark.parametrize("argv, message", [
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
])
def test_bad_values_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_m200m_follows_fof_unless_asked():
    assert _parse_args([])[1].m200m is True
    assert _parse_args(["--analyses", "knn_density"])[1].m200m is False
    assert _parse_args(["--no-m200m"])[1].m200m is False
    _, args, snapshots, pm_nc = _parse_args(["--mesh", "4,2", "--nc", "32", "--pm-factor", "2",
                                             "--snapshots", "1.0,0.5"])
    assert args.mesh == (4, 2) and snapshots == [0.5, 1.0] and pm_nc == 64
