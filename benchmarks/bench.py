"""What every benchmark shares: worker processes measured side by side, and statistics.

Not a benchmark of its own: ``benchmarks/run_all.py`` runs the benchmarks.
This file is also the entry of the processes they start:

    python benchmarks/bench.py --worker MODULE... [--plugin]
    python benchmarks/bench.py --once MODULE.FUNCTION

How the sides are kept comparable: each side is a long-lived worker process
(this file with ``--worker``) that imports torch once (and torch_ctxext with
``--plugin``; without it, torch_ctxext cannot be imported), uses one intra-op
thread, and then answers requests on stdin: a measurement of one of the
named benchmark modules (their ``MEASURES``), its result one JSON line on
stdout. The orchestrator sends the same request to the workers in turn,
round after round, alternating which goes first (``alternate``), so machine
noise (frequency changes, other load) hits every side alike and a ratio is
formed from measurements taken seconds apart. Within a round each side keeps
its fastest sample (other load only ever adds time); ratios are medians of
per-round ratios (``ratio_stats``). ``--once`` runs one function of a
module in a fresh process and prints its result (``run_once``).

Peak memory (``backward_peak_bytes``): the code runs under
``torch.profiler.profile(activities=[CPU], profile_memory=True)``. The CPU
allocator reports every allocation and free made while profiling (c10's
ProfiledCPUMemoryReporter); the allocation events are ordered by time and
their signed sizes summed to a running total, whose maximum is the peak:
bytes allocated during the code and not yet freed.
"""
import argparse
import importlib
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

# How the page and the tables name the two sides of a comparison.
SIDE_NAMES = {"backport": "2.13 + torch_ctxext", "native": "native 2.15"}


# --------------------------------------------------------------------------
# Inside a worker process.
# --------------------------------------------------------------------------


def backward_peak_bytes(run_backward):
    """Peak of the bytes allocated during run_backward() and not yet freed,
    from the CPU allocator's events (see the module docstring), the net
    bytes still allocated at its end, and the bytes of every allocation."""
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
    total = peak = allocated = 0
    for _, size in events:
        total += size
        peak = max(peak, total)
        allocated += max(size, 0)
    return {"peak_bytes": peak, "net_bytes": total, "allocated_bytes": allocated, "events": len(events)}


def worker_main(plugin, modules):
    """Answer requests on stdin, one JSON line each, until stdin closes."""
    if not plugin:
        # The native side must not import torch_ctxext (the examples import
        # it when they can).
        sys.modules["torch_ctxext"] = None
    import torch

    measures = {}
    for name in modules:
        measures.update(importlib.import_module(name).MEASURES)
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
        if all(status == "native" for status in info["features"].values()):
            from torch_ctxext._ext import advise_module

            found = advise_module._find()  # which watch advise() takes (looked for, not loaded)
            info["advise_watch"] = f"C++, {found[1]}" if found else "Python (no build of its C++ watch)"
    out = sys.stdout
    out.write(MARK + json.dumps({"ready": info}) + "\n")
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = {"ok": measures[request["measure"]](**request.get("kwargs", {}))}
        except Exception:  # reported to the orchestrator, which raises
            reply = {"error": traceback.format_exc()}
        out.write(MARK + json.dumps(reply) + "\n")
        out.flush()


# --------------------------------------------------------------------------
# In the orchestrator: workers, alternation, statistics.
# --------------------------------------------------------------------------


def _built_in_place():
    """Whether the source tree holds a built extension (setup.py build_ext --inplace)."""
    package = os.path.join(ROOT, "torch_ctxext")
    return any(n.startswith("_C.") and n.endswith((".so", ".pyd")) for n in os.listdir(package))


class Worker:
    """A long-lived measuring process (this file with --worker) that serves
    the measurements of the benchmark modules named in ``modules``."""

    def __init__(self, python, label, plugin, modules, source_tree=True, path=None):
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
        command = [python, HERE, "--worker", *modules] + (["--plugin"] if plugin else [])
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


def run_once(python, function, env=None):
    """``function`` ("module.name") called in a fresh process of ``python``
    (this file with --once, from the temporary directory); its JSON result."""
    out = subprocess.run([python, HERE, "--once", function], capture_output=True, text=True,
                         check=True, cwd=tempfile.gettempdir(), env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


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


def spread(s):
    """A ratio_stats() as the tables print it: median (10th–90th percentile)."""
    return f"{s['ratio']:.3f} ({s['p10']:.3f}–{s['p90']:.3f})"


def release_key(version):
    """A torch version ("2.13.0+cpu") as a sortable tuple."""
    return tuple(int(p) for p in version.split("+")[0].split(".")[:3])


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


def load_average():
    return os.getloadavg() if hasattr(os, "getloadavg") else None


def new_results(plan, quick):
    """The start of a run's JSON-able results: its plan (the grid left out)
    and the machine, before anything is measured."""
    return {
        "plan": {k: v for k, v in plan.items() if k != "grid"},
        "quick": quick,
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="The entry of the processes the benchmarks start "
        "(to run the benchmarks: benchmarks/run_all.py)."
    )
    parser.add_argument("--worker", nargs="+", metavar="MODULE",
                        help="answer requests for the MEASURES of these modules on stdin")
    parser.add_argument("--plugin", action="store_true", help="with --worker: import torch_ctxext")
    parser.add_argument("--once", metavar="MODULE.FUNCTION",
                        help="print FUNCTION()'s result as one JSON line")
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(args.plugin, args.worker)
    if args.once:
        module, _, function = args.once.rpartition(".")
        print(json.dumps(getattr(importlib.import_module(module), function)()))
        return 0
    parser.error("--worker or --once (to run the benchmarks: benchmarks/run_all.py)")


if __name__ == "__main__":
    sys.exit(main())
