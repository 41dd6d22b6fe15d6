"""The build at first import, in a process of its own.

``torch_ctxext._ext.build.build`` (in the importing process) runs :func:`main`
in a child (``child.run``: unseen by the importer's SIGCHLD), hands it a spec on stdin
and reads its answer: everything a build does happens here, nothing in the
importer. This process:

* becomes the build's supervisor (``supervisor``): it ends with the
  importer, and when it is told to stop ends ninja and every compiler and
  removes the build's private directory;
* takes the build's lock (``build_lock``: the ranks of a job build once),
  or reports the compile error recorded by an earlier build;
* writes the ninja file (``compile``: cpp_extension's flags for the
  release, without importing cpp_extension) and runs ninja, the output to
  the build log, each step reported to the importer as it finishes;
* meanwhile imports torch (on a thread: it overlaps the compile), which
  the two checks after it need: the new library is loaded (dlopen) to see
  that it loads, then published (its record written last); then its
  layout verified (``layout_verdict``: a probe in a child process of its
  own) and the verdict kept beside it.

What it says, on stdout, one JSON object a line: {"say": text},
{"progress": [done, total, what]}, and last {"built": {...}} or
{"failed": {...}}. Nothing else goes to stdout: ninja's and the
compiler's output goes to the log.

The standard library only at the top: torch is imported from the
importer's own sys.path, handed over in the spec.
"""
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from . import build_lock, compile, sources, supervisor
from .cache import BUILD_AGAIN, LIBRARY, RECORD, identity, published

_STEP = re.compile(r"^\[(\d+)/(\d+)\] (.*)$")
# A compiler's line that says it did not fail on the code: it was killed (the
# kernel's out-of-memory killer: "Killed signal terminated program cc1plus"),
# crashed, or ran out of memory or disk. Such a failure may not recur.
_NOT_THE_CODE = re.compile(
    r"Killed signal|terminated program|internal compiler error|out of memory|"
    r"memory exhausted|Cannot allocate memory|No space left on device|Segmentation fault",
    re.I,
)


def tell(**message):
    """One line of the answer to the importer."""
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def say(text):
    tell(say=text)


class Failed(Exception):
    """The build failed: ``what`` went wrong, ``log`` says more, ``remembered``
    (a compile error, recorded for later imports), ``note`` (what happens next)."""

    def __init__(self, what, log, remembered=False, note="", timeout=None):
        super().__init__(what)
        self.what, self.log, self.remembered, self.note, self.timeout = what, log, remembered, note, timeout


# --------------------------------------------------------------------------
# What a build needs
# --------------------------------------------------------------------------


def compiler():
    command = shlex.split(os.environ.get("CXX", "c++")) or ["c++"]
    return command[0]


def compiler_named():
    """The compiler as a message names it: its command and where it came
    from ("`false` (from $CXX)", "`c++` (the default; $CXX is not set)")."""
    cxx = os.environ.get("CXX")
    if cxx is None:
        return "`c++` (the default; $CXX is not set)"
    return f"`{cxx}` (from $CXX)"


def compiler_problem():
    """Why the compiler cannot be run, or None: a command by its path that
    is not there or not executable, a bare name not on PATH."""
    command = compiler()
    if shutil.which(command) is not None:
        return None
    if os.sep in command:
        why = "does not exist" if not os.path.exists(command) else "is not an executable file"
    else:
        why = "is not on PATH"
    return f"no C++ compiler: {compiler_named()} {why}"


