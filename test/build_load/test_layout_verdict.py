"""The layout verdict: verified once per build and torch, in a child process.

* the probe (``layout_check``) finds everything reading back as the headers
  say on this build, and reports a structure that does not; a member that
  depends on such a structure is not installed, with the reason;
* the verdict is made in a child process (a probe that crashes crashes
  there, and that is a verdict too) and kept beside the build, named by the
  identities of the build and of the torch binaries (their GNU build ids),
  so another build of either never reuses it;
* the import only reads it: a build with a verdict that says a structure
  differs gets none of the members that need it; a verdict that cannot be
  read is made again.
"""
import glob
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import torch_ctxext
from torch_ctxext import _features
from _torch_ctxext_build import layout_check, layout_verdict
from torch_ctxext._ext import loader
from support import python

BACKPORTED = [m for m, s in torch_ctxext.features().items() if s != "native"]
needs_extension = pytest.mark.skipif(not BACKPORTED, reason="the running torch needs no extension")
FEATURES = "import json, torch_ctxext; print(json.dumps(torch_ctxext.features()))"


@pytest.fixture
def copied_build(tmp_path):
    """A cache holding a copy of the loaded build (and nothing else), as the
    build for the running torch: its verdict can be edited without touching
    the cache the rest of the tests use."""
    if loader.loaded is None or loader.loaded.origin == "package":
        pytest.skip("the extension is loaded from the package, not from a build cache")
    source = os.path.dirname(loader.loaded.path)
    target = tmp_path / "cache" / "builds" / os.path.basename(source)
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("layout-*.json"))
    return tmp_path / "cache", target


# --- the probe -------------------------------------------------------------------


@needs_extension
def test_on_this_build_every_structure_reads_back_as_the_headers_say():
    assert loader.verdict is not None and loader.verdict["found"] == {}
    assert layout_check.mismatches(loader.load()) == {}  # the probe itself, here
    if "apply_boxed" in BACKPORTED:  # the probe found PyNode's vtable for the boxed path
        assert isinstance(loader.verdict["facts"]["pynode_vtable_offset"], int)


@needs_extension
def test_a_structure_that_does_not_read_back_is_found_by_the_probe():
    """An extension whose ctx reads 8 bytes larger than torch's: the probe
    says so, naming the sizes."""
    ext = loader.load()

    class OffBy8:
        def __getattr__(self, name):
            return getattr(ext, name)

        def read_ctx_layout(self, ctx):
            facts = ext.read_ctx_layout(ctx)
            facts["ctx_size"] += 8
            return facts

    found = layout_check.mismatches(OffBy8())
    assert set(found) == {"ctx"}
    assert found["ctx"].startswith(f"the ctx object is {torch._C._FunctionBase.__basicsize__} bytes in this torch")


def test_members_that_depend_on_a_structure_that_differs_are_named_with_the_reason():
    verdicts = layout_verdict.verdicts({"task": "the task's lock is elsewhere"})
    assert set(verdicts) == {"input_grad_buffers"}
    assert "the task's lock is elsewhere" in verdicts["input_grad_buffers"]
    assert "rebuild torch_ctxext" in verdicts["input_grad_buffers"]
    assert set(layout_verdict.verdicts({"metadata": "sizes differ"})) == {"set_output_grad_dtype", "apply_boxed"}
    assert set(layout_verdict.verdicts({"ctx": "size"})) == set(layout_verdict.NEEDS)
    assert layout_verdict.verdicts({}) == {}


