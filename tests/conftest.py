import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import gc  # noqa: E402
import importlib.util  # noqa: E402

import pytest  # noqa: E402

from jaxpm_halos.testing import make_mesh  # noqa: E402, F401 (the tests import it from here)

MESH_SHAPES = [(1, 8), (8, 1), (2, 4), (4, 2)]


ALL_MESHES = MESH_SHAPES + [(1, 1)]
LEG2_MESHES = ((8, 1), (2, 4))
# Where CI checks a quantity derived from the exact kernels (a smooth mass, a CDF, a merger
# link): one mesh of many devices. The kernels' own tests check every mesh in CI.
CI_MESHES = ((2, 4),)


def mesh_id(shape):
    return f"mesh{shape[0]}x{shape[1]}"


def xla_flags_with_devices(count: int):
    """This process's ``XLA_FLAGS`` with the host device count set to ``count``: a child
    process then compiles as this one does (e.g. .ci/run's optimisation level, which
    changes bits and compile time)."""
    flag = "--xla_force_host_platform_device_count"
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(flag)]
    return " ".join(kept + [f"{flag}={count}"])


def mesh_params(shapes, ci=None):
    """``shapes`` as pytest parameters, those not in ``LEG2_MESHES`` marked ``leg1``:
    .ci/run's leg 2 (the newest jax) runs a mesh-parametrised test marked ``newest`` on a
    mesh with an axis of size 1 (its own code path) and on (2, 4); leg 1 checks the
    invariance over every mesh and one device. With ``ci`` (shapes), those not in it are also
    marked ``slow``: CI runs the test on ``ci`` alone, and ``-m slow`` on the others."""
    params = []
    for s in shapes:
        marks = [] if s in LEG2_MESHES else [pytest.mark.leg1]
        if ci is not None and s not in ci:
            marks.append(pytest.mark.slow)
        params.append(pytest.param(s, marks=marks))
    return params


def on_ci_meshes():
    """Parametrises a test's ``mesh`` fixture over every mesh, CI running it on
    ``CI_MESHES`` alone (:func:`mesh_params`)."""
    return pytest.mark.parametrize(
        "mesh", mesh_params(ALL_MESHES, ci=CI_MESHES), ids=mesh_id, indirect=True
    )


# The JaxPM stack (pinned in pyproject.toml) is optional for the core package: without it,
# the tests that run JaxPM, jax_cosmo or diffrax are skipped (.ci/run's second leg). Only
# presence is checked, without importing: an installed but broken stack fails its tests.
JAXPM_STACK = ("jaxpm", "jax_cosmo", "diffrax")


def missing(*modules):
    return [m for m in modules if importlib.util.find_spec(m) is None]


def requires(*modules):
    """Skip the test when any of ``modules`` is not installed."""
    absent = missing(*modules)
    return pytest.mark.skipif(
        bool(absent), reason=f"needs {', '.join(absent)} (the pinned JaxPM stack: pip install -e .)"
    )


requires_jaxpm = requires(*JAXPM_STACK)


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    # A whole suite of compiled programs in one process otherwise passes the kernel's
    # vm.max_map_count and segfaults inside the XLA compiler (see jaxpm_halos.clear_caches).
    yield
    import jaxpm_halos

    jaxpm_halos.clear_caches()
    gc.collect()


@pytest.fixture(scope="session", params=mesh_params(ALL_MESHES), ids=mesh_id)
def mesh(request):
    return make_mesh(request.param)


@pytest.fixture(scope="session")
def jaxpm_snapshot_32():
    """A real 32^3 JaxPM run in a 32 Mpc/h box (10 steps to z=0) on a (2, 4) mesh.

    Computed once per session and cached on disk (see tests/snapshots.py). Without the JaxPM
    stack it is only loaded from that cache, and the tests using it are skipped if absent.
    """
    from jaxpm_halos.testing.snapshots import cache_path, jaxpm_snapshot

    absent = missing(*JAXPM_STACK)
    if absent and not cache_path(32, 32.0, 10, 0, (2, 4)).exists():
        pytest.skip(
            f"the 32^3 JaxPM snapshot is not cached and {', '.join(absent)} "
            "is not installed to make it (the pinned JaxPM stack: pip install -e .)"
        )
    return jaxpm_snapshot(32, 32.0, 10)


@pytest.fixture(scope="session")
def jaxpm_history_32():
    """One 32^3 JaxPM run (32 Mpc/h, 10 steps, (2, 4)) at a = 0.5, 0.75 and 1: the
    displacements ``(3, 32, 32, 32, 3)``, cached on disk like :func:`jaxpm_snapshot_32`
    (skipped without the JaxPM stack when not cached)."""
    from jaxpm_halos.testing.snapshots import history_path, jaxpm_history

    absent = missing(*JAXPM_STACK)
    if absent and not history_path(32, 32.0, 10).exists():
        pytest.skip(
            f"the 32^3 JaxPM run is not cached and {', '.join(absent)} is not installed "
            "to make it (the pinned JaxPM stack: pip install -e .)"
        )
    return jaxpm_history(32, 32.0, 10)["disp"]
