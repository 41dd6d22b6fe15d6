"""A build that is found but that the dynamic loader refuses.

The cluster recipe (docs/install-cluster.md) builds into a shared cache on
one machine for nodes that may be older: a build there can need a C library
the node lacks (``version `GLIBC_2.34' not found``), a library the node does
not have, or be damaged. ``import torch_ctxext`` then:

* warns (``UnloadableBuildWarning``) naming the file and quoting the
  dynamic loader, and tries the next build in the loader's order: the next
  packaged binary, the cache, a build at this import (which replaces the
  cache's build that does not load, so later imports load the new one);
* where nothing loads (``TORCH_CTXEXT_JIT=0``, a compiler that fails), still
  succeeds: the members are unavailable, their reason quoting each refusal;
  the loader's ImportError never escapes.

And the cache's key names the C library's version, so that a build made on
a newer machine is not the one an older node looks for.

Each import runs in a fresh interpreter with a cache of its own, the
unloadable ``_C.so`` put where the loader looks for it (the cache's layout:
``build_cache.root()`` and ``build_key``; a wheel's ``_binaries/``).
"""
import json
import os
import pathlib
import platform
import shutil
import subprocess
import sys

import pytest
import torch

import torch_ctxext
from _torch_ctxext_build import sources
from torch_ctxext._ext import build_cache, loader
from support import ROOT, python

from install_env import BACKPORTED, BUILD_TIMEOUT, failing_compiler, needs_extension
from package_copy import add_packaged_binaries, sources_only_copy
from torch_ctxext import _releases

# The members left unavailable without a build: those torch lacks (a native
# member replaced along with another, apply before 2.13, stays native).
LACKING = [m for m in BACKPORTED if m not in _releases.REPLACED_ALONG_WITH]

PACKAGE = os.path.dirname(os.path.abspath(torch_ctxext.__file__))
PROBE = """
import json, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torch_ctxext
from torch_ctxext._ext import loader
print(json.dumps({
    "features": torch_ctxext.features(),
    "warnings": [[w.category.__name__, str(w.message)] for w in caught],
    "loaded": loader.loaded and list(loader.loaded[:2]),
    "choice": loader.choice,
}))
"""