def test_a_probe_that_crashes_is_a_verdict_made_in_the_child_not_a_crash_here(tmp_path):
    """A library that reads a layout as another can crash; it does so in the
    probe's process, and every structure is then reported."""
    source = tmp_path / "crash.c"
    source.write_text("#include <stdlib.h>\nvoid* PyInit__C(void) { abort(); }\n")
    library = tmp_path / "_C.so"
    subprocess.run([shutil.which("cc") or "gcc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    found, facts = layout_verdict.probe(str(library))
    assert set(found) == set(layout_verdict.PARTS) and facts == {}
    assert found["ctx"] == "the layout probe crashed (SIGABRT) reading it"
    assert set(layout_verdict.verdicts(found)) == set(layout_verdict.NEEDS)


def test_a_probe_that_cannot_run_is_no_verdict(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))
    with pytest.raises(layout_verdict.ProbeNotRun, match="could not start"):
        layout_verdict.probe(str(tmp_path / "_C.so"))


# --- what names a verdict ---------------------------------------------------------


def test_the_gnu_build_id_is_the_one_readelf_reads():
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("no readelf to compare with")
    library = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    notes = subprocess.run([readelf, "-n", library], capture_output=True, text=True).stdout
    expected = [line.split()[-1] for line in notes.splitlines() if "Build ID:" in line]
    assert [layout_verdict.gnu_build_id(library)] == expected
    assert layout_verdict.gnu_build_id(__file__) is None  # not an ELF file


@needs_extension
def test_a_verdict_is_never_reused_for_another_build_of_torch_or_of_the_extension(tmp_path, monkeypatch):
    library = loader.loaded.path
    name = layout_verdict.verdict_name(library)
    assert layout_verdict.verdict_name(library) == name  # the same build and torch: the same verdict
    identity = layout_verdict.torch_identity()
    for changed in ("libc10.so", "libtorch_cpu.so", "libtorch_python.so"):
        other = json.loads(json.dumps(identity))
        other["libraries"][changed] = "build-id:0000"
        monkeypatch.setattr(layout_verdict, "torch_identity", lambda other=other: other)
        assert layout_verdict.verdict_name(library) != name, changed
    monkeypatch.undo()
    copy = tmp_path / "_C.so"
    shutil.copyfile(library, copy)
    assert layout_verdict.verdict_name(str(copy)) == name  # the same contents: the same build
    with open(copy, "r+b") as f:  # another build: its build id differs
        data = bytearray(f.read())
        at = data.index(bytes.fromhex(layout_verdict.gnu_build_id(library)))
        data[at] ^= 0xFF
        f.seek(0)
        f.write(data)
    assert layout_verdict.verdict_name(str(copy)) != name


# --- the import reads it ------------------------------------------------------------


@needs_extension
def test_a_build_whose_verdict_says_a_structure_differs_gets_none_of_the_members_that_need_it(copied_build):
    cache, build = copied_build
    library = build / "_C.so"
    record = {**loader.verdict, "found": {"ctx": "the ctx object is 8 bytes larger in the headers"}}
    layout_verdict.write(str(build / layout_verdict.verdict_name(str(library))), record)
    result = python(code=FEATURES + "\nfrom torch.autograd.function import FunctionCtx\nprint(hasattr(FunctionCtx, 'input_grad_buffers'))",
                 TORCH_CTXEXT_CACHE=cache)
    assert result.returncode == 0, result.stderr
    features = json.loads(result.stdout.splitlines()[0])
    assert [m for m, s in features.items() if s == "torch_ctxext"] == []
    assert features["input_grad_buffers"].startswith("unavailable: torch ")
    assert "the ctx object is 8 bytes larger in the headers" in features["input_grad_buffers"]
    assert result.stdout.splitlines()[1] == "False"
    assert "verifying" not in result.stderr  # the verdict was read, not made again


@needs_extension
@pytest.mark.parametrize("content", ["", "{", '{"format": 1, "found": {"ctx": 3}}', '{"format": 999, "found": {}, "facts": {}}'])
def test_a_verdict_that_cannot_be_read_is_made_again_and_kept(copied_build, content):
    cache, build = copied_build
    path = build / layout_verdict.verdict_name(str(build / "_C.so"))
    path.write_text(content)
    first = python(code=FEATURES, TORCH_CTXEXT_CACHE=cache)
    assert first.returncode == 0, first.stderr
    assert "verifying that its extension reads the structures of torch" in first.stderr
    assert {m: s for m, s in json.loads(first.stdout).items() if m in BACKPORTED} == {m: "torch_ctxext" for m in BACKPORTED}
    assert json.loads(path.read_text())["found"] == {}
    again = python(code=FEATURES, TORCH_CTXEXT_CACHE=cache)
    assert again.returncode == 0 and again.stderr == "", again.stderr


@needs_extension
def test_a_build_without_a_verdict_gets_one_at_its_first_import_kept_beside_it(copied_build):
    """(A build made before verdicts, or copied: the build step makes it
    otherwise, test_first_import.py.)"""
    cache, build = copied_build
    assert glob.glob(str(build / "layout-*.json")) == []
    first = python(code=FEATURES, TORCH_CTXEXT_CACHE=cache)
    assert first.returncode == 0, first.stderr
    (verdict,) = glob.glob(str(build / "layout-*.json"))
    assert os.path.basename(verdict) == layout_verdict.verdict_name(str(build / "_C.so"))
    assert json.loads(open(verdict).read())["found"] == {}


def test_features_report_nothing_unavailable_on_this_build():
    assert {m: s for m, s in torch_ctxext.features().items() if s.startswith("unavailable")} == {}
    assert _features.UNAVAILABLE == {}
