"""Benchmarks of torch_ctxext, as ratios measured side by side in one run.

    python benchmarks/bench.py [--torch-2-15 PYTHON] [--quick]

runs every measurement under the current interpreter (torch 2.13 + torch_ctxext)
and, where given, under a native torch 2.15 interpreter, alternating the
processes so that machine noise hits both sides alike, and prints a Markdown
table. Each figure is the median of repeated timings (torch.utils.benchmark).

Measurements (each also runnable alone: ``--measure NAME``):
  read   reading ctx.input_grad_buffers with two exposed entries (us per read)
  idle   forward+backward of a small custom Function that uses no new feature,
         with and without ``import torch_ctxext`` (two processes, alternated)
  fused  a weight shared by 8 micro-batches: backward with addmm_ into the
         exposed buffer vs returning x.t() @ g (time ratio fused/unfused)
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)


def measure_read(n=20000):
    import torch
    import torch_ctxext  # noqa: F401

    timings = {}

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
            timings["read"] = (time.perf_counter() - start) / n * 1e6
            return g, g

    x = torch.ones(8, requires_grad=True)
    w = torch.ones(8, requires_grad=True)
    y = Reader.apply(x, w)
    (y.sum() + (x * 2).sum() + (w * 2).sum()).backward()
    return {"read_us": timings["read"]}


def measure_idle(n=2000, with_plugin=True):
    import torch

    if with_plugin:
        import torch_ctxext  # noqa: F401

    class Plain(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * 2

    x = torch.ones(16, requires_grad=True)

    def step():
        Plain.apply(x).sum().backward()

    for _ in range(200):
        step()
    runs = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(n):
            step()
        runs.append((time.perf_counter() - start) / n * 1e6)
    return {"fwd_bwd_us": statistics.median(runs)}


def measure_fused(batches=(16, 64), dim=1024, micro=8, repeats=15):
    import torch
    import torch_ctxext  # noqa: F401

    torch.set_num_threads(1)

    def make(fuse):
        class Linear(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, w):
                ctx.save_for_backward(x, w)
                return x @ w

            @staticmethod
            def backward(ctx, g):
                x, w = ctx.saved_tensors
                _, w_buffer = ctx.input_grad_buffers
                if fuse and w_buffer is not None:
                    w_buffer.addmm_(x.t(), g)
                    return None, None
                return None, x.t() @ g

        return Linear

    results = {}
    for batch in batches:
        w = torch.randn(dim, dim, requires_grad=True)
        xs = [torch.randn(batch, dim) for _ in range(micro)]
        times = {True: [], False: []}
        for _ in range(repeats):
            for fuse in (True, False):
                fn = make(fuse)
                loss = sum(fn.apply(x, w).sum() for x in xs)
                w.grad = None
                start = time.perf_counter()
                loss.backward()
                times[fuse].append(time.perf_counter() - start)
        fused, plain = statistics.median(times[True]), statistics.median(times[False])
        results[f"B={batch},D={dim}"] = {
            "fused_ms": fused * 1e3,
            "unfused_ms": plain * 1e3,
            "ratio": fused / plain,
        }
    return results


MEASURES = {"read": measure_read, "idle": measure_idle, "fused": measure_fused}


def run_child(python, measure, **kwargs):
    code = (
        f"import sys, json; sys.path.insert(0, {os.path.dirname(HERE)!r}); import bench; "
        f"print(json.dumps(bench.MEASURES[{measure!r}](**{kwargs!r})))"
    )
    env = dict(os.environ)
    out = subprocess.run(
        [python, "-c", code], capture_output=True, text=True, env=env, check=True, cwd="/tmp"
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--torch-2-15", help="python of a native torch 2.15 environment")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import torch

    here = sys.executable
    rows = []
    # read latency: alternate backport and native processes
    reads = {"backport": [], "native": []}
    for _ in range(args.rounds):
        reads["backport"].append(run_child(here, "read")["read_us"])
        if args.torch_2_15:
            reads["native"].append(run_child(args.torch_2_15, "read")["read_us"])
    b = statistics.median(reads["backport"])
    line = f"| read `input_grad_buffers`, 2 exposed entries | {b:.2f} us"
    if reads["native"]:
        n = statistics.median(reads["native"])
        line += f" | {n:.2f} us | {b / n:.2f} |"
    rows.append(line)
    # idle cost: with and without the plugin, alternating processes
    idle = {True: [], False: []}
    for _ in range(args.rounds * 2):
        for with_plugin in (False, True):
            idle[with_plugin].append(run_child(here, "idle", with_plugin=with_plugin)["fwd_bwd_us"])
    w, wo = statistics.median(idle[True]), statistics.median(idle[False])
    rows.append(
        f"| idle: fwd+bwd of a Function using no new feature, with / without import | "
        f"{w:.2f} us | {wo:.2f} us | {w / wo:.3f} |"
    )
    fused = run_child(here, "fused")
    fused_native = run_child(args.torch_2_15, "fused") if args.torch_2_15 else {}
    for shape, r in fused.items():
        line = f"| fused/unfused backward, weight shared by 8 micro-batches, {shape} | {r['ratio']:.2f}"
        if shape in fused_native:
            line += f" | {fused_native[shape]['ratio']:.2f} | |"
        rows.append(line)
    print(f"torch {torch.__version__} + torch_ctxext vs native torch 2.15 "
          f"({'given' if args.torch_2_15 else 'not given'}), {os.cpu_count()} cores, "
          f"{time.strftime('%Y-%m-%d')}")
    print()
    print("| measurement | 2.13 + torch_ctxext | native 2.15 / baseline | ratio |")
    print("|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
