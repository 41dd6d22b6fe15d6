"""Where fusing pays, checked: advise()'s predicted saving against what fuse(model) saves.

    python benchmarks/run_all.py --from-json FILE --remeasure advise --torch-2-15 PY215
                                 [--torch-2-13 PY213] [--quick]

For each model of ``examples/where_fusing_pays.py`` (built with stock
``torch.nn`` modules from a fixed seed; the sizes are in the tables):

* **predicted**: ``torch_ctxext.advise(model)`` over one training step:
  ``avoidable_bytes``, the gradient temporaries the drop-ins would not
  allocate, and ``avoidable_peak_bytes``, the most of them alive at one time;
  "one gradient" is the largest gradient among the tensors it would fuse;
* **measured on the CPU** (exact): the stock model and
  ``torch_ctxext.nn.fuse(model)``, after two warm-up steps, under
  ``torch.profiler`` with ``profile_memory=True`` (bench.py's method): one
  backward, for the bytes of every allocation the CPU allocator made in it;
  and one whole step (forward and backward, the previous gradients freed
  before), for its peak: the maximum of the running sum of its allocations
  and frees, i.e. above what was live before the step (frees of blocks older
  than a profiling session are not reported, so the backward alone would
  miss the release of the forward's activations); the drop of each, stock
  minus fused, and the largest difference between their gradients;
* **measured on the test device** (where ``torch_ctxext_testdevice`` is
  installed; sampled): the same backwards on ``testdevice``, whose allocator
  counts live bytes only (``counters()``): a thread reads them in a loop
  while the backward runs on the engine's device thread, and the peak is the
  largest value read above the value before (a lower bound of the true peak;
  the largest of 3 backwards; not the LSTM: torch's own ``nn.LSTMCell`` calls
  ``_thnn_fused_lstm_cell`` on any device but the CPU, which only CUDA has);
* **time**: a training step (gradients set to None, forward, backward) of
  the stock model, of the stock model inside ``advise(model)``, and of the
  fused model, alternating within each request (each keeps its fastest of
  the repeats); both sides (2.13 + torch_ctxext, native 2.15) alternate per
  round; ratios per round, median and range over rounds.
"""
import os
import statistics
import sys
import time

import bench
import transformers_sizes

sys.path.insert(0, os.path.join(bench.ROOT, "examples"))

SIZES = {
    "albert": {"vocab": 1000, "dim": 256, "hidden": 1024, "depth": 6, "batch": 4, "seq": 16},
    "gpt2": {"vocab": 2000, "context": 64, "dim": 256, "heads": 4, "layers": 2, "batch": 4, "seq": 32},
    "lstm": {"features": 128, "hidden": 256, "steps": 16, "batch": 16},
    "micro-batches": {"features": 512, "hidden": 1024, "classes": 100, "micro": 4, "batch": 16},
}
SIZES_QUICK = {
    "albert": {"vocab": 200, "dim": 64, "hidden": 256, "depth": 4, "batch": 2, "seq": 8},
    "gpt2": {"vocab": 200, "context": 16, "dim": 64, "heads": 2, "layers": 2, "batch": 2, "seq": 8},
    "lstm": {"features": 32, "hidden": 64, "steps": 16, "batch": 4},
    "micro-batches": {"features": 64, "hidden": 128, "classes": 10, "micro": 4, "batch": 8},
}
PLANS = {
    "full": {"rounds": 10, "repeats": 5, "sizes": SIZES},
    "quick": {"rounds": 2, "repeats": 2, "sizes": SIZES_QUICK},
}
VARIANTS = ("stock", "advised", "fused")

# --------------------------------------------------------------------------
# Measurements: inside a worker process.
# --------------------------------------------------------------------------


def _workload(model, sizes, fused, device="cpu", registry="where_fusing_pays"):
    """``registry``: the examples/ module whose MODELS builds ``model``."""
    import importlib

    import torch_ctxext

    workload = importlib.import_module(registry).MODELS[model](**sizes).to(device)
    if fused:
        torch_ctxext.nn.fuse(workload.model)
    return workload


def _prediction(model, sizes, device="cpu", registry="where_fusing_pays"):
    """advise's report of a stock step, and what the fused step's calls avoided."""
    from where_fusing_pays import report_of

    report = report_of(_workload(model, sizes, False, device, registry))
    fusable = [s.grad_bytes for s in report.slots if s.avoidable_bytes]
    fused = report_of(_workload(model, sizes, True, device, registry))
    return {"avoidable_bytes": report.avoidable_bytes, "avoidable_peak_bytes": report.avoidable_peak_bytes,
            "temporary_bytes": report.temporary_bytes, "one_gradient_bytes": max(fusable, default=0),
            "slots": len(report.slots), "fused_avoided_bytes": fused.avoided_bytes,
            "fused_avoidable_bytes": fused.avoidable_bytes}


