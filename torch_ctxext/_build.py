"""Building the C++ extension for the running torch, once, into the build cache.

The extension reads autograd-engine structures by layout, so it must be
compiled against the very torch that runs. When the installed package carries
no build for it (installed from source, or torch was upgraded since), the
first import builds one with ``torch.utils.cpp_extension.load`` and ninja into
the build cache (``_build_cache``: where builds live, how they are named), and
later imports load it from there.

Several processes importing at once (the ranks of a job) build once: the
first takes a file lock and builds, the others wait for it and load. A build
is compiled in a private directory and published by renaming that directory,
so a build killed half-way leaves nothing a later import would load (the next
builder removes the remains). A failed build is recorded, so that waiting
processes and later imports report it at once instead of compiling again;
``python -m torch_ctxext build --force`` tries again.
"""
import contextlib
import datetime
import fcntl
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from . import _build_cache, _sources
from ._build_cache import LIBRARY, RECORD

ENV_JIT = "TORCH_CTXEXT_JIT"
REBUILD = "python -m torch_ctxext build --force"


class ExtensionBuildError(ImportError):
    """The C++ extension could not be built for the running torch.

    The message names what is missing (a compiler, the Python headers, ninja,
    a writable cache) or the compiler's first error, and the build log.
    ``import torch_ctxext`` does not raise it: it warns with the same message
    (:class:`~torch_ctxext._features.ExtensionUnavailableWarning`) and reports
    the members that need the extension unavailable; ``python -m torch_ctxext
    build`` prints it and exits with 1.
    """


def jit_enabled():
    """False when $TORCH_CTXEXT_JIT is 0: never compile at import."""
    return os.environ.get(ENV_JIT, "1").strip().lower() not in ("0", "false", "no", "off")


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
    torch_h = os.path.join(_build_cache.torch_include_dirs()[0], "torch", "extension.h")
    if not os.path.isfile(torch_h):
        problems.append(f"no torch C++ headers: {torch_h} does not exist (a torch without its include/ directory)")
    if _find_ninja() is None:
        problems.append("no ninja: install it with `pip install ninja`")
    return problems


# --------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------

# Run in a child process: its output (ninja's, the compiler's) goes to the
# log, and a failure cannot leave half-initialised state in the importer.
_CHILD = r"""
import ctypes, json, os, signal, sys
spec = json.loads(sys.argv[1])
try:  # die with the importing process (a killed rank must not leave a compile behind)
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
except Exception:
    pass
if os.getppid() != spec["parent"]:
    sys.exit("torch_ctxext: the importing process is gone")
import torch.utils.cpp_extension as cpp_extension
cpp_extension.load(
    name="_C", sources=spec["sources"], extra_cflags=spec["cflags"],
    extra_ldflags=spec["ldflags"], build_directory=spec["directory"],
    verbose=True, is_python_module=True,
)
print("torch_ctxext: the new build loads", flush=True)
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
        compiled = re.search(r"\s-c\s+(\S+)", command)
        what = f"compiled {os.path.basename(compiled.group(1))}" if compiled else "linked _C.so"
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


def _failure(what, log):
    return ExtensionBuildError(
        f"torch_ctxext could not build its C++ extension for torch {torch.__version__}: "
        f"{what}. Build log: {log}. Without it, the members of the ctx contract "
        "torch_ctxext adds to this torch are unavailable (torch_ctxext.features() "
        "says which); build it where a compiler is available with "
        "`python -m torch_ctxext build` (TORCH_CTXEXT_CACHE picks where it goes), "
        "or install a wheel built for this torch."
    )


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
            f"sources  {csrc}: {' '.join(os.path.basename(s) for s in _sources.sources(csrc))}\n\n"
        )


@contextlib.contextmanager
def _locked(path, on_wait):
    """An exclusive flock on ``path``; the kernel releases it if we die."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_wait()
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _compile(partial, csrc, log):
    """Compile into ``partial`` with torch.utils.cpp_extension in a child
    process, showing ninja's progress; raise ExtensionBuildError on failure."""
    spec = {
        "parent": os.getpid(),
        "sources": _sources.sources(csrc),
        "cflags": _sources.jit_cflags(torch.__version__, torch.version.git_version),
        "ldflags": _sources.extra_link_args(),
        "directory": partial,
    }
    env = dict(os.environ)
    ninja = _find_ninja()
    if ninja:
        env["PATH"] = os.path.dirname(ninja) + os.pathsep + env.get("PATH", "")
    env.pop("NINJA_STATUS", None)  # its default "[finished/total] " is what we parse
    progress = _Progress()
    with open(log, "a") as out:
        out.write("$ " + shlex.join([sys.executable, "-c", "<torch.utils.cpp_extension.load>", json.dumps(spec)]) + "\n\n")
        out.flush()
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, json.dumps(spec)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            cwd=partial, env=env, text=True, errors="replace", bufsize=1,
        )
        try:
            for line in child.stdout:
                out.write(line)
                out.flush()
                step = _STEP.match(line)
                if step:
                    progress.step(int(step.group(1)), int(step.group(2)), step.group(3))
            code = child.wait()
        except BaseException:
            child.kill()
            child.wait()
            raise
        finally:
            progress.close()
    if code != 0 or not os.path.isfile(os.path.join(partial, LIBRARY)):
        raise _failure(_first_error(log), log)


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
            f"{_build_cache.ENV_CACHE} to a writable directory", log,
        ) from None
    log = os.path.join(root, key + ".log")
    problems = missing_tools()
    if problems:
        _write_log_header(log, key, csrc, reason)
        with open(log, "a") as f:
            f.write("not built:\n" + "".join(f"  {p}\n" for p in problems))
        raise _failure("; ".join(problems), log)
    return log


