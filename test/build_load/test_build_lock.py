"""The build at first import never makes an import hang or raise.

* a process waiting for another's build waits at most
  $TORCH_CTXEXT_BUILD_TIMEOUT seconds, says at once when the builder is
  stopped or gone (the lock file names its holder), then imports without
  the backported members, saying why; the timeout is not recorded;
* a failure record that cannot be written (a full disk) does not escape the
  import;
* only a deterministic compile error is remembered for later imports; a
  compiler killed by a signal (the out-of-memory killer) is not, and
  ``python -m torch_ctxext info`` says which.

Each case imports torch_ctxext in a fresh subprocess with a throwaway build
cache and a compiler script that fails, hangs or is killed as the case needs;
none compiles the extension. This process never imports torch_ctxext, so the
cases run the package the subprocesses find (the installed one, or the one
$PYTHONPATH names).
"""
import contextlib
import fcntl
import glob
import importlib.util
import json
import os
import signal
import socket
import subprocess
import time

import pytest
import torch
from _torch_ctxext_build import releases
from support import CARRIES_ITS_OWN_BUILD, python, reap, start_python, wait_until

ANNOUNCE = "torch_ctxext: building its C++ extension for torch"
FEATURES = """
import json, torch_ctxext
print(json.dumps(torch_ctxext.features()))
"""
_PACKAGE = os.path.dirname(importlib.util.find_spec("torch_ctxext").origin)
# The members torch_ctxext adds to the running torch (everything on 2.15 is
# native), and a sources-only copy: one that carries its own build (compiled
# in place, the sanitizers' copy; a wheel) never builds at first import.
NEEDS_EXTENSION = pytest.mark.skipif(
    releases.all_native(torch.__version__)
    or CARRIES_ITS_OWN_BUILD,
    reason="the running torch needs no extension, or this copy of torch_ctxext carries its own build",
)


def run(code, timeout=120, **env):
    return python(code=code, timeout=timeout, **env)


def compiler(directory, name, when_compiling):
    """A C++ compiler script that answers torch's version query and runs
    ``when_compiling`` (shell) instead of compiling."""
    path = os.path.join(directory, name)
    with open(path, "w") as f:
        f.write(
            "#!/bin/sh\n"
            "for a in \"$@\"; do if [ \"$a\" = -c ]; then\n"
            f"  {when_compiling}\n"
            "fi; done\n"
            "exec c++ \"$@\"\n"
        )
    os.chmod(path, 0o755)
    return path


def failing(directory):
    return compiler(directory, "failing-c++", "echo 'failing-c++: error: this compiler always fails' >&2; exit 1")


def unavailable(result):
    """The backported members' statuses, from the FEATURES script's output."""
    assert result.returncode == 0, result.stderr
    features = json.loads(result.stdout.splitlines()[-1])
    return {m: s for m, s in features.items() if s != "native"}


@pytest.fixture
def lock(tmp_path):
    """The lock file of the build for the running torch in a fresh cache
    (made by an import that finds no compiler, which builds nothing)."""
    cache = tmp_path / "cache"
    result = run("import torch_ctxext", TORCH_CTXEXT_CACHE=cache, CXX="/nonexistent/c++")
    assert result.returncode == 0, result.stderr
    (path,) = glob.glob(str(cache / "builds" / "*.lock"))
    return cache, path


def _start_time(pid):
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    return int(data[data.rindex(b")") + 2:].split()[19])


