"""The first import of a package installed from source, and every one after.

* the first import on a torch without a build compiles one into the cache
  (one line saying what and why, then progress), later imports load it;
  processes importing at once build once; a build killed half-way leaves
  nothing loadable; TORCH_CTXEXT_JIT=0 keeps the ImportError;
* a failed build names what is missing and the log file, and features()
  reports every backported member unavailable with that reason.

The tests that need a real build share one (about 20 s on 2 idle cores): the
first_import fixture kills a build half-way, then races two processes on the
first import. The failures use a compiler that fails at once.
"""
import fcntl
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sysconfig
import time

import pytest
import torch

from torch_ctxext import _releases

from install_env import (  # noqa: F401  (installed_from_source, sdist, user_env: fixtures)
    ANNOUNCE, BACKPORTED, BUILD_TIMEOUT, CSRC, LOADED, ROOT, checkout, clean_env, failing_compiler,
    installed_from_source, needs_extension, run, sdist, user_env,
)
from support import reap, wait_until


@pytest.fixture(scope="session")
def first_import(user_env, installed_from_source, tmp_path_factory):
    """The first imports of a sources-only install, into an empty cache: one
    killed half-way, then two processes at once. Shared by the tests below:
    they build once between them."""
    cache = tmp_path_factory.mktemp("cache")
    builds = cache / "builds"
    runs = {}

    # 1. A first import killed half-way through its build (the job is killed).
    victim = subprocess.Popen(
        [str(user_env.python), "-c", "import torch_ctxext"], cwd="/",
        env=clean_env(TORCH_CTXEXT_CACHE=cache), stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )
    for line in victim.stderr:
        if line.startswith(ANNOUNCE):
            break
    wait_until(lambda: glob.glob(str(builds / "*.partial-*" / "build.ninja")), 120, "the build wrote its build.ninja")
    time.sleep(2)  # the compilers are running
    under_way = glob.glob(str(builds / "*.partial-*"))
    os.killpg(victim.pid, signal.SIGKILL)  # the job's processes, the importer's group
    reap(victim)
    # The build's supervisor ends the build, removes its directory, then exits:
    # its lock goes with it, a moment after the directory (wait for all three).
    wait_until(lambda: not (glob.glob(str(builds / "*.partial-*")) or _processes_using(under_way)
                            or not _lock_free(builds)),
               60, "the killed build's directory, compilers and lock went")
    runs["killed"] = {
        "returncode": victim.returncode,
        "under_way": under_way,
        "compilers_left": _processes_using(under_way),
        "entries": sorted(os.listdir(builds)),
        "lock_free": _lock_free(builds),
        "import_without_jit": run([user_env.python, "-c", "import torch_ctxext"],
                                  TORCH_CTXEXT_CACHE=cache, TORCH_CTXEXT_JIT=0),
    }

    # 2. Two processes (ranks of a job) importing at once.
    racers = [
        subprocess.Popen(
            [str(user_env.python), "-c", LOADED], cwd="/", env=clean_env(TORCH_CTXEXT_CACHE=cache),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for _ in range(2)
    ]
    runs["race"] = []
    for racer in racers:
        out, err = racer.communicate(timeout=BUILD_TIMEOUT)
        runs["race"].append((racer.returncode, out, err))
    runs["entries_after"] = sorted(os.listdir(builds))
    runs["cache"] = cache
    return runs


def _processes_using(directories):
    """The processes whose command line names one of ``directories`` (the
    compilers of a build there)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().decode(errors="replace")
        except OSError:
            continue
        if any(d in command for d in directories):
            found.append(int(pid))
    return found


def _lock_free(builds):
    for path in glob.glob(str(builds / "*.lock")):
        fd = os.open(path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        finally:
            os.close(fd)
    return True


# --------------------------------------------------------------------------
# The first import
# --------------------------------------------------------------------------


@needs_extension
def test_processes_importing_at_once_build_once_and_all_load_that_build(first_import):
    (code_a, out_a, err_a), (code_b, out_b, err_b) = first_import["race"]
    assert code_a == code_b == 0, err_a + err_b
    origins = sorted(out.split()[0] for out in (out_a, out_b))
    assert origins == ["built", "cache"]
    assert out_a.split()[1] == out_b.split()[1]  # the same library
    builder, waiter = (err_a, err_b) if ANNOUNCE in err_a else (err_b, err_a)
    assert builder.count(ANNOUNCE) == 1 and ANNOUNCE not in waiter
    assert "waiting for another process that is building the extension" in waiter


@needs_extension
def test_the_first_import_says_what_it_builds_and_why_then_shows_progress(first_import):
    err = next(err for _, _, err in first_import["race"] if ANNOUNCE in err)
    lines = err.splitlines()
    announce = next(line for line in lines if line.startswith(ANNOUNCE))
    assert announce.startswith(
        f"{ANNOUNCE} {torch.__version__} (git {torch.version.git_version[:12]}): "
        "this copy of torch_ctxext carries no build (installed from source). "
        f"About 20 s on 2 cores, once; later imports load it from {first_import['cache'] / 'builds'}. Log: "
    )
    log = announce.split("Log: ")[1]
    assert os.path.isfile(log)
    steps = [re.match(r"torch_ctxext: \[(\d+)/(\d+)\] (compiled \S+\.cpp|linked _C\.so)$", line) for line in lines]
    steps = [m for m in steps if m]
    # One step per generated translation unit (_torch_ctxext_build/sources.py), then the link.
    from _torch_ctxext_build import sources as _sources

    total = len(_sources.units(os.path.join(ROOT, "csrc"), torch.__version__)) + 1
    assert [int(m.group(1)) for m in steps] == list(range(1, total + 1))
    assert {int(m.group(2)) for m in steps} == {total}
    assert re.search(r"^torch_ctxext: built in \d+ s: .*/_C\.so$", err, re.M)


@needs_extension
def test_a_build_killed_half_way_leaves_nothing_a_later_import_would_load(first_import):
    killed = first_import["killed"]
    assert killed["returncode"] == -signal.SIGKILL
    assert killed["under_way"]  # the build was under way when the importer was killed ...
    assert killed["compilers_left"] == []  # ... its compilers went with it, and its directory
    assert not [e for e in killed["entries"] if ".partial-" in e], killed["entries"]
    assert not [e for e in killed["entries"] if re.fullmatch(r"torch-[^/]*-[0-9a-f]{16}", e)]
    assert killed["lock_free"]
    refused = killed["import_without_jit"]
    assert refused.returncode == 1
    assert "ImportError: torch_ctxext's C++ extension has not been built for torch" in refused.stderr
    # The next import built and loaded; nothing is left over.
    assert not [e for e in first_import["entries_after"] if ".partial-" in e]


@needs_extension
def test_the_build_verifies_its_layout_once_and_keeps_the_verdict_beside_it(first_import):
    """In the build step, in a child process: the imports that load the
    build, the one that built it included, only read the verdict."""
    (build,) = [p for p in glob.glob(str(first_import["cache"] / "builds" / "torch-*")) if os.path.isdir(p)]
    (verdict,) = glob.glob(os.path.join(build, "layout-*.json"))
    with open(verdict) as f:
        assert json.load(f)["found"] == {}
    with open(build + ".log") as f:
        assert "torch_ctxext: layout verified in " in f.read()
    for _, _, err in first_import["race"]:
        assert "verifying that its extension reads" not in err


@needs_extension
def test_later_imports_load_the_cached_build_silently(user_env, first_import):
    result = run([user_env.python, "-c", LOADED], TORCH_CTXEXT_CACHE=first_import["cache"])
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.split()[0] == "cache"
    without_jit = run([user_env.python, "-c", LOADED], TORCH_CTXEXT_CACHE=first_import["cache"], TORCH_CTXEXT_JIT=0)
    assert without_jit.returncode == 0 and without_jit.stdout.split()[0] == "cache"


@needs_extension
def test_info_says_which_build_is_loaded_from_where_for_which_torch(user_env, first_import):
    result = run([user_env.python, "-m", "torch_ctxext", "info"], TORCH_CTXEXT_CACHE=first_import["cache"])
    assert result.returncode == 0, result.stderr
    builds = first_import["cache"] / "builds"
    git = torch.version.git_version[:12]
    assert f"torch          {torch.__version__} (git {git})\n" in result.stdout
    assert f"built for      {torch.__version__} (git {git})\n" in result.stdout
    assert re.search(rf"^extension      from the build cache: {re.escape(str(builds))}/torch-\S+/_C\.so \(built \S+ in \d+ s\)$",
                     result.stdout, re.M), result.stdout
    assert f"build cache    {builds} ($TORCH_CTXEXT_CACHE)\n" in result.stdout
    for member in BACKPORTED:
        assert re.search(rf"^{member} +torch_ctxext$", result.stdout, re.M)


@needs_extension
def test_the_build_command_reports_an_existing_build_without_rebuilding(user_env, first_import):
    result = run([user_env.python, "-m", "torch_ctxext", "build"], TORCH_CTXEXT_CACHE=first_import["cache"])
    assert result.returncode == 0 and ANNOUNCE not in result.stderr
    assert re.fullmatch(
        rf"build for torch {re.escape(torch.__version__)}: (\S+)/_C\.so\n"
        r"layout verdict: reads back as the headers say: \1/layout-[0-9a-f]{24}\.json\n",
        result.stdout,
    ), result.stdout


@needs_extension
def test_the_build_command_verifies_a_build_that_has_no_verdict(user_env, first_import, tmp_path):
    """A build made before verdicts (here: a copy without its verdict):
    `build` verifies it ahead of time, so that the imports of a job only
    read the verdict."""
    (source,) = [p for p in glob.glob(str(first_import["cache"] / "builds" / "torch-*")) if os.path.isdir(p)]
    target = tmp_path / "cache" / "builds" / os.path.basename(source)
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("layout-*.json"))
    result = run([user_env.python, "-m", "torch_ctxext", "build"], TORCH_CTXEXT_CACHE=tmp_path / "cache")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "verifying that its extension reads the structures of torch" in result.stderr
    (verdict,) = glob.glob(str(target / "layout-*.json"))
    assert f"layout verdict: reads back as the headers say: {verdict}\n" in result.stdout
    later = run([user_env.python, "-c", LOADED], TORCH_CTXEXT_CACHE=tmp_path / "cache")
    assert later.returncode == 0 and later.stderr == "", later.stderr


@needs_extension
def test_an_sdist_install_builds_from_the_sources_it_ships(user_env, sdist, first_import, tmp_path):
    """Installed from the sdist (isolated, into a directory of its own), the
    package finds the build made from the same sources elsewhere: the cache
    key is made of what the build depends on, not of where it was."""
    result = user_env.pip("install", "--no-deps", "--target", tmp_path / "site", sdist)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(os.listdir(tmp_path / "site" / "torch_ctxext" / "csrc")) == CSRC
    loaded = run([user_env.python, "-c", LOADED], PYTHONPATH=tmp_path / "site", TORCH_CTXEXT_CACHE=first_import["cache"])
    assert loaded.returncode == 0 and loaded.stderr == "", loaded.stderr
    origin, path = loaded.stdout.split()
    assert origin == "cache" and path.startswith(str(first_import["cache"]))


@needs_extension
def test_after_a_torch_upgrade_the_first_import_builds_for_the_new_torch(user_env, first_import, tmp_path):
    """A package installed with a build for another torch: with the cache
    holding a build for this torch it loads that; otherwise it builds and says
    why (here with a compiler that fails at once)."""
    package = tmp_path / "site" / "torch_ctxext"
    shutil.copytree(user_env.package(), package, ignore=shutil.ignore_patterns("__pycache__"))
    (package / ("_C" + sysconfig.get_config_var("EXT_SUFFIX"))).write_bytes(b"")  # never loaded: not for this torch
    (package / "_build_info.py").write_text("TORCH_VERSION = '2.13.9+cpu'\nTORCH_GIT_VERSION = 'deadbeef' * 5\n")
    cached = run([user_env.python, "-c", LOADED], PYTHONPATH=tmp_path / "site", TORCH_CTXEXT_CACHE=first_import["cache"])
    assert cached.returncode == 0 and cached.stdout.split()[0] == "cache", cached.stderr
    building = run([user_env.python, "-c", "import torch_ctxext"], PYTHONPATH=tmp_path / "site",
                   TORCH_CTXEXT_CACHE=tmp_path / "empty", CXX=failing_compiler(tmp_path))
    assert (
        f"{ANNOUNCE} {torch.__version__} (git {torch.version.git_version[:12]}): "
        "the installed build is for torch 2.13.9+cpu (git deadbeefdead)."
    ) in building.stderr


@pytest.mark.skipif(bool(BACKPORTED), reason="the running torch needs the extension")
def test_a_torch_that_provides_everything_never_builds(user_env, installed_from_source, tmp_path):
    result = run([user_env.python, "-m", "torch_ctxext", "info"], TORCH_CTXEXT_CACHE=tmp_path)
    assert result.returncode == 0 and result.stderr == ""
    assert "extension      not needed: the running torch provides every member natively" in result.stdout
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------
# When no build is possible
# --------------------------------------------------------------------------


NO_PYTHON_HEADERS = """
import sysconfig
paths = sysconfig.get_paths
sysconfig.get_paths = lambda *a, **k: {**paths(*a, **k), "include": "/nonexistent/include"}
"""
REPORT = """
import json, torch_ctxext
from torch.autograd.function import BackwardCFunction, FunctionCtx
print(json.dumps({"features": torch_ctxext.features(),
                  "present": [n for n in torch_ctxext._features.MEMBERS
                              if hasattr(BackwardCFunction if n.startswith("apply") else FunctionCtx, n)]}))
"""
FAILED_BUILDS = [
    # (case, environment, code run before the import, what the error says)
    ("no-compiler", {"CXX": "/nonexistent/bin/c++"}, "",
     "no C++ compiler: `/nonexistent/bin/c++` (from $CXX) does not exist"),
    ("no-python-headers", {}, NO_PYTHON_HEADERS,
     "no Python headers: /nonexistent/include/Python.h does not exist; install them (e.g. `apt install python3"),
    ("compile-error", {"CXX": "FAILING"}, "", "failing-c++: error: this compiler always fails"),
    ("unwritable-cache", {"TORCH_CTXEXT_CACHE": "FILE/cache"}, "",
     "/cache/builds (Not a directory); set TORCH_CTXEXT_CACHE to a writable directory"),
]


@needs_extension
@pytest.mark.parametrize("case, env, before, says", FAILED_BUILDS, ids=[f[0] for f in FAILED_BUILDS])
def test_a_failed_build_names_what_is_missing_and_the_log_and_every_backported_member_is_unavailable(
    user_env, installed_from_source, tmp_path, case, env, before, says
):
    (tmp_path / "FILE").write_text("a file where the cache should go")
    placeholders = {"FAILING": failing_compiler(tmp_path), "FILE": tmp_path / "FILE"}
    env = {k: re.sub(r"^(FAILING|FILE)", lambda m: str(placeholders[m.group(1)]), v) for k, v in env.items()}
    env = {"TORCH_CTXEXT_CACHE": tmp_path / "cache", **env}
    result = run([user_env.python, "-c", before + REPORT], **env)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    # Members torch lacks are absent; `apply`, which torch_ctxext replaces
    # along with apply_boxed (torch <= 2.12) rather than adds, stays torch's own.
    added = set(BACKPORTED) - set(_releases.REPLACED_ALONG_WITH)
    assert added and not added & set(report["present"])
    assert set(BACKPORTED) & set(_releases.REPLACED_ALONG_WITH) <= set(report["present"])
    reason = report["features"][sorted(added)[0]]
    assert reason.startswith(f"unavailable: torch_ctxext could not build its C++ extension for torch {torch.__version__}: ")
    assert says in reason
    log = re.search(r"Build log: (\S+)\. ", reason).group(1)
    assert os.path.isfile(log)
    for member, status in report["features"].items():
        assert status == (reason if member in added else "native"), member
    assert result.stderr.count("ExtensionUnavailableWarning: ") == 1
    assert reason[len("unavailable: "):] in result.stderr


@needs_extension
def test_a_failed_build_is_not_retried_at_every_import_until_asked(user_env, installed_from_source, tmp_path):
    env = {"TORCH_CTXEXT_CACHE": tmp_path / "cache", "CXX": failing_compiler(tmp_path)}
    first = run([user_env.python, "-c", "import torch_ctxext"], **env)
    assert first.stderr.count(ANNOUNCE) == 1
    with open(re.search(r"Build log: (\S+)\. ", first.stderr).group(1)) as f:
        assert "failing-c++: error: this compiler always fails" in f.read()
    again = run([user_env.python, "-c", "import torch_ctxext"], **env)
    assert ANNOUNCE not in again.stderr
    assert "failing-c++: error: this compiler always fails" in again.stderr
    assert "`python -m torch_ctxext build --force` tries again" in again.stderr
    forced = run([user_env.python, "-m", "torch_ctxext", "build", "--force"], **env)
    assert forced.returncode == 1 and forced.stderr.count(ANNOUNCE) == 1
    assert "torch_ctxext could not build its C++ extension" in forced.stderr.splitlines()[-1]


@needs_extension
def test_without_jit_a_missing_build_is_an_import_error_saying_how_to_build(user_env, installed_from_source, tmp_path):
    result = run([user_env.python, "-c", "import torch_ctxext"], TORCH_CTXEXT_CACHE=tmp_path, TORCH_CTXEXT_JIT=0)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "ImportError: torch_ctxext's C++ extension has not been built for torch "
        f"{torch.__version__} (git {torch.version.git_version[:12]}), and TORCH_CTXEXT_JIT=0 "
        "forbids building it at import. Looked for a packaged binary (this copy carries none: installed "
        f"from source), then a build in the cache {tmp_path}/builds: none. Install the binary wheel for this "
        "CPython (docs/install.md), build it ahead of time with `TORCH_CTXEXT_JIT=1 "
        f"python -m torch_ctxext build` (into {tmp_path}/builds), or unset TORCH_CTXEXT_JIT "
        "to build it at the next import."
    )
    assert os.listdir(tmp_path) == []
