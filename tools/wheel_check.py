"""Check an installed binary wheel as a user meets it: no compiler, nothing built, nothing started.

    python tools/wheel_check.py [--rounds N] [--allow-probe]

Run with the interpreter of an environment where torch and the torch_ctxext
wheel are installed (``python3 tools/run.py test`` and ``tools/wheels.py
--verify`` do, once tools/wheel_verdicts.py has added the layout verdict for
that torch to the wheel). It runs everything in child processes whose PATH
holds that environment's scripts only (no ``cc``, ``c++``, ``g++`` or
``ninja``), with ``CC``/``CXX`` failing, ``TORCH_CTXEXT_JIT=0`` and an empty
build cache (and an empty ``$XDG_CACHE_HOME``: no verdict kept by an earlier
run is read), and checks that:

* ``import torch_ctxext`` loads the packaged binary (nothing compiled, no
  build in the cache) and provides every member the torch lacks; where the
  torch provides them all, it loads nothing, and advise() loads the packaged
  build of its C++ watch;
* the first import starts no process: an audit hook (``sys.addaudithook``),
  installed after ``import torch`` and recording only during ``import
  torch_ctxext``, sees none of the events that start one (``STARTS``). The
  loaded binary's layout verdict is read from beside it, where the wheel
  carries it. ``--allow-probe`` is for a torch build the wheel carries no
  verdict for: the first import then verifies the layout in a child
  process, as it must, and the figures say what it started;
* ``python -m torch_ctxext check`` conforms;
* the import's own cost after ``import torch``, timed inside each process,
  first import against later ones: the median over ``--rounds`` fresh
  processes each with a new, empty cache (a first import), and over
  ``--rounds`` fresh processes sharing a cache one import has used (later
  imports).

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

# The audit events raised by whatever starts a process: fork, exec, spawn,
# subprocess, system (CPython's audit events table).
STARTS = ("os.posix_spawn", "os.fork", "os.forkpty", "subprocess.Popen", "os.exec", "os.system", "os.spawn",
          "pty.spawn")

IMPORT = """
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
STARTS = %r
started, recording = [], False
def hook(event, args):
    # Only this package's import: torch's own may start something.
    if recording and event in STARTS:
        started.append([event, repr(args[:2])[:300]])
sys.addaudithook(hook)
recording = True
t2 = time.perf_counter()
import torch_ctxext
t3 = time.perf_counter()
recording = False
from torch_ctxext._ext import loader
print(json.dumps({"torch_s": t1 - t0, "torch_ctxext_s": t3 - t2, "features": torch_ctxext.features(),
                  "origin": loader.loaded and loader.loaded.origin, "choice": loader.choice,
                  "binary": loader.loaded and loader.loaded.path, "verdict": loader.verdict_path,
                  "started": started, "torch": torch.__version__}))
