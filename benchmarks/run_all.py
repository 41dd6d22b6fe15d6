"""Run every benchmark and regenerate the benchmarks page and its figures.

    python benchmarks/run_all.py --torch-2-15 PY215 [--out docs] [--quick]
                                 [--torch-2-13 PY213] [--json FILE] [--install]
    python benchmarks/run_all.py --from-json docs/benchmarks.json [--out docs]
    python benchmarks/run_all.py --from-json FILE --remeasure check_function|model|install --torch-2-15 PY215
    python benchmarks/run_all.py --from-json FILE --remeasure releases --torch-2-15 PY215 \\
                                 --other-releases PYTHON[:BUILT_TREE]...

Measures with benchmarks/bench.py (worker processes alternated side by side,
see its docstring), then writes

    OUT/benchmarks.md          the page (Markdown tables; never edit by hand)
    OUT/img/bench_*.png        the figures it shows
    OUT/benchmarks.json        the raw results

The interpreter running this script draws the figures, so it needs
matplotlib; by default it is also the torch 2.13 side (torch 2.13 with
torch_ctxext importable: the source tree's if it is built in place, else the
installed one).
The docs environment has both:

    ~/.cache/torch_ctxext/venv-docs/bin/python benchmarks/run_all.py \\
        --torch-2-15 ~/.cache/torch_ctxext/venv-2.15.0/bin/python

The full run (the model included) takes 8 to 13 minutes on 2 cores;
``--quick`` (a smoke run for CI, under a minute) measures a smaller grid with
fewer rounds, leaves out the checker's time (benchmarks/bench_check_function.py)
and, unless --out is given, writes into a temporary directory rather than docs/.
``--from-json`` measures nothing and redraws the page and figures from the
raw results of an earlier run (to change the presentation, not the numbers);
with ``--remeasure check_function``, ``--remeasure model`` (the shared-layer
model of benchmarks/bench_model.py) or ``--remeasure install`` it measures that
part again and keeps the rest:

    python benchmarks/run_all.py --from-json docs/benchmarks.json --remeasure check_function \\
        --torch-2-13 PY213 --torch-2-15 PY215

``--remeasure read`` measures the read cost on 2.13 against ``--torch-2-15``
again (both ways: as measured and as the excess over a baseline read).

``--remeasure releases`` measures the idle and read cost on each release given
with ``--other-releases`` (that environment's installed torch_ctxext, or the
copy of the tree built in place in BUILT_TREE) and merges the rows into the
earlier results, release by release, so that releases whose environments do
not fit on the disk together can be measured one after another
(``bash tools/run.sh matrix --bench`` does, for every supported release).

``--install`` adds the install figures to a full run (benchmarks/bench_import.py:
the first import, which builds the extension, and the import from the build
cache; one build, 2 to 3 minutes on 2 cores).
"""
import argparse
import json
import math
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench  # noqa: E402
import bench_model  # noqa: E402
import bench_model_report  # noqa: E402

IMG = "img"
FIGURES = {
    "overhead": "bench_overhead.png",
    "time": "bench_fused_time.png",
    "memory": "bench_fused_memory.png",
    "model": "bench_model.png",
}
COLORS = {"backport": "#1f77b4", "native": "#ff7f0e"}


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        sys.exit(
            "run_all.py draws figures and needs matplotlib in the interpreter that "
            "runs it: use the docs environment (see requirements-docs.txt), e.g. "
            "~/.cache/torch_ctxext/venv-docs/bin/python benchmarks/run_all.py ..."
        )
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _label(row):
    return f"B={row['B']}\nD={row['D']}\nN={row['N']}"