def shared_library_needing_a_missing_library(directory):
    """A real shared library (ELF) that links libctxext_gone.so, which is
    not there when it is loaded: ``libctxext_gone.so: cannot open shared
    object file``, as a build meets on a node that lacks a library of the
    machine it was built on."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to make a shared library with")
    directory = pathlib.Path(directory)
    (directory / "gone.c").write_text("int ctxext_gone(void) { return 1; }\n")
    (directory / "needs.c").write_text("int ctxext_gone(void);\nint needs(void) { return ctxext_gone(); }\n")
    subprocess.run([compiler, "-shared", "-fPIC", "-o", directory / "libctxext_gone.so", directory / "gone.c"],
                   check=True)
    subprocess.run([compiler, "-shared", "-fPIC", "-o", directory / "needs.so", directory / "needs.c",
                    f"-L{directory}", "-lctxext_gone"], check=True)
    (directory / "libctxext_gone.so").unlink()
    return (directory / "needs.so").read_bytes(), "libctxext_gone.so: cannot open shared object file"


def not_a_shared_library(directory):
    return b"not a shared library\n" * 200, "invalid ELF header"


UNLOADABLE = {"not_elf": not_a_shared_library, "missing_library": shared_library_needing_a_missing_library}


def cache_build_path(cache):
    """Where the cache at ``cache`` keeps the build for the running torch and
    these sources (what the fresh interpreter's loader looks for)."""
    saved = os.environ.get(build_cache.ENV_CACHE)
    os.environ[build_cache.ENV_CACHE] = str(cache)
    try:
        return pathlib.Path(build_cache.root()) / build_cache.build_key(sources.csrc_dir())
    finally:
        if saved is None:
            del os.environ[build_cache.ENV_CACHE]
        else:
            os.environ[build_cache.ENV_CACHE] = saved


def put_in_cache(cache, data):
    """Publish ``data`` as the cache's build for this torch (its library and
    its record, as a build leaves them); its path."""
    directory = cache_build_path(cache)
    directory.mkdir(parents=True)
    (directory / build_cache.LIBRARY).write_bytes(data)
    (directory / build_cache.RECORD).write_text(json.dumps({"torch": torch.__version__}))
    return directory / build_cache.LIBRARY


def import_fresh(cache, pythonpath=ROOT, timeout=300, **env):
    """``import torch_ctxext`` in a fresh interpreter: (what it says, stderr).
    It must succeed."""
    done = python(code=PROBE, timeout=timeout, PYTHONPATH=pythonpath, TORCH_CTXEXT_CACHE=cache, **env)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def warned(answer, category):
    return [message for name, message in answer["warnings"] if name == category]


def test_two_c_library_versions_get_two_cache_keys(monkeypatch):
    csrc = sources.csrc_dir()
    keys = {}
    for version in ("2.36", "2.31"):
        monkeypatch.setattr(platform, "libc_ver", lambda *a, v=version, **k: ("glibc", v))
        keys[version] = build_cache.build_key(csrc)
    assert keys["2.36"] != keys["2.31"]
    assert "-glibc2.31-" in keys["2.31"] and "-glibc2.36-" in keys["2.36"]
    # Everything else is as before: torch, git, Python, machine, fingerprint.
    assert keys["2.31"].replace("-glibc2.31-", "-") == keys["2.36"].replace("-glibc2.36-", "-")


def test_a_c_library_that_cannot_be_told_leaves_its_piece_out_of_the_key(monkeypatch):
    monkeypatch.setattr(platform, "libc_ver", lambda *a, **k: ("", ""))
    key = build_cache.build_key(sources.csrc_dir())
    git = (torch.version.git_version or "unknown")[:12]
    head = f"torch-{torch.__version__}-git{git}-{sys.implementation.cache_tag}-{platform.machine()}-"
    assert key.startswith(head) and len(key) == len(head) + 16, key


@needs_extension
@pytest.mark.parametrize("kind", sorted(UNLOADABLE))
def test_a_cache_build_that_does_not_load_is_passed_over_and_the_members_are_unavailable(tmp_path, kind):
    data, refusal = UNLOADABLE[kind](tmp_path)
    library = put_in_cache(tmp_path / "cache", data)
    answer, _ = import_fresh(tmp_path / "cache", TORCH_CTXEXT_JIT="0")
    passed_over = warned(answer, "UnloadableBuildWarning")
    assert len(passed_over) == 1, answer["warnings"]
    assert str(library) in passed_over[0] and refusal in passed_over[0]
    assert "TORCH_CTXEXT_JIT=0 forbids building it again" in passed_over[0]
    unavailable = warned(answer, "ExtensionUnavailableWarning")
    assert len(unavailable) == 1 and refusal in unavailable[0] and str(library) in unavailable[0]
    for member in LACKING:
        assert answer["features"][member].startswith("unavailable: "), answer["features"]
        assert refusal in answer["features"][member]
    assert answer["loaded"] is None
    assert library.read_bytes() == data  # left in place: other nodes of a shared cache may load it


@needs_extension
def test_a_cache_build_that_does_not_load_and_a_compiler_that_fails_leave_the_members_unavailable(tmp_path):
    data, refusal = not_a_shared_library(tmp_path)
    library = put_in_cache(tmp_path / "cache", data)
    answer, _ = import_fresh(tmp_path / "cache", CXX=failing_compiler(str(tmp_path)))
    assert any(str(library) in m and "this import builds it again" in m
               for m in warned(answer, "UnloadableBuildWarning")), answer["warnings"]
    for member in LACKING:
        reason = answer["features"][member]
        assert reason.startswith("unavailable: ") and refusal in reason and str(library) in reason
        assert "this compiler always fails" in reason  # and the build's own failure
    assert answer["loaded"] is None


@needs_extension
def test_a_cache_build_that_does_not_load_is_built_again_in_its_place_and_loaded(tmp_path):
    data, refusal = not_a_shared_library(tmp_path)
    library = put_in_cache(tmp_path / "cache", data)
    answer, said = import_fresh(tmp_path / "cache", timeout=BUILD_TIMEOUT)
    passed_over = warned(answer, "UnloadableBuildWarning")
    assert len(passed_over) == 1 and str(library) in passed_over[0] and refusal in passed_over[0]
    assert not warned(answer, "ExtensionUnavailableWarning"), answer["warnings"]
    assert answer["loaded"] == [str(library), "built"]
    assert "the build in the cache does not load here" in said  # the build says why it runs
    assert {answer["features"][m] for m in BACKPORTED} == {"torch_ctxext"}
    # The next import loads the new build: the refused one is not tried again.
    again, said_again = import_fresh(tmp_path / "cache")
    assert again["loaded"] == [str(library), "cache"] and again["warnings"] == [], again["warnings"]
    assert "building" not in said_again


def this_torch(**changes):
    return dict({"torch": torch.__version__, "git": torch.version.git_version,
                 "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI), "python": sys.implementation.cache_tag},
                **changes)


def wheel_install(tmp_path, builds):
    """A copy of the package as the binary wheel lays it out, carrying
    ``builds`` ([(binary bytes, manifest entry)], in the manifest's order)."""
    site = tmp_path / "site"
    package = sources_only_copy(PACKAGE, str(site))
    add_packaged_binaries(package, [(f"build-{i}", data, entry) for i, (data, entry) in enumerate(builds)],
                          python=sys.implementation.cache_tag)
    return site, pathlib.Path(package) / "_binaries"


@needs_extension
@pytest.mark.skipif(loader.loaded is None, reason="no binary is loaded here to package")
def test_a_packaged_binary_that_does_not_load_is_passed_over_for_the_next_one(tmp_path):
    data, refusal = not_a_shared_library(tmp_path)
    real = pathlib.Path(loader.loaded.path).read_bytes()
    site, binaries = wheel_install(tmp_path, [(data, this_torch()), (real, this_torch())])
    answer, _ = import_fresh(tmp_path / "cache", pythonpath=site, TORCH_CTXEXT_JIT="0")
    passed_over = warned(answer, "UnloadableBuildWarning")
    assert len(passed_over) == 1, answer["warnings"]
    assert str(binaries / "build-0" / "_C.so") in passed_over[0] and refusal in passed_over[0]
    assert answer["loaded"] == [str(binaries / "build-1" / "_C.so"), "package"]
    assert {answer["features"][m] for m in BACKPORTED} == {"torch_ctxext"}
    assert "build-0/_C.so does not load (" in answer["choice"]


@needs_extension
def test_a_packaged_binary_that_does_not_load_with_nothing_else_leaves_the_members_unavailable(tmp_path):
    data, refusal = not_a_shared_library(tmp_path)
    site, binaries = wheel_install(tmp_path, [(data, this_torch())])
    answer, _ = import_fresh(tmp_path / "cache", pythonpath=site, TORCH_CTXEXT_JIT="0")
    binary = str(binaries / "build-0" / "_C.so")
    assert any(binary in m and refusal in m for m in warned(answer, "UnloadableBuildWarning")), answer["warnings"]
    for member in LACKING:
        reason = answer["features"][member]
        assert reason.startswith("unavailable: ") and binary in reason and refusal in reason
        assert "TORCH_CTXEXT_JIT=0 forbids building it at import" in reason


def test_a_rank_that_waited_loads_the_build_that_replaced_the_unloadable_one(tmp_path, monkeypatch):
    """The ranks of a job all fail to load the cache's build; the first
    rebuilds it, the others find a build that is no longer the one they
    failed on and take it without building."""
    from torch_ctxext._ext import build

    monkeypatch.setenv(build_cache.ENV_CACHE, str(tmp_path / "cache"))
    library = put_in_cache(tmp_path / "cache", not_a_shared_library(tmp_path)[0])
    refused = build_cache.identity(str(library))
    started = []
    monkeypatch.setattr(build, "_run_child", lambda spec: started.append(spec) or {
        "built": {"library": str(library), "built": True}})
    # Still the build this rank failed on: built again, the build's process told which.
    assert build.build("the build in the cache does not load here", replace=refused) == (str(library), True)
    assert started[-1]["replace"] == refused
    # Another rank replaced it meanwhile (another file there): taken as it is.
    library.write_bytes(library.read_bytes() + b"\n")
    assert build_cache.identity(str(library)) != refused
    assert build.build("the build in the cache does not load here", replace=refused) == (str(library), False)
    assert len(started) == 1
