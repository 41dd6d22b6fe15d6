"""Building the C++ extension for the running torch, once, into the build cache.

The extension reads autograd-engine structures by layout, so it must be
compiled against the very torch that runs. When the installed package carries
no build for it (installed from source, or torch was upgraded since), the
first import builds one into the build cache (``build_cache``: where builds
live, how they are named), and later imports load it from there.

The importing process only starts a child and reads its answer: the build
runs in ``_torch_ctxext_build.build_child`` (started with ``child.run``, so
that the importer's SIGCHLD, whatever it is, neither breaks it nor sees it).
The importer hands it the facts of its torch (attribute reads:
``compile.target_of_running_torch``) and its path; the child takes the lock,
writes the ninja file with the flags cpp_extension would use (``compile``,
without importing cpp_extension or setuptools, without a CUDA query),
compiles, checks that the library loads, publishes it and verifies its
layout. What the child says (what it builds and why, the progress, a wait
for another process's build) the importer prints on its own stderr, which it
never redirects.

Several processes importing at once (the ranks of a job) build once
(``build_lock``). A build is compiled in a private directory, renamed into
place, loaded to see that it loads, and published by writing its record
last, so a build killed half-way, or one that does not load, leaves nothing
a later import would load. A build that failed with a compile error is
recorded, so that waiting processes and later imports report it at once
instead of compiling again; ``python -m torch_ctxext build --force`` tries
again. A failure that may not recur (the compiler or the build killed by a
signal, e.g. for memory; the disk full) is not recorded.

No wait is unbounded: a process waits for another's build at most
$TORCH_CTXEXT_BUILD_TIMEOUT seconds (default 600), then leaves the members
unavailable, as for a failed build.
"""
import json
import os
import sys

import torch
from _torch_ctxext_build import child, compile, layout_verdict, sources
from _torch_ctxext_build.build_lock import ENV_TIMEOUT, build_timeout, say, stderr_is_a_terminal, to_stderr
from _torch_ctxext_build.cache import ENV_CACHE, LIBRARY

from . import build_cache

ENV_JIT = "TORCH_CTXEXT_JIT"


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


# What became of the last build this process tried (``python -m torch_ctxext
# info``): None, or the ExtensionBuildError it raised.
last_failure = None


# --------------------------------------------------------------------------
# Starting the build's process and reading its answer
# --------------------------------------------------------------------------

class _Progress:
    """Ninja's steps as they finish: one line updated in place on a terminal,
    a line per step otherwise (logs of batch jobs)."""

    def __init__(self):
        self.tty = stderr_is_a_terminal()
        self.shown = False

    def step(self, done, total, what):
        text = f"torch_ctxext: [{done}/{total}] {what}"
        if self.tty:
            to_stderr("\r\033[K" + text)
            self.shown = True
        else:
            to_stderr(text + "\n")

    def close(self):
        if self.shown:
            to_stderr("\n")
            self.shown = False


def _failure(what, log, remembered=False, note=""):
    """``log``: the build log that says more, or None where none was written
    (the build process never started)."""
    error = ExtensionBuildError(
        f"torch_ctxext could not build its C++ extension for torch {torch.__version__}: "
        f"{what}." + (f" Build log: {log}." if log else "") + " Without it, the members of the ctx contract "
        "torch_ctxext adds to this torch are unavailable (torch_ctxext.features() "
        "says which); build it where a compiler is available with "
        "`python -m torch_ctxext build` (TORCH_CTXEXT_CACHE picks where it goes), "
        "or install a wheel built for this torch." + (f" {note}" if note else "")
    )
    error.remembered, error.what = remembered, what
    return error


def _timeout_failure(what, log, note):
    error = ExtensionBuildError(
        f"torch_ctxext could not load its C++ extension for torch {torch.__version__}: {what}. "
        "Without it, the members of the ctx contract torch_ctxext adds to this torch are "
        f"unavailable in this process (torch_ctxext.features() says which). {note}"
    )
    error.what = what
    return error


