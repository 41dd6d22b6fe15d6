"""The benchmarks page, docs/benchmarks.md, written from the raw results.

Presentation only: what the benchmark modules measured (a run of
benchmarks/run_all.py, or the raw results of an earlier one, ``--from-json``)
becomes the page's Markdown (write()), with the figures of
benchmarks/figures.py beside it. Each benchmark module tabulates its own
results; this module arranges the page around those tables: versions,
summary, sections, and how it is measured.
"""
import math
import os
import statistics

import bench_advise
import bench_advise_models
import bench_boxed_memory
import bench_check_function
import bench_drop_ins_per_call
import bench_fused
import bench_idle_instructions
import bench_import
import bench_import_cost
import bench_model
import bench_overhead
import bench_releases
import figures
from figures import FIGURES, IMG
from page_models import advise_section, model_section


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
    if "idle_instructions" in results:
        rows = results["idle_instructions"]
        worst = max(rows.values(), key=lambda r: r["ratio"])
        ok = "within" if worst["ratio"] <= 1.02 else "**outside**"
        lines.append(
            f"* Idle cost in instructions (callgrind, {len(rows)} releases): at most "
            f"{worst['ratio']:.3f} (torch {worst['torch']}), {ok} the 2% target."
        )
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
        lines += [f"* Shared-layer model, {line}." for line in bench_model.summary(results["model"])]
    if "advise" in results:
        lines += [f"* Where fusing pays, {line}." for line in bench_advise.summary(results["advise"])]
    if "advise_models" in results:
        lines += [f"* Real models, {line}." for line in bench_advise_models.summary(results["advise_models"])]
    if "import_cost" in results:
        r = results["import_cost"]
        lines.append(
            f"* The import's own cost (after `import torch`, build cached): {r['new_ms']:.1f} ms, against "
            f"{r['old_ms']:.1f} ms for {r['against']}, whose import ran the layout probe's backward in the "
            f"process (ratio {r['new_over_old']['ratio']:.2f}, {r['new_ms'] - r['old_ms']:+.1f} ms); finding "
            f"and reading the layout verdict instead costs {r['find_verdict_ms']:.2f} ms."
        )
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


def _measured_by(module):
    """Lines naming the module that measured a section, and its docstring's
    account of how (after the title and the usage)."""
    return [f"Measured by `benchmarks/{module.__name__}.py`:", "",
            module.__doc__.split("\n\n", 2)[2].strip(), ""]


def first_import_section(r):
    """The first import three ways (benchmarks/bench_first_import.py)."""
    rows = ["| first import, empty cache | median | every round |", "|---|---|---|"]
    what = {"build": "`import torch_ctxext`, sources only: the build, in a child process",
            "one TU": "`cpp_extension.load` of one TU including `torch/extension.h`",
            "wheel": "`import torch_ctxext`, a packaged binary: nothing compiled",
            "against": "`import torch_ctxext`, sources only, the earlier revision"}
    for side, values in r["seconds"].items():
        rows.append(f"| {what.get(side, side)} | {statistics.median(values):.1f} s | "
                    f"{', '.join(f'{v:.1f}' for v in values)} s |")
    ratios = [f"{k}: {v['median']:.2f} ({v['min']:.2f} to {v['max']:.2f})" for k, v in r.items() if k.endswith("/ one TU")]
    return [
        "## The first import: the build, the smallest extension, a packaged binary",
        "",
        f"Measured {r['date']}, {r['rounds']} rounds, each a fresh process a side in turn (the order "
        "rotating), by `benchmarks/bench_first_import.py` (`run_all.py --remeasure first_import`); "
        f"load average at each round's start {', '.join(f'{v:.1f}' for v in r['load_average'])}.",
        "",
        *rows,
        "",
        "Ratios to the one-TU extension, per round (median, extremes): " + "; ".join(ratios) + ".",
        "",
    ]


def wheels_section(r):
    """The binary wheels (tools/wheels.py's wheels.json)."""
    rows = ["| wheel | binaries | size |", "|---|---|---|"]
    for w in r["wheels"]:
        rows.append(f"| `{w['wheel']}` | {w['binaries']} | {w['bytes'] / 1e6:.2f} MB |")
    return [
        "## The binary wheels",
        "",
        f"`python3 tools/run.py wheels` on {r['date']}"
        + (f" ({r['scope']})" if r.get("scope") else "")
        + f": {r['seconds'] / 60:.0f} min for {r['compiled']} builds (torch's wheels fetched and unpacked, "
        f"each compiled; load average {r['load_average']:.1f}). A second run with unchanged sources "
        "compiles nothing. One binary is about 330 KB (130 KB compressed), the package without "
        "binaries 0.27 MB.",
        "",
        *rows,
        "",
    ] + ([
        f"`tools/wheels.py --verify` (a release step): {r['verify_seconds_per_build'] / 60:.0f} min per CPython x "
        "torch build here, mostly installing torch into a fresh venv; the whole set (4 CPythons x 9 releases, "
        f"37 builds with the CPU build of 2.13.0) about {37 * r['verify_seconds_per_build'] / 3600:.1f} hours.",
        "",
    ] if r.get("verify_seconds_per_build") else [])


