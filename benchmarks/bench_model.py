"""Training steps of a model that shares a block across depth: fused against unfused.

    python benchmarks/run_all.py --from-json FILE --remeasure model --torch-2-15 PY215
                                 [--torch-2-13 PY213] [--quick]

The model is ``examples/shared_layers.py``'s: a token embedding, one block
(LayerNorm, Linear, GELU, Linear, residual) applied ``depth`` times, and an
output projection tied to the embedding; each of the block's two weights and
two biases is used ``depth`` times inside one backward. Three variants of it,
from the same initial weights on the same batches:

* **fused**: the block's layers are ``examples/fused_linear.py``'s
  ``FusedLinear``; each use after the first adds its gradient into the buffer
  ``ctx.input_grad_buffers`` exposes (``addmm_``) and returns ``None``;
* **unfused**: the same ``FusedLinear`` with ``fuse=False``: the same
  Function, returning every gradient for the engine to add;
* **nn.Linear**: the block built from ``torch.nn.Linear`` (what a user
  replaces).

One training step is ``zero_grad(set_to_none=True)``, forward, cross-entropy,
backward and ``torch.optim.SGD.step()``. Each side (torch 2.13 +
torch_ctxext, native torch 2.15) is a long-lived worker process (bench.py's
``Worker``, one intra-op thread); the same request goes to both, round after
round, alternating which goes first. Within a request the three variants
alternate step by step (rotating the order), each keeping its fastest step;
a ratio is formed per request, and the tables give the median over rounds
(range over rounds in parentheses).

Peak memory: one more step per variant under ``torch.profiler`` with
``profile_memory=True``; the running sum of the CPU allocator's events over
the whole step, its maximum being the step's peak above what was live before
it (parameters, optimizer state: nothing for plain SGD) (bench.py's method).

Loss curves: each side trains each variant for ``loss_steps`` steps from the
same initial weights on the same batches and reports every loss.
"""
import math
import os
import statistics
import sys
import time

import bench

# The model and its FusedLinear are the examples' (imported in the workers).
sys.path.insert(0, os.path.join(bench.ROOT, "examples"))

VARIANTS = ("fused", "unfused", "nn.Linear")
VOCAB = 1000
# (dim, hidden, depth, batch, seq): tokens per step = batch * seq.
GRID = [(256, 1024, 12, 4, 16), (256, 1024, 12, 8, 32), (512, 2048, 6, 1, 16), (512, 2048, 6, 4, 16)]
GRID_QUICK = [(128, 512, 6, 4, 8)]
PLANS = {
    "full": {"rounds": 16, "repeats": 5, "loss_steps": 30, "loss_config": 0, "grid": GRID},
    "quick": {"rounds": 2, "repeats": 2, "loss_steps": 5, "loss_config": 0, "grid": GRID_QUICK},
}


# --------------------------------------------------------------------------
# Measurements: inside a worker process.
# --------------------------------------------------------------------------

_MODELS = {}


def _model(variant, dim, hidden, depth):
    """A fresh model of the variant, from the same initial weights."""
    import torch
    from fused_linear import FusedLinear
    from shared_layers import SharedLayerModel

    linear = {
        "fused": lambda i, o: FusedLinear(i, o),
        "unfused": lambda i, o: FusedLinear(i, o, fuse=False),
        "nn.Linear": torch.nn.Linear,
    }[variant]
    torch.manual_seed(0)
    return SharedLayerModel(VOCAB, dim, hidden, depth, linear=linear)


def _stepper(variant, dim, hidden, depth, batch, seq):
    """(model, step()) for one variant; the model and optimizer are kept
    across requests, the batch is fixed."""
    import torch
    from shared_layers import shifted_token_batch

    config = (dim, hidden, depth, batch, seq)
    if _MODELS.get("config") != config:  # one configuration at a time
        _MODELS.clear()
        _MODELS["config"] = config
    if variant not in _MODELS:
        model = _model(variant, dim, hidden, depth)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        tokens, targets = shifted_token_batch(batch, seq, VOCAB, torch.Generator().manual_seed(0))

        def step(zero_grad=True):
            if zero_grad:
                optimizer.zero_grad(set_to_none=True)
            loss = model.loss(tokens, targets)
            loss.backward()
            optimizer.step()
            return loss

        step.zero_grad = lambda: optimizer.zero_grad(set_to_none=True)
        _MODELS[variant] = step
    return _MODELS[variant]


