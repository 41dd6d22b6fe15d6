"""Fused gradient accumulation: a weight shared by N micro-batches.

    python benchmarks/run_all.py --torch-2-15 PY215 ...     (with every benchmark)

Backward with ``addmm_`` into the exposed weight buffer vs returning
``x.t() @ g``; backward time ratio fused/unfused, and the peak of the
backward's allocations from the allocator (benchmarks/bench.py's
backward_peak_bytes, started after the forward), for every B, D, N of the
grid; torch 2.13 + torch_ctxext and native torch 2.15 side by side.

Nothing allocated before the backward is freed during it (inputs, weight,
output gradients are all held by the benchmark), so the peak is the
backward's peak above its starting point.
"""
import statistics
import time

from bench import SIDE_NAMES, backward_peak_bytes

# The full grid (B, D, N), and the smaller one of --quick.
FUSED_GRID = [(b, d, n) for d in (512, 1024) for n in (2, 8) for b in (16, 64, 256)]
FUSED_GRID_QUICK = [(16, 512, 2), (256, 512, 8), (64, 1024, 8)]
PLANS = {
    "full": {"fused_rounds": 6, "fused_repeats": 5, "grid": FUSED_GRID},
    "quick": {"fused_rounds": 2, "fused_repeats": 3, "grid": FUSED_GRID_QUICK},
}


# --------------------------------------------------------------------------
# Measurements: inside a worker process.
# --------------------------------------------------------------------------


def _linear_functions():
    import torch

    def linear_forward(ctx, x, w):  # the same in both
        ctx.save_for_backward(x, w)
        return x @ w

    class FusedLinear(torch.autograd.Function):
        forward = staticmethod(linear_forward)

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            _, w_buffer = ctx.input_grad_buffers
            if w_buffer is not None:
                w_buffer.addmm_(x.t(), g)
                return None, None
            return None, x.t() @ g

    class Linear(torch.autograd.Function):
        forward = staticmethod(linear_forward)

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return None, x.t() @ g

    return {"fused": FusedLinear, "unfused": Linear}


def measure_fused(batch, dim, micro, repeats=15, memory=True, seed=0):
    """Backward times (s) of the fused and unfused variants, alternated
    within this process, and (memory=True) their backward peaks."""
    import torch

    functions = _linear_functions()
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(dim, dim, generator=gen).requires_grad_()
    xs = [torch.randn(batch, dim, generator=gen) for _ in range(micro)]
    # Dense output gradients, held by the benchmark for the whole run.
    gs = [torch.randn(batch, dim, generator=gen) for _ in range(micro)]

    def prepare(variant):
        fn = functions[variant]
        ys = [fn.apply(x, w) for x in xs]
        w.grad = None

        def run():
            torch.autograd.backward(ys, gs)

        return run

    reference = {}
    for variant in ("unfused", "fused"):  # warm up, and check they agree
        prepare(variant)()
        reference[variant] = w.grad.clone()
    torch.testing.assert_close(reference["fused"], reference["unfused"], rtol=1e-4, atol=1e-3)

    times = {"fused": [], "unfused": []}
    order = ["fused", "unfused"]
    for _ in range(repeats):
        for variant in order:
            run = prepare(variant)
            start = time.perf_counter()
            run()
            times[variant].append(time.perf_counter() - start)
        order.reverse()
    result = {"times_s": times}
    if memory:
        result["memory"] = {v: backward_peak_bytes(prepare(v)) for v in ("fused", "unfused")}
    w.grad = None
    return result