def _max_difference(a, b):
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def allocations(workload):
    """The bytes the CPU allocator hands out in one backward of the workload,
    and the peak of one whole step above what was live before it, after two
    warm-up steps (first-call allocations, the bias's cached ones)."""
    for _ in range(2):
        workload.model.zero_grad(set_to_none=True)
        workload.loss().backward()
    # The backward alone: every allocation it makes.
    workload.model.zero_grad(set_to_none=True)
    loss = workload.loss()
    backward = bench.backward_peak_bytes(loss.backward)
    # The whole step: the peak, exact (every block freed in it was allocated
    # in it; the last step's gradients are freed before).
    workload.model.zero_grad(set_to_none=True)
    del loss
    step = bench.backward_peak_bytes(lambda: workload.loss().backward())
    return backward["allocated_bytes"], step["peak_bytes"]


def measure_advise_memory(model, sizes, registry="where_fusing_pays"):
    """The prediction, and the stock and fused backwards' allocations on the CPU."""
    result = {"predicted": _prediction(model, sizes, registry=registry), "memory": {}}
    grads = {}
    for variant in ("stock", "fused"):
        workload = _workload(model, sizes, variant == "fused", registry=registry)
        allocated, peak = allocations(workload)
        result["memory"][variant] = {"allocated_bytes": allocated, "peak_bytes": peak}
        grads[variant] = {n: p.grad for n, p in workload.model.named_parameters()}
    result["max_grad_difference"] = _max_difference(grads["stock"], grads["fused"])
    return result


_STEPS = {}


def measure_advise_steps(model, sizes, repeats=3, registry="where_fusing_pays"):
    """Seconds per training step of each variant (alternated, ``repeats`` each)."""
    import torch_ctxext

    if _STEPS.get("config") != (registry, model, sorted(sizes.items())):
        _STEPS.clear()
        _STEPS["config"] = (registry, model, sorted(sizes.items()))
        _STEPS["stock"] = _workload(model, sizes, False, registry=registry)
        _STEPS["fused"] = _workload(model, sizes, True, registry=registry)
    stock, fused = _STEPS["stock"], _STEPS["fused"]

    def step(workload, advised=False):
        workload.model.zero_grad(set_to_none=True)
        if advised:
            with torch_ctxext.advise(workload.model):
                workload.loss().backward()
        else:
            workload.loss().backward()

    runs = {"stock": lambda: step(stock), "advised": lambda: step(stock, True), "fused": lambda: step(fused)}
    for run in runs.values():
        run()  # warm-up
    times = {v: [] for v in VARIANTS}
    order = list(VARIANTS)
    for _ in range(repeats):
        for v in order:
            start = time.perf_counter()
            runs[v]()
            times[v].append(time.perf_counter() - start)
        order = order[1:] + order[:1]
    return {"times_s": times}


MEASURES = {"advise_memory": measure_advise_memory, "advise_steps": measure_advise_steps}


def device_memory():
    """In a fresh process (bench.run_once): the test device registered before
    any backward, then each model's prediction and sampled peaks there."""
    import torch_ctxext_testdevice  # noqa: F401  (before the first backward)

    plan = PLANS["quick" if os.environ.get("TORCH_CTXEXT_BENCH_QUICK") else "full"]
    out = {}
    for model, sizes in plan["sizes"].items():
        if model == "lstm":
            continue  # torch's own cell calls _thnn_fused_lstm_cell there, which only CUDA has
        out[model] = {"predicted": _prediction(model, sizes, "testdevice"), "peak_bytes": {}}
        for variant in ("stock", "fused"):
            workload = _workload(model, sizes, variant == "fused", "testdevice")
            out[model]["peak_bytes"][variant] = max(_sampled_peak(workload) for _ in range(3))
    return out


def _sampled_peak(workload):
    import threading

    import torch_ctxext_testdevice as device

    workload.model.zero_grad(set_to_none=True)
    loss = workload.loss()
    base = device.counters()["live_bytes"]
    seen, done = [base], threading.Event()

    def poll():
        peak, read = base, device.counters
        while not done.is_set():
            peak = max(peak, read()["live_bytes"])
        seen[0] = peak

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # the Python Functions of the backward get the GIL soon
    poller = threading.Thread(target=poll)
    poller.start()
    try:
        loss.backward()
    finally:
        done.set()
        poller.join()
        sys.setswitchinterval(switch)
    return seen[0] - base


# --------------------------------------------------------------------------
# Orchestration.
# --------------------------------------------------------------------------


def _has_test_device(python):
    import subprocess

    code = "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch_ctxext_testdevice') is None)"
    return subprocess.run([python, "-c", code]).returncode == 0


