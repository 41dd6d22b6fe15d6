"""advise()'s own build of its C++ watch, on a torch that provides every member
natively (torch_ctxext/_ext/advise_module.py): ``import torch_ctxext`` loads
nothing there; advise() loads only a build made for exactly the running torch
(a packaged binary whose digest holds, the install's, the cache's), under a
name of its own, never compiles one, and without one watches in Python and
says why. The watch itself: test_advise_watch.py (which runs wherever a C++
watch is there, this build included)."""
import hashlib
import json
import os
import shutil

import pytest
import torch

import torch_ctxext
from torch_ctxext._ext import advise_module, build_cache, loader
from support import ROOT, python

ALL_NATIVE = all(status == "native" for status in torch_ctxext.features().values())
all_native = pytest.mark.skipif(
    not ALL_NATIVE, reason=f"torch {torch.__version__} lacks members: torch_ctxext's extension carries the watch")


def run(code, **env):
    done = python(code=code, path=[ROOT], **env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


STEP = """
import json, sys
import torch, torch_ctxext
from torch_ctxext._ext import advise_module, loader
{setup}
at_import = sorted(m for m in sys.modules if m.startswith("torch_ctxext") and m.endswith("_C"))
layer = torch.nn.Linear(3, 3)
with torch_ctxext.advise(layer) as report:
    sum(layer(torch.randn(2, 3) * k).sum() for k in range(3)).backward()
print(json.dumps({{"at_import": at_import, "choice": advise_module.choice,
                   "after": sorted(m for m in sys.modules if m.startswith("torch_ctxext") and m.endswith("_C")),
                   "temporaries": report["weight"].temporaries, "summed": report["weight"].summed_out_of_place}}))
"""


def this_torch_build():
    """The advise-only build for the running torch in the cache, or skip."""
    library = build_cache.cached_library()
    if library is None:
        pytest.skip("no build of advise()'s watch for this torch in the cache (`python -m torch_ctxext build`)")
    return library


@all_native
def test_the_import_loads_nothing_and_advise_loads_its_own_watch_under_its_own_name():
    this_torch_build()
    seen = run(STEP.format(setup=""))
    assert seen["at_import"] == []
    assert seen["after"] == ["torch_ctxext._advise._C"]
    assert seen["choice"].startswith("the build in the cache: ")
    assert (seen["temporaries"], seen["summed"]) == (2, 1)


@all_native
def test_a_packaged_binary_for_this_very_torch_is_taken_first(tmp_path):
    library = shutil.copy(this_torch_build(), tmp_path / "_C.so")
    digest = hashlib.sha256(open(library, "rb").read()).hexdigest()
    entry = dict(loader._this_torch(), file=str(library), sha256=digest)
    setup = f"loader.packaged_binaries = lambda: [{entry!r}]"
    seen = run(STEP.format(setup=setup), TORCH_CTXEXT_CACHE=str(tmp_path / "empty"))
    assert seen["choice"] == f"the packaged binary: {library}"
    assert (seen["temporaries"], seen["summed"]) == (2, 1)


@all_native
def test_without_a_build_advise_watches_in_python_and_says_how_to_make_one(tmp_path):
    seen = run(STEP.format(setup=""), TORCH_CTXEXT_CACHE=str(tmp_path))
    assert seen["after"] == []
    assert "advise() watches in Python (`python -m torch_ctxext build` makes one)" in seen["choice"]
    assert (seen["temporaries"], seen["summed"]) == (2, 1)  # the same report
    info = python("-m", "torch_ctxext", "info", PYTHONPATH=ROOT, TORCH_CTXEXT_CACHE=tmp_path)
    assert "advise watch   Python: no build of advise()'s C++ watch" in info.stdout
    assert not os.listdir(tmp_path) or os.listdir(tmp_path) == ["builds"] and not os.listdir(tmp_path / "builds")


def test_only_a_build_for_this_very_torch_is_taken(monkeypatch, tmp_path):
    here = loader._this_torch()
    damaged = tmp_path / "damaged.so"
    damaged.write_bytes(b"not the manifest's bytes")
    entries = [
        dict(here, git="0" * 40, file=str(tmp_path / "other-git.so"), sha256="x"),  # another build of the release
        dict(here, python="cpython-39", file=str(tmp_path / "other-python.so"), sha256="x"),
        dict(here, file=str(damaged), sha256=hashlib.sha256(b"what was packaged").hexdigest()),
    ]
    monkeypatch.setattr(loader, "packaged_binaries", lambda: entries)
    monkeypatch.setattr(loader, "packaged_build", lambda: (str(tmp_path / "_C.so"), "2.14.1", "1" * 40))
    monkeypatch.setattr(build_cache, "cached_library", lambda: None)
    assert advise_module._find() is None
    assert f"the packaged binary {damaged} is damaged" in advise_module.choice
    assert "advise() watches in Python" in advise_module.choice


@pytest.mark.skipif(ALL_NATIVE, reason="torch provides every member: the advise-only build is the one used")
def test_where_torch_lacks_members_the_extensions_own_watch_is_used():
    assert advise_module.load(os.devnull) is None  # never even opened
    assert advise_module.choice.startswith("not used: this torch's build of torch_ctxext's extension")
