"""What the loader does with the binaries a binary wheel carries.

A binary wheel (tools/wheels.py) holds ``torch_ctxext/_binaries/<build>/_C.so``
and a manifest of what each was built for. The loader:

* loads the binary for this torch version, git hash, C++ ABI and CPython,
  its digest checked, and compiles nothing;
* passes over a damaged or missing one and says so (the build at import
  follows, or with TORCH_CTXEXT_JIT=0 the members are unavailable with an
  ImportError naming what was looked for and what was found);
* takes a binary for the same release from another build of torch (another
  git hash) only once its layout verdict against this torch is clean;
* never takes a binary for another CPython or C++ ABI; pip refuses a wheel
  of another CPython outright;
* reads the layout verdict a wheel carries beside the binary
  (tools/wheel_verdicts.py adds it for each torch the wheel is verified
  against): the first import then starts no process; without one for the
  running torch (another build of torch) it verifies in a child, as before.

Each case is a package tree made here around the binary the running torch
loaded (a binary wheel's layout), imported in a fresh interpreter with an
empty build cache.
"""
import base64
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch

import torch_ctxext
from _torch_ctxext_build import layout_verdict as _verdict
from torch_ctxext._ext import loader
from support import ROOT, python

from package_copy import add_packaged_binaries, sources_only_copy
from wheel_check import IMPORT as AUDITED_IMPORT

TOOLS = os.path.join(ROOT, "tools")

PACKAGE = os.path.dirname(os.path.abspath(torch_ctxext.__file__))
needs_binary = pytest.mark.skipif(
    loader.loaded is None, reason="this torch provides every member natively: no binary is loaded to package"
)
PROBE = """
import json, torch, torch_ctxext
from torch_ctxext._ext import loader
print(json.dumps({"features": torch_ctxext.features(), "choice": loader.choice,
                  "origin": loader.loaded and loader.loaded.origin}))
"""


