"""What the plugin's tests share: a fresh interpreter with a clean
environment, waiting for a condition with a deadline, and reaping a child.

A test that needs a process of its own (an import's first build, a crash, a
fork, an exit) starts it with :func:`python` or :func:`start_python`: the
child sees none of this test run's ``TORCH_CTXEXT_*`` or ``PYTHON*``
settings (nor ``CXX``), only what the test gives it, and imports the same
torch_ctxext as the test process (the directory it was found in is on the
child's ``PYTHONPATH``, unless the test names another), whether that is a
checkout or an install. A test
that waits for something another process does calls :func:`wait_until`,
which fails naming what never happened; a child a test started is ended
with :func:`reap`, whatever the test's outcome.

This module imports neither torch nor torch_ctxext: tests about what the
first import does to a process import it before either.
"""
import glob
import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
import time

TESTS = os.path.dirname(os.path.abspath(__file__))  # the shared helper modules live here
ROOT = os.path.dirname(TESTS)  # the checkout: its tools/, docs/, examples/, benchmarks/


def _importable_from():
    """The directory ``import torch_ctxext`` finds the package under test in
    (found without importing it)."""
    spec = importlib.util.find_spec("torch_ctxext")
    if spec is None or not spec.submodule_search_locations:
        return ROOT
    return os.path.dirname(os.path.abspath(list(spec.submodule_search_locations)[0]))


PACKAGE_PARENT = _importable_from()
PACKAGE = os.path.join(PACKAGE_PARENT, "torch_ctxext")
# How the copy under test was installed: one that carries a compiled
# extension of its own (built in place, as without build isolation with a
# compiler at hand; a binary wheel's _binaries/) loads it, and its import
# builds nothing; a sources-only copy (a checkout, pip's default install)
# builds at its first import. The tests of the build at import need the latter.
CARRIES_ITS_OWN_BUILD = bool(glob.glob(os.path.join(PACKAGE, "_C*.so"))) or os.path.isdir(
    os.path.join(PACKAGE, "_binaries"))


def _scrubbed(name):
    return name.startswith(("TORCH_CTXEXT_", "PYTHON")) or name == "CXX"


def clean_env(**settings):
    """The environment of a fresh shell: this process's, without any
    ``TORCH_CTXEXT_*``, ``PYTHON*`` or ``CXX`` setting; then ``settings``
    (values made strings; None removes the variable)."""
    env = {k: v for k, v in os.environ.items() if not _scrubbed(k)}
    for name, value in settings.items():
        if not name.isupper():  # a misspelt keyword would become a variable, silently
            raise TypeError(f"{name}={value!r}: environment settings are upper-case names "
                            "(a keyword of the helper it was meant for?)")
        if value is None:
            env.pop(name, None)
        else:
            env[name] = str(value)
    return env


def child_env(path=(), **settings):
    """:func:`clean_env` for a Python child: ``path`` (directories), then the
    directory the package under test is imported from, on its
    ``PYTHONPATH``, unless ``settings`` names one."""
    settings.setdefault("PYTHONPATH", os.pathsep.join([*map(str, path), PACKAGE_PARENT]))
    return clean_env(**settings)


def run(args, timeout=300, cwd="/", **settings):
    """Run a program (``args``: its path, then its arguments) to its end in
    :func:`clean_env`; output captured as text. The CompletedProcess."""
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, cwd=str(cwd),
                          env=clean_env(**settings), timeout=timeout)


def python(*args, code=None, timeout=300, cwd="/", path=(), input=None, start_new_session=False, **settings):
    """Run a fresh interpreter to its end: ``python -c code args...`` (code
    dedented), or ``python args...``; output captured as text. ``settings``
    are environment variables (:func:`child_env`); ``start_new_session``: the
    child leads a process group of its own (one it may signal whole). Returns the
    CompletedProcess; a child that outlives ``timeout`` is killed and fails
    the test with what it printed."""
    argv = [sys.executable, *(["-c", textwrap.dedent(code)] if code is not None else []), *map(str, args)]
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=str(cwd), input=input,
                              env=child_env(path, **settings), start_new_session=start_new_session)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"a child still ran after {timeout} s: {' '.join(argv[:3])!r}...\n"
                             f"stdout: {e.stdout!r}\nstderr: {e.stderr!r}") from None


def start_python(*args, code=None, cwd="/", path=(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                 preexec_fn=None, start_new_session=False, **settings):
    """Start a fresh interpreter as :func:`python` runs one, without waiting:
    the Popen (text pipes). End it with :func:`reap`."""
    argv = [sys.executable, *(["-c", textwrap.dedent(code)] if code is not None else []), *map(str, args)]
    return subprocess.Popen(argv, stdout=stdout, stderr=stderr, text=True, cwd=str(cwd),
                            env=child_env(path, **settings), preexec_fn=preexec_fn,
                            start_new_session=start_new_session)


def wait_until(condition, deadline, what, interval=0.05):
    """Call ``condition`` until it returns something true, and return that;
    an AssertionError naming ``what`` if ``deadline`` seconds pass first."""
    end = time.monotonic() + deadline
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= end:
            raise AssertionError(f"{what}: not within {deadline} s")
        time.sleep(interval)


def reap(process, timeout=60):
    """Wait for ``process`` (a Popen, or the pid of a forked child) to exit,
    killing it (SIGKILL) if it has not within ``timeout`` seconds; its exit
    code (negative: the signal that ended it, -9 where it was killed here).
    A Popen's pipes are drained and closed."""
    if isinstance(process, int):
        exited = []

        def gone():
            done, status = os.waitpid(process, os.WNOHANG)
            if done:
                exited.append(os.waitstatus_to_exitcode(status))
            return done

        try:
            wait_until(gone, timeout, f"process {process} exited", interval=0.02)
        except AssertionError:
            os.kill(process, signal.SIGKILL)
            _, status = os.waitpid(process, 0)
            return os.waitstatus_to_exitcode(status)
        return exited[0]
    try:
        process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
    return process.returncode