def collect(python_213=None, python_215=None, quick=False, plans=None, registry="where_fusing_pays",
            device=True):
    """Every model on both sides (and the test device); a JSON-able dict.
    ``plans`` and ``registry``: another set of models (bench_advise_models.py)."""
    plan = (plans or PLANS)["quick" if quick else "full"]
    started = time.time()
    results = bench.new_results({k: v for k, v in plan.items() if k != "sizes"}, quick)
    results["rows"] = []
    python_213 = python_213 or sys.executable
    # torch_ctxext is imported on both sides: advise() and the drop-ins are
    # its Python; on torch 2.15 it patches nothing and loads no extension.
    pair = [bench.Worker(python_213, "backport", True, ["bench_advise"])]
    if python_215:
        pair.append(bench.Worker(python_215, "native", True, ["bench_advise"]))
    try:
        results["workers"] = {w.label: w.ready() for w in pair}
        for model, sizes in plan["sizes"].items():
            row = {"model": model, "sizes": sizes}
            for w in pair:
                row[w.label] = w.call("advise_memory", model=model, sizes=sizes, registry=registry)
            ratios = {w.label: {"advised/stock": [], "fused/stock": []} for w in pair}
            fastest = {w.label: {v: [] for v in VARIANTS} for w in pair}
            for r in range(plan["rounds"]):
                for w in pair if r % 2 == 0 else pair[::-1]:
                    got = w.call("advise_steps", model=model, sizes=sizes, repeats=plan["repeats"],
                                 registry=registry)
                    best = {v: min(t) for v, t in got["times_s"].items()}
                    for v in VARIANTS:
                        fastest[w.label][v].append(best[v])
                    ratios[w.label]["advised/stock"].append(best["advised"] / best["stock"])
                    ratios[w.label]["fused/stock"].append(best["fused"] / best["stock"])
            for label, by_name in ratios.items():
                row[label]["ms"] = {v: statistics.median(t) * 1e3 for v, t in fastest[label].items()}
                for name, values in by_name.items():
                    row[label][name] = dict(bench.ratio_stats(values), min=min(values), max=max(values))
            results["rows"].append(row)
            bench.log(f"advise {model} done ({time.time() - started:.0f}s)")
    finally:
        for w in pair:
            w.close()
    if device and _has_test_device(python_213):
        env = dict(os.environ, **({"TORCH_CTXEXT_BENCH_QUICK": "1"} if quick else {}))
        results["device"] = bench.run_once(python_213, "bench_advise.device_memory", env=env)
        bench.log(f"advise on the test device done ({time.time() - started:.0f}s)")
    results["machine"]["load_average_at_end"] = bench.load_average()
    results["seconds"] = time.time() - started
    return results


# --------------------------------------------------------------------------
# The results as tables.
# --------------------------------------------------------------------------


def sides(results):
    return [s for s in ("backport", "native") if s in results["rows"][0]]


def _mib(n):
    return f"{n / 2**20:.3f}"


def drops(side):
    """Measured drops (stock - fused) of a row's side: allocations, peak."""
    m = side["memory"]
    return (m["stock"]["allocated_bytes"] - m["fused"]["allocated_bytes"],
            m["stock"]["peak_bytes"] - m["fused"]["peak_bytes"])


def memory_table(results):
    out = ["| model | side | predicted: avoidable MiB | measured: the backward's allocations drop by MiB "
           "| difference / one gradient | predicted: at most off the peak MiB | measured: the step's peak "
           "drops by MiB (stock → fused) | difference / one gradient | gradients: largest difference |",
           "|---|---|---|---|---|---|---|---|---|"]
    for row in results["rows"]:
        for s in sides(results):
            side = row[s]
            p = side["predicted"]
            one = p["one_gradient_bytes"]
            allocated, peak = drops(side)
            m = side["memory"]
            out.append(
                f"| {row['model']} | {bench.SIDE_NAMES[s]} | {_mib(p['avoidable_bytes'])} | {_mib(allocated)} | "
                f"{(allocated - p['avoidable_bytes']) / one:+.3f} | {_mib(p['avoidable_peak_bytes'])} | "
                f"{_mib(peak)} ({_mib(m['stock']['peak_bytes'])} → {_mib(m['fused']['peak_bytes'])}) | "
                f"{(peak - p['avoidable_peak_bytes']) / one:+.3f} | {side['max_grad_difference']:.2g} |")
    return "\n".join(out)


def time_table(results):
    ss = sides(results)
    out = ["| model |" + "".join(f" {bench.SIDE_NAMES[s]}: stock / advised / fused ms | advised / stock "
                                 "| fused / stock |" for s in ss), "|---|" + "---|---|---|" * len(ss)]
    for row in results["rows"]:
        line = f"| {row['model']} |"
        for s in ss:
            ms = row[s]["ms"]
            line += (f" {ms['stock']:.1f} / {ms['advised']:.1f} / {ms['fused']:.1f} "
                     f"| {_ratio(row[s]['advised/stock'])} | {_ratio(row[s]['fused/stock'])} |")
        out.append(line)
    return "\n".join(out)


