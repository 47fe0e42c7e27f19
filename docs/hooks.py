"""MkDocs hooks of the jaxpm_halos site (``hooks:`` in ``mkdocs.yml``).

Three jobs, all at build time, so that no figure or reference on the site is typed by hand:

* ``<!-- benchmark-tables -->`` in a page becomes the CPU benchmark report. The targets
  and the timings are computed from ``benchmarks/results.json`` with the same formatting
  as ``benchmarks/run.py`` (the functions below mirror ``run.py``'s ``target_rows``,
  ``growth_row`` and ``report``; keep them in step). ``results.json`` holds the timing
  rows only, so the memory figures, the run's date and its machine are taken from the
  generated part of ``benchmarks/RESULTS.md``, which ``run.py`` writes in the same run.
  A timings row that is not in ``RESULTS.md`` is a warning (an error under ``--strict``):
  the two files come from different runs.
* ``<!-- gpu-tables -->`` becomes the GPU tables, from ``benchmarks/gpu_results_h200.json``
  and ``benchmarks/gpu_results.json``.
* ``::: jaxpm_halos.NAME`` blocks whose NAME is both a public function and a subpackage
  (``fof`` and ``knn`` after the package was split into folders) are pointed at the module
  that defines the function, since mkdocstrings would otherwise document the subpackage.

The docs build does not import jaxpm_halos, jax or scipy: this file reads JSON and text.
"""

from __future__ import annotations

import ast
import json
import logging
import math
import re
from pathlib import Path

log = logging.getLogger("mkdocs.hooks.jaxpm_halos")

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
PACKAGE = ROOT / "jaxpm_halos"

# --- mirrored from benchmarks/run.py (keep in step) ------------------------------------
KNN_KS = (8, 16, 32)
RECIPE = dict(nc=64, box=128.0, steps=10)
RECIPE_SAVES = ((1.0,), (0.5, 1.0), (0.2, 0.4, 0.6, 0.8, 1.0))
FOF_LIMITS = ((64, 3.0), (128, 2.0))
KNN_LIMITS = {16: 1.0, 8: 1.2, 32: 1.2}
KNN_SIZES = (64, 128)
COMPILE_LIMIT = 30.0
INSITU_LIMIT = 6.0
KEEP_BELOW = "<!-- run.py keeps everything below this line -->"
# Targets computed from the memory runs, which results.json does not hold.
MEMORY_TARGETS = ("warm peak memory of", "XLA temporaries of", "the recipe's solve temporaries")


def _verdict(ok):
    return "met" if ok else "**missed**"


def _find(rows, size, what, kind="jaxpm", where="8 dev (2,4)"):
    return next(
        (
            r
            for r in rows
            if (r["size"], r["kind"], r["what"], r["where"]) == (size, kind, what, where)
        ),
        None,
    )


def _ratio(r):
    return r["warm"] / r["ref_time"]


def _row(target, found, limit, unit="x", digits=2):
    if not found:
        return target, "not measured", "-"
    figures = "; ".join(
        f"{label}: {fig:.{digits}f}{unit} ({detail})" for label, fig, detail in found
    )
    return target, figures, _verdict(max(fig for _, fig, _ in found) <= limit)


