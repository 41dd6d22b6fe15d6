"""The plugin itself: what import patches, what it refuses, what it reports."""
import importlib
import importlib.machinery
import os
import textwrap

import pytest
import torch
from torch.autograd.function import BackwardCFunction, Function, FunctionCtx
from torch.autograd.variable import Variable

import torch_ctxext
from torch_ctxext import _features, _releases
from support import python


def test_features_names_every_member_of_the_contract_and_who_provides_it():
    features = torch_ctxext.features()
    assert list(features) == list(_features.MEMBERS)
    for member, status in features.items():
        assert status in ("native", "torch_ctxext"), (member, status)


def test_members_torch_lacks_are_provided_by_torch_ctxext_and_native_ones_untouched():
    code = """
        import torch
        from torch.autograd.function import BackwardCFunction, FunctionCtx
        before = {n: (BackwardCFunction if n.startswith("apply") else FunctionCtx).__dict__.get(n)
                  for n in ("apply", "apply_boxed", "apply_jvp", "mark_dirty",
                            "input_grad_buffers", "set_output_grad_dtype")}
        apply_before = torch.autograd.Function.__dict__["apply"]
        import torch_ctxext
        from torch_ctxext import _features
        features = torch_ctxext.features()
        for name, obj in before.items():
            owner = BackwardCFunction if name.startswith("apply") else FunctionCtx
            if features[name] == "native":
                assert owner.__dict__.get(name) is obj, name
            else:
                # Absent before, or replaced because torch's cannot do it
                # (torch 2.12's BackwardCFunction.apply cannot box grads).
                assert obj is None or name in _features.PROVIDED, name
                assert features[name] == "torch_ctxext", name
        if features["set_output_grad_dtype"] == "native":
            assert torch.autograd.Function.__dict__["apply"] is apply_before
        print("ok")
    """
    result = python(code=code)
    assert result.stdout.strip() == "ok", result.stderr


def test_importing_twice_is_harmless():
    apply = Function.__dict__["apply"]
    engine = Variable._execution_engine  # guarded or not, unchanged
    prop = FunctionCtx.__dict__.get("input_grad_buffers")
    importlib.reload(torch_ctxext)
    assert Function.__dict__["apply"] is apply
    assert Variable._execution_engine is engine
    assert FunctionCtx.__dict__.get("input_grad_buffers") is prop


def test_help_shows_the_documented_contract_with_the_matmul_example():
    doc = FunctionCtx.input_grad_buffers.__doc__
    assert "Return existing buffers for accumulating gradients" in doc
    assert "class Matmul(torch.autograd.Function)" in doc
    doc = FunctionCtx.set_output_grad_dtype.__doc__
    assert "Declare the gradient dtype for each of this Function's outputs" in doc


def test_info_prints_the_torch_version_the_build_and_every_member():
    result = python("-m", "torch_ctxext", "info")
    assert result.returncode == 0, result.stderr
    assert f"torch          {torch.__version__}" in result.stdout
    assert "built for" in result.stdout
    for member in _features.MEMBERS:
        assert member in result.stdout


def test_an_unsupported_torch_is_refused_at_import_naming_the_supported_releases():
    result = python(code=
        """
        import torch
        torch.__version__ = "2.5.1"
        import torch_ctxext
        """
    )
    assert result.returncode != 0
    assert (
        f"ImportError: torch_ctxext supports torch {_releases.range_text()}, but torch 2.5.1 is installed"
        in result.stderr
    )
    assert f"pip install 'torch{_releases.requirement()}'" in result.stderr


needs_extension = pytest.mark.skipif(
    hasattr(FunctionCtx, "input_grad_buffers")
    and torch_ctxext.features()["input_grad_buffers"] == "native"
    and torch_ctxext.features()["set_output_grad_dtype"] == "native",
    reason="the running torch needs no extension",
)


