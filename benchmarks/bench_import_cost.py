"""The import's own cost: this checkout against an earlier revision, side by side.

    python benchmarks/run_all.py --from-json docs/benchmarks.json --remeasure import_cost \\
                                 --against REV [--torch-2-13 PY]

``import torch_ctxext`` in a process that has already imported torch
(perf_counter around the import), with the extension from a warm build
cache, for this checkout's package and for the package of revision ``REV``
(``git archive``), each a sources-only copy on ``PYTHONPATH``, sharing one
build cache (each has its build, made before the rounds, and this
checkout's has its layout verdict). The two alternate process by process,
round after round, rotating which goes first; the ratio is the median of
per-round ratios (10th to 90th percentile in parentheses), the times are
medians over rounds and, least disturbed by other load, minima.

Then, in one process that imported this checkout's package, what finding
the layout verdict costs (the import's new step: the build's and torch's
GNU build ids, the verdict's name, reading its JSON): best of 5 times 100
calls.
"""
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import bench
from bench import ROOT
from bench_import import _env, _run, _sources_only_copy, measured_on, timed_imports


def _revision_copy(rev, site):
    """The package of revision ``rev`` (with csrc/ inside it), sources only."""
    tree = tempfile.mkdtemp(prefix="torch_ctxext-rev-")
    try:
        # The build layer beside the package, in the revisions that have one.
        layer = subprocess.run(["git", "-C", ROOT, "ls-tree", "--name-only", rev, "_torch_ctxext_build"],
                               capture_output=True, text=True, check=True).stdout.split()
        archive = subprocess.run(["git", "-C", ROOT, "archive", rev, "torch_ctxext", "csrc", *layer],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
        package = os.path.join(site, "torch_ctxext")
        shutil.copytree(os.path.join(tree, "torch_ctxext"), package)
        shutil.copytree(os.path.join(tree, "csrc"), os.path.join(package, "csrc"))
        for name in layer:
            shutil.copytree(os.path.join(tree, name), os.path.join(site, name))
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", rev], capture_output=True,
                            text=True, check=True).stdout.strip()
    return commit


FIND_VERDICT = (
    "import timeit, torch, torch_ctxext\n"
    "from _torch_ctxext_build import layout_verdict as v\n"
    "from torch_ctxext._ext import loader as l\n"
    "def find():\n"
    "    library = l.loaded.path\n"
    "    return v.read(v.beside(library))\n"
    "assert find() is not None\n"
    "print(min(timeit.repeat(find, number=100, repeat=5)) / 100 * 1e3)\n"
)


def collect(python=None, against="HEAD~1", rounds=20):
    """Measure; return a JSON-able dict."""
    python = python or sys.executable
    work = tempfile.mkdtemp(prefix="torch_ctxext-bench-import-cost-")
    try:
        cache = os.path.join(work, "cache")
        sites = {"this checkout": os.path.join(work, "site-new"), "earlier": os.path.join(work, "site-old")}
        _sources_only_copy(sites["this checkout"])
        earlier = _revision_copy(against, sites["earlier"])
        sides = {side: _env(site, cache) for side, site in sites.items()}
        for side, env in sides.items():  # each builds (and verifies) once, before the rounds
            bench.log(f"warming {side}: its build")
            _run(python, "import torch_ctxext", env)
        info = json.loads(_run(python, "import json, torch; print(json.dumps([torch.__version__, torch.version.git_version]))",
                               sides["earlier"])[1].stdout)
        bench.log(f"import torch_ctxext, this checkout vs {earlier}: {rounds} rounds")
        per_round = timed_imports(python, sides, rounds, origins=dict.fromkeys(sides, "cache"))
        ratios = [n / o for n, o in zip(per_round["this checkout"], per_round["earlier"])]
        find_verdict_ms = float(_run(python, FIND_VERDICT, sides["this checkout"])[1].stdout)
        return {
            **measured_on(info),
            "against": earlier,
            "rounds": rounds,
            "new_ms": statistics.median(per_round["this checkout"]),
            "old_ms": statistics.median(per_round["earlier"]),
            "new_min_ms": min(per_round["this checkout"]),
            "old_min_ms": min(per_round["earlier"]),
            "new_over_old": bench.ratio_stats(ratios),
            "find_verdict_ms": find_verdict_ms,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def table(r):
    """The Markdown table of the page."""
    s = r["new_over_old"]
    return "\n".join([
        "| measurement | time |",
        "|---|---|",
        f"| `import torch_ctxext` after `import torch`, this checkout (verdict read; no autograd) | {r['new_ms']:.1f} ms (least disturbed {r['new_min_ms']:.1f} ms) |",
        f"| `import torch_ctxext` after `import torch`, {r['against']} (layout probe run in the process) | {r['old_ms']:.1f} ms (least disturbed {r['old_min_ms']:.1f} ms) |",
        f"| this checkout / {r['against']} | {s['ratio']:.3f} ({s['p10']:.3f}–{s['p90']:.3f}), {r['new_ms'] - r['old_ms']:+.1f} ms |",
        f"| finding and reading the layout verdict (build ids, name, JSON) | {r['find_verdict_ms']:.3f} ms |",
    ])