def _publish(partial, final, record):
    """Make the complete build in ``partial`` visible as ``final`` at once."""
    for name in os.listdir(partial):  # keep the library and the ninja file
        if name not in (LIBRARY, "build.ninja"):
            path = os.path.join(partial, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    with open(os.path.join(partial, RECORD), "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    os.chmod(partial, 0o755)  # mkdtemp's 0700 would hide it from a shared cache's other users
    old = None
    if os.path.isdir(final):  # --force over an existing build
        old = tempfile.mkdtemp(prefix=os.path.basename(final) + ".old-", dir=os.path.dirname(final))
        os.rename(final, os.path.join(old, "build"))
    os.rename(partial, final)
    if old:  # processes that loaded it keep their mapping
        shutil.rmtree(old, ignore_errors=True)


def build(reason, force=False):
    """Return (path of the build for the running torch, whether this call
    built it): built now if the cache has none (or ``force``), else the one
    there, possibly made by another process while this one waited for it.
    Raises ExtensionBuildError."""
    csrc = _sources.csrc_dir()
    if csrc is None:
        raise ExtensionBuildError(
            "torch_ctxext cannot build its C++ extension: its sources (csrc/*.cpp) "
            f"are neither in {_sources.CSRC_CANDIDATES[0]} nor in {_sources.CSRC_CANDIDATES[1]}. "
            "Reinstall torch_ctxext (pip install --force-reinstall torch_ctxext)."
        )
    root = _build_cache.root()
    key = _build_cache.build_key(csrc)
    final = os.path.join(root, key)
    library = os.path.join(final, LIBRARY)
    if os.path.isfile(library) and not force:
        return library, False
    log = _check_can_build(root, key, csrc, reason)
    lock = os.path.join(root, key + ".lock")
    failed = os.path.join(root, key + ".failed")

    def waiting():
        _say(f"waiting for another process that is building the extension for torch {torch.__version__} (lock {lock})")

    with _locked(lock, waiting):
        if os.path.isfile(library) and not force:
            return library, False  # built by the process we waited for
        if os.path.isfile(failed) and not force:
            with open(failed) as f:
                recorded = json.load(f)
            raise ExtensionBuildError(f"{recorded['message']} (recorded at {recorded['when']}; `{REBUILD}` tries again)")
        for stale in os.listdir(root):  # remains of builds killed half-way
            if stale.startswith((key + ".partial-", key + ".old-")):
                shutil.rmtree(os.path.join(root, stale), ignore_errors=True)
        _write_log_header(log, key, csrc, reason)
        _say(
            f"building its C++ extension for torch {torch.__version__} "
            f"(git {(torch.version.git_version or 'unknown')[:12]}): {reason}. "
            f"About a minute, once; later imports load it from {root}. Log: {log}"
        )
        partial = tempfile.mkdtemp(prefix=key + ".partial-", dir=root)
        start = time.monotonic()
        try:
            _compile(partial, csrc, log)
        except BaseException as e:
            shutil.rmtree(partial, ignore_errors=True)
            if isinstance(e, ExtensionBuildError):  # recorded for the waiting and the later
                with open(failed + ".tmp", "w") as f:
                    json.dump({"message": str(e), "when": _now(), "log": log}, f)
                os.replace(failed + ".tmp", failed)
            raise
        seconds = time.monotonic() - start
        _publish(partial, final, {
            "torch": torch.__version__,
            "torch_git": torch.version.git_version,
            "python": sys.implementation.cache_tag,
            "fingerprint": _build_cache.fingerprint(csrc),
            "sources": [os.path.basename(s) for s in _sources.sources(csrc)],
            "csrc": csrc,
            "built_at": _now(),
            "seconds": round(seconds, 1),
            "log": log,
        })
        with contextlib.suppress(FileNotFoundError):
            os.remove(failed)
        _say(f"built in {seconds:.0f} s: {library}")
        return library, True
