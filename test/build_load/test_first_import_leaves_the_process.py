"""The first import, the one that builds, leaves the process as ``import torch`` does.

A first import (an empty build cache: a source install, the first job after a
torch upgrade) builds the extension. Everything of the build happens in a
child process (_torch_ctxext_build/build_child.py); the importer only starts it
and reads its answer. So, compared with the same process before the import:

* the same threads and no child left; every signal's disposition unchanged;
  ``sys.path``, ``sys.meta_path``, the loggers, ``sys.stdout`` and
  ``sys.stderr`` the same objects; no ``torch.utils.cpp_extension``,
  setuptools or distutils imported;
* what the importer's other threads print while it builds reaches its
  stdout, none of it the build log;
* no ResourceWarning;
* it works with any ``sys.stderr`` (None, or a forwarder with ``write``
  alone);
* under an importer whose SIGCHLD is ignored or reaped by a handler, as any
  other (test_first_import_under_any_sigchld.py: apart, so that the two
  files' builds run on both of the suite's workers).

Each case runs a fresh interpreter with a build cache of its own; each
builds (20 s or more on 2 cores).
"""
import json
import textwrap

import pytest
import torch

from _torch_ctxext_build import releases
from test_build_lock import NEEDS_EXTENSION
from support import python

# Who provides each member a build adds, once the import has built: torch_ctxext
# where the running torch lacks it (this process never imports torch_ctxext:
# the release facts say what torch has, as features() reads them).
PROVIDERS = {m: "native" if releases.native(m, torch.__version__) else "torch_ctxext"
             for m in ("input_grad_buffers", "set_output_grad_dtype")}

# The importer imports torch first, as every importer of torch_ctxext does,
# and only then traces allocations, so that a ResourceWarning names where
# its object was made: traced from the start (-X tracemalloc), torch's own
# import takes 27 s of 2.13's, against 2 s untraced.
STATE = r"""
import logging, os, signal, sys, threading, tracemalloc
import torch
tracemalloc.start(5)
def parent_of(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError):
        return None
def state():
    return {
        "threads": sorted(t.name for t in threading.enumerate()),
        "os threads": len(os.listdir("/proc/self/task")),
        "children": sorted(int(e) for e in os.listdir("/proc") if e.isdigit() and parent_of(e) == os.getpid()),
        "signals": {s.name: repr(signal.getsignal(s)) for s in signal.Signals
                    if s not in (signal.SIGKILL, signal.SIGSTOP)},
        "sys.path": list(sys.path),
        # (less the finder the boxed-grads member places on torch 2.6 to 2.12 until
        # compiled autograd is imported: the member's install, not the build)
        "sys.meta_path": [repr(f) for f in sys.meta_path if "_PatchOnImport" not in repr(f)],
        "loggers": sorted(logging.Logger.manager.loggerDict),
        "stdout": id(sys.stdout), "stderr": id(sys.stderr),
        "build modules": sorted(m for m in sys.modules if m.split(".")[0] in ("setuptools", "distutils")
                                or m.startswith("torch.utils.cpp_extension")),
    }
"""


def first_import(tmp_path, code, env=None, prelude=""):
    """``code`` in a fresh interpreter whose build cache is empty: its stdout
    and stderr (the interpreter exits non-zero if ``code`` raises)."""
    completed = python("-W", "always::ResourceWarning", "-c",
                       STATE + textwrap.dedent(prelude) + textwrap.dedent(code),
                       timeout=900, cwd=tmp_path, TORCH_CTXEXT_CACHE=tmp_path / "cache", **(env or {}))
    assert completed.returncode == 0, completed.stdout + completed.stderr
    return completed


def _answer(completed):
    return json.loads(completed.stdout.strip().splitlines()[-1])


@NEEDS_EXTENSION
def test_a_building_first_import_leaves_the_process_as_it_found_it(tmp_path):
    completed = first_import(tmp_path, """
        import json, time
        import torch
        printed = []
        def chatter(stop):
            while not stop.is_set():
                print("chatter", len(printed), flush=True)
                printed.append(1)
                time.sleep(0.05)
        stop = threading.Event()
        thread = threading.Thread(target=chatter, args=(stop,), name="chatter")
        thread.start()
        time.sleep(0.2)
        before = state()
        import torch_ctxext
        after = state()
        stop.set()
        thread.join()
        print(json.dumps({"before": before, "after": after, "printed": len(printed),
                          "features": torch_ctxext.features()}))
    """)
    answer = _answer(completed)
    assert "building its C++ extension" in completed.stderr  # this import built
    assert {m: answer["features"][m] for m in PROVIDERS} == PROVIDERS
    before, after = answer["before"], answer["after"]
    for what in before:
        assert after[what] == before[what], what
    assert before["build modules"] == []
    # What the other thread printed while the import built reached stdout, all of it.
    chatter = [line for line in completed.stdout.splitlines() if line.startswith("chatter ")]
    assert len(chatter) == answer["printed"] > 20
    (log,) = (tmp_path / "cache" / "builds").glob("*.log")
    assert "chatter" not in log.read_text()
    assert "ResourceWarning" not in completed.stderr


# What an importer may have as sys.stderr: nothing (fd 2 closed, a
# pythonw-like service), or a forwarder with write() and flush() alone (a
# log shipper: no isatty, no fileno).
STDERRS = {
    "None": "sys.stderr = None\n",
    "a write-only forwarder": textwrap.dedent("""
        class Forwarder:
            def __init__(self):
                self.lines = []
            def write(self, text):
                self.lines.append(text)
            def flush(self):  # Python flushes sys.stderr at exit
                pass
        sys.stderr = forwarder = Forwarder()
    """),
}


@NEEDS_EXTENSION
@pytest.mark.parametrize("stderr", list(STDERRS))
def test_a_building_first_import_works_with_any_sys_stderr(tmp_path, stderr):
    completed = first_import(tmp_path, STDERRS[stderr] + textwrap.dedent("""
        import json
        import torch_ctxext
        said = "".join(forwarder.lines) if "forwarder" in globals() else ""
        print(json.dumps({"features": torch_ctxext.features(), "said": said}))
    """))
    answer = _answer(completed)
    assert answer["features"]["input_grad_buffers"] == "torch_ctxext"
    if stderr == "a write-only forwarder":  # what the build says reaches it, a line per step
        assert "torch_ctxext: building its C++ extension" in answer["said"]
        assert "torch_ctxext: [1/" in answer["said"] and "built in" in answer["said"]
