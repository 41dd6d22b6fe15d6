"""Run every benchmark and regenerate the benchmarks page and its figures.

    python benchmarks/run_all.py --torch-2-15 PY215 [--out docs] [--quick]
                                 [--torch-2-13 PY213] [--json FILE] [--install]
    python benchmarks/run_all.py --from-json docs/benchmarks.json [--out docs]
    python benchmarks/run_all.py --from-json FILE --remeasure check_function|model|install --torch-2-15 PY215
    python benchmarks/run_all.py --from-json FILE --remeasure releases --torch-2-15 PY215 \\
                                 --other-releases PYTHON[:BUILT_TREE]...

The one entry point of the benchmarks. Each measurement is a module of its
own, which measures and tabulates its results:

    bench_overhead.py        idle cost of the import, and reading ctx.input_grad_buffers
    bench_releases.py        the same idle and read cost on each other release
    bench_fused.py           fused gradient accumulation: backward time and peak memory
    bench_model.py           a model sharing one block across depth: step time, peak, losses
    bench_advise.py          advise()'s predicted saving against fuse(model)'s measured one
    bench_advise_models.py   the same on GPT-2, BERT, ALBERT, T5, Llama (transformers), an LSTMCell
    bench_boxed_memory.py    boxed grads freed early: peak memory (with --torch-2-12)
    bench_check_function.py  torch_ctxext.testing.check_function's own time
    bench_import.py          the first import (the build) and the import from the cache
    bench_import_cost.py     the import's own cost against an earlier revision (--against)
    bench_idle_instructions.py  the idle cost counted in instructions (callgrind), per release

bench.py holds what they share (worker processes alternated side by side,
see its docstring; statistics) and is the entry of the processes they start;
page.py writes the page and figures.py the figures:

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
fewer rounds, leaves out the checker's time (bench_check_function.py)
and, unless --out is given, writes into a temporary directory rather than docs/.
``--from-json`` measures nothing and redraws the page and figures from the
raw results of an earlier run (to change the presentation, not the numbers);
with ``--remeasure check_function``, ``--remeasure model`` (the shared-layer
model of bench_model.py), ``--remeasure advise`` (bench_advise.py: the four
models of examples/where_fusing_pays.py, needs --torch-2-15) or
``--remeasure install`` it measures that part again and keeps the rest:

    python benchmarks/run_all.py --from-json docs/benchmarks.json --remeasure check_function \\
        --torch-2-13 PY213 --torch-2-15 PY215

``--remeasure read`` measures the read cost on 2.13 against ``--torch-2-15``
again (both ways: as measured and as the excess over a baseline read).

``--remeasure releases`` measures the idle and read cost on each release given
with ``--other-releases`` (that environment's installed torch_ctxext, or the
copy of the tree built in place in BUILT_TREE) and merges the rows into the
earlier results, release by release, so that releases whose environments do
not fit on the disk together can be measured one after another
(``python3 tools/run.py matrix --bench`` does, for every supported release).

``--remeasure builds`` measures the first import (the build) from an empty
cache on 2.13, ``--torch-2-15`` and each of ``--other-releases``, and merges
the rows release by release.

``--remeasure per_call`` measures FusedLinear's cost per call against
nn.Linear's and the least custom Function's in this interpreter
(bench_fused.py's ``collect_per_call``: CPU time side by side, and
instructions under callgrind, bench_per_call_instructions.py; about 6
minutes).

``--remeasure instructions`` counts the idle cost in instructions under
callgrind (bench_idle_instructions.py: free of the machine's noise; about 4
minutes per release) on ``--torch-2-13`` and each of ``--other-releases``
(this interpreter where neither is given), and merges
the rows release by release.
``--remeasure import_cost --against REV`` measures ``import torch_ctxext``
(from a warm build cache) for this checkout and for revision REV side by
side (bench_import_cost.py), and what finding the layout verdict costs.

``--install`` adds the install figures to a full run (bench_import.py:
the first import, which builds the extension, and the import from the build
cache; one build, 2 to 3 minutes on 2 cores).
"""
import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench  # noqa: E402
import bench_advise  # noqa: E402
import bench_advise_models  # noqa: E402
import bench_boxed_memory  # noqa: E402
import bench_check_function  # noqa: E402
import bench_fused  # noqa: E402
import bench_idle_instructions  # noqa: E402
import bench_import  # noqa: E402
import bench_import_cost  # noqa: E402
import bench_model  # noqa: E402
import bench_overhead  # noqa: E402
import bench_releases  # noqa: E402
import figures  # noqa: E402
import page  # noqa: E402


