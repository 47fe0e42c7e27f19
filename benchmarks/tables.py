"""The benchmark report's tables, from the figures of one run of ``run.py``.

``run.py`` stores every figure of a run in ``benchmarks/results.json`` and writes the top of
``benchmarks/RESULTS.md`` with :func:`report_lines`; the docs build (``docs/hooks.py``)
renders the performance page from the same JSON with the same functions, so the two never
differ. Pure Python: the docs build imports neither jax nor numpy.

``results.json`` holds a dict:

- ``measured`` (a date), ``machine``, ``commit`` (short hash, ``-dirty`` when the tree
  differed; empty outside git);
- ``rows``: one dict per timing (``size``, ``kind``, ``what``, ``where``, ``n``, ``first``,
  ``warm``, ``ref``, ``ref_time``, and ``kdcount``, ``halos`` where measured);
- ``memory``: one dict per analysis and size (``nc``, ``what``, and in bytes per particle
  ``first`` and ``warm`` peak RSS growth, ``own`` and ``plain_jit`` XLA temporaries);
- ``solve_memory``: the recipe's solve temporaries per layout (``where``, ``without`` and
  ``with`` FoF and kNN density, ``with_all`` with M200m and peaks too; bytes per particle).

A row of the accelerator path (``what`` :data:`SCAN`) also holds ``selection_ops``, the
sorts and TopKs over candidate lists in its compiled program; the recipe's one-snapshot row
holds ``solve_compile``, the solve's compile seconds without and with the analyses.
"""

from __future__ import annotations

import math

KNN_KS = (8, 16, 32)
# The in-situ recipe of docs/insitu.md: 64^3 in 128 Mpc/h, 10 LeapfrogMidpoint steps.
RECIPE = dict(nc=64, box=128.0, steps=10)
RECIPE_SAVES = ((1.0,), (0.5, 1.0), (0.2, 0.4, 0.6, 0.8, 1.0))

# What the issues ask of the figures. FoF against scipy on 8 devices: (size, ratio limit).
FOF_LIMITS = ((64, 3.0), (128, 2.0))
# kNN density against cKDTree(k + 1) on JaxPM snapshots, 8 devices, 64^3 and 128^3.
KNN_LIMITS = {16: 1.0, 8: 1.2, 32: 1.2}
KNN_SIZES = (64, 128)
COMPILE_LIMIT = 30.0
MEMORY_LIMITS = {"fof": 1024, "knn_density k=16": 2048}  # warm peak RSS, B/particle
KNN_TEMP_LIMIT = 400  # XLA temporaries of knn_density k=16, B/particle, 64^3 and 128^3
INSITU_LIMIT = 6.0  # PM steps per snapshot through InSitu.saveat, the recipe
SOLVE_MEMORY_LIMIT = 1.3  # the recipe's solve temporaries with / without the analyses
SOLVE_COMPILE_LIMIT = 1.5  # the recipe's solve compile with / without the analyses
# The accelerator path (KNNConfig(search="scan"), what a GPU runs) on 8 CPU devices.
SCAN = "knn_density k=16, search=scan"
SCAN_LIMIT = 1.0  # against cKDTree(k + 1), 64^3 and 128^3
# What a run directory adds per snapshot (merger links, members, light cone), 64^3, PM steps.
PRODUCTS = "run products: links+members+light cone z<0.1, per snapshot"
PRODUCTS_LIMIT = 1.0
STATISTICS = "differentiable statistics in situ, per snapshot"
STATISTICS_PARTS = ("smooth SO", "kNN-CDF", "soft counts")
# run.py rewrites the report above this line and keeps the hand-written part below it.
KEEP_BELOW = "<!-- run.py keeps everything below this line -->"


def _verdict(ok):
    return "met" if ok else "**missed**"


def _find(rows, size, what, kind="jaxpm", where="8 dev (2,4)"):
    key = (size, kind, what, where)
    return next((r for r in rows if (r["size"], r["kind"], r["what"], r["where"]) == key), None)


def _ratio(r):
    return r["warm"] / r["ref_time"]


def _judged(target, found, limit, unit="x", digits=2):
    """A target row from ``found``, (label, figure, detail) triples: met when every figure
    is within ``limit``."""
    if not found:
        return target, "not measured", "-"
    figures = "; ".join(
        f"{label}: {fig:.{digits}f}{unit} ({detail})" for label, fig, detail in found
    )
    return target, figures, _verdict(max(fig for _, fig, _ in found) <= limit)


