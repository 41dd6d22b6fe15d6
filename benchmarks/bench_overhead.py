"""Idle and read cost: what importing torch_ctxext costs a Function that uses
nothing new, and what reading ``ctx.input_grad_buffers`` costs.

    python benchmarks/run_all.py --torch-2-15 PY215 ...     (with every benchmark)
    python benchmarks/run_all.py --from-json FILE --remeasure read --torch-2-15 PY215

idle  forward+backward of a small custom Function that uses no new feature
      (us per step), in a worker with ``import torch_ctxext`` vs one without;
      a third worker imported torch_ctxext and had a buffer handed out once
      (so the reentrancy guard is installed); and, in one process, through
      torch_ctxext's Function.apply wrapper vs the original.
read  reading ctx.input_grad_buffers with two exposed entries (us per read),
      torch 2.13 + torch_ctxext vs native torch 2.15, both as measured and as
      the excess over a baseline read (ctx.needs_input_grad in the same loop,
      same backward), which leaves out the loop's own cost.

The measurements run in worker processes (benchmarks/bench.py), side by side.
"""
import statistics
import time

from bench import alternate, ratio_stats, spread

# Rounds and sizes: the full plan, and the smaller one of --quick.
PLANS = {
    "full": {"idle_rounds": 240, "idle_n": 100, "idle_samples": 10, "idle_warmup": 50,
             "ab_rounds": 160, "read_rounds": 60, "read_n": 20000, "read_samples": 3},
    "quick": {"idle_rounds": 20, "idle_n": 100, "idle_samples": 10, "idle_warmup": 50,
              "ab_rounds": 20, "read_rounds": 5, "read_n": 5000, "read_samples": 3},
}


# --------------------------------------------------------------------------
# Measurements: inside a worker process (torch already imported, and
# torch_ctxext too where the worker was started with --plugin).
# --------------------------------------------------------------------------


