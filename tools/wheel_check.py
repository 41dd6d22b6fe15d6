"""Check an installed binary wheel as a user meets it: no compiler, nothing built.

    python tools/wheel_check.py [--rounds N]

Run with the interpreter of an environment where torch and the torch_ctxext
wheel are installed (``bash tools/run.sh test`` and ``tools/wheels.py
--verify`` do). It runs everything in child processes whose PATH holds that
environment's scripts only (no ``cc``, ``c++``, ``g++`` or ``ninja``), with
``CC``/``CXX`` failing, ``TORCH_CTXEXT_JIT=0`` and an empty build cache, and
checks that:

* ``import torch_ctxext`` loads the packaged binary (nothing compiled, no
  build in the cache) and provides every member the torch lacks; where the
  torch provides them all, it loads nothing, and advise() loads the packaged
  build of its C++ watch;
* ``python -m torch_ctxext check`` conforms;
* the import's own cost after ``import torch``: the median over ``--rounds``
  fresh processes of (import torch, then torch_ctxext) minus (import torch),
  timed inside each process.

Prints one JSON line with the figures; exits 1 on the first failure.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

IMPORT = """
import json, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import torch_ctxext
t2 = time.perf_counter()
from torch_ctxext._ext import loader
print(json.dumps({"torch_s": t1 - t0, "torch_ctxext_s": t2 - t1, "features": torch_ctxext.features(),
                  "origin": loader.loaded and loader.loaded.origin, "choice": loader.choice,
                  "torch": torch.__version__}))
"""

# Where torch provides every member natively: the import loads nothing, and
# advise() watches with the packaged build of its C++ watch.
ADVISE = """
import json, sys
import torch, torch_ctxext
from torch_ctxext._ext import advise_module
loaded_at_import = sorted(m for m in sys.modules if m.startswith("torch_ctxext.") and m.endswith("._C"))
layer = torch.nn.Linear(3, 3)
with torch_ctxext.advise(layer) as report:
    sum(layer(torch.randn(2, 3) * k).sum() for k in range(3)).backward()
print(json.dumps({"loaded_at_import": loaded_at_import, "choice": advise_module.choice,
                  "temporaries": report["weight"].temporaries}))
"""


def fail(message):
    print(f"wheel_check: FAILED: {message}", flush=True)
    sys.exit(1)


def environment(cache):
    scripts = os.path.dirname(sys.executable)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_CTXEXT_", "PYTHON"))}
    env.update(PATH=scripts, CC="/bin/false", CXX="/bin/false", TORCH_CTXEXT_JIT="0", TORCH_CTXEXT_CACHE=cache)
    for tool in ("cc", "c++", "g++", "gcc", "ninja"):
        if shutil.which(tool, path=scripts):
            fail(f"{tool} is reachable from {scripts}: not an environment without a compiler")
    return env


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    cache = tempfile.mkdtemp(prefix="torch_ctxext-wheel-check-")
    env = environment(cache)
    try:
        rounds = []
        for _ in range(max(1, args.rounds)):
            done = subprocess.run([sys.executable, "-c", IMPORT], capture_output=True, text=True, env=env, cwd="/")
            if done.returncode != 0:
                fail(f"import torch_ctxext failed:\n{done.stderr}")
            rounds.append(json.loads(done.stdout.strip().splitlines()[-1]))
        first = rounds[0]
        all_native = all(status == "native" for status in first["features"].values())
        if all_native:
            if first["origin"] is not None:
                fail(f"torch provides every member, yet the import loaded {first['origin']} ({first['choice']})")
            done = subprocess.run([sys.executable, "-c", ADVISE], capture_output=True, text=True, env=env, cwd="/")
            if done.returncode != 0:
                fail(f"advise() failed:\n{done.stderr}")
            advised = json.loads(done.stdout.strip().splitlines()[-1])
            if advised["loaded_at_import"] or not advised["choice"].startswith("the packaged binary"):
                fail(f"advise() did not watch with the packaged build of its C++ watch: {advised}")
            first["origin"], first["choice"] = "package (advise()'s watch)", advised["choice"]
        elif not str(first["origin"]).startswith("package"):
            fail(f"the import did not load a packaged binary: {first['origin']} ({first['choice']})")
        unavailable = {m: s for m, s in first["features"].items() if s.startswith("unavailable")}
        if unavailable:
            fail(f"members unavailable: {unavailable}")
        builds = [n for n in os.listdir(os.path.join(cache, "builds"))] if os.path.isdir(os.path.join(cache, "builds")) else []
        if [n for n in builds if n != "layouts"]:
            fail(f"something was built: {builds}")
        check = subprocess.run([sys.executable, "-m", "torch_ctxext", "check"], capture_output=True, text=True,
                               env=env, cwd="/")
        if check.returncode != 0 or "verdict: conforms" not in check.stdout:
            fail(f"check does not conform:\n{check.stdout[-3000:]}\n{check.stderr[-3000:]}")
        later = rounds[1:] or rounds  # the first import verified the layout (once per torch), in a child
        cost = statistics.median(r["torch_ctxext_s"] for r in later)
        print(json.dumps({
            "torch": first["torch"], "python": sys.implementation.cache_tag, "origin": first["origin"],
            "choice": first["choice"], "built": [n for n in builds if n != "layouts"],
            "first_import_ms": round(rounds[0]["torch_ctxext_s"] * 1e3, 1),
            "import_ms_median": round(cost * 1e3, 1),
            "import_torch_ms_median": round(statistics.median(r["torch_s"] for r in later) * 1e3, 1),
            "check": "conforms",
        }), flush=True)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