""" % (STARTS,)

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
    """The environment of every child: no compiler, no build at import, and
    ``cache`` for both the build cache and $XDG_CACHE_HOME (the importer's
    own verdicts): nothing of an earlier import is found elsewhere."""
    scripts = os.path.dirname(sys.executable)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_CTXEXT_", "PYTHON"))}
    env.update(PATH=scripts, CC="/bin/false", CXX="/bin/false", TORCH_CTXEXT_JIT="0",
               TORCH_CTXEXT_CACHE=os.path.join(cache, "torch_ctxext"), XDG_CACHE_HOME=os.path.join(cache, "xdg"))
    for tool in ("cc", "c++", "g++", "gcc", "ninja"):
        if shutil.which(tool, path=scripts):
            fail(f"{tool} is reachable from {scripts}: not an environment without a compiler")
    return env


def imported(env):
    """One fresh process's ``import torch_ctxext`` (IMPORT's figures)."""
    done = subprocess.run([sys.executable, "-c", IMPORT], capture_output=True, text=True, env=env, cwd="/")
    if done.returncode != 0:
        fail(f"import torch_ctxext failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _ms(rounds, key="torch_ctxext_s"):
    return round(statistics.median(r[key] for r in rounds) * 1e3, 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10,
                        help="first imports (each with an empty cache) and later ones, each (default %(default)s)")
    parser.add_argument("--allow-probe", action="store_true",
                        help="the wheel carries no verdict for this torch: the first import may verify in a child")
    args = parser.parse_args()
    top = tempfile.mkdtemp(prefix="torch_ctxext-wheel-check-")
    try:
        # First imports: each in a fresh process with a cache of its own, empty.
        first = []
        for i in range(max(1, args.rounds)):
            first.append(imported(environment(os.path.join(top, f"first-{i}"))))
        # Later imports: fresh processes sharing a cache a first import used.
        cache = os.path.join(top, "later")
        env = environment(cache)
        imported(env)
        later = [imported(env) for _ in range(max(1, args.rounds))]
        one = first[0]
        all_native = all(status == "native" for status in one["features"].values())
        if all_native:
            if one["origin"] is not None:
                fail(f"torch provides every member, yet the import loaded {one['origin']} ({one['choice']})")
            done = subprocess.run([sys.executable, "-c", ADVISE], capture_output=True, text=True, env=env, cwd="/")
            if done.returncode != 0:
                fail(f"advise() failed:\n{done.stderr}")
            advised = json.loads(done.stdout.strip().splitlines()[-1])
            if advised["loaded_at_import"] or not advised["choice"].startswith("the packaged binary"):
                fail(f"advise() did not watch with the packaged build of its C++ watch: {advised}")
            one["origin"], one["choice"] = "package (advise()'s watch)", advised["choice"]
        elif not str(one["origin"]).startswith("package"):
            fail(f"the import did not load a packaged binary: {one['origin']} ({one['choice']})")
        unavailable = {m: s for m, s in one["features"].items() if s.startswith("unavailable")}
        if unavailable:
            fail(f"members unavailable: {unavailable}")
        carried = bool(one["binary"] and one["verdict"]) and \
            os.path.dirname(one["verdict"]) == os.path.dirname(one["binary"])
        figures = (f"first import {_ms(first)} ms, later {_ms(later)} ms (medians of {len(first)} and "
                   f"{len(later)} processes)")
        later_started = [r["started"] for r in later if r["started"]]
        if later_started:
            fail(f"a later import started processes: {later_started[0]}")
        first_started = [r["started"] for r in first if r["started"]]
        if first_started and not args.allow_probe:
            where = ("the verdict was read beside the binary" if carried else
                     f"the wheel carries no layout verdict for torch {one['torch']} beside the binary it loaded "
                     f"(tools/wheel_verdicts.py adds one); the verdict came from {one['verdict']}")
            fail(f"the first import started processes: {first_started[0]} ({where}; {figures})")
        builds = os.listdir(os.path.join(cache, "torch_ctxext", "builds")) if \
            os.path.isdir(os.path.join(cache, "torch_ctxext", "builds")) else []
        if [n for n in builds if n != "layouts"]:
            fail(f"something was built: {builds}")
        check = subprocess.run([sys.executable, "-m", "torch_ctxext", "check"], capture_output=True, text=True,
                               env=env, cwd="/")
        if check.returncode != 0 or "verdict: conforms" not in check.stdout:
            fail(f"check does not conform:\n{check.stdout[-3000:]}\n{check.stderr[-3000:]}")
        print(json.dumps({
            "torch": one["torch"], "python": sys.implementation.cache_tag, "origin": one["origin"],
            "choice": one["choice"], "built": [n for n in builds if n != "layouts"],
            "verdict": "carried by the wheel" if carried else "made at the first import" if one["verdict"] else None,
            "first_import_started": len(first_started[0]) if first_started else 0,
            "first_import_ms_median": _ms(first),
            "import_ms_median": _ms(later),
            "import_torch_ms_median": _ms(later, "torch_s"),
            "check": "conforms",
        }), flush=True)
    finally:
        shutil.rmtree(top, ignore_errors=True)


if __name__ == "__main__":
    main()