def plan_of(quick):
    """Rounds and sizes of the idle, read and fused measurements."""
    kind = "quick" if quick else "full"
    return {**bench_overhead.PLANS[kind], **bench_fused.PLANS[kind]}


def collect(python_213=None, python_215=None, quick=False, measures=None):
    """Idle, read and fused ("measures": all three unless given), side by
    side in one set of workers; a JSON-able dict of results."""
    plan = plan_of(quick)
    measures = measures or ["idle", "read", "fused"]
    python_213 = python_213 or sys.executable
    started = time.time()
    results = bench.new_results(plan, quick)
    workers = {}
    served = ["bench_overhead", "bench_fused"]

    def start(label, python, plugin):
        workers[label] = bench.Worker(python, label, plugin, served)

    try:
        # Start every process first: they import torch concurrently.
        if "idle" in measures:
            start("idle-without", python_213, False)
            start("idle-with", python_213, True)
            start("idle-with-guard", python_213, True)
        if {"read", "fused"} & set(measures):
            start("backport", python_213, True)
            if python_215:
                start("native", python_215, False)
        results["workers"] = {label: w.ready() for label, w in workers.items()}
        bench.log(f"{len(workers)} workers ready after {time.time() - started:.0f}s")
        if "idle" in measures:
            results["idle"] = bench_overhead.collect_idle(workers, plan)
            bench.log(f"idle done ({time.time() - started:.0f}s)")
        pair = [workers["backport"]] + ([workers["native"]] if "native" in workers else [])
        if "read" in measures:
            results["read"] = bench_overhead.collect_read(pair, plan)
            bench.log(f"read done ({time.time() - started:.0f}s)")
        if "fused" in measures:
            results["fused"] = []
            for batch, dim, micro in plan["grid"]:
                results["fused"].append(bench_fused.collect_fused(pair, plan, batch, dim, micro))
                bench.log(f"fused B={batch} D={dim} N={micro} done ({time.time() - started:.0f}s)")
    finally:
        for w in workers.values():
            w.close()
    results["machine"]["load_average_at_end"] = bench.load_average()
    results["seconds"] = time.time() - started
    return results


def headline(results):
    w = results["workers"]
    side = w.get("backport") or w.get("idle-with")
    m = results["machine"]
    return (
        f"torch {side['torch']} + torch_ctxext vs native torch "
        f"{w['native']['torch'] if 'native' in w else '2.15 (not given)'}; "
        f"{m['cpu_count']} × {m['cpu_model']}; 1 intra-op thread per worker; "
        f"{results['date']}; {results['seconds']:.0f} s"
        + ("; QUICK (smoke) run" if results["quick"] else "")
    )


def markdown_tables(results):
    parts = []
    if "idle" in results or "read" in results:
        parts.append(bench_overhead.overhead_table(results))
    if "fused" in results:
        parts.append(bench_fused.fused_tables(results))
    if "model" in results:
        parts.append(bench_model.tables(results["model"]))
    if "advise" in results:
        parts.append(bench_advise.memory_table(results["advise"]))
        parts.append(bench_advise.time_table(results["advise"]))
    if "advise_models" in results:
        parts.append(bench_advise_models.table(results["advise_models"]))
    return "\n\n".join(parts)


