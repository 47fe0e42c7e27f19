"""MkDocs hooks of the jaxpm_halos site (``hooks:`` in ``mkdocs.yml``).

Three jobs, all at build time, so that no figure or reference on the site is typed by hand:

* ``<!-- benchmark-tables -->`` in a page becomes the CPU benchmark report, rendered from
  ``benchmarks/results.json`` by ``benchmarks/tables.py``, the module ``run.py`` writes
  ``benchmarks/RESULTS.md`` with: the page and the file show the same tables.
* ``<!-- gpu-tables -->`` becomes the GPU tables, from ``benchmarks/gpu_results_h200.json``
  and ``benchmarks/gpu_results.json``.
* ``::: jaxpm_halos.NAME`` blocks whose NAME is both a public function and a subpackage
  (``fof`` and ``knn``) are pointed at the module that defines the function, since
  mkdocstrings would otherwise document the subpackage.

The docs build does not import jaxpm_halos, jax or numpy: this file reads JSON and source.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import logging
import re
from pathlib import Path

log = logging.getLogger("mkdocs.hooks.jaxpm_halos")

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
PACKAGE = ROOT / "jaxpm_halos"


def _tables():
    spec = importlib.util.spec_from_file_location("benchmark_tables", BENCH / "tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def benchmark_tables():
    results = json.loads((BENCH / "results.json").read_text())
    return "\n".join(_tables().report_lines(results, level=3)) + "\n"


# The GPU results files: the card of rows that do not name theirs, and when they were measured.
GPU_RESULTS = (
    ("gpu_results_h200.json", "NVIDIA H200", "2026-12-04, after the kNN redesign"),
    ("gpu_results.json", "NVIDIA H100 80GB HBM3", "2026-11, before the kNN redesign"),
)


def gpu_tables():
    tables, out = _tables(), []
    for name, card, when in GPU_RESULTS:
        path = BENCH / name
        if path.is_file():
            rows = json.loads(path.read_text())
            out += [f"#### `benchmarks/{name}` ({when})", "", *tables.gpu_lines(rows, card), ""]
    return "\n".join(out)


# --- API reference -----------------------------------------------------------------------


def _definitions():
    """{name: dotted module} of every top-level function and class in the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if module.endswith(".__init__"):
            module = module[: -len(".__init__")]
        try:
            tree = ast.parse(path.read_text())
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                found.setdefault(node.name, []).append(module)
    return found


def _api_path(name, definitions):
    """Where mkdocstrings should look for the public ``jaxpm_halos.<name>``."""
    if not (PACKAGE / name / "__init__.py").is_file():
        return f"jaxpm_halos.{name}"
    modules = [m for m in definitions.get(name, ()) if m != "jaxpm_halos"]
    if not modules:  # a subpackage documented as such (io)
        return f"jaxpm_halos.{name}"
    if len(modules) != 1:
        log.warning(
            "jaxpm_halos.%s is a subpackage and %s defines a function of that name: "
            "say in docs/api.md which one to document",
            name,
            modules or "nothing",
        )
        return f"jaxpm_halos.{name}"
    return f"{modules[0]}.{name}"


def on_page_markdown(markdown, page, config, files):
    if "<!-- benchmark-tables -->" in markdown:
        markdown = markdown.replace("<!-- benchmark-tables -->", benchmark_tables())
    if "<!-- gpu-tables -->" in markdown:
        markdown = markdown.replace("<!-- gpu-tables -->", gpu_tables())
    if re.search(r"^::: jaxpm_halos\.", markdown, re.M):
        definitions = _definitions()
        markdown = re.sub(
            r"^::: jaxpm_halos\.(\w+)$",
            lambda m: f"::: {_api_path(m.group(1), definitions)}",
            markdown,
            flags=re.M,
        )
    return markdown


_ROLE = re.compile(r":(?:func|class|meth|attr|mod|data|obj|exc|const):<code>(~?)([^<]*)</code>")


def _strip_role(match):
    short, target = match.groups()
    return f"<code>{target.rsplit('.', 1)[-1] if short else target}</code>"


def on_page_content(html, page, config, files):
    """The docstrings cross-reference in Sphinx's roles (:func:`name`); mkdocstrings
    leaves the role as text, so show the name alone, as code."""
    return _ROLE.sub(_strip_role, html)