# FusedLinear's cost per call against nn.Linear's: (name, in, out, rows,
# calls per step). One call per step has nothing to fuse (fuse() leaves such
# a layer stock; this is what a layer swapped anyway costs); several calls
# per step fuse all but the first to run backward.
PER_CALL_CASES = [
    ("16 x 16, 4 rows, used once", 16, 16, 4, 1),
    ("64 x 64, 8 rows, used once", 64, 64, 8, 1),
    ("64 x 64, 8 rows, used 4 times", 64, 64, 8, 4),
    ("512 x 512, 64 rows, used once", 512, 512, 64, 1),
    ("512 x 512, 64 rows, used 4 times", 512, 512, 64, 4),
    ("1024 x 1024, 256 rows, used 4 times", 1024, 1024, 256, 4),
]


def _FloorLinear(features, out):
    """An ``nn.Linear`` whose forward is the least custom Function there is
    (``F.linear``, then ``g @ W``, ``g.t() @ x`` and ``g.sum(0)``): what any
    Python ``autograd.Function`` costs a call, the floor under FusedLinear's."""
    import torch
    import torch.nn.functional as F

    class Floor(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, bias):
            ctx.save_for_backward(x, weight)
            return F.linear(x, weight, bias)

        @staticmethod
        def backward(ctx, g):
            x, weight = ctx.saved_tensors
            return g.mm(weight), g.t().mm(x), g.sum(0)

    class FloorLinear(torch.nn.Linear):
        def forward(self, x):
            return Floor.apply(x, self.weight, self.bias)

    return FloorLinear(features, out)


def _PythonFusedLinear(features, out):
    """A ``FusedLinear`` that always runs its Python Function
    (``FusedLinearFunction``), never the extension's C++ one."""
    from torch_ctxext.nn import FusedLinear, FusedLinearFunction

    class PythonFusedLinear(FusedLinear):
        def forward(self, x):
            return FusedLinearFunction.apply(x, self.weight, self.bias, self.fuse)

    return PythonFusedLinear(features, out)


def per_call_route():
    """Which Function FusedLinear runs on plain CPU tensors here."""
    import torch

    from torch_ctxext.nn import FusedLinear

    node = FusedLinear(2, 2)(torch.ones(1, 2, requires_grad=True)).grad_fn
    return "the C++ Function" if type(node).__name__ == "CppFunction" else "the Python Function"


def measure_per_call(cases=None, rounds=15, steps=20, seed=0):
    """Seconds per call (forward and backward, and forward under no_grad) of
    ``nn.Linear``, of ``FusedLinear`` (the C++ Function where the extension
    has it), of FusedLinear's Python Function and of the least custom
    Function, with the same weights, each step
    ``calls`` uses of the layer summed into one backward; the two alternate
    round by round (``steps`` steps each), and each round gives one
    fused - stock difference per call, in wall time and in this thread's CPU
    time (``time.thread_time``: other processes' load does not count)."""
    import torch

    from torch_ctxext.nn import FusedLinear

    results = []
    for name, features, out, rows, calls in cases or PER_CALL_CASES:
        gen = torch.Generator().manual_seed(seed)
        stock = torch.nn.Linear(features, out)
        fused = FusedLinear(features, out)
        fused.load_state_dict(stock.state_dict())
        python = _PythonFusedLinear(features, out)
        floor = _FloorLinear(features, out)
        for layer in (python, floor):
            layer.load_state_dict(stock.state_dict())
        layers = {"stock": stock, "fused": fused, "python": python, "floor": floor}
        xs = [torch.randn(rows, features, generator=gen).requires_grad_() for _ in range(calls)]

        def step(layer):
            layer.zero_grad(set_to_none=True)
            sum(layer(x).sum() for x in xs).backward()

        def forward(layer):
            with torch.no_grad():
                for x in xs:
                    layer(x)

        def timed(run, layer):
            wall, cpu = time.perf_counter(), time.thread_time()
            for _ in range(steps):
                run(layer)
            return ((time.perf_counter() - wall) / (steps * calls), (time.thread_time() - cpu) / (steps * calls))

        for layer in layers.values():  # warm up
            step(layer)
            forward(layer)
        torch.testing.assert_close(fused.weight.grad, stock.weight.grad)
        row = {"case": name, "calls": calls}
        for label, run in (("step", step), ("no_grad", forward)):
            got = {variant: [] for variant in layers}
            order = list(layers)
            for _ in range(rounds):
                for variant in order:
                    got[variant].append(timed(run, layers[variant]))
                order.reverse()
            for i, clock in enumerate(("wall", "cpu")):
                stock_s = [t[i] for t in got["stock"]]
                row[f"{label}_{clock}_stock_us"] = statistics.median(stock_s) * 1e6
                for variant, key in (("fused", "extra"), ("python", "python"), ("floor", "floor")):
                    times = [t[i] for t in got[variant]]
                    row[f"{label}_{clock}_{key}_us"] = statistics.median(
                        [f - s for f, s in zip(times, stock_s)]) * 1e6
        results.append(row)
    return results


