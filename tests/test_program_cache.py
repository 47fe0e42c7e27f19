"""Compiled programs share one cache bounded by the memory maps they hold (vm.max_map_count)."""

import os

import jax
import numpy as np
import pytest
from conftest import make_mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpm_halos as jh
from jaxpm_halos.core import frontend as _frontend

pytestmark = [
    pytest.mark.newest,
    pytest.mark.skipif(
        not os.path.exists("/proc/self/maps"), reason="memory maps are counted in /proc/self/maps"
    ),
]

MAPS_PER_PROGRAM = 2_700  # the cache's estimate for a program it has not measured yet


def test_default_budget_is_half_the_kernel_limit():
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
    except OSError:  # not Linux: the documented fallback
        limit = _frontend._DEFAULT_MAX_MAPS
    assert _frontend.max_map_count() == limit
    assert _frontend.ProgramCache().budget() == int(0.5 * limit)
    assert _frontend.ProgramCache(max_maps=5).budget() == 5


@pytest.mark.slow
def test_maps_stay_bounded_when_more_programs_are_compiled_than_the_budget_holds(monkeypatch):
    """Four distinct FoF and kNN programs (512 points on a (2, 4) mesh, ~2,200 maps each)
    against a budget of two: the oldest are dropped and their maps released."""
    budget = 2 * MAPS_PER_PROGRAM
    monkeypatch.setattr(_frontend, "_PROGRAMS", _frontend.ProgramCache(max_maps=budget))
    mesh = make_mesh((2, 4))
    pos = np.random.default_rng(0).uniform(0, 16, (512, 3)).astype(np.float32)
    x = jax.device_put(pos, NamedSharding(mesh, P(("x", "y"))))
    jh.clear_caches()
    start = _frontend.maps_in_use()
    peak = start
    for i in range(4):
        if i == 2:
            out = jh.knn_density(x, 16.0, 4 + i)
        else:
            out = jh.fof(x, 16.0, 0.6 + 0.01 * i, min_members=2)
        jax.block_until_ready(out)
        peak = max(peak, _frontend.maps_in_use())
    programs = _frontend._PROGRAMS.entries.values()
    assert 1 <= len(programs) <= 2
    assert all(p.maps > 0 for p in programs), [p.maps for p in programs]
    # Four programs kept would add ~8,800 maps; a slack of 1,000 covers JAX's own.
    assert peak - start <= budget + 1_000, f"{peak - start} maps added"
    jh.clear_caches()
    assert _frontend.maps_in_use() - start < 1_000


def test_a_cached_program_is_reused_and_refreshed():
    cache = _frontend.ProgramCache(max_maps=10**9)
    built = []

    def build(n):
        built.append(n)
        return jax.jit(lambda v: v + n)

    for n in (1, 2, 1, 3, 1):
        assert int(cache.get(build, 2, (n,), {})(np.int32(0))) == n
    assert built == [1, 2, 3]  # per-function cap 2: 2 was the least recently used
    assert [k[1] for k in cache.entries] == [(3,), (1,)]
