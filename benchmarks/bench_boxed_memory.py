"""Peak memory of a backward whose boxed Function frees its grads early.

    python benchmarks/run_all.py --torch-2-15 PY215 --torch-2-12 PY212 ...

Workload: a Function with 8 outputs of 4 MiB each (float32 1M). Its backward
first reduces each grad to a few numbers, then needs a workspace as large as
all 8 grads together to build the input's gradient (think of a kernel's
scratch space). Boxed (``boxed_grads_call = True``) it pops each grad from the
list as it goes, so the grads are gone before the workspace is allocated;
unboxed, the engine holds all 8 until backward returns, and they coexist with
the workspace.

Peak memory is measured from the allocator: torch.profiler with
``profile_memory=True`` records every CPU allocation and free as a
``[memory]`` event with its byte delta; the peak is the maximum of the running
sum of those deltas, in event order, over the backward call alone (so it is
the backward's own peak above what was live when it started).
"""
import os

from bench import run_once

N_OUTPUTS, NUMEL = 8, 1 << 20


def make(boxed):
    import torch

    class Spread(torch.autograd.Function):
        boxed_grads_call = boxed

        @staticmethod
        def forward(ctx, x):
            return tuple(x * (i + 1) for i in range(N_OUTPUTS))

        @staticmethod
        def backward(ctx, *args):
            scale = []
            if boxed:
                (grads,) = args
                while grads:
                    g = grads.pop(0)
                    scale.append(g.sum())
                    del g
            else:
                scale = [g.sum() for g in args]
            workspace = torch.ones(N_OUTPUTS, NUMEL)
            workspace *= torch.stack(scale)[:, None] / NUMEL
            weights = torch.arange(1, N_OUTPUTS + 1, dtype=workspace.dtype)
            return (workspace * weights[:, None]).sum(0)

    return Spread


def peak_bytes(boxed):
    import torch
    import torch_ctxext  # noqa: F401  (boxed grads on torch < 2.13)
    from torch.profiler import ProfilerActivity, profile

    Spread = make(boxed)
    x = torch.ones(NUMEL, requires_grad=True)
    outs = Spread.apply(x)
    loss = sum((o * 1.0).sum() for o in outs)
    del outs
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss.backward()
    running = peak = 0
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]"
    )
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
    return peak


def measure():
    import torch

    return {
        "torch": torch.__version__,
        "boxed_peak_mib": peak_bytes(True) / 2**20,
        "unboxed_peak_mib": peak_bytes(False) / 2**20,
    }


def compare(pythons):
    """measure() under each interpreter, one after the other, each in a
    fresh process. torch 2.12's is its environment's installed torch_ctxext,
    not this source tree's build."""
    rows = []
    for python in pythons:
        env = dict(os.environ)
        if "2.12" in python:
            env.pop("PYTHONPATH", None)
        rows.append(run_once(python, "bench_boxed_memory.measure", env=env))
    return rows


def table(rows):
    """The comparison as a Markdown table (the 2.12 side with torch_ctxext)."""
    return "\n".join([
        "| torch | boxed peak (MiB) | unboxed peak (MiB) | boxed / unboxed |",
        "|---|---|---|---|",
        *[
            f"| {r['torch']}{' + torch_ctxext' if r['torch'].startswith('2.12') else ' (native)'} "
            f"| {r['boxed_peak_mib']:.1f} | {r['unboxed_peak_mib']:.1f} "
            f"| {r['boxed_peak_mib'] / r['unboxed_peak_mib']:.2f} |"
            for r in rows
        ],
    ])