def _spec(reason, force, csrc, key, replace=None):
    """What the build's process needs, all of it plain data."""
    import sysconfig  # here: only a build needs it

    # Python.h of this interpreter (the build's process runs the same one).
    target = compile.target_of_running_torch(torch, python_include=sysconfig.get_paths()["include"])._asdict()
    root = build_cache.root()
    return {
        "parent": os.getpid(), "reason": reason, "force": force, "replace": replace, "csrc": csrc, "root": root,
        "key": key,
        "timeout": build_timeout(), "env_timeout": ENV_TIMEOUT, "env_cache": ENV_CACHE,
        "target": target, "torch_file": os.path.abspath(torch.__file__),
        # The importer's path as the layout probe takes it (strings, absolute, less the
        # entry Python put first for the importer's cwd or script), for torch's import there.
        "path": layout_verdict.probe_path(),
        "record": {
            "torch": torch.__version__, "torch_git": torch.version.git_version,
            "python": sys.implementation.cache_tag, "fingerprint": build_cache.fingerprint(csrc),
            "sources": [os.path.basename(s) for s in sources.sources(csrc, torch.__version__)], "csrc": csrc,
            "advise_only": sources.advise_only(torch.__version__),
        },
    }


def _run_child(spec):
    """Start the build's process, show what it says, return its last word
    ({"built": ...} or {"failed": ...}) or raise ExtensionBuildError."""
    progress, answer = _Progress(), {}

    def on_line(line):
        try:
            message = json.loads(line)
        except ValueError:
            return  # not ours (nothing else should write to its stdout)
        if not isinstance(message, dict):
            return
        if "progress" in message:
            progress.step(*message["progress"])
        elif "say" in message:
            progress.close()
            say(message["say"])
        else:
            answer.update(message)

    log = os.path.join(spec["root"], spec["key"] + ".log")
    try:
        finished = child.run(
            child.python_running("build_child"), input=json.dumps(spec), on_line=on_line,
            cwd=spec["root"] if os.path.isdir(spec["root"]) else "/", new_session=True,
        )
    except child.ChildNotStarted as e:
        # Nothing was started, so no log was written: name none.
        raise _failure(f"its build process could not start ({e.strerror or e}, errno {e.errno})", None) from None
    finally:
        progress.close()
    if not answer:
        how = f"was killed by signal {finished.signal}" if finished.signal else f"exited with status {finished.status}"
        said = (finished.output.strip().splitlines() or ["no output"])[-1]
        raise _failure(f"its build process {how} without an answer ({said})", log, note=(
            "This failure may not recur, so it is not recorded: the next import builds again."
        ))
    return answer


def build(reason, force=False, replace=None):
    """Return (path of the build for the running torch, whether this call
    built it): built now if the cache has none (or ``force``), else the one
    there, possibly made by another process while this one waited for it
    (at most $TORCH_CTXEXT_BUILD_TIMEOUT seconds).

    ``replace``: the ``build_cache.identity`` of the cache's build that did
    not load here. It is built again in its place, unless it is no longer
    the one there (another process, a rank of the same job, replaced it
    while this one waited): the ranks that all failed to load it build once,
    and a build that does not load is not loaded again by later imports.

    Raises ExtensionBuildError, and nothing else an import could not expect."""
    global last_failure
    csrc = sources.csrc_dir()
    if csrc is None:
        raise ExtensionBuildError(
            "torch_ctxext cannot build its C++ extension: its sources (csrc/*.cpp) "
            f"are neither in {sources.CSRC_CANDIDATES[0]} nor in {sources.CSRC_CANDIDATES[1]}. "
            "Reinstall torch_ctxext (docs/install.md), which carries them."
        )
    key = build_cache.build_key(csrc)
    final = os.path.join(build_cache.root(), key)
    library = os.path.join(final, LIBRARY)
    if build_cache.published(final) and not force and (replace is None or build_cache.identity(library) != replace):
        return library, False
    answer = _run_child(_spec(reason, force, csrc, key, replace))
    if "built" in answer:
        return answer["built"]["library"], answer["built"]["built"]
    failed = answer["failed"]
    if failed.get("timeout") is not None:
        last_failure = _timeout_failure(failed["what"], failed["log"], failed["note"])
    else:
        last_failure = _failure(failed["what"], failed["log"], failed["remembered"], failed["note"])
    raise last_failure