def _time_detail(r, unit=" s"):
    return f"{r['warm']:.3f}{unit} / {r['ref_time']:.3f} s"


def _speed_targets(rows):
    out = []
    for size, limit in FOF_LIMITS:
        found = [
            (kind, _ratio(r), _time_detail(r, ""))
            for kind in ("jaxpm", "uniform")
            if (r := _find(rows, size, "fof", kind))
        ]
        out.append(_judged(f"FoF {size}^3, 8 devices: <= {limit:g}x scipy", found, limit))
    for k, limit in KNN_LIMITS.items():
        found = [
            (f"{size}^3", _ratio(r), _time_detail(r, ""))
            for size in KNN_SIZES
            if (r := _find(rows, size, f"knn_density k={k}"))
        ]
        target = f"kNN density k={k}, JaxPM snapshots, 8 devices: <= {limit:g}x cKDTree"
        out.append(_judged(target, found, limit))
    out += _scan_targets(rows)
    target = f"compile <= {COMPILE_LIMIT:g} s per function"
    compiled = [r for r in rows if "saveat" not in r["what"]]  # a solve's compile is the PM's
    if not compiled:
        return out + [(target, "not measured", "-")]
    worst = max(compiled, key=lambda r: r["first"] - r["warm"])
    seconds = worst["first"] - worst["warm"]
    where = f"{worst['what']}, {worst['size']}^3, {worst['where']}"
    verdict = _verdict(seconds <= COMPILE_LIMIT)
    return out + [(target, f"at most {seconds:.1f} s ({where})", verdict)]


def _scan_targets(rows):
    """The accelerator path on the CPU: its speed against cKDTree, and the sorts and TopKs
    over candidate lists in its compiled program (none is the target)."""
    scan = [r for size in KNN_SIZES if (r := _find(rows, size, SCAN))]
    found = [(f"{r['size']}^3", _ratio(r), _time_detail(r, "")) for r in scan]
    target = (
        f'accelerator path (KNNConfig(search="scan")) kNN density k=16, JaxPM snapshots, '
        f"8 devices: <= {SCAN_LIMIT:g}x cKDTree"
    )
    ops = [(f"{r['size']}^3", r["selection_ops"]) for r in scan if "selection_ops" in r]
    target_ops = "no sort and no TopK over candidate lists in that program (compiled HLO)"
    if not ops:
        return [_judged(target, found, SCAN_LIMIT), (target_ops, "not measured", "-")]
    figures = "; ".join(f"{size}: {o['topk']} TopK, {o['sort']} sorts" for size, o in ops)
    verdict = _verdict(all(o["topk"] == o["sort"] == 0 for _, o in ops))
    return [_judged(target, found, SCAN_LIMIT), (target_ops, figures, verdict)]


def _memory_targets(memory):
    out = []
    for what, limit in MEMORY_LIMITS.items():
        found = [(f"{m['nc']}^3", m["warm"], "warm RSS") for m in memory if m["what"] == what]
        target = f"warm peak memory of {what} <= {limit} B/particle"
        out.append(_judged(target, found, limit, " B", 0))
    knn = [m for m in memory if m["what"] == "knn_density k=16" and m["nc"] in KNN_SIZES]
    found = [(f"{m['nc']}^3", m["own"], "XLA temp") for m in knn]
    target = f"XLA temporaries of knn_density k=16 <= {KNN_TEMP_LIMIT} B/particle"
    found_jit = [(f"{m['nc']}^3", m["plain_jit"], "XLA temp") for m in knn]
    target_jit = f"the same in a user's plain jax.jit <= {KNN_TEMP_LIMIT} B/particle"
    return out + [
        _judged(target, found, KNN_TEMP_LIMIT, " B", 0),
        _judged(target_jit, found_jit, KNN_TEMP_LIMIT, " B", 0),
    ]


_SAVEAT = "in-situ saveat fof+knn_density k=16"  # the recipe's timing rows


