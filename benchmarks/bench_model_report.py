"""The shared-layer model benchmark on the page: tables, summary, figure, section.

Presentation only, of what ``bench_model.collect`` measured (also from the raw
results of an earlier run): ``benchmarks/run_all.py`` draws the figure and
writes the section of docs/benchmarks.md with it; ``bench_model.py`` prints
the tables.
"""
import math

import bench
import bench_model

SIDE_NAMES = bench.SIDE_NAMES


def _spread(s):
    return f"**{s['ratio']:.3f}** ({s['min']:.3f}–{s['max']:.3f})"


def sides(results):
    return [s for s in ("backport", "native") if s in results["rows"][0]]


def tables(results):
    """Step time and peak memory, as two Markdown tables."""
    ss = sides(results)
    head = "| D | hidden | depth | tokens |" + "".join(
        f" {SIDE_NAMES[s]}: fused / unfused / nn.Linear ms | fused / unfused | fused / nn.Linear |"
        for s in ss
    )
    out = [head, "|---|---|---|---|" + "---|---|---|" * len(ss)]
    for row in results["rows"]:
        line = f"| {row['dim']} | {row['hidden']} | {row['depth']} | {row['tokens']} |"
        for s in ss:
            r = row[s]
            line += (
                f" {r['fused_ms']:.1f} / {r['unfused_ms']:.1f} / {r['nn.Linear_ms']:.1f} "
                f"| {_spread(r['fused/unfused'])} | {_spread(r['fused/nn.Linear'])} |"
            )
        out.append(line)
    mem = ["| D | hidden | depth | tokens | one gradient of fc1.weight MiB |" + "".join(
        f" {SIDE_NAMES[s]}: step peak fused / unfused / nn.Linear MiB | fused / unfused | fused / nn.Linear |"
        for s in ss
    ), "|---|---|---|---|---|" + "---|---|---|" * len(ss)]
    for row in results["rows"]:
        line = (f"| {row['dim']} | {row['hidden']} | {row['depth']} | {row['tokens']} "
                f"| {row['dim'] * row['hidden'] * 4 / 2**20:.2f} |")
        for s in ss:
            p = row[s]["peak_bytes"]
            line += (
                f" {p['fused'] / 2**20:.2f} / {p['unfused'] / 2**20:.2f} / {p['nn.Linear'] / 2**20:.2f} "
                f"| **{row[s]['peak fused/unfused']:.3f}** | **{row[s]['peak fused/nn.Linear']:.3f}** |"
            )
        mem.append(line)
    return "\n".join(out) + "\n\n" + "\n".join(mem)


def loss_table(results):
    agreement = results["loss_agreement"]
    out = ["| compared | largest difference of a loss over the curve |", "|---|---|"]
    for name, diff in agreement.items():
        out.append(f"| {name} | {diff:.3g} |")
    return "\n".join(out)


def summary(results):
    """One line per side: the ratio range over the grid."""
    lines = []
    for s in sides(results):
        t = [row[s]["fused/unfused"]["ratio"] for row in results["rows"]]
        n = [row[s]["fused/nn.Linear"]["ratio"] for row in results["rows"]]
        p = [row[s]["peak fused/unfused"] for row in results["rows"]]
        lines.append(
            f"{SIDE_NAMES[s]}: step time fused/unfused {min(t):.2f} to {max(t):.2f}, "
            f"fused/nn.Linear {min(n):.2f} to {max(n):.2f}; step peak fused/unfused "
            f"{min(p):.3f} to {max(p):.3f}"
        )
    if len(sides(results)) == 2:
        rel = [row["backport"]["fused/unfused"]["ratio"] / row["native"]["fused/unfused"]["ratio"]
               for row in results["rows"]]
        geomean = math.exp(sum(math.log(r) for r in rel) / len(rel))
        lines.append(
            "step time fused/unfused on 2.13 + torch_ctxext over the same on native 2.15, "
            f"geometric mean over the grid: {geomean:.2f} (1.00 = the same speed-up)"
        )
    return lines


COLORS = {"backport": "#1f77b4", "native": "#ff7f0e"}


def _label(row):
    return f"D {row['dim']}, H {row['hidden']}\ndepth {row['depth']}\n{row['tokens']} tokens"


def plot(results, path, plt):
    """Step-time ratios, peak ratios and the loss curves, in one figure."""
    ss = sides(results)
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
    ax_time.set_xticklabels([_label(r) for r in rows], fontsize=6.5)
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
    ax_mem.set_xticklabels([_label(r) for r in rows], fontsize=6.5)
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


def _versions(results):
    w = results["workers"]
    out = []
    if "backport" in w:
        b = w["backport"]
        out.append(f"torch {b['torch']} + torch_ctxext {b.get('torch_ctxext', '?')}")
    if "native" in w:
        out.append(f"native torch {w['native']['torch']} (torch_ctxext not imported)")
    return "; ".join(out)


def page_section(results, figure):
    """The benchmarks page's section on this benchmark (Markdown)."""
    m = results["machine"]
    la0, la1 = m.get("load_average_at_start"), m.get("load_average_at_end")
    load = f"{la0[0]:.2f} / {la1[0]:.2f}" if la0 and la1 else "unknown"
    lines = [
        "## A model that shows the gain: one block shared across depth",
        "",
        "Measured by `benchmarks/bench_model.py` (`python benchmarks/run_all.py --from-json docs/benchmarks.json --remeasure model "
        "--torch-2-15 PYTHON_OF_TORCH_2.15`"
        + (" --quick" if results["quick"] else "")
        + f"; its own run: {results['date']}, {results['seconds']:.0f} s, checkout "
        f"{m.get('git_commit', '?')}, load average at start / end {load}; {_versions(results)}; "
        "1 intra-op thread per worker).",
        "",
        f"![Training step of the shared-layer model, fused / unfused]({figure})",
        "",
        "Training step time (ms: median over rounds of each variant's fastest step) and the "
        "ratios (median over rounds, range over rounds); lower is better:",
        "",
        tables(results).split("\n\n")[0],
        "",
        "Peak of a whole training step above what was live before it (allocator events):",
        "",
        tables(results).split("\n\n")[1],
        "",
        f"Loss curves ({results['losses']['steps']} SGD steps, lr 0.05, same initial weights and "
        "batches; the largest difference between two curves):",
        "",
        loss_table(results),
        "",
    ]
    explained = results["losses"].get("backport", {}).get("explain")
    if explained:
        depth = results["losses"]["config"]["depth"]
        lines += [
            f"`torch_ctxext.explain()` over one fused backward (depth {depth}): "
            f"{explained['reads']} reads of `ctx.input_grad_buffers`, {explained['exposed']} "
            f"buffers exposed (weight and bias of fc1 and fc2 at {depth - 1} of their {depth} "
            f"uses); {explained['fell_back']} tensor entries were None (each Linear's input, "
            "used once, and each weight and bias at the use that runs backward first: no "
            "earlier producer).",
            "",
        ]
    lines += [
        "How it is measured (from `benchmarks/bench_model.py`):",
        "",
        bench_model.__doc__.split("\n\n", 2)[2].strip(),
        "",
    ]
    return "\n".join(lines)