TARGET_PER_CALL_US = 5.0  # the target: a drop-in at most 5 us a call above its stock module


def per_call_section(r):
    """FusedLinear's cost per call (bench_fused.py's collect_per_call)."""
    route = r.get("route", "the Python Function")
    rows = r["cpu"]
    # Where a call's fixed cost shows: layers whose nn.Linear call takes
    # under 200 us; above, a few us are within a run's noise.
    fixed = [row for row in rows if row["step_cpu_stock_us"] < 200]
    large = [row for row in rows if row["step_cpu_stock_us"] >= 200]

    def extras(selected, key="step_cpu_extra_us"):
        return ", ".join(f"{row[key]:+.1f}" for row in selected) + " us"

    several = [row for row in fixed if row["calls"] > 1]
    once = [row for row in fixed if row["calls"] == 1]
    met = all(row["step_cpu_extra_us"] <= TARGET_PER_CALL_US for row in several)
    verdict = (
        f"The target is at most {TARGET_PER_CALL_US:.0f} us a call above `nn.Linear` (forward and backward, "
        f"CPU time). Where a call's fixed cost shows (`nn.Linear` under 200 us a call), FusedLinear ({route}) "
        f"costs {extras(several)} a call for a layer used several times, the modules `fuse()` swaps "
        f"(target {'met' if met else 'not met'}), and {extras(once)} for a layer used once, which `fuse()` "
        f"leaves stock{' (over the target)' if any(row['step_cpu_extra_us'] > TARGET_PER_CALL_US for row in once) else ''}; "
        f"its Python Function costs {extras(fixed, 'step_cpu_python_us')} and the least custom Python Function "
        f"{extras(fixed, 'step_cpu_floor_us')}.")
    if large:
        large_once = [row for row in large if row["calls"] == 1]
        large_several = [row for row in large if row["calls"] > 1]
        verdict += " On the larger layers the matrix products dominate"
        if large_several:
            verdict += f": used several times, FusedLinear changes a call by {extras(large_several)}"
        if large_once:
            share = max(row["step_cpu_extra_us"] / row["step_cpu_stock_us"] for row in large_once)
            noise = max(abs(row["no_grad_cpu_extra_us"]) for row in large_once)
            verdict += (f"; used once, by {extras(large_once)} ({100 * share:.1f} % of a call, where the same "
                        f"`F.linear` call under no_grad differs by {noise:.1f} us in this run)")
        verdict += "."
    lines = [
        "## FusedLinear's cost per call",
        "",
        f"Measured {r['date']} on torch {r['torch']}, one thread, {r['rounds']} rounds, load average "
        f"{r['load_average']:.1f} at the start (`run_all.py --remeasure per_call`). FusedLinear runs "
        f"{route} here. Where torch_ctxext has a build for the running torch (its extension on torch 2.6 "
        "to 2.14; on native 2.15 the build advise() loads too) FusedLinear runs, on plain CPU tensors, its "
        "Function written in C++ (`csrc/fused_linear.cpp`, a `torch::autograd::Function`), and elsewhere "
        "(another device, a subclass, a mode, autocast, 2.15 without that build) its Python "
        "`autograd.Function`: `Function.apply`'s Python wrapper, a ctx, a Python backward. The least custom Python Function (`F.linear` forward; "
        "backward `g @ W`, `g.t() @ x`, `g.sum(0)`, the products of `nn.Linear`'s own backward) is the "
        "floor no Python drop-in goes below. Each step is "
        "`calls` uses of the layer summed into one backward (several uses: all but the first to run "
        "backward add into the engine's buffers); medians over rounds of the per-round difference "
        "against `nn.Linear`, in the CPU time of the measuring thread (`time.thread_time`: other processes' load does not count) and in wall time:",
        "",
        bench_fused.per_call_table(r["cpu"]),
        "",
        verdict,
        "",
    ]
    if r.get("drop_ins"):
        lines += drop_ins_lines(r["drop_ins"])
    if r.get("instructions"):
        lines += [
            "The same in instructions (`benchmarks/bench_per_call_instructions.py`, callgrind: free of the "
            "machine's noise; instructions are not time, a Python-level step costs more time per "
            "instruction than a matrix product):",
            "",
            bench_fused.instructions_table(r["instructions"]),
            "",
        ]
    return lines


