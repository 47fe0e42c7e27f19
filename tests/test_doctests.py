"""The docstring examples of the main public calls run as written (doctest), on the 8 host
CPU devices conftest.py sets up."""

import doctest
import importlib

import pytest

MODULES = [
    "jaxpm_halos.fof.fof",
    "jaxpm_halos.knn.knn",
    "jaxpm_halos.so.so",
    # The newest jax runs InSitu's own tests (a compile of FoF and kNN together) instead.
    pytest.param("jaxpm_halos.insitu.insitu", marks=pytest.mark.leg1),
    "jaxpm_halos.merger.links",
    "jaxpm_halos.stats.abundance",
]


@pytest.mark.newest
@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run_as_written(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.attempted > 0, f"{name} has no docstring examples"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