def measure_model_step(dim, hidden, depth, batch, seq, repeats=3, memory=False):
    """Seconds per training step of each variant (repeats samples each,
    alternated), and (memory=True) each variant's step peak in bytes."""
    fresh = _MODELS.get("config") != (dim, hidden, depth, batch, seq)
    steps = {v: _stepper(v, dim, hidden, depth, batch, seq) for v in VARIANTS}
    if fresh:
        for step in steps.values():  # warm up (first-call allocations)
            step()
    times = {v: [] for v in VARIANTS}
    order = list(VARIANTS)
    for r in range(repeats):
        for v in order:
            start = time.perf_counter()
            steps[v]()
            times[v].append(time.perf_counter() - start)
        order = order[1:] + order[:1]
    result = {"times_s": times}
    if memory:
        result["peak_bytes"] = {v: _step_peak_bytes(steps[v]) for v in VARIANTS}
    return result


def _step_peak_bytes(step):
    """The peak of one training step's allocations (bench.py's method).

    The previous step's gradients are freed before profiling starts: the
    profiler reports the free of a block allocated while an earlier profiler
    session was running with that block's size, and of any other block
    allocated before this session not at all, so a free of a block older than
    the session would make the figure depend on what was profiled before.
    Within the step nothing older is freed (parameters are updated in place,
    the batch is held)."""
    step.zero_grad()
    return bench.backward_peak_bytes(lambda: step(zero_grad=False))["peak_bytes"]


def measure_model_losses(dim, hidden, depth, batch, seq, steps=30):
    """Every loss of ``steps`` SGD steps per variant, from the same initial
    weights on the same batches; and what explain() counted in the fused
    variant's first backward, where torch_ctxext is importable."""
    import torch
    from shared_layers import shifted_token_batch, train

    # The example's own training loop (its vocabulary is the model's, VOCAB).
    curves = {variant: train(_model(variant, dim, hidden, depth), steps,
                             batch=batch, seq=seq, lr=0.05, seed=1)
              for variant in VARIANTS}
    result = {"losses": curves}
    if "torch_ctxext" in sys.modules and sys.modules["torch_ctxext"] is not None:
        import torch_ctxext

        model = _model("fused", dim, hidden, depth)
        tokens, targets = shifted_token_batch(batch, seq, VOCAB, torch.Generator().manual_seed(1))
        with torch_ctxext.explain() as report:
            model.loss(tokens, targets).backward()
        stats = report.functions["FusedLinearFunction"]
        result["explain"] = {"reads": stats.reads, "exposed": stats.exposed,
                             "fell_back": stats.fell_back}
    return result


MEASURES = {"model_step": measure_model_step, "model_losses": measure_model_losses}


# --------------------------------------------------------------------------
# Orchestration.
# --------------------------------------------------------------------------


def _config(row):
    dim, hidden, depth, batch, seq = row
    return {"dim": dim, "hidden": hidden, "depth": depth, "batch": batch, "seq": seq}