def measure_read(n=20000, samples=1):
    """us per read of ctx.input_grad_buffers (two exposed entries), one value
    per sample; each sample is one backward that reads n times. In the same
    backward, right after, the same loop reads ``ctx.needs_input_grad`` (a
    plain attribute of every ctx): the loop's own cost and an attribute read,
    the baseline whose excess is the property's own cost."""
    import torch

    timings, baselines = [], []

    class Reader(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            return x * w

        @staticmethod
        def backward(ctx, g):
            buffers = ctx.input_grad_buffers
            assert buffers[0] is not None and buffers[1] is not None
            start = time.perf_counter()
            for _ in range(n):
                ctx.input_grad_buffers
            timings.append((time.perf_counter() - start) / n * 1e6)
            start = time.perf_counter()
            for _ in range(n):
                ctx.needs_input_grad
            baselines.append((time.perf_counter() - start) / n * 1e6)
            return g, g

    for _ in range(samples):
        x = torch.ones(8, requires_grad=True)
        w = torch.ones(8, requires_grad=True)
        y = Reader.apply(x, w)
        # x * 2 and w * 2 were created after Reader: their backward runs
        # first and leaves a buffer for both of Reader's inputs.
        (y.sum() + (x * 2).sum() + (w * 2).sum()).backward()
    return {"read_us": timings, "base_us": baselines}


class _Plain:
    cls = None


def _plain_function():
    import torch

    if _Plain.cls is None:

        class Plain(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                ctx.save_for_backward(x)
                return x * 2

            @staticmethod
            def backward(ctx, g):
                (x,) = ctx.saved_tensors
                return g * 2

        _Plain.cls = Plain
    return _Plain.cls


def measure_idle(n=2000, samples=7, warmup=200, in_process_ab=False):
    """us per forward+backward of a Function that uses no new feature, one
    value per sample of n steps.

    in_process_ab (a worker that imported torch_ctxext): alternate samples
    through torch_ctxext's ``Function.apply`` wrapper (the only per-call cost
    of the import) and through the original ``Function.apply``, restored for
    those samples; returns both lists."""
    import torch

    plain = _plain_function()
    x = torch.ones(16, requires_grad=True)

    def step():
        plain.apply(x).sum().backward()

    def sample():
        start = time.perf_counter()
        for _ in range(n):
            step()
        return (time.perf_counter() - start) / n * 1e6

    for _ in range(warmup):
        step()
    if not in_process_ab:
        return {"fwd_bwd_us": [sample() for _ in range(samples)]}
    Function = torch.autograd.Function
    wrapped = Function.__dict__["apply"]
    original = classmethod(Function._torch_ctxext_original_apply)
    runs = {"wrapped_us": [], "original_us": []}
    try:
        for i in range(2 * samples):
            use_original = (i % 2 == 1) ^ (i // 2 % 2 == 1)  # ABBA order
            Function.apply = original if use_original else wrapped
            runs["original_us" if use_original else "wrapped_us"].append(sample())
    finally:
        Function.apply = wrapped
    return runs


def expose_once():
    """Have ctx.input_grad_buffers hand out a buffer once (installs
    torch_ctxext's reentrancy guard on torch < 2.15)."""
    measure_read(n=1, samples=1)
    return {}


def declare_none_once():
    """Run a Function that declares set_output_grad_dtype(None) once, and
    drop its graph: on torch <= 2.9 this places torch_ctxext's wrapper around
    the engine's validate_outputs, which every later node run then passes."""
    import torch

    class Uncast(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.set_output_grad_dtype(None)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    Uncast.apply(torch.ones(2, requires_grad=True)).sum().backward()
    from torch_ctxext._ext import loader as _extension

    ext = _extension.load()
    return {"uncast_hook_placed": bool(getattr(ext._testing, "uncast_hook_placed", lambda: False)())}


MEASURES = {
    "read": measure_read,
    "idle": measure_idle,
    "expose_once": expose_once,
    "declare_none_once": declare_none_once,
}


# --------------------------------------------------------------------------
# Orchestration: alternated side by side, and the results' table.
# --------------------------------------------------------------------------


def collect_idle(workers, plan):
    """The idle measurement on the workers "idle-without", "idle-with" and
    "idle-with-guard" (the same torch 2.13), alternated; and, in the process
    of "idle-with", the wrapper against the original Function.apply."""
    workers["idle-with-guard"].call("expose_once")
    order = [workers[k] for k in ("idle-without", "idle-with", "idle-with-guard")]
    _, per_round = alternate(
        order, plan["idle_rounds"], "idle", "fwd_bwd_us",
        n=plan["idle_n"], samples=plan["idle_samples"], warmup=plan["idle_warmup"],
    )
    base = per_round["idle-without"]
    result = {
        "us": {k: statistics.median(v) for k, v in per_round.items()},
        "with_import": ratio_stats([a / b for a, b in zip(per_round["idle-with"], base)]),
        "with_guard": ratio_stats([a / b for a, b in zip(per_round["idle-with-guard"], base)]),
    }
    # In one process: through the wrapper vs the original Function.apply.
    ab = []
    wrapped_us, original_us = [], []
    for _ in range(plan["ab_rounds"]):
        got = workers["idle-with"].call(
            "idle", n=plan["idle_n"], samples=plan["idle_samples"], warmup=20, in_process_ab=True
        )
        wrapped_us.append(min(got["wrapped_us"]))
        original_us.append(min(got["original_us"]))
        ab.append(wrapped_us[-1] / original_us[-1])
    result["in_process"] = ratio_stats(ab)
    result["us"]["in-process-wrapped"] = statistics.median(wrapped_us)
    result["us"]["in-process-original"] = statistics.median(original_us)
    return result


def collect_read(pair, plan):
    """The read measurement on the 2.13 side ("backport") and, where in
    ``pair``, the native side, alternated; read_results() of it."""
    per_round = alternate_read(pair, plan["read_rounds"], plan["read_n"], plan["read_samples"])
    return read_results(per_round, "backport", "native")


def alternate_read(workers, rounds, n, samples):
    """The read measurement on every worker, alternated as alternate() does.
    Per worker and round: the fastest read, the fastest baseline read, and
    their difference, the excess (each the least disturbed of its samples).
    Returns {label: {"read": [...], "base": [...], "excess": [...]}}."""
    per_round = {w.label: {"read": [], "base": [], "excess": []} for w in workers}
    for r in range(rounds):
        shift = r % len(workers)
        for w in workers[shift:] + workers[:shift]:
            got = w.call("read", n=n, samples=samples)
            read, base = min(got["read_us"]), min(got["base_us"])
            per_round[w.label]["read"].append(read)
            per_round[w.label]["base"].append(base)
            per_round[w.label]["excess"].append(read - base)
    return per_round


def read_results(per_round, side, native):
    """Medians (us) of the read, its baseline and its excess per side, and,
    against the native side, the ratios both ways: read / read (the loop's
    own cost included) and excess / excess (the property's own cost)."""
    out = {
        "us": {k: statistics.median(v["read"]) for k, v in per_round.items()},
        "base_us": {k: statistics.median(v["base"]) for k, v in per_round.items()},
        "excess_us": {k: statistics.median(v["excess"]) for k, v in per_round.items()},
    }
    if native in per_round:
        a, b = per_round[side], per_round[native]
        out["backport_over_native"] = ratio_stats([x / y for x, y in zip(a["read"], b["read"])])
        out["excess_over_native"] = ratio_stats([x / y for x, y in zip(a["excess"], b["excess"])])
    return out


def overhead_table(results):
    """Idle and read rows, as a Markdown table."""
    out = [
        "| measurement | measured | baseline | ratio (10th–90th percentile of rounds) | target |",
        "|---|---|---|---|---|",
    ]
    if "idle" in results:
        idle = results["idle"]
        us = idle["us"]
        out.append(
            "| idle: fwd+bwd of a Function using no new feature, process with / without "
            f"`import torch_ctxext` | {us['idle-with']:.2f} us | {us['idle-without']:.2f} us "
            f"| {spread(idle['with_import'])} | ≤ 1.02 |"
        )
        out.append(
            "| idle, in one process: through torch_ctxext's `Function.apply` wrapper / "
            f"the original `Function.apply` | {us['in-process-wrapped']:.2f} us "
            f"| {us['in-process-original']:.2f} us | {spread(idle['in_process'])} | ≤ 1.02 |"
        )
        out.append(
            "| idle, process with import after a buffer was handed out once (reentrancy "
            f"guard installed) / without import | {us['idle-with-guard']:.2f} us "
            f"| {us['idle-without']:.2f} us | {spread(idle['with_guard'])} | |"
        )
    if "read" in results:
        read = results["read"]
        if "backport_over_native" in read:
            out.append(
                "| read `ctx.input_grad_buffers` (2 exposed entries), 2.13 + torch_ctxext / "
                f"native 2.15, the loop's own cost included | {read['us']['backport']:.3f} us "
                f"| {read['us']['native']:.3f} us | {spread(read['backport_over_native'])} | |"
            )
        if "excess_over_native" in read:
            out.append(
                "| the same, excess over a baseline read (`ctx.needs_input_grad` in the same loop: "
                f"{read['base_us']['backport'] * 1e3:.0f} / {read['base_us']['native'] * 1e3:.0f} ns) "
                f"| {read['excess_us']['backport'] * 1e3:.0f} ns | {read['excess_us']['native'] * 1e3:.0f} ns "
                f"| {spread(read['excess_over_native'])} | ≤ 1.0 |"
            )
        else:
            out.append(
                "| read `ctx.input_grad_buffers` (2 exposed entries), 2.13 + torch_ctxext "
                f"| {read['us']['backport']:.3f} us | (no torch 2.15 given) | | |"
            )
    return "\n".join(out)
