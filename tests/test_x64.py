"""With ``jax_enable_x64`` (as JaxPM users often set for float64 states), FoF, kNN and
``InSitu`` run on float32 and float64 positions on a device mesh, and equal the serial
references. Before, every kNN call failed with a JAX-internal ``TypeError``
(an int64 sum written into an int32 buffer) and FoF on float64 positions with a shape
error (float64 bits read as two int32 words), and so did SO masses.

The flag is global, so the checks run in a child process and never touch the suite's.
"""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CHILD = textwrap.dedent("""
    import os
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    jax.config.update("jax_enable_x64", True)
    import numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    from scipy.spatial import cKDTree
    import jaxpm_halos as jh
    from jaxpm_halos.testing.reference import fof_labels, so_reference, unambiguous_linking_length

    box, k = 8.0, 6
    rng = np.random.default_rng(3)
    pos = np.concatenate([rng.uniform(0, box, (256, 3)),                 # background
                          np.mod(rng.normal(0, 0.3, (256, 3)), box)])    # clump on the corner
    link = unambiguous_linking_length(pos, box, 0.35)
    want_labels = fof_labels(pos, box, link)
    want_dist = cKDTree(pos, boxsize=box).query(pos, k=k + 1)[0][:, 1:]
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
""")

FOF_KNN = textwrap.dedent("""
    for dtype, rtol in ((np.float32, 2e-6), (np.float64, 1e-12)):
        x = jax.device_put(pos.astype(dtype), NamedSharding(mesh, P(("x", "y"))))
        labels, _ = jh.fof(x, box, linking_length=link, min_members=2)
        np.testing.assert_array_equal(np.asarray(labels), want_labels)
        dist, _ = jh.knn(x, box, k)
        assert np.asarray(dist).dtype == dtype
        np.testing.assert_allclose(np.asarray(dist), want_dist, rtol=rtol, atol=rtol * box)
    print("X64 OK")
""")

SO_INSITU = textwrap.dedent("""
    # SO masses about clump and background points, against a float64 brute force (float64
    # distances once failed in the sort that packs a centre and float32 distance bits).
    centres = pos[[0, 256, 300, 400]]
    rho_so = 50.0 * len(pos) / box ** 3
    want_mass = so_reference(pos, centres, box, rho_so, 1.0)[:, 0]
    x = jax.device_put(pos, NamedSharding(mesh, P(("x", "y"))))
    radius, mass = jh.spherical_overdensity(x, centres, box_size=box, density=rho_so)
    assert np.asarray(radius).dtype == np.float64
    np.testing.assert_array_equal(np.asarray(mass), want_mass)
    assert want_mass[0] < 5 and min(want_mass[1:]) > 50  # a background point, clump members

    # InSitu on a float64 JaxPM-like state equals the offline calls on its positions.
    nc = 8
    y = np.stack([rng.normal(0, 0.6, (nc, nc, nc, 3)), rng.normal(0, 0.1, (nc, nc, nc, 3))])
    y = jax.device_put(y, NamedSharding(mesh, P(None, "x", "y")))
    insitu = jh.InSitu(box_size=box, analyses=("fof", "knn_density"), b=0.4, min_members=2,
                       k=k)
    out = insitu(y, 1.0)
    particles = jh.from_jaxpm(y, box_size=box)
    labels, _ = jh.fof(particles, linking_length=0.4 * box / nc, min_members=2)
    np.testing.assert_array_equal(np.asarray(out["fof"]["labels"]), np.asarray(labels))
    rho = jh.knn_density(particles, k=k)
    np.testing.assert_array_equal(np.asarray(out["knn_density"]["density"]), np.asarray(rho))
    print("X64 OK")
""")


def _run_child(body):
    tests = Path(__file__).resolve().parent
    result = subprocess.run(
        [sys.executable, "-c", CHILD + body], cwd=tests, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0 and "X64 OK" in result.stdout, result.stderr[-4000:]


@pytest.mark.newest
def test_float32_and_float64_positions_under_x64_equal_the_references():
    _run_child(FOF_KNN)


@pytest.mark.slow  # CI runs the FoF and kNN part only, for its time
def test_float64_so_masses_and_insitu_equal_the_references():
    _run_child(SO_INSITU)