def plot_overhead(results, path, plt):
    rows = []
    if "idle" in results:
        idle = results["idle"]
        rows += [
            ("idle: process with / without\nimport torch_ctxext", idle["with_import"]),
            ("idle, one process: apply wrapper /\noriginal Function.apply", idle["in_process"]),
            ("idle: with import, guard installed /\nwithout import", idle["with_guard"]),
        ]
    if "read" in results and "backport_over_native" in results["read"]:
        rows.append(
            ("read ctx.input_grad_buffers:\n2.13 + torch_ctxext / native 2.15",
             results["read"]["backport_over_native"])
        )
    if "read" in results and "excess_over_native" in results["read"]:
        rows.append(
            ("read, excess over a baseline read:\n2.13 + torch_ctxext / native 2.15",
             results["read"]["excess_over_native"])
        )
    fig, ax = plt.subplots(figsize=(7.5, 0.9 + 0.75 * len(rows)))
    ys = list(range(len(rows)))[::-1]
    for y, (name, s) in zip(ys, rows):
        ax.barh(y, s["ratio"], color="#1f77b4", height=0.55)
        ax.errorbar(
            s["ratio"], y, xerr=[[s["ratio"] - s["p10"]], [s["p90"] - s["ratio"]]],
            color="black", capsize=3, lw=1,
        )
        ax.text(max(s["p90"], s["ratio"]) + 0.01, y, f"{s['ratio']:.3f}", va="center", fontsize=9)
    ax.set_yticks(ys)
    ax.set_yticklabels([name for name, _ in rows], fontsize=8)
    ax.axvline(1.0, color="black", lw=0.8)
    if "idle" in results:
        ax.axvline(1.02, color="red", lw=0.8, ls="--", label="idle target 1.02")
        ax.legend(loc="lower right", fontsize=8)
    lo = min(s["p10"] for _, s in rows)
    hi = max(s["p90"] for _, s in rows)
    ax.set_xlim(min(0.5, lo - 0.05), max(1.15, hi + 0.1))
    ax.set_xlabel("ratio (median of per-round ratios; bars: 10th–90th percentile)")
    ax.set_title("Overhead, measured side by side", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def _grouped_bars(ax, rows, sides, value, err=None):
    width = 0.8 / len(sides)
    for i, side in enumerate(sides):
        xs = [k + (i - (len(sides) - 1) / 2) * width for k in range(len(rows))]
        vals = [value(r[side]) for r in rows]
        kwargs = {}
        if err:
            kwargs["yerr"] = [
                [v - err(r[side])[0] for v, r in zip(vals, rows)],
                [err(r[side])[1] - v for v, r in zip(vals, rows)],
            ]
            kwargs["capsize"] = 2
        ax.bar(xs, vals, width, label=bench.SIDE_NAMES[side], color=COLORS[side], **kwargs)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([_label(r) for r in rows], fontsize=7)


def plot_fused_time(results, path, plt):
    rows = results["fused"]
    sides = [s for s in ("backport", "native") if s in rows[0]]
    fig, ax = plt.subplots(figsize=(max(6, 0.75 * len(rows) + 1.5), 3.6))
    _grouped_bars(
        ax, rows, sides, lambda r: r["time_ratio"],
        err=lambda r: (min(r["time_ratio_min"], r["time_ratio"]), max(r["time_ratio_max"], r["time_ratio"])),
    )
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_ylabel("backward time, fused / unfused")
    ax.set_title(
        "Weight shared by N micro-batches: addmm_ into ctx.input_grad_buffers vs returning x.t() @ g",
        fontsize=9,
    )
    ax.legend(fontsize=8, loc="upper right", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def plot_fused_memory(results, path, plt):
    rows = results["fused"]
    sides = [s for s in ("backport", "native") if s in rows[0]]
    fig, ax = plt.subplots(figsize=(max(6, 0.75 * len(rows) + 1.5), 3.6))
    _grouped_bars(ax, rows, sides, lambda r: r["peak_ratio"])
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_ylim(0, 1.35)
    ax.set_ylabel("backward peak (allocator), fused / unfused")
    ax.set_title("Peak memory of the backward (CPU allocator events via torch.profiler)", fontsize=9)
    ax.legend(fontsize=8, loc="upper right", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def _geomean(values):
    return math.exp(sum(math.log(v) for v in values) / len(values))


def verdicts(results):
    lines = []
    if "idle" in results:
        for key, what in (("with_import", "process with / without import"),
                          ("in_process", "in one process, wrapper / original apply")):
            r = results["idle"][key]["ratio"]
            ok = "within" if r <= 1.02 else "**outside**"
            lines.append(f"* Idle cost, {what}: {r:.3f}, {ok} the 2% target.")
    if "read" in results and "excess_over_native" in results["read"]:
        read = results["read"]
        r = read["excess_over_native"]["ratio"]
        lines.append(
            "* Reading `ctx.input_grad_buffers` (two exposed entries), excess over a baseline "
            f"read: {read['excess_us']['backport'] * 1e3:.0f} ns on 2.13 + torch_ctxext, "
            f"{read['excess_us']['native'] * 1e3:.0f} ns on native 2.15: ratio {r:.2f}, "
            + ("within" if r <= 1.0 else "**outside**") + " the 1.0 target; "
            f"as measured (the loop's own cost included) {read['us']['backport']:.2f} us against "
            f"{read['us']['native']:.2f} us (ratio {read['backport_over_native']['ratio']:.2f})."
        )
    if "fused" in results:
        rows = results["fused"]
        if "native" in rows[0]:
            rel = _geomean([r["backport"]["time_ratio"] / r["native"]["time_ratio"] for r in rows])
            lines.append(
                "* Fused speed-up against native: geometric mean over the grid of "
                "(fused/unfused on 2.13 + torch_ctxext) / (fused/unfused on native 2.15) = "
                f"{rel:.2f} (1.00 = the same speed-up)."
            )
        sides = [s for s in ("backport", "native") if s in rows[0]]
        savings = [r[s]["peak_saving_grads"] for r in rows for s in sides]
        exact = all(abs(v - 1.0) < 0.01 for v in savings)
        lines.append(
            "* Peak memory: fused is lower than unfused by "
            + ("exactly one gradient-sized temporary (D × D × 4 bytes) in every "
               "configuration, on both sides." if exact else
               f"{min(savings):.2f} to {max(savings):.2f} gradients (target: 1).")
        )
    if "model" in results:
        lines += [f"* Shared-layer model, {line}." for line in bench_model_report.summary(results["model"])]
    if "install" in results:
        r = results["install"]
        lines.append(
            f"* Installing from source: the first import builds the extension in "
            f"{r['first_import_s']:.0f} s; later imports load it from the build cache: "
            f"`import torch_ctxext` {r['cached_ms']:.1f} ms against {r['package_ms']:.1f} ms with a "
            f"build shipped in the package (ratio {r['cached_over_package']['ratio']:.2f}; finding "
            f"the cached build costs {r['lookup_cache_ms']:.1f} ms; `import torch` alone takes "
            f"{r['import_torch_s']:.1f} s)."
        )
    return "\n".join(lines)


def _origin(info):
    path = info.get("torch_ctxext_file", "")
    if not path:
        return "?"
    # Judged from the path alone: the results may come from another checkout.
    parts = path.split(os.sep)
    return "installed" if "site-packages" in parts or "dist-packages" in parts else (
        "source tree, built in place"
    )


def _worker_versions(results):
    w = results["workers"]
    rows = []
    side = w.get("backport") or w.get("idle-with")
    if side:
        rows.append(
            f"| torch 2.13 side | torch {side['torch']} (git {side['torch_git'][:12]}), "
            f"Python {side['python']}, torch_ctxext {side.get('torch_ctxext', '?')} "
            f"({_origin(side)}; checkout {results['machine']['git_commit']}) |"
        )
    if "native" in w:
        n = w["native"]
        rows.append(
            f"| native side | torch {n['torch']} (git {n['torch_git'][:12]}), Python {n['python']}, "
            "torch_ctxext not imported |"
        )
    return rows


METHOD = """\
* **Side by side.** Each side is a long-lived worker process (`bench.py --worker`)
  that imports torch once, uses one intra-op thread, and answers requests. The
  same request goes to every worker in turn, round after round, rotating which
  goes first, so load on the machine hits all sides alike; every ratio is
  formed round by round from measurements taken seconds apart, and the page
  shows the median of those per-round ratios (10th–90th percentile in
  parentheses). Within a round each side keeps the smallest of its samples
  (other load only ever adds time).
* **Idle.** Forward + backward of a 16-element custom Function that uses no
  new feature (`save_for_backward`, `x * 2`), µs per step. Three processes of
  the same torch 2.13 environment: without `import torch_ctxext`, with it, and
  with it after one buffer was handed out (which installs the reentrancy guard
  on `backward`/`grad`). The in-process row alternates, in the process that
  imported torch_ctxext, samples through its `Function.apply` wrapper (the only
  per-call cost of the import) and through the original `Function.apply`.
* **Read.** µs per read of `ctx.input_grad_buffers` inside one backward, two
  entries exposed each time; torch 2.13 + torch_ctxext vs native torch 2.15.
  Right after it, in the same backward, the same loop reads
  `ctx.needs_input_grad` (a plain attribute): the baseline. Both figures are
  kept: the read as measured (the loop's own cost included, which dilutes
  any difference) and its excess over the baseline (the property's own
  cost), each side's per round being its fastest read minus its fastest
  baseline, and the ratio the median of per-round excess ratios.
* **Fused.** A weight `w` (D × D) shared by N micro-batches `x_i` (B × D):
  `y_i = Linear.apply(x_i, w)`, then `torch.autograd.backward(ys, gs)` with
  dense output gradients. *Unfused* returns `x.t() @ g` for `w`; *fused*
  reads `ctx.input_grad_buffers` and, when `w`'s buffer is there, does
  `w_buffer.addmm_(x.t(), g)` and returns `None` (the first micro-batch to
  run finds no buffer and returns its gradient). Backward time only; the two
  variants alternate within each worker (several repeats per request, of
  which each keeps its fastest), both workers alternate per round; the ratio
  is the median over rounds of fastest fused / fastest unfused, the range is
  over rounds, the ms columns are medians over rounds.
* **Peak memory (allocator).** Each variant's backward runs once more under
  `torch.profiler.profile(activities=[ProfilerActivity.CPU], profile_memory=True)`,
  started after the forward. The CPU allocator reports every allocation and
  free made while profiling (c10's `ProfiledCPUMemoryReporter`); the
  allocation events (`_ExtraFields_Allocation`, device CPU) from
  `prof.profiler.kineto_results.experimental_event_tree()` are ordered by
  time and their signed sizes summed to a running total; its maximum is the
  peak: bytes allocated during the backward and not yet freed. Nothing that
  existed before the backward is freed during it (inputs, weight and output
  gradients are held by the benchmark), so this is the backward's peak above
  its starting point. It is deterministic, so one profiled run per variant
  and side suffices. Expected: unfused holds the accumulated buffer plus one
  fresh `x.t() @ g` (2 gradients), fused only the buffer (1 gradient).
"""


def render_page(results, command):
    m = results["machine"]
    la0 = m.get("load_average_at_start")
    la1 = m.get("load_average_at_end")
    load = (
        f"{la0[0]:.2f} / {la1[0]:.2f}" if la0 and la1 else "unknown"
    )
    lines = [
        "# Benchmarks",
        "",
        "<!-- Generated by benchmarks/run_all.py; do not edit by hand, rerun it. -->",
        "",
        f"Generated by `{command}` (one run, {results['seconds']:.0f} s; raw results in "
        "`docs/benchmarks.json`). Every figure is a ratio of measurements taken side by "
        "side in that run; ratios, not absolute times, are what carry over between machines.",
        "",
    ]
    if results["quick"]:
        lines += [
            "**This is a `--quick` smoke run: a reduced grid and few rounds. "
            "Do not publish these numbers.**",
            "",
        ]
    lines += [
        "## Machine and versions",
        "",
        "| | |",
        "|---|---|",
        f"| CPU | {m['cpu_count']} × {m['cpu_model']} (`os.cpu_count()`; model from /proc/cpuinfo), "
        f"{m.get('cpus_usable', '?')} usable |",
        f"| load average (1 min) at start / end | {load} |",
        *_worker_versions(results),
        "| threads | 1 intra-op thread per worker (`torch.set_num_threads(1)`) |",
        f"| date | {results['date']} |",
        "",
        "## Summary",
        "",
        verdicts(results),
        "",
    ]
    if "idle" in results or "read" in results:
        lines += [
            "## Overhead: idle cost and reading the buffers",
            "",
            f"![Overhead ratios]({IMG}/{FIGURES['overhead']})",
            "",
            bench.overhead_table(results),
            "",
        ]
    if "idle_releases" in results:
        lines += [
            "## Idle and read cost on each supported torch",
            "",
            "The same idle measurement on each release, with torch_ctxext built for "
            "it (what it patches differs: see the compatibility matrix); where it "
            "wraps the engine's validate_outputs (torch 2.6 to 2.9), also in a process "
            "in which a `None` declaration placed that wrapper; and reading "
            "`ctx.input_grad_buffers` (two exposed entries) against native torch 2.15 "
            "in the same run. Releases are measured one run after another "
            "(`--remeasure releases`); each row's ratios were taken side by side:",
            "",
            bench.idle_releases_table(results),
            "",
        ]
    if "fused" in results:
        lines += [
            "## Fused gradient accumulation",
            "",
            f"![Backward time ratio, fused / unfused]({IMG}/{FIGURES['time']})",
            "",
            f"![Backward peak memory ratio, fused / unfused]({IMG}/{FIGURES['memory']})",
            "",
            "Backward time (ms, fused / unfused: median over rounds of the fastest repeat) and the ratio, with its range over rounds; "
            "lower is better:",
            "",
            bench.fused_tables(results).split("\n\n")[0],
            "",
            "Backward peak from the allocator (method below): unfused → fused, and the saving "
            "in units of one gradient of `w` (D × D float32):",
            "",
            bench.fused_tables(results).split("\n\n")[1],
            "",
        ]
    if "check_function" in results:
        import bench_check_function

        rows = results["check_function"]
        lines += [
            "## Checking a Function",
            "",
            "`torch_ctxext.testing.check_function` on the corpus of `test/check_corpus/` "
            "(custom Functions in the styles real projects use, correct and broken, each "
            "with an expert's verdict): the checker's own time per Function, its agreement "
            "with the verdicts, and the issue's moderate-size Function against the "
            "`gradcheck` + `gradgradcheck` (slow mode) the previous checker ran "
            f"(measured {rows[0].get('date', '?')}, one intra-op thread; load average "
            + ", ".join(f"{r['torch']}: {r['load_average'][0]:.1f} to {r['load_average'][1]:.1f}"
                        for r in rows if r.get("load_average") and None not in r["load_average"])
            + "):",
            "",
            bench_check_function.summary_table(rows),
            "",
            "Per Function (fastest of the rounds; mode: which gradient check ran, `reference` "
            "for a stated intended gradient; ✗ marks a disagreement with the verdict):",
            "",
            bench_check_function.case_table(rows),
            "",
            "Measured by `benchmarks/bench_check_function.py`:",
            "",
            bench_check_function.__doc__.split("\n\n", 2)[2].strip(),
            "",
        ]
    if "boxed" in results:
        import bench_boxed_memory

        rows = results["boxed"]
        lines += [
            "## Boxed grads: peak memory with early freeing",
            "",
            "| torch | boxed peak (MiB) | unboxed peak (MiB) | boxed / unboxed |",
            "|---|---|---|---|",
            *[
                f"| {r['torch']}{' + torch_ctxext' if r['torch'].startswith('2.12') else ' (native)'} "
                f"| {r['boxed_peak_mib']:.1f} | {r['unboxed_peak_mib']:.1f} "
                f"| {r['boxed_peak_mib'] / r['unboxed_peak_mib']:.2f} |"
                for r in rows
            ],
            "",
            "Measured by `benchmarks/bench_boxed_memory.py`:",
            "",
            bench_boxed_memory.__doc__.split("\n\n", 2)[2].strip(),
            "",
        ]
    if "model" in results:
        lines += [bench_model_report.page_section(results["model"], f"{IMG}/{FIGURES['model']}")]
    if "install" in results:
        import bench_import

        r = results["install"]
        lines += [
            "## Installing: the first import and the next",
            "",
            f"Measured {r['date']} (load average {r['load_average'][0]:.2f} at the end), "
            f"torch {r['torch']} (git {r['torch_git'][:12]}), by `benchmarks/bench_import.py` "
            "on this checkout's sources; see [Installing](install.md) for what the first "
            "import does.",
            "",
            bench_import.table(r),
            "",
            *[
                "* " + " ".join(paragraph.split())
                for paragraph in bench_import.__doc__.split("\n\n")[3:]
            ],
            "",
        ]
    if "build_releases" in results:
        import bench_import

        lines += [
            "## The first import on each release: the build",
            "",
            "`python -c \"import torch_ctxext\"` on a sources-only copy of this checkout's "
            "package with an empty build cache (`bench_import.py --releases`, one release after "
            "another): what a user waits for once per torch. The sources are compiled in at most "
            "two generated translation units (`torch_ctxext/_sources.py`), leaving out those "
            "whose member the torch provides; torch 2.15 needs nothing and builds nothing. "
            "Other load on the machine only adds time: the load average is given.",
            "",
            bench_import.builds_table(results["build_releases"]),
            "",
        ]
    lines += ["## How it is measured", "", METHOD]
    return "\n".join(lines)


def boxed_memory(pythons):
    """Peak memory of bench_boxed_memory.py's workload under each interpreter."""
    import subprocess

    rows = []
    for python in pythons:
        env = dict(os.environ)
        if "2.12" in python:  # an installed torch_ctxext, not this source tree's build
            env.pop("PYTHONPATH", None)
        out = subprocess.run(
            [python, os.path.join(HERE, "bench_boxed_memory.py")],
            capture_output=True, text=True, check=True, cwd=tempfile.gettempdir(), env=env,
        )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Run every benchmark; write OUT/benchmarks.md and OUT/img/bench_*.png."
    )
    parser.add_argument("--torch-2-15", metavar="PYTHON",
                        help="python of a native torch 2.15 environment (required unless --from-json)")
    parser.add_argument("--torch-2-13", metavar="PYTHON",
                        help="python of the torch 2.13 environment (default: this one)")
    parser.add_argument("--other-releases", metavar="PYTHON", nargs="*", default=[],
                        help="pythons of other torch releases with torch_ctxext installed, "
                        "or PYTHON:DIR with a tree built in place in DIR: adds the idle "
                        "and read cost on each")
    parser.add_argument("--torch-2-12", metavar="PYTHON",
                        help="python of a torch 2.12 environment with torch_ctxext installed: "
                        "adds the boxed-grads peak-memory comparison with this torch 2.13")
    parser.add_argument("--out", help="docs directory to write into (default: docs; "
                        "with --quick a temporary directory)")
    parser.add_argument("--quick", action="store_true", help="smoke run for CI (under a minute)")
    parser.add_argument("--json", metavar="FILE", help="also write the raw results here")
    parser.add_argument("--install", action="store_true",
                        help="also measure the first import (a build) and the import from the "
                        "build cache (with --from-json: --remeasure install)")
    parser.add_argument(
        "--from-json", metavar="FILE",
        help="measure nothing: redraw the page and figures from the raw results of an earlier run",
    )
    parser.add_argument(
        "--remeasure", choices=["check_function", "model", "install", "releases", "read", "builds"], action="append", default=[],
        help="with --from-json: measure this part again (with --torch-2-13 / this "
        "interpreter and --torch-2-15 where given) and keep the rest of the earlier "
        "results; 'model' is the shared-layer model (benchmarks/bench_model.py, 5 to 8 "
        "minutes, needs --torch-2-15); 'releases' the idle and read cost on each of "
        "--other-releases (read against --torch-2-15), merged release by release; "
        "'read' the read cost on 2.13 against --torch-2-15; 'builds' the first import "
        "(the build) from an empty cache on 2.13, --torch-2-15 and each of --other-releases",
    )
    args = parser.parse_args(argv)
    plt = _pyplot()
    out = args.out or (
        os.path.join(tempfile.gettempdir(), "torch_ctxext-bench-quick")
        if args.quick else os.path.join(os.path.dirname(HERE), "docs")
    )
    def command_of(torch_2_12, other_releases, install, quick):
        return "python benchmarks/run_all.py --torch-2-15 PYTHON_OF_TORCH_2.15" + (
            " --torch-2-12 PYTHON_OF_TORCH_2.12" if torch_2_12 else ""
        ) + (
            " --other-releases PYTHONS_OF_THE_OTHER_RELEASES" if other_releases else ""
        ) + (
            " --install" if install else ""
        ) + (
            " --quick" if quick else ""
        )

    command = command_of(args.torch_2_12, args.other_releases, args.install, args.quick)
    if args.from_json:
        with open(args.from_json) as f:
            results = json.load(f)
        # The run that measured them, as far as its results tell.
        command = command_of("boxed" in results, "idle_releases" in results,
                             "install" in results, results["quick"] or args.quick)
        if "check_function" in args.remeasure:
            import bench_check_function

            pythons = [args.torch_2_13 or sys.executable] + [p for p in [args.torch_2_15] if p]
            results["check_function"] = bench_check_function.compare(pythons)
        if "model" in args.remeasure:
            if not args.torch_2_15:
                parser.error("--remeasure model needs --torch-2-15 (the native side)")
            results["model"] = bench_model.collect(args.torch_2_13, args.torch_2_15, quick=args.quick)
        if "read" in args.remeasure:
            if not args.torch_2_15:
                parser.error("--remeasure read needs --torch-2-15 (the native side)")
            read = bench.collect(args.torch_2_13, args.torch_2_15, quick=results["quick"], measures=["read"])
            results["read"] = read["read"]
        if "builds" in args.remeasure:
            import bench_import

            pythons = [args.torch_2_13 or sys.executable] + [p for p in [args.torch_2_15] if p]
            pythons += [p.partition(":")[0] for p in args.other_releases or []]
            rows = {r["torch"]: r for r in results.get("build_releases", [])}
            rows.update({r["torch"]: r for r in bench_import.first_import_per_release(pythons)})
            results["build_releases"] = list(rows.values())
        if "releases" in args.remeasure:
            if not args.other_releases:
                parser.error("--remeasure releases needs --other-releases")
            plan = dict(bench.PLANS["quick" if results["quick"] else "full"])
            results.setdefault("idle_releases", {}).update(
                bench.collect_idle_releases(args.other_releases, plan, native=args.torch_2_15))
    elif not args.torch_2_15:
        parser.error("--torch-2-15 is required (the native side of every comparison)")
    else:
        results = bench.collect(args.torch_2_13, args.torch_2_15, quick=args.quick)
        if args.other_releases:
            plan = dict(bench.PLANS["quick" if args.quick else "full"])
            results["idle_releases"] = bench.collect_idle_releases(
                args.other_releases, plan, native=args.torch_2_15)
        if args.torch_2_12:
            results["boxed"] = boxed_memory([args.torch_2_12, args.torch_2_13 or sys.executable])
        if not args.quick:
            import bench_check_function

            results["check_function"] = bench_check_function.compare(
                [args.torch_2_13 or sys.executable, args.torch_2_15])
        results["model"] = bench_model.collect(args.torch_2_13, args.torch_2_15, quick=args.quick)
    if args.install or "install" in args.remeasure:
        import bench_import

        results["install"] = bench_import.collect(args.torch_2_13, rounds=5 if args.quick else 20)
    os.makedirs(os.path.join(out, IMG), exist_ok=True)
    plot_overhead(results, os.path.join(out, IMG, FIGURES["overhead"]), plt)
    plot_fused_time(results, os.path.join(out, IMG, FIGURES["time"]), plt)
    plot_fused_memory(results, os.path.join(out, IMG, FIGURES["memory"]), plt)
    if "model" in results:
        bench_model_report.plot(results["model"], os.path.join(out, IMG, FIGURES["model"]), plt)
    with open(os.path.join(out, "benchmarks.md"), "w") as f:
        f.write(render_page(results, command))
    for path in filter(None, [os.path.join(out, "benchmarks.json"), args.json]):
        if (args.from_json and not args.remeasure
                and os.path.abspath(path) == os.path.abspath(args.from_json)):
            continue  # nothing new was measured
        with open(path, "w") as f:
            json.dump(results, f, indent=1, sort_keys=True)
            f.write("\n")
    print(bench.headline(results))
    print()
    print(bench.markdown_tables(results))
    if "model" in results:
        print()
        print(bench_model_report.tables(results["model"]))
    print(f"\nwrote {out}/benchmarks.md, {out}/benchmarks.json and {out}/{IMG}/bench_*.png",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
