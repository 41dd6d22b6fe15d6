"""The build layer, ``_torch_ctxext_build``: what setup.py, tools/ and the
children an import starts import, without torch and without the package.

* each of its modules imports in an interpreter that has the standard
  library and the layer's directory on its path and nothing else (as its
  child processes are started: ``python -I -S``), with a torch that cannot
  be imported, and imports nothing of ``torch_ctxext``; the probe's checks
  (``layout_check``), which run in the probe's process after torch, excepted;
* the release facts are one module under both names, and the command line
  ``python3 torch_ctxext/_releases.py FACT`` works from a checkout without
  any path set.
"""
import os
import pkgutil
import textwrap

import _torch_ctxext_build
from _torch_ctxext_build import releases
from support import ROOT, python

NEEDS_TORCH = {"layout_check"}


def test_each_module_of_the_build_layer_imports_without_torch_and_without_the_package(tmp_path):
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('no torch here')\n")
    modules = sorted(m.name for m in pkgutil.iter_modules(_torch_ctxext_build.__path__) if m.name not in NEEDS_TORCH)
    code = textwrap.dedent(f"""
        import importlib, json, sys
        sys.path[:0] = [{str(tmp_path)!r}]
        sys.path.append({ROOT!r})
        for name in {modules!r}:
            importlib.import_module("_torch_ctxext_build." + name)
        print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "torch_ctxext"))))
    """)
    done = python("-I", "-S", "-c", code, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    assert {"releases", "sources", "compile", "cache", "child", "layout_verdict", "verdict_store"} <= set(modules)


def test_the_release_facts_are_one_module_under_both_names():
    from torch_ctxext import _releases

    assert _releases is releases


def test_the_release_facts_command_line_runs_from_a_checkout_without_a_path():
    for path in (os.path.join(ROOT, "torch_ctxext", "_releases.py"), releases.__file__):
        done = python("-I", path, "releases", timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == list(releases.RELEASES)