def per_call_table(rows):
    """``measure_per_call``'s rows as a Markdown table."""
    out = ["| layer, step | nn.Linear us per call (CPU / wall) | FusedLinear - nn.Linear us per call "
           "(CPU / wall) | its Python Function - nn.Linear (CPU / wall) "
           "| least custom Function - nn.Linear us per call (CPU / wall) "
           "| under no_grad: FusedLinear - nn.Linear us (CPU / wall) |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        python = (f"{r['step_cpu_python_us']:+.1f} / {r['step_wall_python_us']:+.1f}"
                  if "step_cpu_python_us" in r else "not measured")
        out.append(f"| {r['case']} | {r['step_cpu_stock_us']:.1f} / {r['step_wall_stock_us']:.1f} "
                   f"| **{r['step_cpu_extra_us']:+.1f}** / {r['step_wall_extra_us']:+.1f} "
                   f"| {python} "
                   f"| {r['step_cpu_floor_us']:+.1f} / {r['step_wall_floor_us']:+.1f} "
                   f"| {r['no_grad_cpu_extra_us']:+.1f} / {r['no_grad_wall_extra_us']:+.1f} |")
    return "\n".join(out)


def collect_per_call(rounds=15, instruction_cases=((4, 16, 1), (8, 64, 4))):
    """What docs/benchmarks.md's "FusedLinear's cost per call" shows, for
    ``run_all.py --remeasure per_call``: ``measure_per_call`` in this
    process (one thread), then bench_per_call_instructions.py's counts (one
    callgrind process per case of ``instruction_cases``: rows, features,
    uses per step), where valgrind is installed."""
    import datetime
    import os

    import torch

    import bench_drop_ins_per_call
    import bench_per_call_instructions

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        load = os.getloadavg()[0]
        cpu = measure_per_call(rounds=rounds)
        drop_ins = bench_drop_ins_per_call.measure_drop_ins(rounds=rounds)
    finally:
        torch.set_num_threads(threads)
    instructions = []
    if bench_per_call_instructions.available() is None:
        for rows, features, uses in instruction_cases:
            got = bench_per_call_instructions.measure(rows, features, uses)
            instructions.append({"rows": rows, "features": features, "uses": uses, **got})
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "rounds": rounds, "load_average": load, "torch": torch.__version__, "cpu": cpu,
            "route": per_call_route(), "drop_ins": drop_ins,
            "instructions": instructions}


def instructions_table(rows):
    """``collect_per_call``'s instruction counts as a Markdown table."""
    out = ["| layer, step | nn.Linear, thousands of instructions per call (forward + backward / forward) "
           "| least custom Function - nn.Linear | FusedLinear - nn.Linear | FusedLinear - least custom Function |",
           "|---|---|---|---|---|"]
    for r in rows:
        s, f = r["step"], r["forward"]
        use = "used once" if r["uses"] == 1 else f"used {r['uses']} times"
        out.append(f"| {r['features']} x {r['features']}, {r['rows']} rows, {use} "
                   f"| {s['stock'] / 1e3:.1f}k / {f['stock'] / 1e3:.1f}k "
                   f"| {(s['floor'] - s['stock']) / 1e3:+.1f}k / {(f['floor'] - f['stock']) / 1e3:+.1f}k "
                   f"| **{(s['fused'] - s['stock']) / 1e3:+.1f}k** / {(f['fused'] - f['stock']) / 1e3:+.1f}k "
                   f"| {(s['fused'] - s['floor']) / 1e3:+.1f}k / {(f['fused'] - f['floor']) / 1e3:+.1f}k |")
    return "\n".join(out)


