"""The benchmarks page's figures, drawn from the raw results with matplotlib.

benchmarks/page.py writes them beside docs/benchmarks.md (draw()); the
interpreter that runs benchmarks/run_all.py needs matplotlib (the docs
environment has it).
"""
import os
import sys

import bench_advise
import bench_model
from bench import SIDE_NAMES

IMG = "img"
FIGURES = {
    "overhead": "bench_overhead.png",
    "time": "bench_fused_time.png",
    "memory": "bench_fused_memory.png",
    "model": "bench_model.png",
    "advise": "bench_advise.png",
    "advise_models": "bench_advise_models.png",
}
COLORS = {"backport": "#1f77b4", "native": "#ff7f0e"}


def pyplot():
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
        ax.bar(xs, vals, width, label=SIDE_NAMES[side], color=COLORS[side], **kwargs)
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


def _model_label(row):
    return f"D {row['dim']}, H {row['hidden']}\ndepth {row['depth']}\n{row['tokens']} tokens"


def plot_model(results, path, plt):
    """Step-time ratios, peak ratios and the loss curves, in one figure."""
    ss = bench_model.sides(results)
    rows = results["rows"]
    fig, (ax_time, ax_mem, ax_loss) = plt.subplots(
        1, 3, figsize=(13, 3.9), gridspec_kw={"width_ratios": [1.4, 1, 1.1]}
    )
    bars = [(s, k) for s in ss for k in ("fused/unfused", "fused/nn.Linear")]
    width = 0.8 / len(bars)
    for i, (s, k) in enumerate(bars):
        xs = [j + (i - (len(bars) - 1) / 2) * width for j in range(len(rows))]
        vals = [row[s][k]["ratio"] for row in rows]
        err = [[v - min(row[s][k]["min"], v) for v, row in zip(vals, rows)],
               [max(row[s][k]["max"], v) - v for v, row in zip(vals, rows)]]
        ax_time.bar(xs, vals, width, yerr=err, capsize=2, color=COLORS[s],
                    alpha=1.0 if k == "fused/unfused" else 0.45,
                    label=f"{SIDE_NAMES[s]}: {k}")
    ax_time.axhline(1.0, color="black", lw=0.8)
    ax_time.set_xticks(range(len(rows)))
    ax_time.set_xticklabels([_model_label(r) for r in rows], fontsize=6.5)
    ax_time.set_ylabel("training step time ratio")
    ax_time.set_title("Step time (median over rounds; bars: range)", fontsize=9)
    ax_time.legend(fontsize=6.5, loc="lower left")
    bars = [(s, k) for s in ss for k in ("peak fused/unfused", "peak fused/nn.Linear")]
    width = 0.8 / len(bars)
    for i, (s, k) in enumerate(bars):
        xs = [j + (i - (len(bars) - 1) / 2) * width for j in range(len(rows))]
        ax_mem.bar(xs, [row[s][k] for row in rows], width, color=COLORS[s],
                   alpha=1.0 if k == "peak fused/unfused" else 0.45,
                   label=f"{SIDE_NAMES[s]}: {k.removeprefix('peak ')}")
    ax_mem.axhline(1.0, color="black", lw=0.8)
    ax_mem.set_ylim(0, 1.2)
    ax_mem.set_xticks(range(len(rows)))
    ax_mem.set_xticklabels([_model_label(r) for r in rows], fontsize=6.5)
    ax_mem.set_ylabel("training step peak ratio")
    ax_mem.set_title("Peak memory of a step (allocator)", fontsize=9)
    ax_mem.legend(fontsize=6.5, loc="lower left")
    losses = results["losses"]
    styles = {"fused": ("-", 2.5), "unfused": ("--", 1.5), "nn.Linear": (":", 1.5)}
    for s in ss:
        for v, (ls, lw) in styles.items():
            curve = losses[s]["losses"][v]
            ax_loss.plot(range(1, len(curve) + 1), curve, ls=ls, lw=lw, color=COLORS[s],
                         alpha=0.6 if v == "fused" else 1.0, label=f"{SIDE_NAMES[s]}: {v}")
    c = losses["config"]
    ax_loss.set_title(f"Loss curves (D {c['dim']}, depth {c['depth']}, "
                      f"{c['batch'] * c['seq']} tokens):\nall six coincide", fontsize=9)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss")
    ax_loss.legend(fontsize=6.5)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def _step_ratio_bars(ax_time, rows, ss):
    """Per model and side: advised/stock and fused/stock (bars: the range over rounds)."""
    keys = [(s, k) for s in ss for k in ("advised/stock", "fused/stock")]
    width = 0.8 / len(keys)
    for i, (s, k) in enumerate(keys):
        xs = [j + (i - (len(keys) - 1) / 2) * width for j in range(len(rows))]
        vals = [r[s][k]["ratio"] for r in rows]
        err = [[v - min(r[s][k]["min"], v) for v, r in zip(vals, rows)],
               [max(r[s][k]["max"], v) - v for v, r in zip(vals, rows)]]
        ax_time.bar(xs, vals, width, yerr=err, capsize=2, color=COLORS[s],
                    alpha=1.0 if k == "fused/stock" else 0.45, label=f"{SIDE_NAMES[s]}: {k}")
    ax_time.axhline(1.0, color="black", lw=0.8)
    ax_time.set_xticks(range(len(rows)))
    ax_time.set_xticklabels([r["model"] for r in rows])