def find_ninja():
    """ninja on PATH, beside this interpreter (a venv that is not activated),
    or the ninja wheel's own."""
    import sysconfig

    dirs = [os.path.dirname(sys.executable), sysconfig.get_path("scripts")]
    try:
        import ninja

        dirs.append(ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    return shutil.which("ninja") or shutil.which("ninja", path=os.pathsep.join(d for d in dirs if d))


def missing_tools(target):
    """What a build needs and this machine lacks, one sentence each."""
    problems = []
    problem = compiler_problem()
    if problem is not None:
        problems.append(
            f"{problem}; install one (e.g. `apt install g++`, `dnf install gcc-c++`, "
            "`conda install gxx`) or point $CXX at it"
        )
    python_h = os.path.join(target.python_include, "Python.h")
    if not os.path.isfile(python_h):
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        problems.append(
            f"no Python headers: {python_h} does not exist; install them "
            f"(e.g. `apt install python{version}-dev`, `dnf install python{version}-devel`)"
        )
    torch_h = os.path.join(target.torch_dir, "include", "torch", "extension.h")
    if not os.path.isfile(torch_h):
        problems.append(f"no torch C++ headers: {torch_h} does not exist (a torch without its include/ directory)")
    if find_ninja() is None:
        problems.append("no ninja: install it with `pip install ninja`")
    return problems


# --------------------------------------------------------------------------
# The log and what it says went wrong
# --------------------------------------------------------------------------


def first_error(log):
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


_OUTPUT_LINES = 3  # of a failed command's output, in the message (the log has all of it)


def _failed_step(failed):
    """What failed, for the message: "the C++ compiler `false` (from $CXX)
    failed on unit_engine.cpp (csrc/engine_layout.cpp, ...): exit status 1
    with no output", or with the first lines of what it printed, errors
    first. ninja 1.12 and later give the exit status; older ninja does not,
    and then the message has none."""
    step = failed[0]
    lines = [line.strip() for line in step["output"] if line.strip()]
    errors = [line for line in lines if re.search(r"\b(fatal error|error):", line)]
    shown = (errors + [line for line in lines if line not in errors])[:_OUTPUT_LINES]
    text = f"the C++ compiler {compiler_named()} {step['what']}"
    if step["code"] is not None:
        text += f": exit status {step['code']}"
    text += (": " + " | ".join(shown)) if shown else " with no output"
    if len(failed) > 1:
        text += f" (and {len(failed) - 1} more step{'s' if len(failed) > 2 else ''} failed)"
    return text


def compile_failure(code, log, failed=(), library_missing=False):
    """The Failed for a ninja that exited with ``code``; ``failed``: the
    steps ninja said failed (``NinjaSteps.failed``), the first named in the
    message with its compiler, exit status and first lines of output.

    Only a deterministic compile error (an error status, and the compiler
    said ``error:`` about the code) is remembered: anything else (killed by
    a signal, for memory, the disk full, no diagnostic: a compiler that
    fails without a word, such as CXX=false) may not recur. A step that
    failed without a diagnostic says to fix the compiler or set $CXX."""
    first = first_error(log)
    what = _failed_step(failed) if failed else first
    if library_missing and not failed:
        what = (f"the C++ compiler {compiler_named()} exited with status 0 but wrote no {LIBRARY}; "
                "install or fix a C++ compiler, or set $CXX to one that works")
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        why = f"the build was killed by {name}"
    elif _NOT_THE_CODE.search(first):
        why = "the compiler was killed or ran out of resources, not stopped by an error in the code"
    elif code > 0 and re.search(r"\b(fatal error|error):", first):
        if failed and first not in what:  # the first error of another step than the first failed
            what += f" ({first})"
        return Failed(what, log, remembered=True, note=(
            "This is a compile error: it is recorded, and later imports report it "
            f"without compiling until `{BUILD_AGAIN}`."
        ))
    else:
        why = "the build stopped without a compile error"
        if failed:
            # No diagnostic and no signal: `false`, a wrapper script that
            # cannot run its compiler, a compiler killed without a word.
            what += ("; a compiler that fails without saying why does not work (or was killed): "
                     "install or fix a C++ compiler, or set $CXX to one that works")
    return Failed(what, log, note=f"This failure may not recur ({why}), so it is not recorded: the next import builds again.")


def write_log_header(log, spec, target, ninja):
    with open(log, "w") as f:
        f.write(
            f"torch_ctxext build {spec['key']}\n"
            f"started  {build_lock.now()}\n"
            f"reason   {spec['reason']}\n"
            f"torch    {target.torch_version} (git {target.git_version}) {target.torch_dir}\n"
            f"python   {sys.executable} {sys.version.split()[0]}\n"
            f"compiler {os.environ.get('CXX', 'c++')} -> {shutil.which(compiler())}\n"
            f"ninja    {ninja}\n"
            f"sources  {spec['csrc']}: "
            f"{' '.join(os.path.basename(s) for s in sources.sources(spec['csrc'], target.torch_version))}\n\n"
        )


# --------------------------------------------------------------------------
# The build
# --------------------------------------------------------------------------


def _describe(command, failed=False):
    """What a ninja step did: "compiled <source>" or "linked _C.so", or,
    ``failed``, "failed to compile <source>" or "failed to link _C.so"."""
    try:
        words = shlex.split(command)
    except ValueError:  # an unbalanced quote: not a command we wrote
        words = command.split()
    for flag, argument in zip(words, words[1:]):
        if flag == "-c":
            return f"{'failed to compile' if failed else 'compiled'} {os.path.basename(argument)}"
    return f"failed to link {LIBRARY}" if failed else f"linked {LIBRARY}"


def _output_of(command):
    """The file a step's command writes (its ``-o``), or None."""
    try:
        words = shlex.split(command)
    except ValueError:
        words = command.split()
    for flag, argument in zip(words, words[1:]):
        if flag == "-o":
            return argument
    return None


def _members(unit):
    """The sources a generated translation unit includes, as csrc/<name>
    (sources.write_units), or [] where it cannot be read."""
    try:
        with open(unit, errors="replace") as f:
            return ["csrc/" + os.path.basename(m) for m in re.findall(r'^#include "([^"]+)"', f.read(), re.M)]
    except OSError:
        return []


# ninja's line for a step that failed: "FAILED: out" (ninja 1.11 and before),
# "FAILED: [code=1] out" (1.12 and later: the command's exit status).
_FAILED = re.compile(r"^FAILED: (?:\[code=(-?\d+)\] )?(.*?)\s*$")


class NinjaSteps:
    """ninja's output (-v, on a pipe), line by line: each step as it ends,
    told to the importer as compiled or failed, and the steps that failed,
    with the command's exit status where ninja gives it and its output.

    On a pipe ninja prints a step's "[done/total] command" line when the
    step has ended, then, if it failed, "FAILED: out", the command again,
    and its output. So a step's line alone does not say whether it failed:
    the file it writes does (the directory is fresh: nothing is left from
    an earlier build, and a compiler that fails writes no object). A step
    whose file is there but that ninja then calls FAILED is told again, as
    failed."""

    def __init__(self, directory):
        self.directory = directory
        self.failed = []  # {"what", "command", "code", "output"} per failed step, in order
        self._last = None  # (done, total, command, told failed) of the step whose line came last
        self._collecting = None  # the failed step whose output lines are coming

    def line(self, line):
        text = line.rstrip("\n")
        step = _STEP.match(text)
        if step:
            self._collecting = None
            done, total, command = int(step.group(1)), int(step.group(2)), step.group(3)
            output = _output_of(command)
            missing = output is not None and not os.path.exists(os.path.join(self.directory, output))
            self._last = (done, total, command, missing)
            tell(progress=[done, total, _describe(command, failed=missing)])
            return
        failed = _FAILED.match(text)
        if failed and self._last is not None:
            done, total, command, told = self._last
            if not told:
                tell(progress=[done, total, _describe(command, failed=True)])
            what = _describe(command, failed=True).replace("failed to compile", "failed on", 1)
            if what.startswith("failed on "):
                members = _members(os.path.join(self.directory, what[len("failed on "):]))
                if members:
                    what += f" ({', '.join(members)})"
            self._collecting = {"what": what, "command": command,
                                "code": int(failed.group(1)) if failed.group(1) is not None else None,
                                "output": [], "echoed": False}
            self.failed.append(self._collecting)
            self._last = None
            return
        collecting = self._collecting
        if collecting is None:
            return
        if text.startswith("ninja: "):  # ninja's own last words ("build stopped")
            self._collecting = None
        elif not collecting["echoed"] and text.strip() == collecting["command"].strip():
            collecting["echoed"] = True  # the command, printed again after FAILED
        else:
            collecting["output"].append(text)


def run_ninja(partial, target, log):
    """Compile into ``partial``; raise Failed."""
    ninja = find_ninja()
    compile.write_ninja(target, spec["csrc"], partial, compiler=os.environ.get("CXX", "c++"))
    command = [ninja or "ninja"] + compile.ninja_arguments()
    env = dict(os.environ)
    if ninja:
        env["PATH"] = os.path.dirname(ninja) + os.pathsep + env.get("PATH", "")
    env.pop("NINJA_STATUS", None)  # its default "[finished/total] " is what we parse
    with open(log, "a") as out:
        out.write("$ " + shlex.join(command) + "\n\n")
        out.flush()
        supervisor.ninja_process = ninja = subprocess.Popen(
            command, cwd=partial, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1,
        )
        steps = NinjaSteps(partial)
        for line in ninja.stdout:
            out.write(line)
            out.flush()
            steps.line(line)
        code = ninja.wait()
    if code != 0 or not os.path.isfile(os.path.join(partial, LIBRARY)):
        raise compile_failure(code, log, [dict(f) for f in steps.failed], library_missing=code == 0)


def import_torch(path, torch_file, result):
    """Import the importer's torch (on a thread, while ninja compiles)."""
    try:
        sys.path[:] = path
        import torch

        if os.path.abspath(torch.__file__) != os.path.abspath(torch_file):
            raise ImportError(f"this process imported torch from {torch.__file__}, the importer from {torch_file}")
        result["torch"] = torch
    except BaseException as e:  # said where it is needed
        result["error"] = f"{type(e).__name__}: {e}"


def load_problem(library):
    """None if ``library`` loads with every symbol resolved (torch is
    imported here); else what the loader said. Opened, not imported: its
    module initialisation claims engine hooks."""
    import ctypes

    try:
        ctypes.CDLL(library, mode=os.RTLD_NOW | os.RTLD_LOCAL)
    except OSError as e:
        return str(e)
    return None


def publish(partial, final, record, log, torch_ready):
    """Make the build in ``partial`` visible as ``final``: renamed there,
    loaded to see that it loads, then its record written (which publishes
    it). One that does not load is removed (a previous one put back), and
    its failure, which may not recur, raised."""
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
    problem = (torch_ready.get("error") and f"torch could not be imported to load it ({torch_ready['error']})") \
        or load_problem(os.path.join(final, LIBRARY))
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
        raise Failed(f"the new build does not load: {problem}", log,
                     note="This failure may not recur, so it is not recorded: the next import builds again.")


def verify_layout(library, log):
    """The new build's layout verified against this torch now, in a probe
    process, and the verdict kept beside it; one that cannot be made here
    is made by the next import."""
    from . import layout_verdict  # here: only a build that reads by layout verifies it

    try:
        record = layout_verdict.verify(library)
        layout_verdict.write(layout_verdict.beside(library), record)
        note = f"layout verified in {record['seconds']} s: " + (
            "everything reads back as the headers say" if not record["found"] else json.dumps(record["found"])
        )
    except (layout_verdict.ProbeNotRun, OSError) as e:
        note = f"layout not verified ({e}); the next import verifies it"
    with open(log, "a") as f:
        f.write(f"torch_ctxext: {note}\n")


def recorded_failure(failed):
    """The compile error recorded at ``failed``, or None; a record that cannot
    be read as one is no record (removed: the build runs again)."""
    try:
        with open(failed) as f:
            recorded = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        recorded = None
    if isinstance(recorded, dict) and all(isinstance(recorded.get(k), str) for k in ("message", "when")):
        return recorded
    try:
        os.remove(failed)
    except OSError:
        pass
    return None


def record_failure(failed, error):
    """Record a compile error for later imports; return the Failed to report.
    If it cannot be written (a full disk), that one says so, not remembered."""
    try:
        with open(failed + ".tmp", "w") as f:
            json.dump({"message": f"{error.what}. {error.note}", "what": error.what, "when": build_lock.now(),
                       "log": error.log}, f)
        os.replace(failed + ".tmp", failed)
        return error
    except OSError as e:
        try:
            os.remove(failed + ".tmp")
        except OSError:
            pass
        return Failed(error.what, error.log, note=(
            f"It could not be recorded ({e.strerror}), so the next import compiles again."
        ))


def check_can_build(target):
    """Return the log path; raise Failed naming what is missing."""
    root, key = spec["root"], spec["key"]
    ninja = find_ninja()
    try:
        os.makedirs(root, exist_ok=True)
        open(os.path.join(root, key + ".lock"), "a").close()
    except OSError as e:
        log = os.path.join(tempfile.gettempdir(), f"torch_ctxext-{key}.log")
        write_log_header(log, spec, target, ninja)
        raise Failed(f"cannot write to the build cache {root} ({e.strerror}); set "
                     f"{spec['env_cache']} to a writable directory", log) from None
    log = os.path.join(root, key + ".log")
    problems = missing_tools(target)
    if problems:
        write_log_header(log, spec, target, ninja)
        with open(log, "a") as f:
            f.write("not built:\n" + "".join(f"  {p}\n" for p in problems))
        raise Failed("; ".join(problems), log)
    return log


def build(target):
    """{"library", "built"}: the published build, made now unless another
    process made it while this one waited for the lock."""
    root, key = spec["root"], spec["key"]
    final = os.path.join(root, key)
    library = os.path.join(final, LIBRARY)
    log = check_can_build(target)
    lock = os.path.join(root, key + ".lock")
    failed = os.path.join(root, key + ".failed")
    timeout = spec["timeout"]

    def waiting(holder):
        say(f"waiting for another process that is building the extension for torch {target.torch_version}: "
            f"{holder} (lock {lock}); at most {timeout:.0f} s (${spec['env_timeout']})")

    try:
        with build_lock.locked(lock, waiting, timeout, say=say):
            # A build the importer could not load is built again in its place,
            # unless the process waited for already did that.
            unloadable = spec.get("replace") is not None and identity(library) == spec["replace"]
            if published(final) and not spec["force"] and not unloadable:
                return {"library": library, "built": False}  # built by the process we waited for
            recorded = None if spec["force"] else recorded_failure(failed)
            if recorded is not None:
                raise Failed(recorded.get("what") or recorded["message"], recorded.get("log", log), remembered=True, note=(
                    f"This is a compile error recorded at {recorded['when']}; `{BUILD_AGAIN}` tries again."
                ))
            for stale in os.listdir(root):  # remains of builds killed half-way
                if stale.startswith((key + ".partial-", key + ".old-")):
                    shutil.rmtree(os.path.join(root, stale), ignore_errors=True)
            write_log_header(log, spec, target, find_ninja())
            say(
                f"building its C++ extension for torch {target.torch_version} "
                f"(git {target.git_version[:12]}): {spec['reason']}. "
                f"About 20 s on 2 cores, once; later imports load it from {root}. Log: {log}"
            )
            torch_ready = {}
            importer = threading.Thread(target=import_torch, args=(spec["path"], spec["torch_file"], torch_ready),
                                        daemon=True)
            importer.start()
            partial = supervisor.partial_dir = tempfile.mkdtemp(prefix=key + ".partial-", dir=root)
            start = time.monotonic()
            try:
                run_ninja(partial, target, log)
            except BaseException as e:
                shutil.rmtree(partial, ignore_errors=True)
                supervisor.partial_dir = None
                if isinstance(e, Failed) and e.remembered:  # for the waiting and the later
                    raise record_failure(failed, e) from None
                raise
            seconds = time.monotonic() - start
            importer.join()
            publish(partial, final, dict(spec["record"], built_at=build_lock.now(), seconds=round(seconds, 1),
                                             log=log), log, torch_ready)
            supervisor.partial_dir = None
            try:
                os.remove(failed)
            except FileNotFoundError:
                pass
            say(f"built in {seconds:.0f} s: {library}")
            if not spec["record"].get("advise_only"):  # advise()'s watch and the drop-ins' Function read nothing by layout
                verify_layout(library, log)
            return {"library": library, "built": True}
    except build_lock.LockTimeout as e:
        raise Failed(
            f"it waited {e.timeout:.0f} s (${spec['env_timeout']}) for the build of {e.holder} "
            f"(lock {lock}, its log {log}) and gave up", log, timeout=e.timeout,
            note=("This is not recorded: the next import loads that build if it is done, or waits again; "
                  f"set {spec['env_timeout']} to wait longer."),
        ) from None


def main(argv=()):
    """The build, as the spec on stdin asks; its answer on stdout. Never returns."""
    global spec
    spec = json.loads(sys.stdin.read())
    supervisor.become_the_supervisor(spec["parent"])
    # After the standard library and this package: the importer's path, where
    # the ninja wheel may be (torch is imported with that path alone).
    sys.path.extend(p for p in spec["path"] if p not in sys.path)
    target = compile.Target(**spec["target"])
    try:
        tell(built=build(target))
    except Failed as e:
        tell(failed={"what": e.what, "log": e.log, "remembered": e.remembered, "note": e.note, "timeout": e.timeout})
    except OSError as e:  # a full disk, a cache that vanished: may not recur
        tell(failed={"what": f"{e.strerror or e}" + (f" ({e.filename})" if e.filename else ""),
                     "log": os.path.join(spec["root"], spec["key"] + ".log"), "remembered": False,
                     "note": "This failure may not recur, so it is not recorded: the next import builds again.",
                     "timeout": None})
    sys.stdout.flush()
    os._exit(0)  # not waiting for the torch import thread, nor torch's shutdown


spec = None  # the importer's spec (main)
