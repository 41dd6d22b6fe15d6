"""Where fusing pays on the models people train: advise()'s promise, what fuse(model) avoids, what it saves.

    python benchmarks/run_all.py --from-json FILE --remeasure advise_models --torch-2-15 PY215
                                 [--torch-2-13 PY213] [--quick]

The models of ``examples/transformers_models.py`` (GPT-2, also with two
micro-batches summed, BERT, ALBERT, T5, Llama from ``transformers`` configs
with random weights, and an ``nn.LSTMCell`` unrolled over 32 steps), at the
sizes in the tables, measured as ``bench_advise.py`` measures the project's
own four (its measurements, with this registry of models):

* **promised**: ``advise(model)``'s ``avoidable_bytes`` over one stock step;
  **avoided**: the fused step's own report (``avoided_bytes``);
* **measured**: the bytes the CPU allocator handed out in one backward,
  stock minus ``torch_ctxext.nn.fuse(model)`` (after two warm-up steps);
  the step's peak, stock and fused, against the predicted bound
  (``avoidable_peak_bytes``);
* **time**: a training step of the stock model, of the stock model inside
  ``advise(model)`` (the cost of watching) and of the fused model,
  alternated in each request, both sides (2.13 + torch_ctxext, native 2.15)
  alternating per round; ratios per round, median and range.

Needs ``transformers`` in both interpreters (tools/run.py installs it).
"""
import bench
import bench_advise
from transformers_sizes import SIZES, SIZES_QUICK

PLANS = {
    "full": {"rounds": 8, "repeats": 5, "sizes": SIZES},
    "quick": {"rounds": 2, "repeats": 2, "sizes": SIZES_QUICK},
}
REGISTRY = "transformers_models"
MEASURES = {}  # bench_advise's, with registry=REGISTRY


def collect(python_213=None, python_215=None, quick=False):
    return bench_advise.collect(python_213, python_215, quick, plans=PLANS, registry=REGISTRY, device=False)


def _mib(n):
    return f"{n / 2**20:.3f}"


def table(results):
    """Per model and side: promised, avoided, measured drop (MiB), the peak
    bound and the peak, step times and advise's cost."""
    out = ["| model | side | promised MiB | avoided (fused report) MiB | measured drop MiB | peak bound MiB "
           "| peak stock → fused MiB | step stock / advised / fused ms | advised / stock | fused / stock |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for row in results["rows"]:
        for s in bench_advise.sides(results):
            side = row[s]
            p, m, ms = side["predicted"], side["memory"], side["ms"]
            allocated, _ = bench_advise.drops(side)
            out.append(
                f"| {row['model']} | {bench.SIDE_NAMES[s]} | {_mib(p['avoidable_bytes'])} | "
                f"{_mib(p['fused_avoided_bytes'])} | {_mib(allocated)} | {_mib(p['avoidable_peak_bytes'])} | "
                f"{_mib(m['stock']['peak_bytes'])} → {_mib(m['fused']['peak_bytes'])} | "
                f"{ms['stock']:.1f} / {ms['advised']:.1f} / {ms['fused']:.1f} | "
                f"{bench_advise._ratio(side['advised/stock'])} | {bench_advise._ratio(side['fused/stock'])} |")
    return "\n".join(out)


def summary(results):
    lines = []
    rows = results["rows"]
    for s in bench_advise.sides(results):
        off = max(abs(bench_advise.drops(r[s])[0] - r[s]["predicted"]["avoidable_bytes"]) for r in rows)
        advised = [r[s]["advised/stock"]["ratio"] for r in rows]
        fused = [r[s]["fused/stock"]["ratio"] for r in rows]
        lines.append(
            f"{bench.SIDE_NAMES[s]}: on GPT-2, BERT, ALBERT, T5, Llama and an unrolled LSTMCell the "
            f"backward's allocations drop by advise's promise within {off} B; a step inside advise() "
            f"takes {min(advised):.2f} to {max(advised):.2f} of one without it; fuse(model)'s step "
            f"{min(fused):.2f} to {max(fused):.2f} of the stock modules'")
    return lines


def section(results, figure):
    """The benchmarks page's section (Markdown)."""
    import page_models

    return "\n".join([
        "## Where fusing pays on the models people train",
        "",
        page_models._measured_by(bench_advise, "advise_models", results).replace(
            "bench_advise.py", "bench_advise_models.py"),
        "",
        "Sizes: " + "; ".join(f"{m} " + ", ".join(f"{k} {v}" for k, v in sizes.items())
                             for m, sizes in PLANS["quick" if results["quick"] else "full"]["sizes"].items()),
        "",
        f"![advise()'s promise against fuse(model)'s measured saving, real models]({figure})",
        "",
        "Promised (the stock step's report), avoided (the fused step's report), the backward's "
        "allocations' measured drop, the peak bound and the step's peak, and the step times (ms: "
        "median over rounds of each variant's fastest; ratios: median and range over rounds):",
        "",
        table(results),
        "",
        __doc__.split("\n\n", 2)[2].strip(),
        "",
    ])


if __name__ == "__main__":
    import json
    import sys

    quick = "--quick" in sys.argv
    results = collect(quick=quick)
    print(table(results))
    print("\n".join(summary(results)))
    json.dump(results, sys.stdout if "--json" in sys.argv else open("/dev/null", "w"))