def command_of(torch_2_12, other_releases, install, quick):
    """The command line of the run, as the page names it."""
    return "python benchmarks/run_all.py --torch-2-15 PYTHON_OF_TORCH_2.15" + (
        " --torch-2-12 PYTHON_OF_TORCH_2.12" if torch_2_12 else ""
    ) + (
        " --other-releases PYTHONS_OF_THE_OTHER_RELEASES" if other_releases else ""
    ) + (
        " --install" if install else ""
    ) + (
        " --quick" if quick else ""
    )


def parse_args(argv):
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
        "--remeasure", choices=["check_function", "model", "advise", "advise_models", "install", "releases", "read", "builds", "instructions",
                                "import_cost", "first_import", "wheels", "per_call"],
        action="append", default=[],
        help="with --from-json: measure this part again (with --torch-2-13 / this "
        "interpreter and --torch-2-15 where given) and keep the rest of the earlier "
        "results; 'model' is the shared-layer model (benchmarks/bench_model.py, 5 to 8 "
        "minutes, needs --torch-2-15); 'advise' advise()'s predicted saving against fuse(model)'s "
        "on the four models of examples/where_fusing_pays.py (bench_advise.py, needs --torch-2-15); "
        "'advise_models' the same on the transformers models of examples/transformers_models.py "
        "(bench_advise_models.py, needs --torch-2-15 and transformers on both sides); "
        "'releases' the idle and read cost on each of "
        "--other-releases (read against --torch-2-15), merged release by release; "
        "'read' the read cost on 2.13 against --torch-2-15; 'builds' the first import "
        "(the build) from an empty cache on 2.13, --torch-2-15 and each of --other-releases; "
        "'instructions' the idle cost in instructions (callgrind) on 2.13 and each of "
        "--other-releases; 'import_cost' the import against the revision --against; "
        "'first_import' the build at first import against the one-TU extension and a packaged "
        "binary's first import (bench_first_import.py, on --torch-2-13 / this interpreter); "
        "'wheels' the figures of the last `python3 tools/run.py wheels` (--wheels-summary)",
    )
    parser.add_argument("--wheels-summary", metavar="FILE", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dist", "wheels.json"),
                        help="what tools/wheels.py wrote of its last run (--remeasure wheels)")
    parser.add_argument("--against", metavar="REV", default="HEAD~1",
                        help="the earlier revision --remeasure import_cost compares the import with")
    return parser, parser.parse_args(argv)


def remeasure(results, args, parser):
    """--from-json with --remeasure: measure those parts again into results."""
    if "check_function" in args.remeasure:
        pythons = [args.torch_2_13 or sys.executable] + [p for p in [args.torch_2_15] if p]
        results["check_function"] = bench_check_function.compare(pythons)
    if "model" in args.remeasure:
        if not args.torch_2_15:
            parser.error("--remeasure model needs --torch-2-15 (the native side)")
        results["model"] = bench_model.collect(args.torch_2_13, args.torch_2_15, quick=args.quick)
    if "advise" in args.remeasure:
        if not args.torch_2_15:
            parser.error("--remeasure advise needs --torch-2-15 (the native side)")
        results["advise"] = bench_advise.collect(args.torch_2_13, args.torch_2_15, quick=args.quick)
    if "advise_models" in args.remeasure:
        if not args.torch_2_15:
            parser.error("--remeasure advise_models needs --torch-2-15 (the native side)")
        results["advise_models"] = bench_advise_models.collect(args.torch_2_13, args.torch_2_15, quick=args.quick)
    if "read" in args.remeasure:
        if not args.torch_2_15:
            parser.error("--remeasure read needs --torch-2-15 (the native side)")
        read = collect(args.torch_2_13, args.torch_2_15, quick=results["quick"], measures=["read"])
        results["read"] = read["read"]
    if "builds" in args.remeasure:
        pythons = [args.torch_2_13 or sys.executable] + [p for p in [args.torch_2_15] if p]
        pythons += [p.partition(":")[0] for p in args.other_releases or []]
        rows = {r["torch"]: r for r in results.get("build_releases", [])}
        rows.update({r["torch"]: r for r in bench_import.first_import_per_release(pythons)})
        results["build_releases"] = list(rows.values())
    if "instructions" in args.remeasure:
        pythons = [p for p in [args.torch_2_13] if p] + list(args.other_releases or [])
        results.setdefault("idle_instructions", {}).update(bench_idle_instructions.collect(pythons or [sys.executable]))
    if "first_import" in args.remeasure:
        import bench_first_import

        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            bench_first_import.main(["--python", args.torch_2_13 or sys.executable, "--json", f.name])
            results["first_import"] = json.load(open(f.name))
    if "per_call" in args.remeasure:
        results["per_call"] = bench_fused.collect_per_call(rounds=5 if results["quick"] else 15)
    if "wheels" in args.remeasure:
        with open(args.wheels_summary) as f:
            results["wheels"] = json.load(f)
    if "import_cost" in args.remeasure:
        results["import_cost"] = bench_import_cost.collect(args.torch_2_13, args.against,
                                                           rounds=5 if results["quick"] else 20)
    if "releases" in args.remeasure:
        if not args.other_releases:
            parser.error("--remeasure releases needs --other-releases")
        results.setdefault("idle_releases", {}).update(bench_releases.collect_idle_releases(
            args.other_releases, plan_of(results["quick"]), native=args.torch_2_15))