def _ratio(s):
    return f"**{s['ratio']:.3f}** ({s['min']:.3f}–{s['max']:.3f})"


def device_table(results):
    out = ["| model | predicted: avoidable MiB | predicted: at most off the peak MiB | sampled peak: "
           "stock → fused MiB | its drop MiB |", "|---|---|---|---|---|"]
    for model, d in results["device"].items():
        peaks, p = d["peak_bytes"], d["predicted"]
        out.append(f"| {model} | {_mib(p['avoidable_bytes'])} | {_mib(p['avoidable_peak_bytes'])} | "
                   f"{_mib(peaks['stock'])} → {_mib(peaks['fused'])} | {_mib(peaks['stock'] - peaks['fused'])} |")
    return "\n".join(out)


def sizes_table(results):
    out = ["| model | sizes |", "|---|---|"]
    for row in results["rows"]:
        out.append(f"| {row['model']} | " + ", ".join(f"{k} {v}" for k, v in row["sizes"].items()) + " |")
    return "\n".join(out)


def summary(results):
    """One line per side: agreement of allocations and peak, cost of advise,
    fused step time."""
    lines = []
    rows = results["rows"]
    for s in sides(results):
        def worst(i, key):
            return max(abs(drops(r[s])[i] - r[s]["predicted"][key]) / r[s]["predicted"]["one_gradient_bytes"]
                       for r in rows)

        advised = [r[s]["advised/stock"]["ratio"] for r in rows]
        fused = [r[s]["fused/stock"]["ratio"] for r in rows]
        lines.append(
            f"{bench.SIDE_NAMES[s]}: fuse(model) lowers the backward's allocations by advise's "
            f"avoidable bytes within {worst(0, 'avoidable_bytes'):.3f} of one gradient and the step's "
            f"peak by its avoidable peak within {worst(1, 'avoidable_peak_bytes'):.3f}, in every model; "
            f"a step inside advise() takes {min(advised):.2f} to {max(advised):.2f} of one without it; "
            f"fuse(model)'s step {min(fused):.2f} to {max(fused):.2f} of the stock modules'")
    return lines


# --------------------------------------------------------------------------
# advise()'s cost: a step watched against the same step unwatched.
# --------------------------------------------------------------------------

COST_DOC = """\
    python benchmarks/bench_advise.py --cost [--quick] [--json FILE]
    python benchmarks/bench_advise.py --cost-table FILE...

In the interpreter that runs it (one torch release per run; torch_ctxext
from this tree), for each model at the benchmark sizes and at a step of 1
to 5 ms (the project's four, the transformers models where ``transformers``
is installed, an unrolled ``nn.GRUCell``, four backwards in one block, a
tied autoencoder, one ``nn.TransformerEncoderLayer`` applied four times):
the training step unwatched, inside ``advise(model)`` with the C++ watch
(torch_ctxext's extension; on 2.15 the build ``python -m torch_ctxext
build`` makes), inside ``advise(model)`` with Python's watch, and the same
model built again and fused by ``fuse(model, step=...)`` (only the modules
a watched step shows receiving more than one gradient), interleaved
(the order rotates each round), each round ``inner`` steps of each (about
0.15 s; 0.05 s with ``--quick``); per round the ratio of process CPU time and
of wall time, watched (or fused) over unwatched; the median over 9 rounds (7 with
``--quick``). ``--cost-table`` puts the runs of several releases side by
side."""

def _gru_cell(features, hidden, steps, batch, seed=0):
    """An nn.GRUCell unrolled over ``steps`` steps, a linear readout."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(seed)

    class Unrolled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = torch.nn.GRUCell(features, hidden)
            self.out = torch.nn.Linear(hidden, 10)

        def forward(self, x):
            h = x.new_zeros(x.shape[1], hidden)
            for t in range(x.shape[0]):
                h = self.cell(x[t], h)
            return self.out(h)

    model, x = Unrolled(), torch.randn(steps, batch, features)
    y = torch.randint(0, 10, (batch,))
    return model, lambda: F.cross_entropy(model(x), y).backward()


def _four_backwards(features, hidden, batch, seed=0):
    """Gradient accumulation: four micro-batches, a backward each, in one block."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.GELU(),
                                torch.nn.Linear(hidden, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, 10))
    batches = [(torch.randn(batch, features), torch.randint(0, 10, (batch,))) for _ in range(4)]

    def step():
        for x, y in batches:
            F.cross_entropy(model(x), y).backward()

    return model, step


