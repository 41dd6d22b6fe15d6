"""Installing: the first import, which builds the extension, and every import after it.

    python benchmarks/run_all.py --torch-2-15 PY215 --install ...
    python benchmarks/run_all.py --from-json FILE --remeasure install [--torch-2-13 PY]
    python benchmarks/run_all.py --from-json FILE --remeasure builds --torch-2-15 PY215 \\
                                 [--torch-2-13 PY] [--other-releases PY...]

``install`` (collect()) wants the python of a torch that needs torch_ctxext's
extension (2.12 to 2.14); it measures this checkout's sources, in a temporary
directory. ``builds`` (first_import_per_release()) measures only the first
import (the build for a new torch) from an empty cache on each interpreter's
torch, one after another.

First import: one process ``python -c "import torch_ctxext"`` on a
sources-only copy of the package (what ``pip install`` leaves when the build
cannot see torch) with an empty build cache, wall clock: the build at first
import. Beside it, ``python -c "import torch"`` (median of 5 processes).

Later imports: ``import torch_ctxext`` in a process that has already imported
torch (perf_counter around the import), with the extension loaded from the
build cache vs shipped in the package (the same library, copied into a second
copy of the package with its ``_build_info.py``, as ``pip install
--no-build-isolation`` installs it), so that only how the build is found
differs. The two alternate process by process, round after round, rotating
which goes first; the ratio is the median of per-round ratios (10th to 90th
percentile in parentheses), the times are medians over rounds and, least
disturbed by other load, minima.

Finding the build: in one process, the lookup alone, without loading (best of
5 times 100 calls): in the cache (reading and hashing the files its name
depends on) vs in the package.
"""
import glob
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

sys.path.insert(0, os.path.join(ROOT, "tools"))
from package_copy import sources_only_copy  # noqa: E402

TIMED_IMPORT = (
    "import time, torch; start = time.perf_counter(); import torch_ctxext; "
    "elapsed = time.perf_counter() - start; import torch_ctxext._ext.loader as e; "
    "print(e.loaded.origin, elapsed)"
)


def _env(site, cache):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_CTXEXT_")}
    env.update(PYTHONPATH=site, TORCH_CTXEXT_CACHE=cache)
    return env


def _sources_only_copy(site):
    """This checkout's package, nothing built (tools/package_copy.py)."""
    return sources_only_copy(os.path.join(ROOT, "torch_ctxext"), site)


def _run(python, code, env):
    start = time.monotonic()
    result = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env, cwd=tempfile.gettempdir())
    if result.returncode != 0:
        raise RuntimeError(f"{code!r} failed:\n{result.stderr}")
    return time.monotonic() - start, result


def _lookup_ms(python, function, env):
    module, name = function.rsplit(".", 1)
    code = (
        f"import timeit, torch, torch_ctxext, {module} as m; "
        f"assert m.{name}(); print(min(timeit.repeat(m.{name}, number=100, repeat=5)) / 100 * 1e3)"
    )
    return float(_run(python, code, env)[1].stdout)


def timed_imports(python, sides, rounds, origins):
    """{side: [ms of `import torch_ctxext` after `import torch`, a process a
    round]} for each side (an environment), the sides alternating process by
    process, round after round, rotating which goes first; each must load
    its extension from ``origins[side]``."""
    per_round = {side: [] for side in sides}
    for r in range(rounds):
        order = list(sides)[r % 2:] + list(sides)[: r % 2]
        for side in order:
            origin, seconds = _run(python, TIMED_IMPORT, sides[side])[1].stdout.split()
            assert origin == origins[side], (side, origin)
            per_round[side].append(float(seconds) * 1e3)
    return per_round


def measured_on(info):
    """What a record says of where and when it was measured: ``info`` is
    [torch.__version__, torch.version.git_version] of the measured torch."""
    return {
        "torch": info[0],
        "torch_git": info[1],
        "python": sys.version.split()[0],
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average": os.getloadavg(),
    }