def _recipe_targets(rows, solve_memory):
    found = [
        (f"{len(ts)} snapshot(s)", _ratio(r), _time_detail(r))
        for ts in RECIPE_SAVES
        if (r := _find(rows, RECIPE["nc"], f"{_SAVEAT}, per snapshot of {len(ts)}"))
    ]
    target = (
        f"in situ, the recipe ({RECIPE['nc']}^3, {RECIPE['steps']} steps) through InSitu.saveat: "
        f"FoF + kNN density k=16 <= {INSITU_LIMIT:g} PM steps per snapshot"
    )
    insitu = _judged(target, found, INSITU_LIMIT, " PM steps", 1)
    found = [
        (s["where"], s["with"] / s["without"], f"{s['without']:.0f} -> {s['with']:.0f} B/particle")
        for s in solve_memory
    ]
    target = (
        f"the recipe's solve temporaries with FoF + kNN density <= {SOLVE_MEMORY_LIMIT:g}x without"
    )
    found_all = [
        (s["where"], s["with_all"] / s["without"], f"{s['without']:.0f} -> {s['with_all']:.0f}")
        for s in solve_memory
        if "with_all" in s
    ]
    target_all = (
        "the same in a plain jax.jit with FoF, kNN density, M200m and peaks "
        f"<= {SOLVE_MEMORY_LIMIT:g}x without"
    )
    one = _find(rows, RECIPE["nc"], f"{_SAVEAT}, per snapshot of 1")
    compiles = []
    if one and "solve_compile" in one:
        off, on = one["solve_compile"]
        compiles = [("1 snapshot(s)", on / off, f"{off:.1f} -> {on:.1f} s")]
    target_compile = (
        f"the recipe's solve compile with FoF + kNN density <= {SOLVE_COMPILE_LIMIT:g}x without"
    )
    products = [
        (f"{r['size']}^3", _ratio(r), ", ".join(f"{k} {v:.3f} s" for k, v in r["parts"].items()))
        for r in rows
        if r["what"] == PRODUCTS
    ]
    target_products = (
        f"merger links, member ids and light cone <= {PRODUCTS_LIMIT:g} PM step per snapshot"
    )
    return [
        insitu,
        _judged(target, found, SOLVE_MEMORY_LIMIT),
        _judged(target_all, found_all, SOLVE_MEMORY_LIMIT),
        _judged(target_compile, compiles, SOLVE_COMPILE_LIMIT),
        _judged(target_products, products, PRODUCTS_LIMIT, " PM steps", 2),
        _statistics_row(rows),
    ]


def _statistics_row(rows):
    """What each differentiable summary adds in situ (reported; no target)."""
    target = (
        "differentiable statistics in situ at 64^3, PM steps per snapshot (forward; gradient "
        "w.r.t. the state); smooth SO beyond the hard SO"
    )
    found = [
        f"{name}: {r['parts']['forward'] / r['ref_time']:.2f}; "
        f"{r['parts']['gradient'] / r['ref_time']:.2f}"
        for name in STATISTICS_PARTS
        if (r := _find(rows, 64, f"{STATISTICS}: {name}"))
    ]
    if not found:
        return target, "not measured", "-"
    return target, "; ".join(found), "reported"


def growth_row(rows):
    """Whether each analysis's warm time grew no faster than N log N from the smallest
    size measured to the largest."""
    sizes = sorted({r["size"] for r in rows})
    target = "growth from the smallest to the largest size no worse than N log N"
    if len(sizes) < 2:
        return target, "not measured (one size)", "-"
    lo, hi = sizes[0], sizes[-1]
    nlogn = hi**3 * math.log(hi**3) / (lo**3 * math.log(lo**3))
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