def measure(args):
    """A full (or --quick) run of every benchmark the options ask for."""
    results = collect(args.torch_2_13, args.torch_2_15, quick=args.quick)
    if args.other_releases:
        results["idle_releases"] = bench_releases.collect_idle_releases(
            args.other_releases, plan_of(args.quick), native=args.torch_2_15)
    if args.torch_2_12:
        results["boxed"] = bench_boxed_memory.compare([args.torch_2_12, args.torch_2_13 or sys.executable])
    if not args.quick:
        results["check_function"] = bench_check_function.compare(
            [args.torch_2_13 or sys.executable, args.torch_2_15])
    results["model"] = bench_model.collect(args.torch_2_13, args.torch_2_15, quick=args.quick)
    results["advise"] = bench_advise.collect(args.torch_2_13, args.torch_2_15, quick=args.quick)
    results["advise_models"] = bench_advise_models.collect(args.torch_2_13, args.torch_2_15, quick=args.quick)
    return results


def main(argv=None):
    parser, args = parse_args(argv)
    figures.pyplot()  # fails now, not after the run, where matplotlib is missing
    out = args.out or (
        os.path.join(tempfile.gettempdir(), "torch_ctxext-bench-quick")
        if args.quick else os.path.join(os.path.dirname(HERE), "docs")
    )
    command = command_of(args.torch_2_12, args.other_releases, args.install, args.quick)
    if args.from_json:
        with open(args.from_json) as f:
            results = json.load(f)
        # The run that measured them, as far as its results tell.
        command = command_of("boxed" in results, "idle_releases" in results,
                             "install" in results, results["quick"] or args.quick)
        remeasure(results, args, parser)
    elif not args.torch_2_15:
        parser.error("--torch-2-15 is required (the native side of every comparison)")
    else:
        results = measure(args)
    if args.install or "install" in args.remeasure:
        results["install"] = bench_import.collect(args.torch_2_13, rounds=5 if args.quick else 20)
    page.write(results, out, command)
    for path in filter(None, [os.path.join(out, "benchmarks.json"), args.json]):
        if (args.from_json and not args.remeasure
                and os.path.abspath(path) == os.path.abspath(args.from_json)):
            continue  # nothing new was measured
        with open(path, "w") as f:
            json.dump(results, f, indent=1, sort_keys=True)
            f.write("\n")
    print(headline(results))
    print()
    print(markdown_tables(results))
    print(f"\nwrote {out}/benchmarks.md, {out}/benchmarks.json and {out}/{figures.IMG}/bench_*.png",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