def _mixer(tokens=64, channels=32, depth=2, batch=8):
    """An MLP-Mixer with its block shared ``depth`` times (token mixing: a
    Linear along the sequence axis of the transposed activation), a
    single-use embedding and head: the model and one step's input."""
    import torch
    import torch.nn.functional as F

    class MLP(torch.nn.Module):
        def __init__(self, features):
            super().__init__()
            self.fc1 = torch.nn.Linear(features, 2 * features)
            self.fc2 = torch.nn.Linear(2 * features, features)

        def forward(self, x):
            return self.fc2(F.gelu(self.fc1(x)))

    class Mixer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Linear(channels, channels)
            self.norm1, self.norm2 = torch.nn.LayerNorm(channels), torch.nn.LayerNorm(channels)
            self.tokens, self.channels = MLP(tokens), MLP(channels)
            self.head = torch.nn.Linear(channels, 10)

        def forward(self, x):
            x = self.embed(x)
            for _ in range(depth):
                x = x + self.tokens(self.norm1(x).transpose(1, 2)).transpose(1, 2)
                x = x + self.channels(self.norm2(x))
            return self.head(x.mean(1))

    return Mixer, torch.randn(batch, tokens, channels, generator=torch.Generator().manual_seed(0))


def measure_fuse_selection(rounds=15, steps=10):
    """Seconds per training step of a shared MLP-Mixer: stock, every Linear
    fused (``fuse(model, everything=True)``) and only those that pay
    (``fuse(model, report)``), alternated round by round; medians of each
    variant's time per step over rounds, and of the per-round ratios."""
    import copy

    import torch_ctxext

    Mixer, x = _mixer()
    stock = Mixer()
    with torch_ctxext.advise(stock) as report:
        stock(x).sum().backward()
    variants = {"stock": stock,
                "all": torch_ctxext.nn.fuse(copy.deepcopy(stock), everything=True),
                "paying": torch_ctxext.nn.fuse(copy.deepcopy(stock), report)}

    def step(model):
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()

    times = {v: [] for v in variants}
    order = list(variants)
    for model in variants.values():
        step(model)
    for _ in range(rounds):
        for v in order:
            start = time.thread_time()
            for _ in range(steps):
                step(variants[v])
            times[v].append((time.thread_time() - start) / steps)
        order.reverse()
    swapped = {v: sum(type(m).__name__ == "FusedLinear" for m in model.modules()) for v, model in variants.items()}
    return {v: {"ms": statistics.median(t) * 1e3,
                "ratio": statistics.median([a / b for a, b in zip(t, times["stock"])]),
                "fused_linears": swapped[v]} for v, t in times.items()}


MEASURES = {"fused": measure_fused, "per_call": measure_per_call, "fuse_selection": measure_fuse_selection}


if __name__ == "__main__":
    # python benchmarks/bench_fused.py: FusedLinear's cost per call against
    # nn.Linear's, in this process (torch_ctxext imported), one thread.
    import sys

    import torch

    import torch_ctxext

    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, torch_ctxext {torch_ctxext.__version__}; medians of "
          f"rounds of fused - stock, alternated\n")
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    print(per_call_table(measure_per_call(rounds=rounds)))
    print("\nA shared MLP-Mixer's training step (CPU ms per step, and / stock):\n")
    print("| model | Linears fused | ms | / stock |\n|---|---|---|---|")
    for variant, r in measure_fuse_selection(rounds=rounds).items():
        print(f"| {variant} | {r['fused_linears']} | {r['ms']:.2f} | {r['ratio']:.3f} |")