@needs_extension
def test_the_extension_refuses_to_load_against_another_torch_build(tmp_path):
    """With builds at import turned off (TORCH_CTXEXT_JIT=0) and none in the
    cache: an ImportError naming both builds and how to rebuild."""
    import shutil

    import _torch_ctxext_build

    package = os.path.dirname(torch_ctxext.__file__)
    copy = tmp_path / "torch_ctxext"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    # Its build layer beside it, as an install lays them out.
    build_layer = os.path.dirname(_torch_ctxext_build.__file__)
    shutil.copytree(build_layer, tmp_path / os.path.basename(build_layer), ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "_build_info.py").write_text(
        "TORCH_VERSION = '2.13.9+cpu'\nTORCH_GIT_VERSION = 'deadbeef' * 5\n"
    )
    if not list(copy.glob("_C*")):  # installed from source: the build is in the cache
        (copy / ("_C" + importlib.machinery.EXTENSION_SUFFIXES[0])).write_bytes(b"")
    result = python(code=
        "import torch_ctxext", PYTHONPATH=str(tmp_path), TORCH_CTXEXT_JIT="0",
        TORCH_CTXEXT_CACHE=str(tmp_path / "cache"),
    )
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("torch_ctxext._ext.loader.BuildMismatchError: torch_ctxext was built for torch 2.13.9+cpu (git deadbeefdead)")
    assert f"but torch {torch.__version__}" in last
    assert "unset TORCH_CTXEXT_JIT (it is 0) to build it at import" in last
    assert "`TORCH_CTXEXT_JIT=1 python -m torch_ctxext build`" in last
    assert "pip install --no-build-isolation --force-reinstall --no-deps" in last


@needs_extension
def test_the_compiled_library_records_the_torch_it_was_built_for():
    from torch_ctxext._ext import loader as _extension

    ext = _extension.load()
    assert ext.built_for_torch == torch.__version__
    assert ext.built_for_git_version == torch.version.git_version


@needs_extension
def test_the_reentrancy_guard_is_placed_by_the_first_exposure_and_again_if_removed():
    """A process that never receives a buffer runs backward on the engine as
    torch made it; the first buffer handed out guards the engine before the
    backward can reenter, and the next one puts the guard back if something
    replaced the engine object since."""
    code = """
        import torch, torch_ctxext
        from torch.autograd.variable import Variable
        plain = Variable._execution_engine
        x = torch.ones(2, requires_grad=True)
        (x * 2).sum().backward()
        assert Variable._execution_engine is plain
        class F(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x * 2
            @staticmethod
            def backward(ctx, g):
                assert ctx.input_grad_buffers[0] is not None
                q = torch.ones(1, requires_grad=True)
                try:
                    with torch.enable_grad():
                        (q * 2).sum().backward()
                except RuntimeError as e:
                    print(e)
                return g * 2
        (F.apply(x).sum() + (x * 3).sum()).backward()
        assert Variable._execution_engine is not plain
        assert isinstance(Variable._execution_engine, torch._C._ImperativeEngine)
        Variable._execution_engine = plain  # e.g. a library resetting it
        (F.apply(x).sum() + (x * 3).sum()).backward()
    """
    result = python(code=code)
    assert result.returncode == 0, result.stderr
    message = (
        "Calling backward or grad reentrantly after accessing a non-None "
        "ctx.input_grad_buffers entry is not supported"
    )
    assert result.stdout.split("\n")[:2] == [message, message], result.stdout


def test_installing_changes_nothing_until_torch_ctxext_is_imported(tmp_path):
    """The pytest11 entry point loads a module outside the package: a pytest
    run of any project runs on torch as installed, and a torch release the
    package refuses does not break other projects' test runs."""
    registered = False
    for ep in importlib.metadata.entry_points(group="pytest11"):
        if ep.dist is not None and ep.dist.name.replace("-", "_") == "torch_ctxext":
            assert not ep.value.startswith("torch_ctxext."), ep.value
            registered = True
    (tmp_path / "test_other_project.py").write_text(textwrap.dedent(
        """
        import sys
        import torch
        from torch.autograd.function import FunctionCtx

        def test_torch_is_untouched():
            assert "torch_ctxext" not in sys.modules
            assert FunctionCtx.__dict__.get("input_grad_buffers") is None or NATIVE
        """
    ).replace("NATIVE", repr(torch_ctxext.features()["input_grad_buffers"] == "native")))
    # Installed, the entry point loads the plugin; from a source tree, -p.
    result = python("-m", "pytest", "-q", "-p", "no:cacheprovider",
                    *([] if registered else ["-p", "torch_ctxext_pytest"]), tmp_path, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_member_torch_ctxext_could_not_provide_is_reported_unavailable_with_why(monkeypatch):
    """features() says 'unavailable' and why, e.g. when the 2.12 engine hook
    could not be placed on an unrecognised build (the rest still works)."""
    monkeypatch.setitem(_features._NATIVE, "apply_boxed", False)
    monkeypatch.delattr(BackwardCFunction, "apply_boxed")
    monkeypatch.setitem(_features.UNAVAILABLE, "apply_boxed", "no PyNode::apply found")
    assert torch_ctxext.features()["apply_boxed"] == "unavailable: no PyNode::apply found"