def plot_advise(results, path, plt):
    """Per model: predicted against measured saving (allocations, peak), and
    the step time ratios (advise's cost, fuse's step)."""
    rows = results["rows"]
    ss = bench_advise.sides(results)
    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [1.5, 1]})
    bars = [("predicted: avoidable", lambda r, s: r[s]["predicted"]["avoidable_bytes"], "#9ecae1", None),
            ("measured: allocations' drop", lambda r, s: bench_advise.drops(r[s])[0], "#1f77b4", None),
            ("predicted: at most off the peak", lambda r, s: r[s]["predicted"]["avoidable_peak_bytes"],
             "#fdd0a2", None),
            ("measured: peak's drop", lambda r, s: bench_advise.drops(r[s])[1], "#ff7f0e", None)]
    side = ss[0]
    width = 0.8 / len(bars)
    for i, (label, value, color, _) in enumerate(bars):
        xs = [j + (i - (len(bars) - 1) / 2) * width for j in range(len(rows))]
        ax_mem.bar(xs, [value(r, side) / 2**20 for r in rows], width, color=color, label=label)
    for j, r in enumerate(rows):
        one = r[side]["predicted"]["one_gradient_bytes"] / 2**20
        for k, key in ((0, "avoidable_bytes"), (2, "avoidable_peak_bytes")):
            x = j + (k - (len(bars) - 1) / 2) * width
            ax_mem.errorbar(x, r[side]["predicted"][key] / 2**20, yerr=one, color="black", capsize=3, lw=1)
    ax_mem.set_xticks(range(len(rows)))
    ax_mem.set_xticklabels([r["model"] for r in rows])
    ax_mem.set_ylabel("MiB saved by fuse(model), one backward")
    ax_mem.set_title(f"{SIDE_NAMES[side]}: predicted (error bar: ± one gradient) against measured",
                     fontsize=9)
    ax_mem.legend(fontsize=7)
    _step_ratio_bars(ax_time, rows, ss)
    ax_time.set_ylabel("training step time ratio")
    ax_time.set_title("Step time: inside advise() and fused, over stock (bars: range)", fontsize=9)
    ax_time.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def plot_advise_models(results, path, plt):
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
        ax_mem.scatter(xs, ys, marker=marker, color=COLORS[s], label=SIDE_NAMES[s], zorder=3)
        if s == ss[0]:
            for x, y, r in zip(xs, ys, rows):
                ax_mem.annotate(r["model"], (x, y), fontsize=7, xytext=(4, -10), textcoords="offset points")
    ax_mem.plot([0, top * 1.05], [0, top * 1.05], color="black", lw=0.8, label="measured = predicted")
    ax_mem.set_xlabel("predicted: advise's avoidable MiB (stock step)")
    ax_mem.set_ylabel("measured: the backward's allocations drop, MiB")
    ax_mem.set_title("fuse(model) on the real models: predicted against measured", fontsize=9)
    ax_mem.legend(fontsize=7)
    _step_ratio_bars(ax_time, rows, ss)
    ax_time.axhline(1.05, color="grey", lw=0.8, ls="--")
    ax_time.set_ylabel("training step time ratio")
    ax_time.set_title("Step time inside advise() and fused, over stock (bars: range; dashed: 1.05)",
                      fontsize=9)
    ax_time.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def draw(results, out):
    """Every figure the results have data for, into OUT/img/."""
    plt = pyplot()
    os.makedirs(os.path.join(out, IMG), exist_ok=True)
    plot_overhead(results, os.path.join(out, IMG, FIGURES["overhead"]), plt)
    plot_fused_time(results, os.path.join(out, IMG, FIGURES["time"]), plt)
    plot_fused_memory(results, os.path.join(out, IMG, FIGURES["memory"]), plt)
    if "model" in results:
        plot_model(results["model"], os.path.join(out, IMG, FIGURES["model"]), plt)
    if "advise" in results:
        plot_advise(results["advise"], os.path.join(out, IMG, FIGURES["advise"]), plt)
    if "advise_models" in results:
        plot_advise_models(results["advise_models"], os.path.join(out, IMG, FIGURES["advise_models"]), plt)