def _tied_autoencoder(features, hidden, batch, seed=0):
    """An autoencoder whose decoder is its encoder's weight, transposed."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(seed)

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = torch.nn.Linear(features, hidden)
            self.bias = torch.nn.Parameter(torch.zeros(features))

        def forward(self, x):
            return F.linear(torch.relu(self.encoder(x)), self.encoder.weight.t(), self.bias)

    model, x = Tied(), torch.randn(batch, features)
    return model, lambda: F.mse_loss(model(x), x).backward()


def _shared_encoder_layer(dim, heads, depth, batch, seq, seed=0):
    """One nn.TransformerEncoderLayer (nn.MultiheadAttention inside) applied ``depth`` times."""
    import torch

    torch.manual_seed(seed)

    class Shared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True)

        def forward(self, x):
            for _ in range(depth):
                x = self.layer(x)
            return x

    model, x = Shared(), torch.randn(batch, seq, dim)
    return model, lambda: model(x).pow(2).mean().backward()


COST_MODELS = {"gru-cell": _gru_cell, "4 backwards": _four_backwards, "tied autoencoder": _tied_autoencoder,
               "shared encoder layer": _shared_encoder_layer}
# (registry, model, sizes at the benchmark size, sizes at a step of 1 to 5 ms)
COST_PLAN = [
    *[("where_fusing_pays", m, SIZES[m], small) for m, small in {
        "albert": {"vocab": 1000, "dim": 128, "hidden": 512, "depth": 4, "batch": 2, "seq": 16},
        "gpt2": {"vocab": 1000, "context": 32, "dim": 128, "heads": 4, "layers": 2, "batch": 2, "seq": 16},
        "lstm": {"features": 64, "hidden": 128, "steps": 16, "batch": 8},
        "micro-batches": {"features": 256, "hidden": 512, "classes": 100, "micro": 4, "batch": 8},
    }.items()],
    *[("transformers_models", m, None, small) for m, small in {
        "gpt2": {"vocab": 1000, "dim": 64, "layers": 2, "heads": 2, "batch": 2, "seq": 32},
        "gpt2-micro": {"vocab": 1000, "dim": 64, "layers": 2, "heads": 2, "batch": 1, "seq": 32},
        "bert": {"vocab": 1000, "dim": 64, "layers": 2, "heads": 2, "batch": 2, "seq": 32},
        "albert": {"vocab": 1000, "dim": 64, "layers": 4, "heads": 2, "batch": 2, "seq": 32},
        "t5": {"vocab": 1000, "dim": 64, "layers": 2, "heads": 2, "batch": 2, "seq": 32},
        "llama": {"vocab": 1000, "dim": 64, "layers": 2, "heads": 2, "batch": 2, "seq": 32},
        "lstm-cell": {"features": 32, "hidden": 64, "steps": 32, "batch": 8},
    }.items()],
    (None, "gru-cell", {"features": 128, "hidden": 256, "steps": 32, "batch": 32},
     {"features": 32, "hidden": 64, "steps": 16, "batch": 8}),
    (None, "4 backwards", {"features": 512, "hidden": 1024, "batch": 64},
     {"features": 256, "hidden": 256, "batch": 32}),
    (None, "tied autoencoder", {"features": 1024, "hidden": 512, "batch": 256},
     {"features": 512, "hidden": 256, "batch": 64}),
    (None, "shared encoder layer", {"dim": 256, "heads": 4, "depth": 4, "batch": 4, "seq": 128},
     {"dim": 64, "heads": 2, "depth": 4, "batch": 2, "seq": 32}),
]
COST_VARIANTS = ("stock", "advised", "python", "fused")


def _cost_workload(registry, model, sizes):
    if registry is None:
        return COST_MODELS[model](**sizes)
    workload = _workload(model, sizes, False, registry=registry)
    return workload.model, lambda: workload.loss().backward()


def _interleaved(runs, rounds, target_s):
    """Each of ``runs`` (name -> a step; "stock" among them) warmed up, then
    ``rounds`` rounds of ``inner`` steps of each (about ``target_s`` of the
    stock one), the order rotating each round: (inner, {name: {"cpu": [...],
    "wall": [...]}}), seconds a step per round."""
    for run in runs.values():  # warm-up
        run()
        run()
    start = time.perf_counter()
    runs["stock"]()
    inner = max(1, min(50, round(target_s / max(time.perf_counter() - start, 1e-6))))
    times = {v: {"cpu": [], "wall": []} for v in runs}
    order = list(runs)
    for _ in range(rounds):
        for v in order:
            run = runs[v]
            c, w = time.process_time(), time.perf_counter()
            for _ in range(inner):
                run()
            times[v]["cpu"].append((time.process_time() - c) / inner)
            times[v]["wall"].append((time.perf_counter() - w) / inner)
        order = order[1:] + order[:1]
    return inner, times


def _advised(net, step, python=False):
    """A training step of ``net`` inside ``advise(net)``: with the C++ watch
    where there is one, with Python's where ``python``."""
    import torch_ctxext
    from torch_ctxext._advise import graph

    def run():
        native = graph._native_watch
        if python:
            graph._native_watch = lambda *args: (None, False)
        try:
            net.zero_grad(set_to_none=True)
            with torch_ctxext.advise(net):
                step()
        finally:
            graph._native_watch = native
    return run