def _hold(path, pid):
    """Take the build lock as the builder ``pid`` would, naming it as holder."""
    fd = os.open(path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    ns = os.readlink("/proc/self/ns/pid")
    record = {"pid": pid, "host": socket.gethostname(), "pid_namespace": ns, "start": None, "since": "now"}
    if os.path.exists(f"/proc/{pid}"):
        record["start"] = _start_time(pid)
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    return fd


# --------------------------------------------------------------------------
# Waiting for another process's build
# --------------------------------------------------------------------------


@NEEDS_EXTENSION
def test_an_import_waiting_for_a_stopped_builder_says_so_at_once_and_gives_up_after_the_timeout(tmp_path):
    """The first job after a torch upgrade, stopped with Ctrl-Z while it
    builds: a second import says at once that the builder is stopped, and
    after $TORCH_CTXEXT_BUILD_TIMEOUT imports without the members."""
    cache = tmp_path / "cache"
    # Compiles until the test removes `hang` (ninja runs each compiler in a
    # process group of its own, which neither the Ctrl-Z nor the kill below
    # reaches: the compilers must end by themselves).
    compiling, hang = tmp_path / "compiling", tmp_path / "hang"
    hang.touch()
    hanging = compiler(tmp_path, "hanging-c++",
                       f"touch {compiling}; while [ -e {hang} ]; do sleep 0.1; done; exit 1")
    builder = start_python(code="import torch_ctxext", stdout=None, start_new_session=True,
                           TORCH_CTXEXT_CACHE=cache, CXX=hanging)
    try:
        wait_until(compiling.exists, 120, "the build's compiler started")
        # The build's own process holds the lock (build_child.py, a session of
        # its own: a Ctrl-Z of the importer's job does not reach it); stopped.
        (lock,) = glob.glob(str(cache / "builds" / "*.lock"))
        holder = json.loads(open(lock).read())["pid"]
        os.kill(holder, signal.SIGSTOP)
        start = time.monotonic()
        waiter = run(FEATURES, TORCH_CTXEXT_CACHE=cache, CXX=hanging, TORCH_CTXEXT_BUILD_TIMEOUT=5)
        took = time.monotonic() - start
        leftovers = os.listdir(cache / "builds")
    finally:
        hang.unlink()
        os.killpg(builder.pid, signal.SIGKILL)
        reap(builder)
        with contextlib.suppress(NameError, ProcessLookupError):
            os.kill(holder, signal.SIGCONT)  # it ends with the importer (PR_SET_PDEATHSIG) once it runs
    statuses = unavailable(waiter)
    assert statuses and all(s.startswith("unavailable: torch_ctxext could not load its C++ extension") for s in statuses.values())
    reason = next(iter(statuses.values()))
    assert f"it waited 5 s ($TORCH_CTXEXT_BUILD_TIMEOUT) for the build of pid {holder} on {socket.gethostname()}, which is stopped (state T" in reason
    assert f"resume it (`kill -CONT {holder}`" in reason
    assert "This is not recorded" in reason
    waiting = next(line for line in waiter.stderr.splitlines() if "waiting for another process" in line)
    assert f"pid {holder} on {socket.gethostname()}, which is stopped (state T" in waiting
    assert "at most 5 s ($TORCH_CTXEXT_BUILD_TIMEOUT)" in waiting
    assert waiter.stderr.count("ExtensionUnavailableWarning") == 1
    assert took < 5 + 30  # the wait, plus starting Python and importing torch
    assert not [e for e in leftovers if e.endswith(".failed")]


@NEEDS_EXTENSION
def test_an_import_waiting_for_a_builder_that_is_gone_says_so(lock, tmp_path):
    """The lock is held (by a process that inherited it) but the builder it
    names has exited: said at once, then the bounded wait."""
    cache, path = lock
    gone = subprocess.Popen(["true"])
    gone.wait()
    fd = _hold(path, gone.pid)
    try:
        waiter = run(FEATURES, TORCH_CTXEXT_CACHE=cache, CXX=failing(tmp_path), TORCH_CTXEXT_BUILD_TIMEOUT=1)
    finally:
        os.close(fd)
    reason = next(iter(unavailable(waiter).values()))
    assert f"for the build of pid {gone.pid} on {socket.gethostname()}, which has exited; the lock is still held" in reason
    assert "which has exited" in next(line for line in waiter.stderr.splitlines() if "waiting for another process" in line)


@NEEDS_EXTENSION
def test_an_import_waiting_for_a_running_builder_waits_until_the_timeout_then_imports_without_the_members(lock, tmp_path):
    cache, path = lock
    fd = _hold(path, os.getpid())  # this process: running
    try:
        start = time.monotonic()
        waiter = run(FEATURES, TORCH_CTXEXT_CACHE=cache, CXX=failing(tmp_path), TORCH_CTXEXT_BUILD_TIMEOUT=3)
        took = time.monotonic() - start
    finally:
        os.close(fd)
    reason = next(iter(unavailable(waiter).values()))
    assert f"it waited 3 s ($TORCH_CTXEXT_BUILD_TIMEOUT) for the build of pid {os.getpid()} on {socket.gethostname()} (lock {path}" in reason
    assert "stopped" not in waiter.stderr and "exited" not in waiter.stderr
    assert took >= 3
    # Not recorded: once the lock is free, the next import builds (and here fails to compile).
    after = run(FEATURES, TORCH_CTXEXT_CACHE=cache, CXX=failing(tmp_path))
    assert ANNOUNCE in after.stderr
    assert "failing-c++: error: this compiler always fails" in next(iter(unavailable(after).values()))


@NEEDS_EXTENSION
def test_a_timeout_that_is_not_a_number_is_said_and_the_default_used(lock, tmp_path):
    cache, path = lock
    result = run("import torch_ctxext._ext.build as b; print(b.build_timeout())", TORCH_CTXEXT_CACHE=cache,
                 CXX=failing(tmp_path), TORCH_CTXEXT_BUILD_TIMEOUT="ten minutes")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-1] == "600.0"
    assert "ignoring TORCH_CTXEXT_BUILD_TIMEOUT='ten minutes' (not a number of seconds); waiting at most 600 s" in result.stderr


