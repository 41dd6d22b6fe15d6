"""The checker's own time per Function, on the corpus of test/check_corpus/.

    python benchmarks/run_all.py --from-json FILE --remeasure check_function \\
                                 [--torch-2-13 PY213] --torch-2-15 PY215

Workload: ``check_function`` on every Function of the corpus (Functions in
the styles real projects use and broken variants of them, each with an
expert's verdict), with one intra-op thread. A first pass pays torch's
one-time costs of a process (imports on the first backward with explicit
gradients, forward-mode decompositions, functorch) and is timed apart as the
cold pass; then every Function is checked five more times, in turn, and
keeps its fastest time (other load on the machine only ever adds time). The
figures are the median and the maximum over Functions of those times, the
agreement of the checker's verdict (the set of failed and noted rules) with
the expert's, and, for the issue's moderate-size Function (a ZeRO-3 linear
with inputs (8, 4, 32) and (64, 32)), check_function against what the
previous checker ran, ``torch.autograd.gradcheck`` and ``gradgradcheck`` in
their default (slow) mode on float64 copies, timed in the same process right
after check_function (its fastest of three).
"""
import os
import statistics
import sys
import time

from bench import ROOT, run_once

ROUNDS = 5
MODERATE = "zero3_linear_moderate_size"


def _mode(report):
    text = report.gradient_mode
    if not text:
        return "none"
    return "reference" if text.startswith("against") else text.split(" ")[0]


def measure():
    """One JSON-able dict for this interpreter."""
    sys.path.insert(0, os.path.join(ROOT, "test"))
    import torch

    import torch_ctxext
    from check_corpus import CASES
    from torch_ctxext.testing import check_function

    torch.set_num_threads(1)
    load_at_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    cases = [c for c in CASES if c.missing() is None]

    def run(case):
        start = time.perf_counter()
        report = check_function(case.function, *case.args(), raise_on_failure=False,
                                **case.options)
        return time.perf_counter() - start, report

    start = time.perf_counter()
    first = {case.id: run(case) for case in cases}
    cold = time.perf_counter() - start
    times = {case.id: [] for case in cases}
    for r in range(ROUNDS):
        order = cases[r % len(cases):] + cases[: r % len(cases)]  # rotate who goes first
        for case in order:
            times[case.id].append(run(case)[0])
    rows = []
    for case in cases:
        report = first[case.id][1]
        agree = (
            {f.name for f in report.failures} == case.expected_failures()
            and {n.name for n in report.notes} == set(case.noted)
            and not report.errors
        )
        rows.append({
            "id": case.id, "verdict": case.verdict, "agree": agree, "mode": _mode(report),
            "seconds": min(times[case.id]), "seconds_median": statistics.median(times[case.id]),
        })
    best = [row["seconds"] for row in rows]
    moderate = next(c for c in cases if c.id == MODERATE)
    return {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "load_average": [load_at_start, os.getloadavg()[0] if hasattr(os, "getloadavg") else None],
        "torch": torch.__version__,
        "features": torch_ctxext.features(),
        "functions": len(rows),
        "skipped": sorted(c.id for c in CASES if c.missing() is not None),
        "agree": sum(row["agree"] for row in rows),
        "median_s": statistics.median(best),
        "max_s": max(best),
        "max_id": rows[best.index(max(best))]["id"],
        "cold_pass_s": cold,
        "moderate": _moderate(moderate, check_function, torch),
        "rows": rows,
    }


def _moderate(case, check_function, torch):
    """check_function vs gradcheck + gradgradcheck (slow, float64 copies)."""
    def checker():
        check_function(case.function, *case.args(), **case.options)

    def gradchecks():
        args = [a.detach().double().requires_grad_(a.requires_grad) for a in case.args()]
        torch.autograd.gradcheck(case.function.apply, args)
        torch.autograd.gradgradcheck(case.function.apply, args)

    def timed(fn):
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    ours = min(timed(checker) for _ in range(3))
    theirs = timed(gradchecks)  # seconds: once is enough next to milliseconds
    return {"id": case.id, "check_function_s": ours, "gradcheck_slow_s": theirs,
            "ratio": ours / theirs}


def compare(pythons):
    """measure() under each interpreter, one after the other, each in a
    fresh process."""
    return [run_once(python, "bench_check_function.measure") for python in pythons]


def summary_table(results):
    lines = [
        "| torch | Functions | checker agrees with the expert | median per Function | "
        "slowest Function | cold first pass (all Functions) | moderate size: check_function / "
        "gradcheck + gradgradcheck (slow) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        m = r["moderate"]
        lines.append(
            f"| {r['torch']} | {r['functions']} | {r['agree']} of {r['functions']} | "
            f"{r['median_s'] * 1e3:.1f} ms | {r['max_s'] * 1e3:.0f} ms (`{r['max_id']}`) | "
            f"{r['cold_pass_s']:.1f} s | {m['check_function_s'] * 1e3:.0f} ms / "
            f"{m['gradcheck_slow_s']:.2f} s = **{m['ratio']:.3f}** |"
        )
    return "\n".join(lines)


def case_table(results):
    head = "| Function | expected verdict | mode | " + " | ".join(
        f"{r['torch']} (ms)" for r in results) + " |"
    lines = [head, "|---|---|---|" + "---|" * len(results)]
    by_torch = [{row["id"]: row for row in r["rows"]} for r in results]
    for row in results[0]["rows"]:
        cells = [f"{t[row['id']]['seconds'] * 1e3:.1f}" + ("" if t[row["id"]]["agree"] else " ✗")
                 if row["id"] in t else "–" for t in by_torch]
        lines.append(f"| `{row['id']}` | {row['verdict']} | {row['mode']} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)