def drop_ins_lines(rows):
    """The other drop-ins' cost per call (bench_drop_ins_per_call.py), in
    the same run as FusedLinear's."""
    over = [row for row in rows if row["cpu_fused_us"] > TARGET_PER_CALL_US]
    verdict = (f"Target (at most {TARGET_PER_CALL_US:.0f} us a call above the stock module): "
               + ("met by every drop-in" if not over else
                  "not met by " + ", ".join(f"{row['case'].split(' ')[0]} ({row['cpu_fused_us']:+.1f} us)"
                                            for row in over))
               + ". With their Python Functions (while `advise()` or `explain()` observe, or on native 2.15 "
               "without the build) they cost "
               + ", ".join(f"{row['cpu_python_us']:+.1f}" for row in rows) + " us a call.")
    return [
        "The other drop-ins, in the same run (`benchmarks/bench_drop_ins_per_call.py`): the stock module, the "
        "drop-in as it runs (FusedGRUCell's and FusedLSTMCell's whole step, FusedMultiheadAttention's "
        "projections and FusedEmbedding's lookup in C++, `csrc/fused_linear.cpp` and "
        "`csrc/fused_embedding.cpp`), and the drop-in with those hidden (its Python Functions), with the same "
        "weights; a step is `calls` calls summed into one backward, rounds alternating; medians of the "
        "per-round difference per call:",
        "",
        bench_drop_ins_per_call.drop_ins_table(rows),
        "",
        verdict,
        "",
    ]


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
            bench_overhead.overhead_table(results),
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
            bench_releases.idle_releases_table(results),
            "",
        ]
    if "idle_instructions" in results:
        lines += [
            "## Idle cost in instructions, on each supported torch",
            "",
            "The wall-time ratios above vary by far more than the 2% target from one "
            "round to the next on a shared machine; instruction counts do not. "
            "`run_all.py --remeasure instructions`:",
            "",
            bench_idle_instructions.table(results["idle_instructions"]),
            "",
            *_measured_by(bench_idle_instructions),
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
            bench_fused.fused_tables(results).split("\n\n")[0],
            "",
            "Backward peak from the allocator (method below): unfused → fused, and the saving "
            "in units of one gradient of `w` (D × D float32):",
            "",
            bench_fused.fused_tables(results).split("\n\n")[1],
            "",
        ]
    if "check_function" in results:
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
            *_measured_by(bench_check_function),
        ]
    if "boxed" in results:
        lines += [
            "## Boxed grads: peak memory with early freeing",
            "",
            bench_boxed_memory.table(results["boxed"]),
            "",
            *_measured_by(bench_boxed_memory),
        ]
    if "model" in results:
        lines += [model_section(results["model"], f"{IMG}/{FIGURES['model']}")]
    if "advise" in results:
        lines += [advise_section(results["advise"], f"{IMG}/{FIGURES['advise']}")]
    if "advise_models" in results:
        lines += [bench_advise_models.section(results["advise_models"], f"{IMG}/{FIGURES['advise_models']}")]
    if "advise_cost" in results:
        lines += [bench_advise.cost_section(results["advise_cost"])]
    if "advise_floor" in results:
        lines += [bench_advise.floor_section(results["advise_floor"])]
    if "install" in results:
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
    if "import_cost" in results:
        r = results["import_cost"]
        lines += [
            "## The import's own cost: reading a verdict instead of running the probe",
            "",
            f"Measured {r['date']} (load average {r['load_average'][0]:.2f} at the end), "
            f"torch {r['torch']} (git {r['torch_git'][:12]}), {r['rounds']} rounds, by "
            f"`benchmarks/bench_import_cost.py` (`run_all.py --remeasure import_cost --against "
            f"{r['against']}`): the import of this checkout, which reads the build's layout "
            f"verdict, against the import of {r['against']}, which ran the layout probe (a "
            "forward and two backwards) in the importing process.",
            "",
            bench_import_cost.table(r),
            "",
            *_measured_by(bench_import_cost),
        ]
    if "first_import" in results:
        lines += first_import_section(results["first_import"])
    if "wheels" in results:
        lines += wheels_section(results["wheels"])
    if "build_releases" in results:
        lines += [
            "## The first import on each release: the build",
            "",
            "`python -c \"import torch_ctxext\"` on a sources-only copy of this checkout's "
            "package with an empty build cache (`run_all.py --remeasure builds`: three rounds, the "
            "releases in turn within each round): what a user waits for once per torch. The sources are compiled in at most "
            "two generated translation units (`_torch_ctxext_build/sources.py`), leaving out those "
            "whose member the torch provides; torch 2.15 needs nothing and builds nothing. "
            "Other load on the machine only adds time: the load average is given.",
            "",
            bench_import.builds_table(results["build_releases"]),
            "",
        ]
    if "per_call" in results:
        lines += per_call_section(results["per_call"])
    lines += ["## How it is measured", "", METHOD]
    return "\n".join(lines)


def write(results, out, command):
    """OUT/benchmarks.md and its figures in OUT/img/; ``command`` is the run
    of run_all.py the page says it was generated by."""
    figures.draw(results, out)
    with open(os.path.join(out, "benchmarks.md"), "w") as f:
        f.write(render_page(results, command))
