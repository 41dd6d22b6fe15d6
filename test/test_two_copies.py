"""Two copies of torch_ctxext's extension in one process: the second is refused.

Each copy of the library would hook the autograd engine itself (libtorch_cpu's
GOT entries, PyNode's vtable slot) and consult only its own records, so a
second copy would silently undo what the first provides (on torch <= 2.9 the
first copy's set_output_grad_dtype(None) declarations would be cast). The
first copy to load claims the hooks in torch._C; a later one refuses to load,
naming both (csrc/module.cpp), and a package that vendors torch_ctxext under
another name reports the refusal like a failed build: the import succeeds
and features() says why its members are unavailable.

Each case runs in a subprocess: a refused copy must not leave the test
process with a claim it cannot undo.
"""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import torch_ctxext
from torch_ctxext._ext import loader as _extension

pytestmark = pytest.mark.skipif(
    _extension.loaded is None, reason="no extension loaded (native torch 2.15)"
)

# Checks, in the subprocess, that the first copy still provides what it did.
FIRST_COPY_INTACT = textwrap.dedent(
    f"""
    import sys
    sys.path.append({os.path.dirname(os.path.abspath(__file__))!r})
    from engine_hook_functions import fused_backward, uncast_backward

    def first_copy_intact():
        uncast_backward()
        assert fused_backward(), "no backward received w's buffer"
        print("first copy: intact")
    """
)


def run(script, *args):
    proc = subprocess.run(
        [sys.executable, "-c", FIRST_COPY_INTACT + textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc.returncode, proc.stdout + proc.stderr


def test_the_same_library_loaded_again_from_another_path_is_refused_naming_both(tmp_path):
    first = _extension.loaded.path
    second = tmp_path / os.path.basename(first)
    shutil.copyfile(first, second)
    code, output = run(
        """
        import importlib.util, sys
        import torch_ctxext
        from torch_ctxext._ext import loader as _extension
        first_copy_intact()
        for name, path in (("vendored._C", sys.argv[1]), ("vendored_again._C", sys.argv[2])):
            spec = importlib.util.spec_from_file_location(name, path)
            try:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            except ImportError as error:
                print("refused:", error)
            else:
                print("loaded a second copy:", path)
        first_copy_intact()
        """,
        str(second),
        first,  # the very same file, under another module name
    )
    assert code == 0, output
    assert "loaded a second copy" not in output, output
    assert output.count("first copy: intact") == 2, output
    assert output.count(
        "refused: torch_ctxext: another copy of torch_ctxext's C++ extension is "
        f"already loaded in this process: {first} (module torch_ctxext._C). This copy, "
    ) == 2, output
    assert f"This copy, {second}, is not loaded" in output, output
    assert f"This copy, {first}, is not loaded" in output, output
    assert "a second copy would replace the first one's hooks" in output, output


def vendor_a_copy(target):
    """A copy of this torch_ctxext under another name, with its C++ sources
    inside, as a library that vendors it would ship it (and as an installed
    copy carries them; a checkout keeps csrc/ beside the package)."""
    package = os.path.dirname(torch_ctxext.__file__)
    shutil.copytree(package, target, ignore=shutil.ignore_patterns("__pycache__"))
    if not os.path.isdir(os.path.join(target, "csrc")):
        shutil.copytree(os.path.join(os.path.dirname(package), "csrc"), os.path.join(target, "csrc"))


@pytest.mark.skipif(
    _extension.loaded is not None and _extension.loaded.origin == "package",
    reason="this copy carries its own build (compiled in place): a vendored copy of it would "
    "load its own library instead of building, which the next test covers",
)
def test_a_vendored_copy_of_the_package_reports_the_refusal_in_features(tmp_path):
    # A copy of the package under another name, as a library that vendors
    # torch_ctxext ships it. It loads an extension only for a member still
    # missing (one the installed copy does not provide, say a newer member):
    # simulated by hiding the first copy's input_grad_buffers while the
    # vendored copy is imported.
    vendor_a_copy(tmp_path / "vendored_ctxext")
    code, output = run(
        """
        import sys, warnings
        sys.path.insert(0, sys.argv[1])
        import torch_ctxext
        from torch.autograd.function import FunctionCtx
        first_copy_intact()
        hidden = FunctionCtx.__dict__["input_grad_buffers"]
        del FunctionCtx.input_grad_buffers
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import vendored_ctxext
        for w in caught:
            print("warned:", w.category.__name__, w.message)
        print("vendored features:", vendored_ctxext.features()["input_grad_buffers"])
        FunctionCtx.input_grad_buffers = hidden
        print("vendored loaded:", "vendored_ctxext._C" in sys.modules)
        print("first features:", torch_ctxext.features()["input_grad_buffers"])
        first_copy_intact()
        """,
        str(tmp_path),
    )
    assert code == 0, output
    path = _extension.loaded.path
    refusal = (
        "torch_ctxext: another copy of torch_ctxext's C++ extension is already "
        f"loaded in this process: {path} (module torch_ctxext._C). This copy, "
        f"{path} (module vendored_ctxext._C), is not loaded"
    )
    assert f"vendored features: unavailable: {refusal}" in output, output
    assert f"warned: ExtensionUnavailableWarning {refusal}" in output, output
    assert "vendored loaded: False" in output, output
    assert "first features: torch_ctxext" in output, output
    assert output.count("first copy: intact") == 2, output


def test_a_vendored_copy_imported_second_says_the_members_are_the_first_copys_not_native(tmp_path):
    """Every member the installed copy provides is already there when the
    vendored copy is imported: it loads nothing, and says who provides them
    (torch_ctxext, from the other copy), never "native"."""
    vendor_a_copy(tmp_path / "vendored_ctxext")
    code, output = run(
        """
        import sys
        sys.path.insert(0, sys.argv[1])
        import torch_ctxext
        import vendored_ctxext
        from vendored_ctxext import _features
        provided = [n for n, s in torch_ctxext.features().items() if s == "torch_ctxext"]
        print("provided by the first:", provided)
        print("vendored says:", sorted({vendored_ctxext.features()[n] for n in provided}))
        print("vendored route:", sorted({_features.routes()[n] for n in provided}))
        first_copy_intact()
        """,
        str(tmp_path),
    )
    assert code == 0, output
    assert "provided by the first: []" not in output, output
    assert "vendored says: ['torch_ctxext']" in output, output
    assert "vendored route: ['provided by another copy of torch_ctxext, loaded first (torch_ctxext." in output, output
    assert "first copy: intact" in output, output
