"""The first import, three ways, side by side in one run.

    python benchmarks/bench_first_import.py [--python PY] [--rounds 3] [--against REV] [--json FILE]

In each round, one fresh process each, in turn (the order rotating from
round to round), all from an empty build cache:

* ``build``: ``import torch_ctxext`` on a sources-only copy of this checkout
  (the build at first import, in its own process, and the layout verified);
* ``one TU``: the smallest torch extension there is, one translation unit
  that includes ``torch/extension.h`` and binds one function, built with
  ``torch.utils.cpp_extension.load`` (what a user compares a build with);
* ``wheel``: ``import torch_ctxext`` on a copy carrying a packaged binary for
  this torch (a binary wheel's layout, tools/wheels.py), nothing compiled
  (its first import verifies the layout once, in a child process);
* with ``--against REV``: ``build`` of that revision of the sources too.

Each is the wall clock of the whole process (``python -c ...``), including
``import torch``. The ratios (build / one TU, ...) are per round; the
median and the extremes are printed, and the machine's load average.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
from package_copy import add_packaged_binaries, sources_only_copy  # noqa: E402
ONE_TU = r"""
#include <torch/extension.h>
torch::Tensor twice(const torch::Tensor& x) { return x * 2; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("twice", &twice); }
"""
LOAD_ONE_TU = ("import sys, torch, torch.utils.cpp_extension as c; "
               "c.load(name='one_tu', sources=[sys.argv[1]], build_directory=sys.argv[2])")


def _copy(source_root, site, binary=None):
    """The package of the checkout at ``source_root``, nothing built, and
    with ``binary`` ((path, manifest entry)) packaged as a wheel carries it."""
    package = sources_only_copy(os.path.join(source_root, "torch_ctxext"), site)
    if binary is not None:
        path, entry = binary
        with open(path, "rb") as f:
            add_packaged_binaries(package, [("this", f.read(), entry)])


def _timed(command, env):
    start = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tempfile.gettempdir())
    if done.returncode != 0:
        raise RuntimeError(f"{command} failed:\n{done.stderr[-3000:]}")
    return time.monotonic() - start, done


def _env(site=None, cache=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_CTXEXT_")}
    if site:
        env["PYTHONPATH"] = site
    if cache:
        env["TORCH_CTXEXT_CACHE"] = cache
    return env


def _this_binary(python, work):
    """A build of the extension for ``python``'s torch, and its manifest entry."""
    site, cache = os.path.join(work, "binary-site"), os.path.join(work, "binary-cache")
    _copy(ROOT, site)
    code = ("import json, sys, torch, torch_ctxext; from torch_ctxext._ext import loader; "
            "print(json.dumps([loader.loaded.path, {'torch': torch.__version__, 'git': torch.version.git_version, "
            "'cxx11_abi': bool(torch._C._GLIBCXX_USE_CXX11_ABI), 'python': sys.implementation.cache_tag}]))")
    _, done = _timed([python, "-c", code], _env(site, cache))
    path, entry = json.loads(done.stdout.strip().splitlines()[-1])
    kept = os.path.join(work, "binary.so")
    shutil.copy(path, kept)
    return kept, entry


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--against", help="a git revision whose build at first import runs beside")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    work = tempfile.mkdtemp(prefix="torch_ctxext-bench-first-")
    try:
        tu = os.path.join(work, "one_tu.cpp")
        with open(tu, "w") as f:
            f.write(ONE_TU)
        binary = _this_binary(args.python, work)
        sides = {"build": ROOT, "one TU": None, "wheel": ROOT}
        if args.against:
            old = os.path.join(work, "against")
            subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", old, args.against], check=True,
                           capture_output=True)
            sides["against"] = old
        times = {side: [] for side in sides}
        loads = []
        for r in range(args.rounds):
            order = list(sides)[r % len(sides):] + list(sides)[: r % len(sides)]
            loads.append(os.getloadavg()[0])
            for side in order:
                fresh = tempfile.mkdtemp(dir=work)
                if side == "one TU":
                    os.makedirs(os.path.join(fresh, "build"))
                    seconds, _ = _timed([args.python, "-c", LOAD_ONE_TU, tu, os.path.join(fresh, "build")], _env())
                else:
                    site = os.path.join(fresh, "site")
                    _copy(sides[side], site, binary if side == "wheel" else None)
                    seconds, done = _timed([args.python, "-c", "import torch_ctxext"],
                                           _env(site, os.path.join(fresh, "cache")))
                    if side == "wheel":
                        assert "building" not in done.stderr, done.stderr
                times[side].append(seconds)
                shutil.rmtree(fresh, ignore_errors=True)
                print(f"round {r + 1} {side}: {seconds:.1f} s", flush=True)
        result = {"python": args.python, "rounds": args.rounds, "load_average": loads,
                  "seconds": times, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        for side in sides:
            if side == "one TU":
                continue
            ratios = [a / b for a, b in zip(times[side], times["one TU"])]
            result[f"{side} / one TU"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
        for side, values in times.items():
            print(f"{side:8} median {statistics.median(values):6.1f} s  (every round: "
                  f"{', '.join(f'{v:.1f}' for v in values)})")
        for key, value in result.items():
            if key.endswith("/ one TU"):
                print(f"{key}: {value['median']:.2f} ({value['min']:.2f} to {value['max']:.2f})")
        print(f"load average (1 min) at each round's start: {', '.join(f'{v:.1f}' for v in loads)}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    finally:
        if args.against:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", os.path.join(work, "against")],
                           capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