def this_torch(**changes):
    return dict({"torch": torch.__version__, "git": torch.version.git_version,
                 "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI), "python": sys.implementation.cache_tag},
                **changes)


def test_a_sources_only_copy_of_an_install_built_in_place_carries_nothing_of_that_build(tmp_path):
    """``pip install --no-build-isolation`` with a compiler builds in place:
    the package then holds the extension, its record and the layout verdict
    kept beside it. A sources-only copy of it (what these tests install by
    hand) carries none of them: a verdict without its binary would be read
    as the packaged one's."""
    installed = tmp_path / "installed" / "torch_ctxext"
    shutil.copytree(PACKAGE, installed, ignore=shutil.ignore_patterns("__pycache__", "_C*", "layout-*.json"))
    shutil.copytree(os.path.join(os.path.dirname(PACKAGE), "_torch_ctxext_build"),
                    tmp_path / "installed" / "_torch_ctxext_build", ignore=shutil.ignore_patterns("__pycache__"))
    if not (installed / "csrc").is_dir():  # a checkout keeps them beside the package; an install, inside
        shutil.copytree(os.path.join(ROOT, "csrc"), installed / "csrc")
    built = ["_C.cpython-311-x86_64-linux-gnu.so", "_build_info.py", "layout-0123456789abcdef01234567.json",
             ".layout-x.tmp"]
    for name in built:
        (installed / name).write_text("built here\n")
    copy = pathlib.Path(sources_only_copy(str(installed), str(tmp_path / "site")))
    assert sorted(set(os.listdir(copy)) & set(built)) == []
    assert (copy / "__init__.py").is_file() and (copy / "csrc").is_dir()


def binary_install(tmp_path, entries, damage=None):
    """A copy of the package carrying the loaded binary once per manifest
    entry (``damage``: "missing" or "corrupt" for the first); its site dir."""
    site = tmp_path / "site"
    package = sources_only_copy(PACKAGE, str(site))
    data = open(loader.loaded.path, "rb").read()
    binaries = pathlib.Path(add_packaged_binaries(
        package, [(f"build-{i}", data, entry) for i, entry in enumerate(entries)],
        python=sys.implementation.cache_tag))
    if damage == "missing":
        (binaries / "build-0" / "_C.so").unlink()
    elif damage == "corrupt":
        (binaries / "build-0" / "_C.so").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    return site


def import_refused(site, tmp_path):
    """The ImportError ``import torch_ctxext`` raises with TORCH_CTXEXT_JIT=0."""
    done = python(code=PROBE, PYTHONPATH=site, TORCH_CTXEXT_CACHE=tmp_path / "cache", TORCH_CTXEXT_JIT=0,
                  XDG_CACHE_HOME=tmp_path / "xdg")
    assert done.returncode == 1, done.stdout + done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: "), done.stderr
    return last


def import_from(site, tmp_path, **env):
    # An empty $XDG_CACHE_HOME too: no verdict in the importer's own layouts/.
    done = python(code=PROBE, PYTHONPATH=site, TORCH_CTXEXT_CACHE=tmp_path / "cache", TORCH_CTXEXT_JIT=0,
                  XDG_CACHE_HOME=tmp_path / "xdg", CXX="/bin/false", CC="/bin/false", **env)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def import_audited(site, tmp_path):
    """The first ``import torch_ctxext`` from ``site`` in a fresh process
    (tools/wheel_check.py's: ``started`` lists the audit events of every
    process it started), with empty caches: nothing kept before is read."""
    done = python(code=AUDITED_IMPORT, PYTHONPATH=site, TORCH_CTXEXT_CACHE=tmp_path / "cache", TORCH_CTXEXT_JIT=0,
                  XDG_CACHE_HOME=tmp_path / "xdg", CXX="/bin/false", CC="/bin/false")
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def provided(answer):
    """Whether the import provides what this process's import provides: the
    members the running torch lacks by torch_ctxext, the others natively."""
    return answer["features"] == torch_ctxext.features()


@needs_binary
def test_the_binary_for_this_torch_is_loaded_and_nothing_is_compiled(tmp_path):
    site = binary_install(tmp_path, [this_torch(python="cpython-0"), this_torch()])
    answer, said = import_from(site, tmp_path)
    assert provided(answer)
    assert answer["origin"] == "package"
    assert "loaded, nothing compiled" in answer["choice"]
    assert "building" not in said
    assert not list((tmp_path / "cache").glob("builds/torch-*"))


@needs_binary
@pytest.mark.parametrize("damage, said", [("corrupt", "is damaged (its digest is not the manifest's)"),
                                          ("missing", "cannot be read")])
def test_a_damaged_or_missing_binary_is_passed_over_and_named(tmp_path, damage, said):
    site = binary_install(tmp_path, [this_torch()], damage=damage)
    reason = import_refused(site, tmp_path)
    assert said in reason and "build-0" in reason
    assert "TORCH_CTXEXT_JIT=0 forbids building it at import" in reason


@needs_binary
def test_a_binary_for_the_same_release_from_another_build_is_taken_once_its_layout_verdict_is_clean(tmp_path):
    site = binary_install(tmp_path, [this_torch(git="0" * 40, torch=torch.__version__.split("+")[0] + "+vendor")])
    answer, said = import_from(site, tmp_path)
    assert provided(answer)
    assert answer["origin"] == "package (verified)"
    assert "the same release from another build" in answer["choice"]
    assert "verifying that its extension reads the structures" in said  # the probe ran, in a child
    assert list((tmp_path / "cache").glob("builds/layouts/layout-*.json"))  # and its verdict is kept
    again, said_again = import_from(site, tmp_path)
    assert again["origin"] == "package (verified)" and "verifying" not in said_again


@needs_binary
def test_a_packaged_binary_with_its_verdict_beside_it_starts_no_process_at_the_first_import(tmp_path):
    site = binary_install(tmp_path, [this_torch()])
    binary = site / "torch_ctxext" / "_binaries" / "build-0" / "_C.so"
    # This process's verdict is for the same bytes and torch: the key is theirs.
    _verdict.write(_verdict.beside(str(binary)), loader.verdict)
    answer, said = import_audited(site, tmp_path)
    assert answer["origin"] == "package" and answer["binary"] == str(binary)
    assert answer["started"] == []
    assert answer["verdict"] == _verdict.beside(str(binary))
    assert provided(answer)
    assert "verifying" not in said
    assert not [p for d in ("cache", "xdg") for p in (tmp_path / d).glob("**/layout-*.json")]  # none kept


@needs_binary
def test_a_packaged_binary_without_a_verdict_for_this_torch_still_verifies_in_a_child(tmp_path):
    site = binary_install(tmp_path, [this_torch()])
    binary = site / "torch_ctxext" / "_binaries" / "build-0" / "_C.so"
    # A verdict for another build of torch (another key) is not this one's.
    _verdict.write(str(binary.parent / "layout-000000000000000000000000.json"), loader.verdict)
    answer, said = import_audited(site, tmp_path)
    assert answer["origin"] == "package"
    assert answer["started"]  # the probe, in a child process
    assert "verifying that its extension reads the structures" in said
    kept = tmp_path / "cache" / "builds" / "layouts" / os.path.basename(_verdict.beside(str(binary)))
    assert answer["verdict"] == str(kept) and kept.exists()
    assert provided(answer)


def as_wheel(site, path):
    """The package at ``site`` as a wheel (with a RECORD) at ``path``."""
    with zipfile.ZipFile(path, "w") as z:
        for file in sorted(pathlib.Path(site).rglob("*")):
            if file.is_file() and "__pycache__" not in file.parts:
                z.write(file, file.relative_to(site).as_posix())
        z.writestr("torch_ctxext-0.0.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: false\n")
        z.writestr("torch_ctxext-0.0.0.dist-info/RECORD", "")
    return path


@needs_binary
def test_wheel_verdicts_adds_the_verdict_the_installed_binary_reads_at_its_first_import(tmp_path):
    wheel = as_wheel(binary_install(tmp_path / "made", [this_torch(python="cpython-0"), this_torch()]),
                     tmp_path / "torch_ctxext-0.0.0-cp0-cp0-linux_x86_64.whl")
    done = python(os.path.join(TOOLS, "wheel_verdicts.py"), wheel)
    assert done.returncode == 0, done.stdout + done.stderr
    # The name the loaded binary computes here: the key is the binary's and
    # this torch's, wherever the binary lies.
    member = "torch_ctxext/_binaries/build-1/" + _verdict.verdict_name(loader.loaded.path)
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        record = z.read("torch_ctxext-0.0.0.dist-info/RECORD").decode()
        data = z.read(member)
        z.extractall(tmp_path / "site")
    assert [n for n in names if "layout-" in n] == [member]
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    assert f"{member},sha256={digest},{len(data)}" in record.splitlines()
    assert json.loads(data)["found"] == {} and json.loads(data)["library"] == "torch_ctxext/_binaries/build-1/_C.so"
    answer, said = import_audited(tmp_path / "site", tmp_path)
    assert answer["origin"] == "package" and answer["started"] == [] and "verifying" not in said
    assert answer["verdict"] == str(tmp_path / "site" / member)


@needs_binary
def test_wheel_verdicts_refuses_a_wheel_without_a_binary_for_this_torch_and_leaves_it_unchanged(tmp_path):
    wheel = as_wheel(binary_install(tmp_path / "made", [this_torch(git="0" * 40)]),
                     tmp_path / "torch_ctxext-0.0.0-cp0-cp0-linux_x86_64.whl")
    before = wheel.read_bytes()
    done = python(os.path.join(TOOLS, "wheel_verdicts.py"), wheel)
    assert done.returncode == 1
    assert f"carries no binary for torch {torch.__version__}" in done.stdout
    assert wheel.read_bytes() == before


@needs_binary
@pytest.mark.parametrize("other", [{"python": "cpython-39"}, {"cxx11_abi": not torch._C._GLIBCXX_USE_CXX11_ABI},
                                   {"torch": "2.5.1", "git": "1" * 40}])
def test_a_binary_for_another_cpython_abi_or_release_is_never_taken(tmp_path, other):
    site = binary_install(tmp_path, [this_torch(**other)])
    reason = import_refused(site, tmp_path)
    assert "forbids building it at import" in reason
    assert f"Looked for a packaged binary for torch {torch.__version__}" in reason
    assert "this copy carries: torch " in reason  # what was found, named


def test_pip_refuses_a_wheel_of_another_cpython(tmp_path):
    other = "cp39" if sys.version_info[:2] != (3, 9) else "cp313"
    wheel = tmp_path / f"torch_ctxext-0.1.0-{other}-{other}-manylinux_2_34_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("torch_ctxext/__init__.py", "")
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--no-index", str(wheel)],
                          capture_output=True, text=True)
    assert done.returncode != 0
    assert "is not a supported wheel on this platform" in done.stderr