# --------------------------------------------------------------------------
# Failures: which are remembered, and none escapes the import
# --------------------------------------------------------------------------


@NEEDS_EXTENSION
def test_a_failure_record_that_cannot_be_written_does_not_escape_the_import(lock, tmp_path):
    """A full disk when the failure is recorded (the record's temporary
    file is /dev/full): the import warns with the compile error and says it
    could not be recorded; the next import compiles again."""
    cache, path = lock
    os.symlink("/dev/full", path[: -len(".lock")] + ".failed.tmp")
    result = run(FEATURES, TORCH_CTXEXT_CACHE=cache, CXX=failing(tmp_path))
    reason = next(iter(unavailable(result).values()))
    assert "failing-c++: error: this compiler always fails" in reason
    assert "It could not be recorded (No space left on device), so the next import compiles again." in reason
    assert not os.path.exists(path[: -len(".lock")] + ".failed")


@NEEDS_EXTENSION
def test_a_compiler_killed_by_a_signal_is_not_remembered_and_the_next_import_builds_again(tmp_path):
    env = {"TORCH_CTXEXT_CACHE": tmp_path / "cache", "CXX": compiler(tmp_path, "killed-c++", "kill -9 $$")}
    first = run(FEATURES, **env)
    reason = next(iter(unavailable(first).values()))
    assert first.stderr.count(ANNOUNCE) == 1
    assert "This failure may not recur (the build stopped without a compile error), so it is not recorded: the next import builds again." in reason
    assert not glob.glob(str(tmp_path / "cache" / "builds" / "*.failed"))
    info = run("from torch_ctxext.__main__ import main; main(['info'])", **env)
    assert "build failure  not remembered (it may not recur): the next import tries again\n" in info.stdout
    again = run(FEATURES, **env)
    assert again.stderr.count(ANNOUNCE) == 1


# Kill the build's process, the importing process's child (ninja, or the
# child running torch.utils.cpp_extension.load): the ancestor whose
# grandparent is this test process ($TEST_PROCESS); never compile.
def _killing(which):
    """A compiler that kills the build's ninja (``which`` "ninja") or the
    build's own process, ninja's parent ("its parent") with SIGKILL."""
    return (
        "p=$$; while [ \"$p\" -gt 1 ]; do "
        "if [ \"$(cat /proc/$p/comm)\" = ninja ]; then "
        + ("kill -9 $p; " if which == "ninja" else "kill -9 $(sed 's/.*) //' /proc/$p/stat | cut -d' ' -f2); ")
        + "break; fi; p=$(sed 's/.*) //' /proc/$p/stat | cut -d' ' -f2); done; exit 1"
    )


KILL_THE_BUILD = _killing("ninja")