def target_rows(results):
    """The targets table of a run: (target, measured, status) per target, with "not
    measured" where the run has no figure for it."""
    rows = results.get("rows", [])
    return (
        _speed_targets(rows)
        + _memory_targets(results.get("memory", []))
        + _recipe_targets(rows, results.get("solve_memory", []))
        + [growth_row(rows)]
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


_MEMORY_NOTE = (
    "First call: compilation included. Warm call: the peak of a second call (reset through "
    "/proc/self/clear_refs), i.e. the working memory of the analysis with the particles "
    "already resident. XLA temp: the compiled program's temporary buffers (per device, "
    "times the 8 devices), as the call compiles it outside `jit` (on CPU with XLA's "
    "memory-minimising scheduler), and inside a user's plain `jax.jit` (XLA:CPU's default, "
    "concurrency-optimised scheduler)."
)


def _memory_lines(memory):
    lines = [
        "| N | analysis | first call (B/particle) | warm call (B/particle) | "
        "XLA temp, own (B/particle) | XLA temp, plain jit (B/particle) |",
        "|---|---|---|---|---|---|",
    ]
    return lines + [
        f"| {m['nc']}^3 | {m['what']} | {m['first']:.0f} | {m['warm']:.0f} | "
        f"{m['own']:.0f} | {m['plain_jit']:.0f} |"
        for m in memory
    ]


def _solve_lines(solve_memory):
    lines = [
        f"The in-situ recipe ({RECIPE['nc']}^3, {RECIPE['steps']} steps), its diffeqsolve "
        "alone compiled from a given state with one save time, with `InSitu.saveat` (FoF + "
        "kNN density k=16; then M200m and peak centres too) and with `SaveAt(ts=...)`, in a "
        "user's plain `jax.jit`; per device times the devices.",
        "",
        "| devices | without (B/particle) | with (B/particle) | ratio | "
        "with M200m and peaks too (B/particle) | ratio |",
        "|---|---|---|---|---|---|",
    ]
    return lines + [
        f"| {s['where']} | {s['without']:.0f} | {s['with']:.0f} | {s['with'] / s['without']:.2f} | "
        + (
            f"{s['with_all']:.0f} | {s['with_all'] / s['without']:.2f} |"
            if "with_all" in s
            else "- | - |"
        )
        for s in solve_memory
    ]


def measured_line(results):
    at = results.get("commit")
    return (
        f"Measured {results['measured']} on {results['machine']} by `python benchmarks/run.py`"
        + (f" at {at}." if at else ".")
    )


def report_lines(results, level=2):
    """The generated report of a run, its sections at heading ``level``."""
    h = "#" * level
    lines = [
        measured_line(results),
        "Times are the minimum of several warm runs; ratios compare figures measured in "
        "the same process. Every jaxpm_halos result was checked against its reference.",
        "",
        "First call: compilation plus one run; compile: first call minus the warm time.",
        "",
        f"{h} Against the targets",
        "",
        "Every figure comes from this run, and each target is marked met or missed from it.",
        "",
        "| target | measured | status |",
        "|---|---|---|",
    ]
    lines += [f"| {t} | {m} | {v} |" for t, m, v in target_rows(results)]
    if results.get("rows"):
        lines += ["", f"{h} All timings", "", *_timing_lines(results["rows"])]
    if results.get("memory"):
        title = f"{h} Peak memory (child process, peak RSS growth per particle)"
        lines += ["", title, "", _MEMORY_NOTE, "", *_memory_lines(results["memory"])]
    if results.get("solve_memory"):
        title = f"{h} The recipe's solve: XLA temporaries"
        lines += ["", title, "", *_solve_lines(results["solve_memory"])]
    return lines


def _fmt(x, digits=3, style="g"):
    return "-" if x is None else f"{x:.{digits}{style}}"


def _per(a, b):
    return a / b if a and b else None


def gpu_lines(rows, card):
    """The tables of one ``benchmarks/gpu.py`` results file: FoF and kNN density against
    jz-tree, and in situ against a PM step. ``card`` names the GPU of rows that do not."""
    lines = [
        "| card | N | data | FoF (s) | FoF jz-tree (s) | ratio | kNN k=16 (s) | "
        "kNN jz-tree (s) | ratio | FoF scipy (s) | kNN cKDTree (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["kind"] in ("in situ", "top_k"):
            continue
        fof, jz_fof, knn, jz_knn = (r.get(k) for k in ("fof", "jz_fof", "knn", "jz_knn"))
        lines.append(
            f"| {r.get('device', card)} | {r['size']}^3 | {r['kind']} | {_fmt(fof)} | "
            f"{_fmt(jz_fof)} | {_fmt(_per(fof, jz_fof), 2, 'f')} | {_fmt(knn)} | "
            f"{_fmt(jz_knn)} | {_fmt(_per(knn, jz_knn), 2, 'f')} | "
            f"{_fmt(r.get('scipy_fof'))} | {_fmt(r.get('ckdtree_knn'))} |"
        )
    insitu = [r for r in rows if r["kind"] == "in situ"]
    if insitu:
        lines += [
            "",
            "In situ (FoF + kNN density k = 16 on one device) against one PM step:",
            "",
            "| card | N | analyses (s) | PM step (s) | PM steps per snapshot |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {r.get('device', card)} | {r['size']}^3 | {_fmt(r['insitu'])} | "
            f"{_fmt(r['pm_step'])} | {r['insitu'] / r['pm_step']:.0f} |"
            for r in insitu
        ]
    return lines