def _plan_here():
    """COST_PLAN's entries this interpreter can run (the transformers models
    where ``transformers`` is installed), with one intra-op thread."""
    import importlib.util

    import torch

    torch.set_num_threads(1)
    has_transformers = importlib.util.find_spec("transformers") is not None
    return [entry for entry in COST_PLAN if entry[0] != "transformers_models" or has_transformers]


def measure_advise_cost(registry, model, sizes, rounds=9, target_s=0.15):
    """advise()'s cost on one model (see the comment above): per variant the
    median seconds of a step (CPU, wall), and the medians over rounds of
    the ratios to the unwatched step; ``watch``: which watch "advised" got;
    ``swapped``: how many modules ``fuse(model, step=...)`` swapped in the
    copy built the same way that the "fused" variant steps."""
    import torch

    import torch_ctxext
    import torch_ctxext.nn
    from torch_ctxext._advise import graph

    net, step = _cost_workload(registry, model, sizes)
    # The fused variant: the same model built again (same seed), fused where
    # a watched step says it pays, as a user calls fuse().
    fused_net, fused_step = _cost_workload(registry, model, sizes)
    classes = {name: type(m) for name, m in fused_net.named_modules()}
    torch_ctxext.nn.fuse(fused_net, step=fused_step)
    swapped = sum(type(m) is not classes[name] for name, m in fused_net.named_modules())

    def stock():
        net.zero_grad(set_to_none=True)
        step()

    advised, python = _advised(net, step), _advised(net, step, python=True)

    def fused():
        fused_net.zero_grad(set_to_none=True)
        fused_step()

    runs = {"stock": stock, "advised": advised, "python": python, "fused": fused}
    seen = []
    original = graph.Backward.__init__

    def init(self, *args, **kwargs):  # (a backward without a slot is never finished: asked as it is made)
        original(self, *args, **kwargs)
        seen.append(self.native is not None)

    graph.Backward.__init__ = init
    try:
        advised()
    finally:
        graph.Backward.__init__ = original
    watch = "C++" if seen and all(seen) else "Python"
    inner, times = _interleaved(runs, rounds, target_s)
    out = {"torch": torch.__version__, "watch": watch, "inner": inner, "rounds": rounds, "swapped": swapped,
           "ms": {v: {k: statistics.median(t) * 1e3 for k, t in times[v].items()} for v in COST_VARIANTS}}
    for v in ("advised", "python", "fused"):
        for k in ("cpu", "wall"):
            ratios = [a / b for a, b in zip(times[v][k], times["stock"][k])]
            out[f"{v}/stock {k}"] = statistics.median(ratios)
    return out


