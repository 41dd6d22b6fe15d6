"""Building the C++ extension for the running torch, once, into the build cache.

The extension reads autograd-engine structures by layout, so it must be
compiled against the very torch that runs. When the installed package carries
no build for it (installed from source, or torch was upgraded since), the
first import builds one into the build cache (``build_cache``: where builds
live, how they are named), and later imports load it from there. It is built
as ``torch.utils.cpp_extension.load`` builds: the importing process writes the
ninja file with cpp_extension's own helpers (the flags of the running torch
release) and runs ninja; where this torch's helpers are not as expected, it
runs ``load`` itself in a child process.

Several processes importing at once (the ranks of a job) build once: the
first takes a file lock and builds, the others wait for it and load. A build
is compiled in a private directory, renamed into place, loaded (dlopen) to
see that it loads, and published by writing its record last, so a build
killed half-way, or one that does not load, leaves nothing a later import
would load (the next builder removes the remains). A build that failed with a compile error is
recorded, so that waiting processes and later imports report it at once
instead of compiling again; ``python -m torch_ctxext build --force`` tries
again. A failure that may not recur (the compiler or the build killed by a
signal, e.g. for memory; the disk full) is not recorded: the next import
builds again.

No wait is unbounded: a process waits for another's build at most
$TORCH_CTXEXT_BUILD_TIMEOUT seconds (default 600), then leaves the members
unavailable, as for a failed build. The lock file names its holder (pid,
host), so that a waiter says at once when the holder is stopped or gone.
"""
import contextlib
import datetime
import fcntl
import inspect
import json
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import torch

from . import build_cache, layout_verdict, sources
from .build_cache import LIBRARY, RECORD

ENV_JIT = "TORCH_CTXEXT_JIT"
ENV_TIMEOUT = "TORCH_CTXEXT_BUILD_TIMEOUT"
REBUILD = "python -m torch_ctxext build --force"
# How long an import waits for another process's build of the same extension.
# A build takes 15 to 20 s on 2 idle cores (docs/benchmarks.md) and was
# measured at 2.5 min on a loaded 2-core CI machine when it took a minute on
# idle ones; 600 s is four times that. A builder that has not
# finished by then is almost certainly stuck (stopped with Ctrl-Z, hung on a
# network filesystem) rather than slow, and a waiter is better off importing
# without the members than hanging the job. Waiting processes all time out
# about together, so the ranks of a job still agree with each other.
DEFAULT_TIMEOUT = 600.0
# How often a waiter tries the lock again and looks at its holder.
_POLL = 0.2


class ExtensionBuildError(ImportError):
    """The C++ extension could not be built for the running torch.

    The message names what is missing (a compiler, the Python headers, ninja,
    a writable cache) or the compiler's first error, and the build log.
    ``import torch_ctxext`` does not raise it: it warns with the same message
    (:class:`~torch_ctxext._features.ExtensionUnavailableWarning`) and reports
    the members that need the extension unavailable; ``python -m torch_ctxext
    build`` prints it and exits with 1.

    ``remembered`` says whether the failure was recorded in the build cache
    (a compile error: later imports report it without compiling, until
    ``python -m torch_ctxext build --force``) or not (a failure that may not
    recur, or a wait that timed out: the next import tries again).
    """

    remembered = False


def jit_enabled():
    """False when $TORCH_CTXEXT_JIT is 0: never compile at import."""
    return os.environ.get(ENV_JIT, "1").strip().lower() not in ("0", "false", "no", "off")


def build_timeout():
    """Seconds to wait for another process's build: $TORCH_CTXEXT_BUILD_TIMEOUT
    (``inf``: no bound), else DEFAULT_TIMEOUT. A value that is not a
    non-negative number is said and ignored: an import never fails over it."""
    value = os.environ.get(ENV_TIMEOUT, "").strip()
    if not value:
        return DEFAULT_TIMEOUT
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:  # also NaN
        _say(f"ignoring {ENV_TIMEOUT}={value!r} (not a number of seconds); waiting at most {DEFAULT_TIMEOUT:.0f} s")
        return DEFAULT_TIMEOUT
    return seconds


# What became of the last build this process tried (``python -m torch_ctxext
# info``): None, or the ExtensionBuildError it raised.
last_failure = None


# --------------------------------------------------------------------------
# What a build needs
# --------------------------------------------------------------------------