@NEEDS_EXTENSION
@pytest.mark.parametrize("which, said", [
    ("ninja", "This failure may not recur (the build was killed by SIGKILL), so it is not recorded"),
    ("its parent", "its build process was killed by signal 9 without an answer"),
])
def test_a_build_killed_by_a_signal_is_not_remembered(tmp_path, which, said):
    """ninja or the build's own process killed (SIGKILL: the out-of-memory
    killer picks the biggest): not remembered, the next import builds again."""
    env = {"TORCH_CTXEXT_CACHE": tmp_path / "cache", "CXX": compiler(tmp_path, "build-killing-c++", _killing(which))}
    first = run(FEATURES, **env)
    reason = next(iter(unavailable(first).values()))
    assert said in reason
    assert "so it is not recorded: the next import builds again" in reason
    assert not glob.glob(str(tmp_path / "cache" / "builds" / "*.failed"))


@NEEDS_EXTENSION
def test_a_compile_error_is_remembered_and_info_says_until_when(tmp_path):
    env = {"TORCH_CTXEXT_CACHE": tmp_path / "cache", "CXX": failing(tmp_path)}
    first = run(FEATURES, **env)
    assert "This is a compile error: it is recorded" in next(iter(unavailable(first).values()))
    assert len(glob.glob(str(tmp_path / "cache" / "builds" / "*.failed"))) == 1
    info = run("from torch_ctxext.__main__ import main; main(['info'])", **env)
    assert ANNOUNCE not in info.stderr
    assert ("build failure  remembered (a compile error): later imports report it without "
            "compiling until `python -m torch_ctxext build --force`\n") in info.stdout


# --------------------------------------------------------------------------
# An importer killed while it builds
# --------------------------------------------------------------------------


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return False
    return data[data.rindex(b")") + 2:].split()[0] not in (b"Z", b"X")


KILLS = {
    "SIGKILL": lambda pid: os.kill(pid, signal.SIGKILL),  # the out-of-memory killer, kill -9
    "SIGTERM": lambda pid: os.kill(pid, signal.SIGTERM),  # a scheduler's polite kill
    "SIGKILL to its process group": lambda pid: os.killpg(pid, signal.SIGKILL),  # a job's processes
}


@NEEDS_EXTENSION
@pytest.mark.parametrize("kill", list(KILLS))
def test_an_importer_killed_while_it_builds_leaves_no_compiler_running_and_no_partial_build(tmp_path, kill):
    """The build's processes end with the importer, and its private
    directory goes with them (build.py's promise), whatever killed it."""
    cache, compilers = tmp_path / "cache", tmp_path / "compilers"
    slow = compiler(tmp_path, "slow-c++", f"echo $$ >> {compilers}; sleep 300; exit 1")
    importer = start_python(code="import torch_ctxext", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, TORCH_CTXEXT_CACHE=cache, CXX=slow)

    def compiling():
        assert importer.poll() is None, "the import ended before its build compiled"
        return compilers.exists() and compilers.read_text().strip()

    try:
        wait_until(compiling, 300, "the build's compilers started")
        time.sleep(1)  # every unit's compile has started
        pids = [int(p) for p in compilers.read_text().split()]
        assert pids and all(_alive(p) for p in pids)
        KILLS[kill](importer.pid)
        importer.wait(timeout=60)
    finally:
        reap(importer, timeout=0)
    wait_until(lambda: not any(_alive(p) for p in pids), 60, "the compilers ended with the importer")
    wait_until(lambda: glob.glob(str(cache / "builds" / "*.partial-*")) == [], 60,
               "the importer's partial build was removed")


@NEEDS_EXTENSION
@pytest.mark.parametrize("record", ["", "{", "[]", '{"message": 1, "when": "now"}', "\x00\x01"])
def test_a_failure_record_that_cannot_be_read_is_no_record_and_the_build_runs_again(lock, tmp_path, record):
    """An empty or corrupt ``<key>.failed`` (a full disk, an edit) does not
    make the import raise: the build runs, and records its own failure."""
    cache, path = lock
    failed = path[: -len(".lock")] + ".failed"
    with open(failed, "w") as f:
        f.write(record)
    result = run(FEATURES, TORCH_CTXEXT_CACHE=cache, CXX=failing(tmp_path))
    reason = next(iter(unavailable(result).values()))
    assert result.stderr.count(ANNOUNCE) == 1
    assert "failing-c++: error: this compiler always fails" in reason
    with open(failed) as f:
        assert "this compiler always fails" in json.load(f)["message"]
