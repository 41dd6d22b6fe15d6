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

Needs ``transformers`` in both interpreters (tools/run.sh installs it).
"""
import bench
import bench_advise

# Sizes at which the step's work is a real job's shape (hundreds of tokens
# per step, 256-wide), on one CPU thread.
SIZES = {
    "gpt2": {"vocab": 4000, "dim": 256, "layers": 2, "heads": 4, "batch": 4, "seq": 128},
    "gpt2-micro": {"vocab": 4000, "dim": 256, "layers": 2, "heads": 4, "batch": 2, "seq": 128},
    "bert": {"vocab": 4000, "dim": 256, "layers": 2, "heads": 4, "batch": 4, "seq": 128},
    "albert": {"vocab": 4000, "dim": 256, "layers": 4, "heads": 4, "batch": 4, "seq": 128},
    "t5": {"vocab": 4000, "dim": 256, "layers": 2, "heads": 4, "batch": 4, "seq": 128},
    "llama": {"vocab": 4000, "dim": 256, "layers": 2, "heads": 4, "batch": 4, "seq": 128},
    "lstm-cell": {"features": 128, "hidden": 256, "steps": 32, "batch": 32},
}
SIZES_QUICK = {
    "gpt2": {"vocab": 256, "dim": 64, "layers": 2, "heads": 2, "batch": 2, "seq": 16},
    "gpt2-micro": {"vocab": 256, "dim": 64, "layers": 2, "heads": 2, "batch": 2, "seq": 16},
    "bert": {"vocab": 256, "dim": 64, "layers": 2, "heads": 2, "batch": 2, "seq": 16},
    "albert": {"vocab": 256, "dim": 64, "layers": 2, "heads": 2, "batch": 2, "seq": 16},
    "t5": {"vocab": 256, "dim": 64, "layers": 2, "heads": 2, "batch": 2, "seq": 16},
    "llama": {"vocab": 256, "dim": 64, "layers": 2, "heads": 2, "batch": 2, "seq": 16},
    "lstm-cell": {"features": 32, "hidden": 64, "steps": 32, "batch": 4},
}
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


def plot(results, path, plt, colors, side_names):
    """Predicted (the stock report's promise) against measured (the
    allocations' drop) per model and side, on the diagonal where they agree;
    and the step time ratios (advise's cost, the fused step)."""
    rows = results["rows"]
    ss = bench_advise.sides(results)
    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(12, 4.4), gridspec_kw={"width_ratios": [1, 1.3]})
    top = 0
    for s, marker in zip(ss, ("o", "x")):
        xs = [r[s]["predicted"]["avoidable_bytes"] / 2**20 for r in rows]
        ys = [bench_advise.drops(r[s])[0] / 2**20 for r in rows]
        top = max([top, *xs, *ys])
        ax_mem.scatter(xs, ys, marker=marker, color=colors[s], label=side_names[s], zorder=3)
        if s == ss[0]:
            for x, y, r in zip(xs, ys, rows):
                ax_mem.annotate(r["model"], (x, y), fontsize=7, xytext=(4, -10), textcoords="offset points")
    ax_mem.plot([0, top * 1.05], [0, top * 1.05], color="black", lw=0.8, label="measured = predicted")
    ax_mem.set_xlabel("predicted: advise's avoidable MiB (stock step)")
    ax_mem.set_ylabel("measured: the backward's allocations drop, MiB")
    ax_mem.set_title("fuse(model) on the real models: predicted against measured", fontsize=9)
    ax_mem.legend(fontsize=7)
    keys = [(s, k) for s in ss for k in ("advised/stock", "fused/stock")]
    width = 0.8 / len(keys)
    for i, (s, k) in enumerate(keys):
        xs = [j + (i - (len(keys) - 1) / 2) * width for j in range(len(rows))]
        vals = [r[s][k]["ratio"] for r in rows]
        err = [[v - min(r[s][k]["min"], v) for v, r in zip(vals, rows)],
               [max(r[s][k]["max"], v) - v for v, r in zip(vals, rows)]]
        ax_time.bar(xs, vals, width, yerr=err, capsize=2, color=colors[s],
                    alpha=1.0 if k == "fused/stock" else 0.45, label=f"{side_names[s]}: {k}")
    ax_time.axhline(1.0, color="black", lw=0.8)
    ax_time.axhline(1.05, color="grey", lw=0.8, ls="--")
    ax_time.set_xticks(range(len(rows)))
    ax_time.set_xticklabels([r["model"] for r in rows], fontsize=8)
    ax_time.set_ylabel("training step time ratio")
    ax_time.set_title("Step time inside advise() and fused, over stock (bars: range; dashed: 1.05)",
                      fontsize=9)
    ax_time.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


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