def collect_cost(quick=False):
    """Every model of COST_PLAN at both sizes, in this interpreter."""
    import torch

    rows = []
    for registry, model, sizes, small in _plan_here():
        for size, chosen in (("benchmark", sizes), ("1-5 ms", small)):
            if chosen is None:
                chosen = transformers_sizes.SIZES[model]
            got = measure_advise_cost(registry, model, chosen, rounds=7 if quick else 9,
                                      target_s=0.05 if quick else 0.15)
            rows.append({"registry": registry, "model": model, "size": size, "sizes": chosen, **got})
            bench.log(f"advise cost {model} ({size}): {got['ms']['stock']['cpu']:.1f} ms, "
                      f"{got['advised/stock cpu']:.3f} / {got['python/stock cpu']:.3f}, "
                      f"fused {got['fused/stock cpu']:.3f} ({got['swapped']} swapped)")
    return {"torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "load_average": bench.load_average(), "rows": rows}


# --------------------------------------------------------------------------
# What any watch of a step must pay at least: advise()'s cost, taken apart.
# --------------------------------------------------------------------------

FLOOR_DOC = """\
    python benchmarks/bench_advise.py --floor [--quick] [--json FILE]

For each model at its 1-5 ms size, in the interpreter that runs it, the
part of advise()'s cost that no implementation of what its report says can
avoid, against the whole: the step unwatched; the C++ watch alone (each
backward's walk and its hooks on every producer of a slot, made before the
engine runs and closed after it: no Python of advise's); the same and a
frame per module call (a pass-through wrapper of ``_call_impl`` placed on
the model's classes for the step and taken off after, as a block does: the
one way to number a module call's nodes that torch.compile traces); the
step inside ``advise(model)`` with the C++ watch; a walk of the graph in
Python (each node's ``next_functions``, as Python's watch must walk it
where there is no C++ one); the same walk and a Python hook that does
nothing on each producer of a slot (what Python's watch must see: each
gradient a producer returns); the step inside ``advise(model)`` with
Python's watch. Interleaved as ``--cost`` is (the order rotates each
round), process CPU time over the unwatched step's, the median over 9
rounds (7 with ``--quick``)."""

FLOOR_VARIANTS = ("stock", "C++ watch alone", "+ a frame per module call", "advise, C++ watch",
                  "Python walk", "Python walk and no-op hooks", "advise, Python's watch")


def measure_floor(registry, model, sizes, rounds=9, target_s=0.15):
    """FLOOR_DOC's variants on one model: {variant: ratio to the unwatched
    step (CPU, median over rounds)} and the step's ms."""
    import torch

    from torch_ctxext._advise import graph

    net, step = _cost_workload(registry, model, sizes)
    classes = {type(m) for m in net.modules()}
    call_impl = torch.nn.Module._call_impl

    def frame(self, *args, **kwargs):  # the least a wrapper of _call_impl runs
        return call_impl(self, *args, **kwargs)

    def noop(*args):
        return None

    def python_walk(roots, hooks):
        seen, stack, fed = set(), [r.grad_fn for r in roots if r.grad_fn is not None], {}
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            for following, nr in node.next_functions:
                if following is not None:
                    fed.setdefault((following, nr), []).append(node)
                    stack.append(following)
        if not hooks:
            return []
        return [p.register_hook(noop) for producers in fed.values() if len(producers) > 1 for p in producers]

    engine = {"graph": torch.autograd.graph._engine_run_backward,
              "here": torch.autograd.__dict__.get("_engine_run_backward")}
    mode = [None]

    def run_backward(t_outputs, *args, **kwargs):
        run = engine["graph"]
        if mode[0] == "cpp":
            watch, _ = graph._native_watch(t_outputs, (), args[0] if args else kwargs.get("grad_tensors"))
            watch.walked()
            try:
                return run(t_outputs, *args, **kwargs)
            finally:
                watch.close()
        if mode[0] in ("walk", "hooks"):
            handles = python_walk(t_outputs, mode[0] == "hooks")
            try:
                return run(t_outputs, *args, **kwargs)
            finally:
                for handle in handles:
                    handle.remove()
        return run(t_outputs, *args, **kwargs)

    def unwatched(watch=None, frames=False):
        def run():
            net.zero_grad(set_to_none=True)
            mode[0] = watch
            torch.autograd.graph._engine_run_backward = torch.autograd._engine_run_backward = run_backward
            if frames:
                for cls in classes:
                    cls._call_impl = frame
            try:
                step()
            finally:
                if frames:
                    for cls in classes:
                        del cls._call_impl
                torch.autograd.graph._engine_run_backward = engine["graph"]
                torch.autograd._engine_run_backward = engine["here"]
        return run

    runs = dict(zip(FLOOR_VARIANTS, (unwatched(), unwatched("cpp"), unwatched("cpp", frames=True),
                                     _advised(net, step), unwatched("walk"), unwatched("hooks"),
                                     _advised(net, step, python=True))))
    if graph._native_watch((), (), None)[0] is None:  # no C++ watch here: its rows are not measured
        for name in FLOOR_VARIANTS[1:4]:
            del runs[name]
    _, times = _interleaved(runs, rounds, target_s)
    return {"ms": statistics.median(times["stock"]["cpu"]) * 1e3,
            "ratios": {v: statistics.median([a / b for a, b in zip(times[v]["cpu"], times["stock"]["cpu"])])
                       for v in runs if v != "stock"}}


def collect_floor(quick=False):
    """Every model of COST_PLAN at its 1-5 ms size, in this interpreter."""
    import torch

    rows = []
    for registry, model, _, small in _plan_here():
        got = measure_floor(registry, model, small, rounds=7 if quick else 9, target_s=0.05 if quick else 0.15)
        rows.append({"registry": registry, "model": model, "sizes": small, **got})
        bench.log(f"advise floor {model}: {got['ms']:.1f} ms, "
                  + ", ".join(f"{v} {r:.3f}" for v, r in got["ratios"].items()))
    return {"torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "load_average": bench.load_average(), "rows": rows}


def floor_table(run):
    """Markdown: per model, the step and each FLOOR_VARIANTS ratio."""
    out = ["| model | step ms (CPU) |" + "".join(f" {v} |" for v in FLOOR_VARIANTS[1:]),
           "|---|---|" + "---|" * (len(FLOOR_VARIANTS) - 1)]
    for row in run["rows"]:
        name = row["model"] if row["registry"] != "transformers_models" else f"{row['model']} (transformers)"
        out.append(f"| {name} | {row['ms']:.2f} |" + "".join(
            f" {row['ratios'][v]:.3f} |" if v in row["ratios"] else " — |" for v in FLOOR_VARIANTS[1:]))
    return "\n".join(out)


def floor_section(run):
    """The benchmarks page's part on what any watch must pay (Markdown);
    ``run``: collect_floor's result (docs/benchmarks.json's ``advise_floor``)."""
    return "\n".join([
        "### What any watch of the step must pay",
        "",
        f"Measured by `benchmarks/bench_advise.py --floor` ({run.get('label', run['torch'])}, {run['date']}, "
        f"load average {run['load_average'][0]:.1f}). Each over the unwatched step, process CPU time, median "
        "over rounds, at the 1-5 ms sizes:",
        "",
        floor_table(run),
        "",
        *([run["note"], ""] if run.get("note") else []),
        FLOOR_DOC.split("\n\n", 1)[1],
        "",
    ])


def cost_table(runs):
    """Markdown: per model and size, each release's step and advise's cost
    (C++ watch, Python's watch), CPU time and wall time; and, for the runs
    that measured it, the model fused (``fuse(model, step=...)``) against
    stock."""
    with_fused = [any("fused/stock cpu" in row for row in r["rows"]) for r in runs]
    head = "| model | size |" + "".join(
        f" {r.get('label', r['torch'])}: step ms (CPU) | C++ watch: CPU / wall | Python's watch: CPU / wall |"
        + (" fused / stock: CPU / wall (modules swapped) |" if fused else "")
        for r, fused in zip(runs, with_fused))
    out = [head, "|---|---|" + "".join("---|---|---|" + ("---|" if fused else "") for fused in with_fused)]
    keys = []
    for r in runs:
        for row in r["rows"]:
            key = (row["registry"], row["model"], row["size"])
            if key not in keys:
                keys.append(key)
    for registry, model, size in keys:
        name = model if registry != "transformers_models" else f"{model} (transformers)"
        line = f"| {name} | {size} |"
        for r, fused in zip(runs, with_fused):
            row = next((x for x in r["rows"] if (x["registry"], x["model"], x["size"]) == (registry, model, size)),
                       None)
            if row is None:
                line += " — | — | — |" + (" — |" if fused else "")
                continue
            cpp = (f"{row['advised/stock cpu']:.3f} / {row['advised/stock wall']:.3f}" if row["watch"] == "C++"
                   else "no C++ watch")
            line += (f" {row['ms']['stock']['cpu']:.2f} | {cpp} | "
                     f"{row['python/stock cpu']:.3f} / {row['python/stock wall']:.3f} |")
            if fused:
                line += (f" {row['fused/stock cpu']:.3f} / {row['fused/stock wall']:.3f} ({row['swapped']}) |"
                         if "fused/stock cpu" in row else " — |")
        out.append(line)
    return "\n".join(out)


def cost_section(runs):
    """The benchmarks page's section on advise()'s cost (Markdown); ``runs``:
    collect_cost's results, one per release (docs/benchmarks.json's
    ``advise_cost``)."""
    how = COST_DOC.split("\n\n", 1)[1]
    return "\n".join([
        "## advise()'s cost: a step watched against the same step unwatched",
        "",
        "Measured by `benchmarks/bench_advise.py --cost` (one run per release: "
        + "; ".join(f"{r.get('label', r['torch'])} {r['date']}, load average {r['load_average'][0]:.1f}"
                    for r in runs) + "). "
        + "Watched over unwatched, process CPU time / wall time, median over rounds; "
        "step ms: the unwatched step's CPU time (1 intra-op thread):",
        "",
        cost_table(runs),
        "",
        # what a run adds in words (its "note": instruction counts, a floor)
        *[line for r in runs if r.get("note") for line in (f"{r.get('label', r['torch'])}: {r['note']}", "")],
        how,
        "",
    ])


if __name__ == "__main__":
    import json

    if "--cost-table" in sys.argv:
        files = sys.argv[sys.argv.index("--cost-table") + 1:]
        print(cost_table([json.load(open(f)) for f in files]))
    elif "--floor" in sys.argv or "--cost" in sys.argv:
        sys.path.insert(0, os.path.join(bench.ROOT, "examples"))
        floor = "--floor" in sys.argv
        results = (collect_floor if floor else collect_cost)(quick="--quick" in sys.argv)
        if "--json" in sys.argv:
            with open(sys.argv[sys.argv.index("--json") + 1], "w") as f:
                json.dump(results, f, indent=1)
        print(floor_table(results) if floor else cost_table([results]))
