"""Benchmarks of torch_ctxext, as ratios measured side by side in one run.

    python benchmarks/bench.py [--torch-2-15 PYTHON] [--rounds N] [--quick]
                               [--measure NAME] [--json FILE] [--torch-2-13 PYTHON]

runs every measurement under the current interpreter (torch 2.13 + torch_ctxext:
the source tree's if built in place, else the installed one) and, where given,
under a native torch 2.15 interpreter, and prints Markdown tables. ``benchmarks/run_all.py`` runs the same measurements and also writes
docs/benchmarks.md and the figures.

How the sides are kept comparable: each side is a long-lived worker process
(this file with ``--worker``) that imports torch once and then answers requests
on stdin. The orchestrator sends the same request to the workers in turn,
round after round, alternating which goes first, so machine noise (frequency
changes, other load) hits every side alike and a ratio is formed from
measurements taken seconds apart. Every worker uses one intra-op thread.
Within a round each side keeps its fastest sample (other load only ever adds
time); ratios are medians of per-round ratios.

Measurements (each also runnable alone: ``--measure NAME``):
  idle   forward+backward of a small custom Function that uses no new feature
         (us per step), in a worker with ``import torch_ctxext`` vs one
         without; a third worker imported torch_ctxext and had a buffer handed
         out once (so the reentrancy guard is installed); and, in one process,
         through torch_ctxext's Function.apply wrapper vs the original.
  read   reading ctx.input_grad_buffers with two exposed entries (us per read),
         torch 2.13 + torch_ctxext vs native torch 2.15, both as measured
         and as the excess over a baseline read (ctx.needs_input_grad in the
         same loop, same backward), which leaves out the loop's own cost.
  fused  a weight shared by N micro-batches: backward with ``addmm_`` into the
         exposed weight buffer vs returning ``x.t() @ g``; backward time ratio
         fused/unfused, and the peak of the backward's allocations from the
         allocator, for every B, D, N of the grid.

Peak memory: the backward runs once more per variant under
``torch.profiler.profile(activities=[CPU], profile_memory=True)``, started
after the forward. The CPU allocator reports every allocation and free made
while profiling (c10's ProfiledCPUMemoryReporter); the allocation events are
ordered by time and their signed sizes summed to a running total, whose
maximum is the peak: bytes allocated during the backward and not yet freed.
Nothing allocated before the backward is freed during it (inputs, weight,
output gradients are all held by the benchmark), so this is the backward's
peak above its starting point.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
MARK = "@@torch_ctxext-bench "

# The full grid of the fused benchmark, and the smaller one of --quick.
FUSED_GRID = [(b, d, n) for d in (512, 1024) for n in (2, 8) for b in (16, 64, 256)]
FUSED_GRID_QUICK = [(16, 512, 2), (256, 512, 8), (64, 1024, 8)]


# --------------------------------------------------------------------------
# Measurements: run inside a worker process (torch already imported, and
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
    from torch_ctxext import _extension

    ext = _extension.load()
    return {"uncast_hook_placed": bool(getattr(ext, "uncast_hook_placed", lambda: False)())}


def _linear_functions():
    import torch

    class FusedLinear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x @ w

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            _, w_buffer = ctx.input_grad_buffers
            if w_buffer is not None:
                w_buffer.addmm_(x.t(), g)
                return None, None
            return None, x.t() @ g

    class Linear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x @ w

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return None, x.t() @ g

    return {"fused": FusedLinear, "unfused": Linear}


def _backward_peak_bytes(run_backward):
    """Peak of the bytes allocated during run_backward() and not yet freed,
    from the CPU allocator's events (see the module docstring), and the net
    bytes still allocated at its end."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run_backward()
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        fields = node.extra_fields
        if type(fields).__name__ == "_ExtraFields_Allocation" and fields.device == torch.device("cpu"):
            events.append((node.start_time_ns, fields.alloc_size))
    events.sort(key=lambda e: e[0])
    total = peak = 0
    for _, size in events:
        total += size
        peak = max(peak, total)
    return {"peak_bytes": peak, "net_bytes": total, "events": len(events)}


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
        result["memory"] = {v: _backward_peak_bytes(prepare(v)) for v in ("fused", "unfused")}
    w.grad = None
    return result


