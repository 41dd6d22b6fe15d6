"""Idle cost counted in instructions: what ``import torch_ctxext`` costs a
Function that uses nothing new, free of the machine's noise.

    python benchmarks/run_all.py --from-json FILE --remeasure instructions \\
                                 [--torch-2-13 PY] [--other-releases PY[:DIR]...]

On a shared 2-core machine the idle cost in wall time (bench_overhead.py) has
a 10th-90th percentile range of 0.7 to 1.4 around a ratio the target wants
within 1.02: the noise is twenty times the effect. Counting instructions is
deterministic. Each release's python runs one small Function's forward and
backward (bench_overhead's ``Plain``: save_for_backward, one op each way)
under valgrind's callgrind, with and without ``import torch_ctxext`` (the
torch_ctxext of that environment, or of DIR, first on PYTHONPATH, for
``PY:DIR``; built before counting), for
``SHORT`` and ``LONG`` iterations; the difference between the two counts,
divided by the difference in iterations, is the cost of one step, with the
start of the interpreter, the imports and the first steps cancelled out.
BLAS and OpenMP get one thread (OpenBLAS's idle threads spin, and their
spinning would be counted), and Python one hash seed.

Instructions are not time (a cache miss costs more than an add), but every
cost the import could add on the idle path (a Python-level wrapper, a hook
in the engine, state copied into every graph task) executes instructions;
that is how the functorch state left by the import's probes was found
(torch 2.14: 219.1k instructions per step with the import against 212.8k
without; 210.3k once the probes dropped it again).
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import bench

# A long run's 4000 more steps: what differs once between two processes (a
# garbage collection, a lazy import that one of them happens to trigger)
# moves the per-step figure by a 4000th of itself. With 1000 more steps,
# one-time differences of 0.9M instructions were seen (0.4% of a step).
SHORT, LONG = 100, 4100

# One process: torch, then (with_import) torch_ctxext, then the steps.
SCRIPT = """
import sys
import torch
torch.set_num_threads(1)
if sys.argv[1] == "1":
    import torch_ctxext
sys.path.insert(0, sys.argv[3])
from bench_overhead import _plain_function
plain = _plain_function()
x = torch.ones(16, requires_grad=True)
for _ in range(int(sys.argv[2])):
    plain.apply(x).sum().backward()
"""


def available():
    """None if callgrind can run here, else why not."""
    return None if shutil.which("valgrind") else "valgrind is not installed"


def _env(path=None):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if path:
        env["PYTHONPATH"] = path
    # One hash seed for every run: string hashes decide how many probes each
    # dict lookup takes, which moves a count by up to 1% from run to run.
    env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0")
    return env


def _start(python, with_import, iterations, work, path):
    """Start callgrind on ``work``/steps.py in one process; returns the
    process and the files its counts and its stderr go to (files, not pipes:
    two runs are waited for one after the other, and a full pipe would stall
    the second)."""
    out = os.path.join(work, f"callgrind.{int(with_import)}.{iterations}")
    with open(out + ".stderr", "w") as err:
        process = subprocess.Popen(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", python,
             os.path.join(work, "steps.py"), "1" if with_import else "0", str(iterations),
             os.path.dirname(bench.HERE)],
            env=_env(path), cwd=work, stdout=subprocess.DEVNULL, stderr=err,
        )
    return process, out


def _total(path):
    with open(path) as f:
        for line in f:
            match = re.match(r"(?:summary|totals):\s*(\d+)", line)
            if match:
                return int(match.group(1))
    raise RuntimeError(f"no instruction total in {path}")


def measure(entry):
    """{"torch", "features", "without", "with" (instructions per step),
    "ratio"} for one environment's python (``PY`` or ``PY:DIR``): four
    callgrind runs, two at a time (one per core)."""
    python, _, path = entry.partition(":")
    probe = subprocess.run(
        [python, "-c", "import json, torch, torch_ctxext; "
         "print(json.dumps([torch.__version__, torch_ctxext.features()]))"],
        env=_env(path), capture_output=True, text=True, cwd=tempfile.gettempdir(),
    )  # also builds torch_ctxext for this torch if its cache has no build yet
    if probe.returncode != 0:
        raise RuntimeError(f"{python}: import torch_ctxext failed:\n{probe.stderr}")
    version, features = json.loads(probe.stdout.splitlines()[-1])
    work = tempfile.mkdtemp(prefix="torch_ctxext-bench-instructions-")
    with open(os.path.join(work, "steps.py"), "w") as f:
        f.write(SCRIPT)
    counts, runs = {}, []
    try:
        for with_import in (False, True):
            runs = [_start(python, with_import, n, work, path) for n in (SHORT, LONG)]
            for (process, out), n in zip(runs, (SHORT, LONG)):
                if process.wait() != 0:
                    with open(out + ".stderr") as err:
                        raise RuntimeError(f"callgrind failed on {python}:\n{err.read()[-2000:]}")
                counts[(with_import, n)] = _total(out)
    finally:
        for process, _ in runs:  # the other run of a pair that failed
            if process.poll() is None:
                process.kill()
                process.wait()
        shutil.rmtree(work, ignore_errors=True)
    per_step = {
        side: (counts[(flag, LONG)] - counts[(flag, SHORT)]) / (LONG - SHORT)
        for side, flag in (("without", False), ("with", True))
    }
    return {
        "torch": version,
        "features": features,
        **per_step,
        "ratio": per_step["with"] / per_step["without"],
        "iterations": [SHORT, LONG],
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def collect(pythons):
    """measure() on each ``PY`` or ``PY:DIR``, one after another: {torch version: row}."""
    why_not = available()
    if why_not:
        raise RuntimeError(f"cannot count instructions: {why_not}")
    rows = {}
    for python in pythons:
        bench.log(f"instructions: {python}")
        row = measure(python)
        rows[row["torch"]] = row
        bench.log(f"instructions on torch {row['torch']}: {row['with'] / 1e3:.1f}k with, "
                  f"{row['without'] / 1e3:.1f}k without ({row['ratio']:.3f})")
    return rows


def table(rows):
    """The Markdown table of the page."""
    out = [
        "| torch | provided by torch_ctxext | instructions per forward+backward: without / with `import torch_ctxext` | with / without (target ≤ 1.02) | date |",
        "|---|---|---|---|---|",
    ]
    for version, r in sorted(rows.items(), key=lambda kv: bench.release_key(kv[0])):
        provided = ", ".join(
            f"`{m}`" for m, how in sorted(r["features"].items()) if how == "torch_ctxext"
        ) or "nothing"
        out.append(
            f"| {version} | {provided} | {r['without'] / 1e3:.1f}k / {r['with'] / 1e3:.1f}k "
            f"| {r['ratio']:.3f} | {r['date']} |"
        )
    return "\n".join(out)


if __name__ == "__main__":  # one environment, printed: python bench_idle_instructions.py PYTHON...
    print(table(collect(sys.argv[1:] or [sys.executable])))