def collect(python=None, rounds=20):
    """Measure; return a JSON-able dict."""
    python = python or sys.executable
    work = tempfile.mkdtemp(prefix="torch_ctxext-bench-import-")
    try:
        sources, packaged, cache = (os.path.join(work, d) for d in ("site-sources", "site-package", "cache"))
        _sources_only_copy(sources)
        package = _sources_only_copy(packaged)
        info = json.loads(_run(python, "import json, torch; print(json.dumps([torch.__version__, torch.version.git_version]))",
                               _env(sources, cache))[1].stdout)
        bench.log("import torch alone, 5 processes")
        import_torch = statistics.median(_run(python, "import torch", _env(sources, cache))[0] for _ in range(5))
        bench.log("first import: building the extension into an empty cache")
        first, result = _run(python, "import torch_ctxext", _env(sources, cache))
        (key,) = [d for d in os.listdir(os.path.join(cache, "builds")) if os.path.isdir(os.path.join(cache, "builds", d))]
        with open(os.path.join(cache, "builds", key, "build.json")) as f:
            record = json.load(f)
        # The same library, shipped in the package as a compiled install has
        # it, with its layout verdict beside it (made at install).
        suffix = subprocess.run([python, "-c", "import importlib.machinery as m; print(m.EXTENSION_SUFFIXES[0])"],
                                capture_output=True, text=True, check=True).stdout.strip()
        shutil.copy(os.path.join(cache, "builds", key, "_C.so"), os.path.join(package, "_C" + suffix))
        for verdict in glob.glob(os.path.join(cache, "builds", key, "layout-*.json")):
            shutil.copy(verdict, package)
        with open(os.path.join(package, "_build_info.py"), "w") as f:
            f.write(f"TORCH_VERSION = {info[0]!r}\nTORCH_GIT_VERSION = {info[1]!r}\n")
        sides = {"cache": _env(sources, cache), "package": _env(packaged, os.path.join(work, "empty-cache"))}
        bench.log(f"import torch_ctxext, from the cache vs from the package: {rounds} rounds")
        per_round = timed_imports(python, sides, rounds, origins={"cache": "cache", "package": "package"})
        ratios = [c / p for c, p in zip(per_round["cache"], per_round["package"])]
        lookup = {
            "cache": _lookup_ms(python, "torch_ctxext._ext.build_cache.cached_library", sides["cache"]),
            "package": _lookup_ms(python, "torch_ctxext._ext.loader.packaged_build", sides["package"]),
        }
        return {
            **measured_on(info),
            "import_torch_s": import_torch,
            "first_import_s": first,
            "build_s": record["seconds"],
            "build_steps": sum(line.startswith("torch_ctxext: [") for line in result.stderr.splitlines()),
            "cached_ms": statistics.median(per_round["cache"]),
            "package_ms": statistics.median(per_round["package"]),
            "cached_min_ms": min(per_round["cache"]),
            "package_min_ms": min(per_round["package"]),
            "lookup_cache_ms": lookup["cache"],
            "lookup_package_ms": lookup["package"],
            "cached_over_package": bench.ratio_stats(ratios),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def first_import_per_release(pythons, rounds=3):
    """The first import (the build for a new torch) on each interpreter's
    torch, from an empty build cache, ``rounds`` times, the releases taken
    in turn within each round (so that a slow spell of the machine is
    shared out): wall clock of ``python -c "import torch_ctxext"`` on a
    sources-only copy of this checkout's package (the median of the rounds,
    and every round's), the build's own seconds (build.json), what it
    compiled, and the load average before and after (other load only adds
    time). A torch that needs nothing of the extension builds nothing."""
    rows = {}
    for _ in range(rounds):
        for python in pythons:
            run = _first_import_once(python)
            row = rows.setdefault(python, {**run, "runs": []})
            row["runs"].append({k: run[k] for k in ("first_import_s", "build_s", "load_average_before", "load_average_after")})
    for row in rows.values():
        row["first_import_s"] = statistics.median(r["first_import_s"] for r in row["runs"])
        builds = [r["build_s"] for r in row["runs"] if r["build_s"] is not None]
        row["build_s"] = statistics.median(builds) if builds else None
        row["load_average_before"] = max(r["load_average_before"] for r in row["runs"])
        row["load_average_after"] = max(r["load_average_after"] for r in row["runs"])
    return list(rows.values())


def _first_import_once(python):
    work = tempfile.mkdtemp(prefix="torch_ctxext-bench-build-")
    try:
        sources, cache = os.path.join(work, "site"), os.path.join(work, "cache")
        _sources_only_copy(sources)
        env = _env(sources, cache)
        version = _run(python, "import torch; print(torch.__version__)", env)[1].stdout.strip()
        bench.log(f"first import on torch {version}: empty cache")
        load_before = os.getloadavg()
        first, result = _run(python, "import torch_ctxext", env)
        load_after = os.getloadavg()
        builds = os.path.join(cache, "builds")
        keys = [d for d in os.listdir(builds) if os.path.isdir(os.path.join(builds, d))] if os.path.isdir(builds) else []
        record = {}
        if keys:
            with open(os.path.join(builds, keys[0], "build.json")) as f:
                record = json.load(f)
        import_torch = min(_run(python, "import torch", env)[0] for _ in range(3))
        return {
            "torch": version,
            "first_import_s": first,
            "import_torch_s": import_torch,
            "build_s": record.get("seconds"),
            "sources": record.get("sources", []),
            "units": sum(line.startswith("torch_ctxext: [") for line in result.stderr.splitlines()) - 1 if keys else 0,
            "load_average_before": load_before[0],
            "load_average_after": load_after[0],
            "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def builds_table(rows):
    """The first import on each release, as a Markdown table."""
    out = [
        "| torch | first import (empty cache): median (every round) | of which the build | compiled | `import torch` alone | load average (1 min), highest before / after | date |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: bench.release_key(r["torch"])):
        built = (f"{r['build_s']:.1f} s" if r["build_s"] is not None else "no build")
        runs = r.get("runs", [])
        every = " (" + ", ".join(f"{run['first_import_s']:.1f}" for run in runs) + ")" if len(runs) > 1 else ""
        compiled = (f"{r['units']} units: " + ", ".join(f"`{s}`" for s in r["sources"])) if r["sources"] else "nothing"
        out.append(
            f"| {r['torch']} | {r['first_import_s']:.1f} s{every} | {built} | {compiled} | {r['import_torch_s']:.1f} s "
            f"| {r['load_average_before']:.1f} / {r['load_average_after']:.1f} | {r['date']} |"
        )
    return "\n".join(out)


def table(r):
    """The Markdown table of the page."""
    s = r["cached_over_package"]
    return "\n".join([
        "| measurement | time |",
        "|---|---|",
        f"| `python -c \"import torch_ctxext\"`, first import: builds the extension into an empty cache ({r['build_steps'] - 1} files and a link) | {r['first_import_s']:.1f} s (of which the build {r['build_s']:.1f} s) |",
        f"| `python -c \"import torch\"`, for comparison | {r['import_torch_s']:.2f} s |",
        f"| `import torch_ctxext` after `import torch`, extension from the build cache | {r['cached_ms']:.1f} ms (least disturbed {r['cached_min_ms']:.1f} ms) |",
        f"| `import torch_ctxext` after `import torch`, extension shipped in the package | {r['package_ms']:.1f} ms (least disturbed {r['package_min_ms']:.1f} ms) |",
        f"| from the cache / from the package | {s['ratio']:.3f} ({s['p10']:.3f}–{s['p90']:.3f}), {r['cached_ms'] - r['package_ms']:+.1f} ms |",
        f"| finding the build: in the cache / in the package | {r['lookup_cache_ms']:.2f} ms / {r['lookup_package_ms']:.3f} ms |",
    ])