def _compiler():
    command = shlex.split(os.environ.get("CXX", "c++")) or ["c++"]
    return command[0]


def _ninja_dirs():
    """Where ninja may be besides PATH: this interpreter's scripts directory
    (a venv that is not activated) and the ninja wheel's own."""
    import sysconfig  # here: not imported by torch, and only a build needs it

    dirs = [os.path.dirname(sys.executable), sysconfig.get_path("scripts")]
    try:
        import ninja

        dirs.append(ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    return [d for d in dirs if d]


def _find_ninja():
    return shutil.which("ninja") or shutil.which(
        "ninja", path=os.pathsep.join(_ninja_dirs())
    )


def missing_tools():
    """What a build needs and this machine lacks, one sentence each."""
    problems = []
    compiler = _compiler()
    if shutil.which(compiler) is None:
        problems.append(
            f"no C++ compiler: `{compiler}` (from $CXX, default c++) is not on PATH; "
            "install one (e.g. `apt install g++`, `dnf install gcc-c++`, "
            "`conda install gxx`) or point $CXX at it"
        )
    import sysconfig

    python_h = os.path.join(sysconfig.get_paths()["include"], "Python.h")
    if not os.path.isfile(python_h):
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        problems.append(
            f"no Python headers: {python_h} does not exist; install them "
            f"(e.g. `apt install python{version}-dev`, `dnf install python{version}-devel`)"
        )
    torch_h = os.path.join(build_cache.torch_include_dirs()[0], "torch", "extension.h")
    if not os.path.isfile(torch_h):
        problems.append(f"no torch C++ headers: {torch_h} does not exist (a torch without its include/ directory)")
    if _find_ninja() is None:
        problems.append("no ninja: install it with `pip install ninja`")
    return problems


# --------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------

# How a build runs: ninja, in a child process whose output (ninja's, the
# compiler's) goes to the log, and which dies with the importing process (a
# killed rank must not leave a compile behind).
#
# The ninja file is the one torch.utils.cpp_extension.load would write: the
# importing process, which has torch imported already, writes it with the
# helpers load() writes it with (_write_ninja_file_to_build_library and
# _prepare_ldflags: the include paths, the ABI and pybind11 defines, -fPIC,
# the C++ standard, the libraries of the running release), then runs ninja
# as load() does. That saves a child process importing torch again to call
# load(): 1-2 s of a 20 s first import. The helpers are private and their
# parameters change between releases (extra_sycl_cflags and with_sycl came in
# 2.7), so they are called by parameter name, and where they are missing or
# want a parameter load() would not give them, the build runs load() itself
# in a child process (_CHILD), as before.
_CPP_EXTENSION_HELPERS = ("_prepare_ldflags", "_write_ninja_file_to_build_library", "_get_num_workers")

# The fallback: load() in a child process (it imports torch again).
_CHILD = r"""
import json, sys
spec = json.loads(sys.argv[1])
import torch.utils.cpp_extension as cpp_extension
cpp_extension.load(
    name="_C", sources=spec["sources"], extra_cflags=spec["cflags"],
    extra_ldflags=spec["ldflags"], build_directory=spec["directory"],
    verbose=True, is_python_module=True,
)
print("torch_ctxext: the new build loads", flush=True)
"""

# Every build runs under this supervisor, a small child process of the
# importing process (`python -S -c _SUPERVISOR spec`, the standard library
# only), in a session of its own, so that it outlives whatever kills the
# importer, even a kill of the importer's whole process group. The kernel
# tells it when the importer dies (PR_SET_PDEATHSIG); it then ends the
# build: SIGTERM to ninja, which passes it on to each compile's process
# group and waits for them; whatever is left of the build (anything the
# build started is re-parented to the supervisor, a child subreaper) is
# killed; the build's private directory is removed; it exits. The importer
# stopping it (SIGTERM: a KeyboardInterrupt in the importer) does the same.
# Otherwise it runs the build and exits with the build's status (killed by
# the same signal as the build, if the build was). A kill of the supervisor
# itself: ninja gets SIGTERM (its own PR_SET_PDEATHSIG), and the next
# builder removes the directory.
_SUPERVISOR = r"""
import ctypes, json, os, shutil, signal, subprocess, sys, time
spec = json.loads(sys.argv[1])
libc = ctypes.CDLL(None)
libc.prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG: told when the importer dies
libc.prctl(36, 1)                   # PR_SET_CHILD_SUBREAPER: the build's orphans come here
build = None

def children():
    mine, found = str(os.getpid()).encode(), []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open("/proc/%s/stat" % entry, "rb") as f:
                data = f.read()
            if data[data.rindex(b")") + 2:].split()[1] == mine:
                found.append(int(entry))
        except (OSError, ValueError, IndexError):
            pass
    return found

def end(signum, frame):
    for name in ("SIGTERM", "SIGINT", "SIGHUP"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    if build is not None and build.poll() is None:
        build.terminate()  # ninja ends its compiles, then itself
        try:
            build.wait(10)
        except subprocess.TimeoutExpired:
            pass
    for _ in range(100):  # what is left (re-parented here): killed, reaped
        left = children()
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for pid in left:
            try:
                os.waitpid(pid, 0)
            except OSError:
                pass
    shutil.rmtree(spec["partial"], ignore_errors=True)
    os._exit(128 + signum)

for name in ("SIGTERM", "SIGINT", "SIGHUP"):
    signal.signal(getattr(signal, name), end)
if os.getppid() != spec["parent"]:  # the importer died before we could be told
    end(signal.SIGTERM, None)

def dies_with_supervisor():
    libc.prctl(1, int(signal.SIGTERM))

build = subprocess.Popen(spec["command"], cwd=spec["partial"], preexec_fn=dies_with_supervisor)
code = build.wait()
if code < 0:  # say it as the build's own end
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
"""

_STEP = re.compile(r"^\[(\d+)/(\d+)\] (.*)$")


def _say(message):
    print(f"torch_ctxext: {message}", file=sys.stderr, flush=True)


class _Progress:
    """Ninja's steps as they finish: one line updated in place on a terminal,
    a line per step otherwise (logs of batch jobs)."""

    def __init__(self):
        self.tty = sys.stderr.isatty()
        self.shown = False

    def step(self, done, total, command):
        source = _compiled_source(command)
        what = f"compiled {os.path.basename(source)}" if source else "linked _C.so"
        text = f"torch_ctxext: [{done}/{total}] {what}"
        if self.tty:
            sys.stderr.write("\r\033[K" + text)
            self.shown = True
        else:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def close(self):
        if self.shown:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _compiled_source(command):
    """The source a ninja step's command compiles (the argument of ``-c``,
    which ninja quotes when its path has a space), or None (the link)."""
    try:
        words = shlex.split(command)
    except ValueError:  # an unbalanced quote: not a command we wrote
        words = command.split()
    for flag, argument in zip(words, words[1:]):
        if flag == "-c":
            return argument
    return None


def _first_error(log):
    """The line of the log that says what went wrong."""
    try:
        with open(log, errors="replace") as f:
            lines = [line.rstrip() for line in f]
    except OSError:
        return "see the log"
    for line in lines:
        if re.search(r"\b(fatal error|error):", line) and not line.startswith("ninja: "):
            return line.strip()
    tail = [line.strip() for line in lines if line.strip()]
    return tail[-1] if tail else "the build stopped without output"


def _failure(what, log, remembered=False, note=""):
    error = ExtensionBuildError(
        f"torch_ctxext could not build its C++ extension for torch {torch.__version__}: "
        f"{what}. Build log: {log}. Without it, the members of the ctx contract "
        "torch_ctxext adds to this torch are unavailable (torch_ctxext.features() "
        "says which); build it where a compiler is available with "
        "`python -m torch_ctxext build` (TORCH_CTXEXT_CACHE picks where it goes), "
        "or install a wheel built for this torch." + (f" {note}" if note else "")
    )
    error.remembered, error.what = remembered, what
    return error


# A compiler's line that says it did not fail on the code: it was killed (the
# kernel's out-of-memory killer: "Killed signal terminated program cc1plus"),
# crashed, or ran out of memory or disk. Such a failure may not recur.
_NOT_THE_CODE = re.compile(
    r"Killed signal|terminated program|internal compiler error|out of memory|"
    r"memory exhausted|Cannot allocate memory|No space left on device|Segmentation fault",
    re.I,
)


def _compile_failure(code, log):
    """The ExtensionBuildError for a compile that exited with ``code``. Only a
    deterministic compile error (the child exited with an error status and
    the compiler said ``error:`` about the code) is ``remembered``: anything
    else (killed by a signal, for memory, the disk full, no diagnostic) may
    not recur, and the next import builds again."""
    first = _first_error(log)
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        why = f"the build was killed by {name}"
    elif _NOT_THE_CODE.search(first):
        why = "the compiler was killed or ran out of resources, not stopped by an error in the code"
    elif code > 0 and re.search(r"\b(fatal error|error):", first):
        return _failure(first, log, remembered=True, note=(
            "This is a compile error: it is recorded, and later imports report it "
            f"without compiling until `{REBUILD}`."
        ))
    else:
        why = "the build stopped without a compile error"
    return _failure(first, log, note=(
        f"This failure may not recur ({why}), so it is not recorded: the next "
        "import builds again."
    ))


def _write_log_header(log, key, csrc, reason):
    with open(log, "w") as f:
        f.write(
            f"torch_ctxext build {key}\n"
            f"started  {_now()}\n"
            f"reason   {reason}\n"
            f"torch    {torch.__version__} (git {torch.version.git_version}) {torch.__file__}\n"
            f"python   {sys.executable} {sys.version.split()[0]}\n"
            f"compiler {os.environ.get('CXX', 'c++')} -> {shutil.which(_compiler())}\n"
            f"ninja    {_find_ninja()}\n"
            f"sources  {csrc}: {' '.join(os.path.basename(s) for s in sources.sources(csrc, torch.__version__))}\n\n"
        )


def _pid_namespace():
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _proc_stat(pid):
    """(state letter, start time in clock ticks) of ``pid`` (or
    ``pid/task/tid``) from /proc, or None if there is no such process here."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        fields = data[data.rindex(b")") + 2:].split()  # after "pid (comm) ", comm may hold anything
        return fields[0].decode(), int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def _threads_state(pid, state):
    """The holder's state, ``T`` if any of its threads is stopped: a stopped
    process whose main thread was in an uninterruptible wait (a vfork for
    its compiler, whose child was stopped too) shows ``D`` there for good."""
    if state in "Tt":
        return state
    try:
        threads = os.listdir(f"/proc/{int(pid)}/task")
    except OSError:
        return state
    for tid in threads:
        stat = _proc_stat(f"{int(pid)}/task/{tid}")
        if stat and stat[0] in "Tt":
            return stat[0]
    return state


def _identity():
    """This process, as the lock file records its holder."""
    stat = _proc_stat(os.getpid())
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "pid_namespace": _pid_namespace(),
        "start": stat[1] if stat else None,
        "since": _now(),
    }


def _read_holder(fd):
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"null")
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) and isinstance(holder.get("pid"), int) else None


def _holder_state(holder):
    """(what can be said of the lock's holder, how it stands): "stopped",
    "gone", "blocked" (state D) or "running" where it can be looked at (same
    host and pid namespace), else "unknown"."""
    if holder is None:
        return "a process that did not say which (the lock file names none)", "unknown"
    who = f"pid {holder['pid']} on {holder.get('host', 'an unknown host')}"
    if (holder.get("host") != socket.gethostname() or holder.get("pid_namespace") != _pid_namespace()
            or not os.path.isdir("/proc/self")):  # another machine or container, or no /proc to look in
        return who, "unknown"
    stat = _proc_stat(int(holder["pid"]))
    if stat is None or stat[0] in "ZX" or (holder.get("start") is not None and stat[1] != holder["start"]):
        return (
            f"{who}, which has exited; the lock is still held, by a process that "
            "inherited its file (a child it forked)", "gone",
        )
    state = _threads_state(holder["pid"], stat[0])
    if state in "Tt":
        return (
            f"{who}, which is stopped (state {state}): "
            f"resume it (`kill -CONT {holder['pid']}`, or `fg` in its shell) or end it", "stopped",
        )
    if state == "D":
        return f"{who}, in uninterruptible sleep (state D: waiting on a device or a network filesystem)", "blocked"
    return who, "running"


def _try_lock(fd):
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _wait_for_lock(fd, on_wait, timeout):
    """Poll the lock until it is ours or ``timeout`` seconds have passed
    (polling, not a blocking flock with an alarm: SIGALRM is the main
    thread's, and an import may run on any). Say at once what the holder is,
    and again whenever that changes to stopped, gone or blocked; return
    whether the lock was taken, and what was last said of the holder."""
    deadline = time.monotonic() + timeout
    holder, state = _holder_state(_read_holder(fd))
    on_wait(holder)
    said, previous = (holder, state), None
    while True:
        if _try_lock(fd):
            return True, holder
        left = deadline - time.monotonic()
        if left <= 0:
            return False, holder
        holder, state = _holder_state(_read_holder(fd))
        # Said once it has been seen twice in a row: a new holder writes its
        # record just after taking the lock, and a waiter must not report
        # the previous holder's record as the new one gone.
        if (holder, state) == previous and (holder, state) != said and state != "unknown":
            _say(f"the build it waits for: {holder}")
            said = (holder, state)
        previous = (holder, state)
        time.sleep(min(_POLL, left))


class _LockTimeout(Exception):
    def __init__(self, holder, timeout):
        super().__init__(holder, timeout)
        self.holder, self.timeout = holder, timeout


@contextlib.contextmanager
def _locked(path, on_wait, timeout):
    """An exclusive flock on ``path``, waited for at most ``timeout`` seconds
    (else _LockTimeout); the kernel releases it if we die. While it is held,
    the file names its holder (pid, host, pid namespace, start time), so
    that waiters can tell a stopped or vanished holder from a slow one."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if not _try_lock(fd):
            taken, holder = _wait_for_lock(fd, on_wait, timeout)
            if not taken:
                raise _LockTimeout(holder, timeout)
        with contextlib.suppress(OSError):  # advisory: a full disk must not stop the build
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(_identity()) + "\n").encode(), 0)
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # released: no holder to name
    finally:
        os.close(fd)


def _call_by_name(function, arguments):
    """``function`` called with those of ``arguments`` it takes; TypeError if
    it takes one without a default that ``arguments`` lacks."""
    parameters = inspect.signature(function).parameters.values()
    named = [p for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    lacking = [p.name for p in named if p.name not in arguments and p.default is p.empty]
    if lacking or any(p.kind == p.VAR_POSITIONAL for p in parameters):
        raise TypeError(f"{function.__name__} takes {', '.join(lacking) or '*args'}, which load() does not give it")
    return function(**{p.name: arguments[p.name] for p in named if p.name in arguments})


def _write_ninja_file(directory, units, cflags, ldflags):
    """Write ``directory``/build.ninja as ``torch.utils.cpp_extension.load(
    name="_C", sources=units, extra_cflags=cflags, extra_ldflags=ldflags)`` would for
    the running torch, and return the arguments of ninja load() would run it
    with. Raises (AttributeError, TypeError, ...) where this torch's
    cpp_extension does not have the helpers load() uses as expected."""
    from torch.utils import cpp_extension  # here: a build needs it, an import from the cache does not

    helpers = {name: getattr(cpp_extension, name) for name in _CPP_EXTENSION_HELPERS}
    # What load() hands them for C++ sources (no CUDA, no SYCL) and a Python module.
    arguments = {
        "path": os.path.join(directory, "build.ninja"), "name": "_C", "sources": list(units),
        "extra_cflags": list(cflags), "extra_cuda_cflags": [], "extra_sycl_cflags": [],
        "extra_ldflags": list(ldflags), "extra_include_paths": [],
        "with_cuda": False, "with_sycl": False, "is_standalone": False, "verbose": False,
    }
    arguments["extra_ldflags"] = _call_by_name(helpers["_prepare_ldflags"], arguments)
    _call_by_name(helpers["_write_ninja_file_to_build_library"], arguments)
    if not os.path.isfile(arguments["path"]):
        raise FileNotFoundError(f"{helpers['_write_ninja_file_to_build_library'].__name__} wrote no {arguments['path']}")
    workers = _call_by_name(helpers["_get_num_workers"], arguments)  # $MAX_JOBS
    return ["-v"] + (["-j", str(workers)] if workers is not None else [])


@contextlib.contextmanager
def _said_into(log):
    """What torch.utils.cpp_extension says while it is imported and its
    helpers run (e.g. "No CUDA runtime is found" on a CUDA build of torch
    without a GPU: printed, or logged from 2.7) goes to the build log, as it
    did when a child process imported it, not to the importer's terminal."""
    logger = logging.getLogger("torch.utils.cpp_extension")
    with open(log, "a") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        handler, propagate = logging.StreamHandler(out), logger.propagate
        logger.addHandler(handler)
        logger.propagate = False
        try:
            yield
        finally:
            logger.removeHandler(handler)
            logger.propagate = propagate


def _compile(partial, csrc, log):
    """Compile into ``partial`` as torch.utils.cpp_extension.load does:
    ninja in a child process, with the ninja file written here (or load()
    itself in a child process, where this torch's helpers are not as
    expected), showing ninja's progress; raise ExtensionBuildError on
    failure. Whether the library loads is _publish's to see."""
    units = sources.write_units(csrc, partial, torch.__version__)
    cflags = sources.jit_cflags(torch.__version__, torch.version.git_version)
    ldflags = sources.extra_link_args()
    env = dict(os.environ)
    ninja = _find_ninja()
    if ninja:
        env["PATH"] = os.path.dirname(ninja) + os.pathsep + env.get("PATH", "")
    env.pop("NINJA_STATUS", None)  # its default "[finished/total] " is what we parse
    try:
        with _said_into(log):
            arguments = _write_ninja_file(partial, units, cflags, ldflags)
        command = [ninja or "ninja"] + arguments
        shown = command
    except Exception as e:  # a torch whose private helpers differ: load() knows its own
        with open(log, "a") as out:
            out.write(
                f"torch.utils.cpp_extension's ninja-file helpers are not as expected here ({type(e).__name__}: {e}); "
                "building with torch.utils.cpp_extension.load in a child process\n"
            )
        spec = {"sources": units, "cflags": cflags, "ldflags": ldflags, "directory": partial}
        command = [sys.executable, "-c", _CHILD, json.dumps(spec)]
        shown = [sys.executable, "-c", "<torch.utils.cpp_extension.load>", json.dumps(spec)]
    code = _run_build(command, shown, partial, env, log)
    if code != 0 or not os.path.isfile(os.path.join(partial, LIBRARY)):
        raise _compile_failure(code, log)


def _run_build(command, shown, partial, env, log):
    """Run the build's ``command`` in ``partial``, under the supervisor
    (_SUPERVISOR: it ends the build and removes ``partial`` if this process
    dies), its output to the log and its ninja steps to the progress
    display; return its exit status."""
    progress = _Progress()
    supervised = json.dumps({"command": command, "partial": partial, "parent": os.getpid()})
    with open(log, "a") as out:
        out.write("$ " + shlex.join(shown) + "\n\n")
        out.flush()
        child = subprocess.Popen(
            [sys.executable, "-S", "-c", _SUPERVISOR, supervised],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            cwd=partial, env=env, text=True, errors="replace", bufsize=1, start_new_session=True,
        )
        try:
            for line in child.stdout:
                out.write(line)
                out.flush()
                step = _STEP.match(line)
                if step:
                    progress.step(int(step.group(1)), int(step.group(2)), step.group(3))
            return child.wait()
        except BaseException:
            child.terminate()  # the supervisor ends the build
            child.wait()
            raise
        finally:
            progress.close()


def _now():
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _check_can_build(root, key, csrc, reason):
    """Return the log path; raise ExtensionBuildError naming what is missing
    (a writable cache, a compiler, Python headers, ninja) if a build cannot run."""
    try:
        os.makedirs(root, exist_ok=True)
        open(os.path.join(root, key + ".lock"), "a").close()
    except OSError as e:
        log = os.path.join(tempfile.gettempdir(), f"torch_ctxext-{key}.log")
        _write_log_header(log, key, csrc, reason)
        raise _failure(
            f"cannot write to the build cache {root} ({e.strerror}); set "
            f"{build_cache.ENV_CACHE} to a writable directory", log,
        ) from None
    log = os.path.join(root, key + ".log")
    problems = missing_tools()
    if problems:
        _write_log_header(log, key, csrc, reason)
        with open(log, "a") as f:
            f.write("not built:\n" + "".join(f"  {p}\n" for p in problems))
        raise _failure("; ".join(problems), log)
    return log


def _load_problem(library):
    """None if ``library`` loads with every symbol resolved, as its import
    will; else what the loader said (a symbol torch does not export). Opened
    with dlopen in this process (a process of its own would import torch
    again: a second or more), not imported: the import runs its module
    initialisation, which claims the engine hooks (the importing process
    imports it next, and the loader hands it the library opened here).
    Opened at the path it is imported from, which the library names itself
    by (csrc/module.cpp, this_library_path)."""
    import ctypes  # torch has imported it

    path = library
    try:  # `build --force` in a process that imported the previous build from this path:
        ctypes.CDLL(library, mode=os.RTLD_NOW | os.RTLD_NOLOAD)
        path = os.path.join(os.path.dirname(library), ".", os.path.basename(library))  # the loader would answer with that one
    except OSError:
        pass
    try:
        ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_LOCAL)
    except OSError as e:
        return str(e)
    return None


def _publish(partial, final, record, log):
    """Make the complete build in ``partial`` visible as ``final``: renamed
    there (replacing a previous build, or the remains of one killed before
    its record), loaded to see that it loads, then its record written, which
    publishes it (build_cache.published). A build that does not load is
    removed (the previous one, if any, put back) and its failure, which may
    not recur, raised."""
    for name in os.listdir(partial):  # keep the library and the ninja file
        if name not in (LIBRARY, "build.ninja"):
            path = os.path.join(partial, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    os.chmod(partial, 0o755)  # mkdtemp's 0700 would hide it from a shared cache's other users
    old = None
    if os.path.isdir(final):  # --force over an existing build, or the remains of one killed before its record
        old = tempfile.mkdtemp(prefix=os.path.basename(final) + ".old-", dir=os.path.dirname(final))
        os.rename(final, os.path.join(old, "build"))
    os.rename(partial, final)
    problem = _load_problem(os.path.join(final, LIBRARY))
    with open(log, "a") as f:
        f.write(f"error: the new build does not load: {problem}\n" if problem else "torch_ctxext: the new build loads\n")
    if problem:
        shutil.rmtree(final, ignore_errors=True)
        if old:
            os.rename(os.path.join(old, "build"), final)
    else:
        with open(os.path.join(final, RECORD + ".tmp"), "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
        os.replace(os.path.join(final, RECORD + ".tmp"), os.path.join(final, RECORD))
    if old:  # processes that loaded it keep their mapping
        shutil.rmtree(old, ignore_errors=True)
    if problem:
        raise _failure(f"the new build does not load: {problem}", log, note=(
            "This failure may not recur, so it is not recorded: the next import builds again."
        ))


def build(reason, force=False):
    """Return (path of the build for the running torch, whether this call
    built it): built now if the cache has none (or ``force``), else the one
    there, possibly made by another process while this one waited for it
    (at most $TORCH_CTXEXT_BUILD_TIMEOUT seconds).

    Raises ExtensionBuildError, and nothing else an import could not
    expect: an OSError on the way (a full disk, a cache that vanished)
    becomes one too, and is not recorded."""
    global last_failure
    try:
        return _build(reason, force)
    except ExtensionBuildError as e:
        last_failure = e
        raise
    except OSError as e:
        last_failure = _failure(
            f"{e.strerror or e}" + (f" ({e.filename})" if e.filename else ""),
            getattr(e, "torch_ctxext_log", "none written"),
            note="This failure may not recur, so it is not recorded: the next import builds again.",
        )
        raise last_failure from e


def _build(reason, force):
    csrc = sources.csrc_dir()
    if csrc is None:
        raise ExtensionBuildError(
            "torch_ctxext cannot build its C++ extension: its sources (csrc/*.cpp) "
            f"are neither in {sources.CSRC_CANDIDATES[0]} nor in {sources.CSRC_CANDIDATES[1]}. "
            "Reinstall torch_ctxext (pip install --force-reinstall torch_ctxext)."
        )
    root = build_cache.root()
    key = build_cache.build_key(csrc)
    final = os.path.join(root, key)
    library = os.path.join(final, LIBRARY)
    if build_cache.published(final) and not force:
        return library, False
    log = _check_can_build(root, key, csrc, reason)
    lock = os.path.join(root, key + ".lock")
    failed = os.path.join(root, key + ".failed")
    timeout = build_timeout()

    def waiting(holder):
        _say(
            f"waiting for another process that is building the extension for torch {torch.__version__}: "
            f"{holder} (lock {lock}); at most {timeout:.0f} s (${ENV_TIMEOUT})"
        )

    try:
        with _locked(lock, waiting, timeout):
            return _build_holding_the_lock(reason, force, csrc, root, key, log, failed)
    except _LockTimeout as e:
        error = ExtensionBuildError(
            f"torch_ctxext could not load its C++ extension for torch {torch.__version__}: "
            f"it waited {e.timeout:.0f} s (${ENV_TIMEOUT}) for the build of {e.holder} "
            f"(lock {lock}, its log {log}) and gave up. Without it, the members of the ctx "
            "contract torch_ctxext adds to this torch are unavailable in this process "
            "(torch_ctxext.features() says which). This is not recorded: the next import "
            f"loads that build if it is done, or waits again; set {ENV_TIMEOUT} to wait longer."
        )
        raise error from None
    except OSError as e:
        e.torch_ctxext_log = log
        raise


def _build_holding_the_lock(reason, force, csrc, root, key, log, failed):
    final = os.path.join(root, key)
    library = os.path.join(final, LIBRARY)
    if build_cache.published(final) and not force:
        return library, False  # built by the process we waited for
    recorded = None if force else _recorded_failure(failed)
    if recorded is not None:
        error = ExtensionBuildError(f"{recorded['message']} (recorded at {recorded['when']}; `{REBUILD}` tries again)")
        error.remembered = True
        raise error
    for stale in os.listdir(root):  # remains of builds killed half-way
        if stale.startswith((key + ".partial-", key + ".old-")):
            shutil.rmtree(os.path.join(root, stale), ignore_errors=True)
    _write_log_header(log, key, csrc, reason)
    _say(
        f"building its C++ extension for torch {torch.__version__} "
        f"(git {(torch.version.git_version or 'unknown')[:12]}): {reason}. "
        f"About 20 s on 2 cores, once; later imports load it from {root}. Log: {log}"
    )
    partial = tempfile.mkdtemp(prefix=key + ".partial-", dir=root)
    start = time.monotonic()
    try:
        _compile(partial, csrc, log)
    except BaseException as e:
        shutil.rmtree(partial, ignore_errors=True)
        if isinstance(e, ExtensionBuildError) and e.remembered:  # for the waiting and the later
            raise _record_failure(failed, e, log) from None
        raise
    seconds = time.monotonic() - start
    _publish(partial, final, {
        "torch": torch.__version__,
        "torch_git": torch.version.git_version,
        "python": sys.implementation.cache_tag,
        "fingerprint": build_cache.fingerprint(csrc),
        "sources": [os.path.basename(s) for s in sources.sources(csrc, torch.__version__)],
        "csrc": csrc,
        "built_at": _now(),
        "seconds": round(seconds, 1),
        "log": log,
    }, log)
    with contextlib.suppress(FileNotFoundError):
        os.remove(failed)
    _say(f"built in {seconds:.0f} s: {library}")
    _verify_layout(library, log)
    return library, True


def _verify_layout(library, log):
    """Verify the new build's layout against this torch once, now, in a
    child process, and keep the verdict beside it (layout_verdict): the
    imports that load it only read the verdict. One that cannot be made
    here is made by the next import."""
    try:
        record = layout_verdict.verify(library)
        layout_verdict.write(layout_verdict.beside(library), record)
        note = f"layout verified in {record['seconds']} s: " + (
            "everything reads back as the headers say" if not record["found"] else json.dumps(record["found"])
        )
    except (layout_verdict.ProbeNotRun, OSError) as e:
        note = f"layout not verified ({e}); the next import verifies it"
    with contextlib.suppress(OSError), open(log, "a") as f:
        f.write(f"torch_ctxext: {note}\n")


def _recorded_failure(failed):
    """The compile error recorded at ``failed`` ({"message", "when", ...}),
    or None. A record that cannot be read as one (empty, cut short by a full
    disk, edited by hand) is no record: it is removed, and the build runs
    again (and records its failure afresh, if it fails)."""
    try:
        with open(failed) as f:
            recorded = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        recorded = None
    if isinstance(recorded, dict) and all(isinstance(recorded.get(k), str) for k in ("message", "when")):
        return recorded
    with contextlib.suppress(OSError):
        os.remove(failed)
    return None


def _record_failure(failed, error, log):
    """Record a compile error for later imports; return the error to raise.
    If it cannot be written (a full disk), that error says so and is not
    remembered: the next import compiles again and meets it again."""
    try:
        with open(failed + ".tmp", "w") as f:
            json.dump({"message": str(error), "when": _now(), "log": log}, f)
        os.replace(failed + ".tmp", failed)
        return error
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(failed + ".tmp")
        return _failure(error.what, log, note=(
            f"It could not be recorded ({e.strerror}), so the next import compiles again."
        ))