MEASURES = {
    "read": measure_read,
    "idle": measure_idle,
    "fused": measure_fused,
    "expose_once": expose_once,
    "declare_none_once": declare_none_once,
}


def worker_main(plugin):
    """Answer requests on stdin, one JSON line each, until stdin closes."""
    import torch

    torch.set_num_threads(1)
    info = {
        "torch": torch.__version__,
        "torch_git": torch.version.git_version,
        "python": sys.version.split()[0],
        "threads": torch.get_num_threads(),
        "plugin": plugin,
    }
    if plugin:
        import torch_ctxext

        info["torch_ctxext"] = torch_ctxext.__version__
        info["torch_ctxext_file"] = torch_ctxext.__file__
        info["features"] = torch_ctxext.features()
    out = sys.stdout
    out.write(MARK + json.dumps({"ready": info}) + "\n")
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = {"ok": MEASURES[request["measure"]](**request.get("kwargs", {}))}
        except Exception:  # reported to the orchestrator, which raises
            reply = {"error": traceback.format_exc()}
        out.write(MARK + json.dumps(reply) + "\n")
        out.flush()


# --------------------------------------------------------------------------
# Orchestration: workers, alternation, statistics.
# --------------------------------------------------------------------------


def _built_in_place():
    """Whether the source tree holds a built extension (setup.py build_ext --inplace)."""
    package = os.path.join(ROOT, "torch_ctxext")
    return any(n.startswith("_C.") and n.endswith((".so", ".pyd")) for n in os.listdir(package))


class Worker:
    """A long-lived measuring process (this file with --worker)."""

    def __init__(self, python, label, plugin, source_tree=True, script=HERE, path=None):
        self.label = label
        self.log = tempfile.NamedTemporaryFile(
            "w+", prefix=f"torch_ctxext-bench-{label}-", suffix=".log", delete=False
        )
        env = dict(os.environ)
        if not source_tree:  # the environment's own installed torch_ctxext
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                if p and os.path.abspath(p) != ROOT
            )
        elif _built_in_place():
            # The source tree's torch_ctxext first; harmless for workers that
            # never import it. Otherwise the installed one is measured.
            env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
        if path:  # a copy of the tree built in place for this interpreter's torch
            env["PYTHONPATH"] = os.pathsep.join(p for p in (path, env.get("PYTHONPATH")) if p)
        # script: this file, or another benchmark that serves its own
        # measurements through worker_main (bench_model.py).
        command = [python, script, "--worker"] + (["--plugin"] if plugin else [])
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            cwd=tempfile.gettempdir(),
            env=env,
        )
        self.info = None

    def _reply(self):
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        self.log.flush()
        self.log.seek(0)
        raise RuntimeError(
            f"benchmark worker {self.label} exited (rc {self.proc.wait()}):\n"
            + self.log.read()[-4000:]
        )

    def ready(self):
        if self.info is None:
            self.info = self._reply()["ready"]
        return self.info

    def call(self, measure, **kwargs):
        self.ready()
        self.proc.stdin.write(json.dumps({"measure": measure, "kwargs": kwargs}) + "\n")
        self.proc.stdin.flush()
        reply = self._reply()
        if "error" in reply:
            raise RuntimeError(f"{measure} failed in worker {self.label}:\n{reply['error']}")
        return reply["ok"]

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        self.log.close()
        os.unlink(self.log.name)


def alternate(workers, rounds, measure, key, **kwargs):
    """Run the same request on every worker, round after round, rotating
    which goes first. Returns {label: [values...]}, {label: [per-round minima]}.

    Each round keeps the smallest of its samples: interference from other
    load only ever adds time, so the minimum is the least disturbed value."""
    values = {w.label: [] for w in workers}
    per_round = {w.label: [] for w in workers}
    for r in range(rounds):
        shift = r % len(workers)
        for w in workers[shift:] + workers[:shift]:
            got = w.call(measure, **kwargs)[key]
            values[w.label] += got
            per_round[w.label].append(min(got))
    return values, per_round


def _pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(p * (len(values) - 1))))]