def _timing_targets(rows):
    """run.py's targets that come from the timing rows, in run.py's order, with None
    where run.py puts a memory target."""
    out = []
    for size, limit in FOF_LIMITS:
        found = [
            (kind, _ratio(r), f"{r['warm']:.3f} / {r['ref_time']:.3f} s")
            for kind in ("jaxpm", "uniform")
            if (r := _find(rows, size, "fof", kind))
        ]
        out.append(_row(f"FoF {size}^3, 8 devices: <= {limit:g}x scipy", found, limit))
    for k, limit in KNN_LIMITS.items():
        found = [
            (f"{size}^3", _ratio(r), f"{r['warm']:.3f} / {r['ref_time']:.3f} s")
            for size in KNN_SIZES
            if (r := _find(rows, size, f"knn_density k={k}"))
        ]
        out.append(
            _row(
                f"kNN density k={k}, JaxPM snapshots, 8 devices: <= {limit:g}x cKDTree",
                found,
                limit,
            )
        )
    compile_rows = [r for r in rows if "saveat" not in r["what"]]
    if compile_rows:
        worst = max(compile_rows, key=lambda r: r["first"] - r["warm"])
        out.append(
            (
                f"compile <= {COMPILE_LIMIT:g} s per function",
                f"at most {worst['first'] - worst['warm']:.1f} s ({worst['what']}, "
                f"{worst['size']}^3, {worst['where']})",
                _verdict(worst["first"] - worst["warm"] <= COMPILE_LIMIT),
            )
        )
    else:
        out.append((f"compile <= {COMPILE_LIMIT:g} s per function", "not measured", "-"))
    out += [None, None, None]  # warm memory of fof, of knn_density; kNN's XLA temporaries
    found = [
        (f"{len(ts)} snapshot(s)", _ratio(r), f"{r['warm']:.3f} s / {r['ref_time']:.3f} s")
        for ts in RECIPE_SAVES
        if (
            r := _find(
                rows,
                RECIPE["nc"],
                f"in-situ saveat fof+knn_density k=16, per snapshot of {len(ts)}",
            )
        )
    ]
    out.append(
        _row(
            f"in situ, the recipe ({RECIPE['nc']}^3, {RECIPE['steps']} steps) through "
            f"InSitu.saveat: FoF + kNN density k=16 <= {INSITU_LIMIT:g} PM steps per "
            "snapshot",
            found,
            INSITU_LIMIT,
            " PM steps",
            1,
        )
    )
    out.append(None)  # the recipe's solve temporaries
    out.append(_growth_row(rows))
    return out


def _growth_row(rows):
    sizes = sorted({r["size"] for r in rows})
    target = "growth from the smallest to the largest size no worse than N log N"
    if len(sizes) < 2:
        return target, "not measured (one size)", "-"
    lo, hi = sizes[0], sizes[-1]
    n_lo, n_hi = lo**3, hi**3
    nlogn = n_hi * math.log(n_hi) / (n_lo * math.log(n_lo))
    whats = ("fof",) + tuple(f"knn_density k={k}" for k in KNN_KS)
    growth = [
        (w, b["warm"] / a["warm"])
        for w in whats
        if (a := _find(rows, lo, w)) is not None and (b := _find(rows, hi, w)) is not None
    ]
    figures = ", ".join(f"{w} x{g:.0f}" for w, g in growth)
    return (
        target,
        f"{lo}^3 -> {hi}^3, JaxPM snapshots: {figures}; N log N x{nlogn:.0f}",
        _verdict(all(g <= nlogn for _, g in growth)),
    )


def _timing_lines(rows):
    lines = [
        "| N | data | analysis | devices | jaxpm_halos (s) | reference | ref (s) | "
        "ratio | kdcount (s) | first call (s) | compile (s) | halos |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['size']}^3 | {r['kind']} | {r['what']} | {r['where']} | "
            f"{r['warm']:.3f} | {r['ref']} | {r['ref_time']:.3f} | "
            f"{r['warm'] / r['ref_time']:.2f} | {r.get('kdcount', float('nan')):.3f} | "
            f"{r['first']:.1f} | {r['first'] - r['warm']:.1f} | {r.get('halos', '')} |"
        )
    return lines


# --- end of the mirror -------------------------------------------------------------------


def _generated_part():
    """The part of RESULTS.md that run.py writes (above its marker line)."""
    path = BENCH / "RESULTS.md"
    return path.read_text().partition(KEEP_BELOW)[0] if path.is_file() else ""