def collect(python_213=None, python_215=None, quick=False):
    """Run the model benchmark on both sides; a JSON-able dict."""
    plan = dict(PLANS["quick" if quick else "full"])
    started = time.time()
    results = bench.new_results(plan, quick)
    results["rows"] = []
    pair = [bench.Worker(python_213 or sys.executable, "backport", True, ["bench_model"])]
    if python_215:
        # examples/fused_linear.py is torch_ctxext.nn's FusedLinear: the native
        # side imports torch_ctxext, which patches nothing on torch 2.15.
        pair.append(bench.Worker(python_215, "native", True, ["bench_model"]))
    try:
        results["workers"] = {w.label: w.ready() for w in pair}
        for grid_row in plan["grid"]:
            config = _config(grid_row)
            row = dict(config, tokens=config["batch"] * config["seq"])
            per_round = {w.label: {"fused/unfused": [], "fused/nn.Linear": []} for w in pair}
            fastest = {w.label: {v: [] for v in VARIANTS} for w in pair}
            peaks = {}
            for r in range(plan["rounds"]):
                for w in pair if r % 2 == 0 else pair[::-1]:
                    got = w.call("model_step", repeats=plan["repeats"],
                                 memory=w.label not in peaks, **config)
                    best = {v: min(t) for v, t in got["times_s"].items()}
                    for v in VARIANTS:
                        fastest[w.label][v].append(best[v])
                    per_round[w.label]["fused/unfused"].append(best["fused"] / best["unfused"])
                    per_round[w.label]["fused/nn.Linear"].append(best["fused"] / best["nn.Linear"])
                    peaks.setdefault(w.label, got.get("peak_bytes"))
            for label in per_round:
                side = {f"{v}_ms": statistics.median(fastest[label][v]) * 1e3 for v in VARIANTS}
                for name, ratios in per_round[label].items():
                    side[name] = bench.ratio_stats(ratios)
                    side[name]["min"], side[name]["max"] = min(ratios), max(ratios)
                side["peak_bytes"] = peaks[label]
                side["peak fused/unfused"] = peaks[label]["fused"] / peaks[label]["unfused"]
                side["peak fused/nn.Linear"] = peaks[label]["fused"] / peaks[label]["nn.Linear"]
                row[label] = side
            results["rows"].append(row)
            bench.log(f"model {row} done ({time.time() - started:.0f}s)")
        config = _config(plan["grid"][plan["loss_config"]])
        results["losses"] = {"config": config, "steps": plan["loss_steps"]}
        for w in pair:
            results["losses"][w.label] = w.call("model_losses", steps=plan["loss_steps"], **config)
        bench.log(f"model losses done ({time.time() - started:.0f}s)")
    finally:
        for w in pair:
            w.close()
    results["machine"]["load_average_at_end"] = bench.load_average()
    results["seconds"] = time.time() - started
    results["loss_agreement"] = loss_agreement(results)
    return results


def loss_agreement(results):
    """Largest |loss difference| over the curve: fused vs unfused and vs
    nn.Linear on each side, and fused on one side vs the other."""
    losses = results["losses"]
    sides = [s for s in ("backport", "native") if s in losses]
    out = {}
    for s in sides:
        curves = losses[s]["losses"]
        for other in ("unfused", "nn.Linear"):
            out[f"{s}: fused vs {other}"] = max(
                abs(a - b) for a, b in zip(curves["fused"], curves[other])
            )
    if len(sides) == 2:
        out["fused: backport vs native"] = max(
            abs(a - b) for a, b in zip(losses["backport"]["losses"]["fused"],
                                       losses["native"]["losses"]["fused"])
        )
    return out


# --------------------------------------------------------------------------
# The results as tables.
# --------------------------------------------------------------------------


def _spread(s):
    return f"**{s['ratio']:.3f}** ({s['min']:.3f}–{s['max']:.3f})"


def sides(results):
    return [s for s in ("backport", "native") if s in results["rows"][0]]


def tables(results):
    """Step time and peak memory, as two Markdown tables."""
    ss = sides(results)
    head = "| D | hidden | depth | tokens |" + "".join(
        f" {bench.SIDE_NAMES[s]}: fused / unfused / nn.Linear ms | fused / unfused | fused / nn.Linear |"
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
        f" {bench.SIDE_NAMES[s]}: step peak fused / unfused / nn.Linear MiB | fused / unfused | fused / nn.Linear |"
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
            f"{bench.SIDE_NAMES[s]}: step time fused/unfused {min(t):.2f} to {max(t):.2f}, "
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