# --------------------------------------------------------------------------
# Orchestration: alternated side by side, and the results' tables.
# --------------------------------------------------------------------------


def collect_fused(pair, plan, batch, dim, micro):
    """One (B, D, N) of the grid on the workers of ``pair`` ("backport" and,
    where given, "native"), alternated round by round; the row of results."""
    row = {"B": batch, "D": dim, "N": micro, "grad_bytes": dim * dim * 4}
    times = {w.label: {"fused": [], "unfused": []} for w in pair}
    per_call = {w.label: [] for w in pair}
    memory = {}
    for r in range(plan["fused_rounds"]):
        for w in pair if r % 2 == 0 else pair[::-1]:
            got = w.call(
                "fused", batch=batch, dim=dim, micro=micro,
                repeats=plan["fused_repeats"], memory=w.label not in memory,
            )
            t = got["times_s"]
            # The fastest repeat of each variant in this call: other load
            # only ever adds time.
            for variant in ("fused", "unfused"):
                times[w.label][variant].append(min(t[variant]))
            per_call[w.label].append(min(t["fused"]) / min(t["unfused"]))
            memory.setdefault(w.label, got.get("memory"))
    for label in times:
        fused = statistics.median(times[label]["fused"])
        unfused = statistics.median(times[label]["unfused"])
        mem = memory[label]
        row[label] = {
            "fused_ms": fused * 1e3,
            "unfused_ms": unfused * 1e3,
            "time_ratio": statistics.median(per_call[label]),
            "time_ratio_min": min(per_call[label]),
            "time_ratio_max": max(per_call[label]),
            "peak_fused_bytes": mem["fused"]["peak_bytes"],
            "peak_unfused_bytes": mem["unfused"]["peak_bytes"],
            "peak_ratio": mem["fused"]["peak_bytes"] / mem["unfused"]["peak_bytes"],
            "peak_saving_grads": (
                mem["unfused"]["peak_bytes"] - mem["fused"]["peak_bytes"]
            ) / row["grad_bytes"],
        }
    return row


def _mib(n):
    return f"{n / 2**20:.2f}"


def fused_tables(results):
    """The fused grid: time ratios, then peaks, as two Markdown tables."""
    rows = results["fused"]
    sides = [s for s in ("backport", "native") if s in rows[0]]
    time_head = "| B | D | N |" + "".join(
        f" {SIDE_NAMES[s]}: fused / unfused ms | ratio (range over rounds) |" for s in sides
    )
    mem_head = "| B | D | N | gradient MiB |" + "".join(
        f" {SIDE_NAMES[s]}: peak unfused → fused MiB | saving, gradients |" for s in sides
    )
    out = [time_head, "|---|---|---|" + "---|---|" * len(sides)]
    for row in rows:
        line = f"| {row['B']} | {row['D']} | {row['N']} |"
        for s in sides:
            r = row[s]
            line += (
                f" {r['fused_ms']:.2f} / {r['unfused_ms']:.2f} | **{r['time_ratio']:.2f}** "
                f"({r['time_ratio_min']:.2f}–{r['time_ratio_max']:.2f}) |"
            )
        out.append(line)
    out += ["", mem_head, "|---|---|---|---|" + "---|---|" * len(sides)]
    for row in rows:
        line = f"| {row['B']} | {row['D']} | {row['N']} | {_mib(row['grad_bytes'])} |"
        for s in sides:
            r = row[s]
            line += (
                f" {_mib(r['peak_unfused_bytes'])} → {_mib(r['peak_fused_bytes'])} "
                f"| **{r['peak_saving_grads']:.2f}** |"
            )
        out.append(line)
    return "\n".join(out)