def ratio_stats(ratios):
    """Median of per-round ratios, with their 10th and 90th percentiles."""
    return {
        "ratio": statistics.median(ratios),
        "p10": _pct(ratios, 0.1),
        "p90": _pct(ratios, 0.9),
        "rounds": len(ratios),
    }


PLANS = {
    # The full plan takes 3 to 5 minutes on 2 cores (the latter with a load
    # average of 11 from other work); --quick under 1 minute.
    "full": {
        "idle_rounds": 240, "idle_n": 100, "idle_samples": 10, "idle_warmup": 50, "ab_rounds": 160,
        "read_rounds": 60, "read_n": 20000, "read_samples": 3,
        "fused_rounds": 6, "fused_repeats": 5, "grid": FUSED_GRID,
    },
    "quick": {
        "idle_rounds": 20, "idle_n": 100, "idle_samples": 10, "idle_warmup": 50, "ab_rounds": 20,
        "read_rounds": 5, "read_n": 5000, "read_samples": 3,
        "fused_rounds": 2, "fused_repeats": 3, "grid": FUSED_GRID_QUICK,
    },
}


def log(message):
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def machine():
    """What the numbers were measured on."""
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {
        "cpu_count": os.cpu_count(),
        "cpu_model": model,
        "platform": sys.platform,
        "load_average_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
    if hasattr(os, "sched_getaffinity"):
        info["cpus_usable"] = len(os.sched_getaffinity(0))
    try:
        info["git_commit"] = subprocess.run(
            ["git", "-C", ROOT, "describe", "--always", "--dirty"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        info["git_commit"] = "unknown"
    return info


def collect(python_213=None, python_215=None, quick=False, rounds=None, measures=None):
    """Run the measurements; return a JSON-able dict of results.

    rounds, where given, replaces the number of alternation rounds of idle
    and read by 10 * rounds and of fused by rounds."""
    plan = dict(PLANS["quick" if quick else "full"])
    if rounds:
        plan.update(idle_rounds=10 * rounds, ab_rounds=10 * rounds,
                    read_rounds=10 * rounds, fused_rounds=rounds)
    measures = measures or ["idle", "read", "fused"]
    python_213 = python_213 or sys.executable
    started = time.time()
    results = {
        "plan": {k: v for k, v in plan.items() if k != "grid"},
        "quick": quick,
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
    }
    workers = {}

    def start(label, python, plugin):
        workers[label] = Worker(python, label, plugin)

    try:
        # Start every process first: they import torch concurrently.
        if "idle" in measures:
            start("idle-without", python_213, False)
            start("idle-with", python_213, True)
            start("idle-with-guard", python_213, True)
        if {"read", "fused"} & set(measures):
            start("backport", python_213, True)
            if python_215:
                start("native", python_215, False)
        results["workers"] = {label: w.ready() for label, w in workers.items()}
        log(f"{len(workers)} workers ready after {time.time() - started:.0f}s")
        if "idle" in measures:
            results["idle"] = _collect_idle(workers, plan)
            log(f"idle done ({time.time() - started:.0f}s)")
        pair = [workers["backport"]] + ([workers["native"]] if "native" in workers else [])
        if "read" in measures:
            per_round = alternate_read(pair, plan["read_rounds"], plan["read_n"], plan["read_samples"])
            results["read"] = read_results(per_round, "backport", "native")
            log(f"read done ({time.time() - started:.0f}s)")
        if "fused" in measures:
            results["fused"] = []
            for batch, dim, micro in plan["grid"]:
                results["fused"].append(_collect_fused(pair, plan, batch, dim, micro))
                log(f"fused B={batch} D={dim} N={micro} done ({time.time() - started:.0f}s)")
    finally:
        for w in workers.values():
            w.close()
    results["machine"]["load_average_at_end"] = (
        os.getloadavg() if hasattr(os, "getloadavg") else None
    )
    results["seconds"] = time.time() - started
    return results


def _collect_idle(workers, plan):
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


def collect_idle_releases(pythons, plan, native=None):
    """Idle and read cost on each torch release, with the torch_ctxext of that
    environment: its installed one, or, for ``PYTHON:DIR``, the copy of the
    tree built in place in DIR (first on PYTHONPATH).

    Per release, alternated side by side: forward+backward of a Function that
    uses nothing new in a process with ``import torch_ctxext`` against one
    without; where torch_ctxext wraps the engine's validate_outputs (torch <=
    2.9), a third process in which a None declaration placed that wrapper;
    and reading ctx.input_grad_buffers against native torch 2.15 (``native``,
    its python), where torch_ctxext provides it. Returns {torch version:
    {"us": ..., "with_import": ratio stats, ["with_uncast_hook": ...],
    ["read_us": ..., "read_over_native": ...], "features": ...}}."""
    results = {}
    for entry in pythons:
        python, _, path = entry.partition(":")
        workers = [Worker(python, "without", False, source_tree=False, path=path or None),
                   Worker(python, "with", True, source_tree=False, path=path or None)]
        try:
            info = workers[1].ready()
            version = workers[0].ready()["torch"]
            features = info.get("features", {})
            if features.get("set_output_grad_dtype") == "torch_ctxext":
                hooked = Worker(python, "with-uncast-hook", True, source_tree=False, path=path or None)
                workers.append(hooked)
                if not hooked.call("declare_none_once")["uncast_hook_placed"]:
                    workers.pop().close()  # the engine leaves None uncast: no wrapper
            _, per_round = alternate(
                workers, plan["idle_rounds"], "idle", "fwd_bwd_us",
                n=plan["idle_n"], samples=plan["idle_samples"], warmup=plan["idle_warmup"],
            )
            row = {
                "features": features,
                "us": {k: statistics.median(v) for k, v in per_round.items()},
                "with_import": ratio_stats(
                    [a / b for a, b in zip(per_round["with"], per_round["without"])]
                ),
            }
            if "with-uncast-hook" in per_round:
                row["with_uncast_hook"] = ratio_stats(
                    [a / b for a, b in zip(per_round["with-uncast-hook"], per_round["without"])]
                )
            if native and features.get("input_grad_buffers") == "torch_ctxext":
                reference = Worker(native, "native", False, source_tree=False)
                workers.append(reference)
                pair = [workers[1], reference]
                reads = read_results(
                    alternate_read(pair, plan["read_rounds"], plan["read_n"], plan["read_samples"]),
                    "with", "native",
                )
                row["read_us"] = reads["us"]
                row["read_excess_us"] = reads["excess_us"]
                row["read_over_native"] = reads["backport_over_native"]
                row["read_excess_over_native"] = reads["excess_over_native"]
        finally:
            for w in workers:
                w.close()
        results[version] = row
        log(f"idle and read on torch {version} done")
    return results


def _release_key(version):
    return tuple(int(p) for p in version.split("+")[0].split(".")[:3])


def idle_releases_table(results):
    out = [
        "| torch | provided by torch_ctxext | idle: with `import torch_ctxext` / without "
        "(10th–90th pct.) | idle after a `None` declaration (torch ≤ 2.9) | "
        "reading `ctx.input_grad_buffers` (excess over a baseline read) | read / native 2.15 "
        "| excess / native 2.15 (target ≤ 1.1) |",
        "|---|---|---|---|---|---|---|",
    ]
    for version, r in sorted(results["idle_releases"].items(), key=lambda kv: _release_key(kv[0])):
        provided = ", ".join(
            f"`{m}`" for m, how in sorted(r.get("features", {}).items()) if how == "torch_ctxext"
        ) or "nothing"
        hook = _spread(r["with_uncast_hook"]) if "with_uncast_hook" in r else "–"
        read = f"{r['read_us']['with']:.2f} us" if "read_us" in r else "native"
        if "read_excess_us" in r:
            read += f" ({r['read_excess_us']['with'] * 1e3:.0f} ns; native {r['read_excess_us']['native'] * 1e3:.0f} ns)"
        over = _spread(r["read_over_native"]) if "read_over_native" in r else "–"
        excess = _spread(r["read_excess_over_native"]) if "read_excess_over_native" in r else "–"
        out.append(
            f"| {version} | {provided} | {_spread(r['with_import'])} "
            f"({r['us']['with']:.1f} / {r['us']['without']:.1f} us) | {hook} | {read} | {over} | {excess} |"
        )
    return "\n".join(out)


def _collect_fused(pair, plan, batch, dim, micro):
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


# --------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------


def _mib(n):
    return f"{n / 2**20:.2f}"


def _spread(s):
    return f"{s['ratio']:.3f} ({s['p10']:.3f}–{s['p90']:.3f})"


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
            f"| {_spread(idle['with_import'])} | ≤ 1.02 |"
        )
        out.append(
            "| idle, in one process: through torch_ctxext's `Function.apply` wrapper / "
            f"the original `Function.apply` | {us['in-process-wrapped']:.2f} us "
            f"| {us['in-process-original']:.2f} us | {_spread(idle['in_process'])} | ≤ 1.02 |"
        )
        out.append(
            "| idle, process with import after a buffer was handed out once (reentrancy "
            f"guard installed) / without import | {us['idle-with-guard']:.2f} us "
            f"| {us['idle-without']:.2f} us | {_spread(idle['with_guard'])} | |"
        )
    if "read" in results:
        read = results["read"]
        if "backport_over_native" in read:
            out.append(
                "| read `ctx.input_grad_buffers` (2 exposed entries), 2.13 + torch_ctxext / "
                f"native 2.15, the loop's own cost included | {read['us']['backport']:.3f} us "
                f"| {read['us']['native']:.3f} us | {_spread(read['backport_over_native'])} | |"
            )
        if "excess_over_native" in read:
            out.append(
                "| the same, excess over a baseline read (`ctx.needs_input_grad` in the same loop: "
                f"{read['base_us']['backport'] * 1e3:.0f} / {read['base_us']['native'] * 1e3:.0f} ns) "
                f"| {read['excess_us']['backport'] * 1e3:.0f} ns | {read['excess_us']['native'] * 1e3:.0f} ns "
                f"| {_spread(read['excess_over_native'])} | ≤ 1.0 |"
            )
        else:
            out.append(
                "| read `ctx.input_grad_buffers` (2 exposed entries), 2.13 + torch_ctxext "
                f"| {read['us']['backport']:.3f} us | (no torch 2.15 given) | | |"
            )
    return "\n".join(out)


SIDE_NAMES = {"backport": "2.13 + torch_ctxext", "native": "native 2.15"}


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


def markdown_tables(results):
    parts = []
    if "idle" in results or "read" in results:
        parts.append(overhead_table(results))
    if "fused" in results:
        parts.append(fused_tables(results))
    return "\n\n".join(parts)


def headline(results):
    w = results["workers"]
    side = w.get("backport") or w.get("idle-with")
    m = results["machine"]
    return (
        f"torch {side['torch']} + torch_ctxext vs native torch "
        f"{w['native']['torch'] if 'native' in w else '2.15 (not given)'}; "
        f"{m['cpu_count']} × {m['cpu_model']}; 1 intra-op thread per worker; "
        f"{results['date']}; {results['seconds']:.0f} s"
        + ("; QUICK (smoke) run" if results["quick"] else "")
    )


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Benchmarks of torch_ctxext (Markdown tables on stdout; "
        "benchmarks/run_all.py also writes docs/benchmarks.md and figures)."
    )
    parser.add_argument("--torch-2-15", metavar="PYTHON", help="python of a native torch 2.15 environment")
    parser.add_argument(
        "--torch-2-13", metavar="PYTHON",
        help="python of the torch 2.13 environment (default: this one); the "
        "source tree's torch_ctxext is measured if built in place, else the installed one",
    )
    parser.add_argument(
        "--rounds", type=int,
        help="alternation rounds: 10*N for idle and read, N for fused (default: the plan's)",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run (under a minute)")
    parser.add_argument(
        "--measure", action="append", choices=["idle", "read", "fused"],
        help="run only this measurement (repeatable)",
    )
    parser.add_argument("--json", metavar="FILE", help="also write the raw results as JSON")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--plugin", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(args.plugin)
    results = collect(args.torch_2_13, args.torch_2_15, args.quick, args.rounds, args.measure)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, sort_keys=True)
    print(headline(results))
    print()
    print(markdown_tables(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
