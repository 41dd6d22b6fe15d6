"""The layout probe's child process is the importer's in nothing but torch.

* its exit status is read right whatever the importer did with SIGCHLD
  (ignored: the kernel reaps it; a handler that reaps whatever exits), and
  the importer's handler never runs for it;
* it runs with the importer's import path as the import system uses it (a
  ``pathlib.Path`` entry is skipped there, and here), in a
  directory of its own, without the entry Python put first for the
  importer's cwd (a ``json.py`` or ``signal.py`` there is not imported in
  the probe).
"""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from test_layout_verdict import BACKPORTED, FEATURES, copied_build, needs_extension  # noqa: F401  (copied_build: a fixture)
from _torch_ctxext_build import layout_verdict
from torch_ctxext._ext import loader
from support import ROOT, python


def run_script(path, code, cwd, cache=None):
    """Run ``code`` as the script ``path`` (its directory first on its
    path, as Python puts it), in ``cwd``."""
    path.write_text(textwrap.dedent(code))
    return python(path, cwd=cwd, PYTHONPATH=ROOT, TORCH_CTXEXT_CACHE=cache)  # this checkout's, whatever the cwd


@pytest.fixture
def crashing_library(tmp_path):
    source = tmp_path / "crash.c"
    source.write_text("#include <stdlib.h>\nvoid* PyInit__C(void) { abort(); }\n")
    library = tmp_path / "_C.so"
    subprocess.run([shutil.which("cc") or "gcc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return library


# The importer has torch imported before it probes, as every importer of
# torch_ctxext has: torch's own children (a CUDA build's import runs
# ``ldconfig -p`` through ctypes.util.find_library) are not the probe's.
PROBES_UNDER = """
import json, os, signal, sys
import torch
from _torch_ctxext_build import layout_verdict
seen = []
if sys.argv[1] == "ignored":
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
else:  # a handler that reaps whatever exits, as servers and job runners have
    def reap(signum, frame):
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            seen.append(pid)
    signal.signal(signal.SIGCHLD, reap)
answers, handler_saw = {}, {}
for name in sys.argv[2:]:
    try:
        answers[name] = layout_verdict.probe(name)[0]
    except layout_verdict.ProbeNotRun as e:
        answers[name] = "not run: %s" % e
    handler_saw[name], seen[:] = list(seen), []
print(json.dumps({"answers": answers, "handler_saw": handler_saw}))
"""


@needs_extension
@pytest.mark.parametrize("sigchld", ["ignored", "reaping handler"])
def test_the_probe_status_is_read_right_whatever_the_importer_does_with_sigchld(tmp_path, crashing_library, sigchld):
    """A crashing probe is a crash verdict, a good one its verdict (under an
    ignored SIGCHLD a crash once read as "exited with status 0"), and the
    importer's handler runs at most once per probe: for the exit of the
    helper child.run starts it through, never for the probe itself."""
    script = tmp_path / "importer.py"
    script.write_text(PROBES_UNDER)
    result = python(script, sigchld, crashing_library, loader.loaded.path, PYTHONPATH=ROOT)
    assert result.returncode == 0, result.stderr
    said = json.loads(result.stdout.splitlines()[-1])
    crash = said["answers"][str(crashing_library)]
    assert crash == {part: "the layout probe crashed (SIGABRT) reading it" for part in layout_verdict.PARTS}
    assert said["answers"][loader.loaded.path] == {}
    for probed, pids in said["handler_saw"].items():
        assert len(pids) <= (1 if sigchld == "reaping handler" else 0), (probed, pids)


def test_the_probe_path_holds_the_importer_entries_as_the_import_system_uses_them(monkeypatch, tmp_path):
    import pathlib

    monkeypatch.setattr(sys, "path", ["", str(tmp_path), pathlib.Path("/nowhere"), os.fsencode(str(tmp_path / "b")),
                                      "relative", str(tmp_path)])
    monkeypatch.setattr(sys, "argv", ["-c"])
    assert layout_verdict.probe_path() == [str(tmp_path), str(tmp_path / "b"), os.path.abspath("relative")]
    # An entry the importer put there itself (not first) stays, made absolute.
    monkeypatch.setattr(sys, "path", [str(tmp_path), ""])
    assert layout_verdict.probe_path() == [str(tmp_path), os.getcwd()]
    # A script: its directory, put first by Python, is not the probe's.
    monkeypatch.setattr(sys, "argv", [str(tmp_path / "train.py")])
    monkeypatch.setattr(sys, "path", [str(tmp_path), "/elsewhere"])
    assert layout_verdict.probe_path() == ["/elsewhere"]


@needs_extension
def test_a_path_object_on_sys_path_does_not_fail_the_import_that_probes(copied_build, tmp_path):
    """A ``pathlib.Path`` on ``sys.path`` is skipped in the probe's path, as
    the import system skips it: the import that probes gets every member."""
    cache, build = copied_build
    result = run_script(tmp_path / "train.py", f"""
        import pathlib, sys
        sys.path.append(pathlib.Path({str(tmp_path)!r}))
        {FEATURES}
        """, cwd="/", cache=cache)
    assert result.returncode == 0, result.stderr
    assert "verifying that its extension reads the structures" in result.stderr
    features = json.loads(result.stdout)
    assert {m: features[m] for m in BACKPORTED} == {m: "torch_ctxext" for m in BACKPORTED}


@needs_extension
@pytest.mark.parametrize("shadow", ["json.py", "signal.py"])
def test_a_module_in_the_importer_cwd_is_not_imported_by_the_probe(copied_build, tmp_path, shadow):
    """A script run from a directory holding a ``json.py`` (its own imports
    never see it: its path starts with the script's directory): the probe
    does not take the cwd onto its path, does not import that file, and the
    import gets every member."""
    cache, build = copied_build
    work = tmp_path / "work"
    work.mkdir()
    (work / shadow).write_text("raise SystemExit('the probe imported the cwd\\'s module')\n")
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    result = run_script(scripts / "train.py", FEATURES, cwd=work, cache=cache)
    assert result.returncode == 0, result.stderr
    assert "verifying that its extension reads the structures" in result.stderr
    features = json.loads(result.stdout)
    assert {m: features[m] for m in BACKPORTED} == {m: "torch_ctxext" for m in BACKPORTED}
    (verdict,) = build.glob("layout-*.json")
    assert json.loads(verdict.read_text())["found"] == {}