def _section(text, title):
    """The lines of a '## title' section of the generated report, title excluded."""
    match = re.search(rf"^## {re.escape(title)}.*?\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    return match.group(1).strip() if match else ""


def benchmark_tables():
    rows = json.loads((BENCH / "results.json").read_text())
    generated = _generated_part()
    measured = re.search(
        r"^Measured (.*?) by `python benchmarks/run.py`(?: at (\w+(?:-dirty)?))?", generated, re.M
    )
    # run.py's memory targets, in its order (results.json lacks their figures).
    memory_targets = []
    for line in _section(generated, "Against the targets").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith(MEMORY_TARGETS):
            memory_targets.append(tuple(cells))
    memory_iter = iter(memory_targets)
    targets = [t if t is not None else next(memory_iter, None) for t in _timing_targets(rows)]
    targets = [t for t in targets if t is not None]
    timing = _timing_lines(rows)
    missing = [line for line in timing[2:] if line not in generated]
    if missing:
        log.warning(
            "benchmarks/results.json and benchmarks/RESULTS.md come from different "
            "runs: %d timing rows of results.json are not in RESULTS.md (first: %s)",
            len(missing),
            missing[0],
        )
    out = []
    if measured:
        date_machine, commit = measured.group(1), measured.group(2)
        out += [
            f"Measured {date_machine}"
            + (f", at commit `{commit}`" if commit else "")
            + ", by `python benchmarks/run.py`. Times are the minimum of several warm "
            "runs; every ratio compares figures from the same process, and every "
            "jaxpm_halos result was checked against its reference.",
            "",
        ]
    out += ["### Against the targets", "", "| target | measured | status |", "|---|---|---|"]
    out += [f"| {t} | {m} | {v} |" for t, m, v in targets]
    out += [
        "",
        "### All timings",
        "",
        "*First call*: compilation plus one run; *compile*: first call minus the warm "
        "time. *Ratio*: jaxpm_halos' warm time over the reference's.",
        "",
    ]
    out += timing
    for title in ("Peak memory", "The recipe's solve: XLA temporaries"):
        body = _section(generated, title)
        if body:
            heading = re.search(rf"^## ({re.escape(title)}.*)$", generated, re.M).group(1)
            out += ["", f"### {heading[0].upper()}{heading[1:]}", "", body]
    return "\n".join(out) + "\n"


def _fmt(x, digits=3, style="g"):
    return "-" if x is None else f"{x:.{digits}{style}}"


def gpu_tables():
    out = []
    # The card of rows without a "device" field, and when the file was measured.
    for name, card, when in (
        ("gpu_results_h200.json", "NVIDIA H200", "2026-12-04, after the kNN redesign"),
        ("gpu_results.json", "NVIDIA H100 80GB HBM3", "2026-11, before the kNN redesign"),
    ):
        path = BENCH / name
        if not path.is_file():
            continue
        rows = json.loads(path.read_text())
        out += [
            f"#### `benchmarks/{name}` ({when})",
            "",
            "| card | N | data | FoF (s) | FoF jz-tree (s) | ratio | kNN k=16 (s) | "
            "kNN jz-tree (s) | ratio | FoF scipy (s) | kNN cKDTree (s) |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            if r["kind"] == "in situ":
                continue
            fof, jz_fof = r.get("fof"), r.get("jz_fof")
            knn, jz_knn = r.get("knn"), r.get("jz_knn")
            out.append(
                f"| {r.get('device', card)} | {r['size']}^3 | {r['kind']} | {_fmt(fof)} | "
                f"{_fmt(jz_fof)} | "
                f"{_fmt(fof / jz_fof if fof and jz_fof else None, 2, 'f')} | {_fmt(knn)} | "
                f"{_fmt(jz_knn)} | {_fmt(knn / jz_knn if knn and jz_knn else None, 2, 'f')} | "
                f"{_fmt(r.get('scipy_fof'))} | {_fmt(r.get('ckdtree_knn'))} |"
            )
        insitu = [r for r in rows if r["kind"] == "in situ"]
        if insitu:
            out += [
                "",
                "In situ (FoF + kNN density k = 16 on one device) against one PM step:",
                "",
                "| card | N | analyses (s) | PM step (s) | PM steps per snapshot |",
                "|---|---|---|---|---|",
            ]
            out += [
                f"| {r.get('device', card)} | {r['size']}^3 | {_fmt(r['insitu'])} | "
                f"{_fmt(r['pm_step'])} | "
                f"{r['insitu'] / r['pm_step']:.0f} |"
                for r in insitu
            ]
        out.append("")
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
