"""A torch newer than the tested range, and members that could not be provided.

* On a torch newer than every tested release (2.16, a nightly
  ``2.16.0a0+git...``) ``import torch_ctxext`` succeeds as a no-op: a
  :class:`torch_ctxext.NewerTorchWarning` names the tested range, native
  members stay untouched, nothing of the extension is loaded, and a member
  that torch lacks there (a regression) is reported unavailable, so that
  ``python -m torch_ctxext check`` runs and reports it as a failure.
* A member that the running torch lacks and torch_ctxext could not provide
  (no compiler, a failed build) raises, where a backward uses it,
  :class:`torch_ctxext.MemberUnavailableError` naming torch_ctxext, the
  member and the reason, while ``hasattr`` still says it is absent.

Each scenario runs in a fresh interpreter: the version string is made newer
before torch_ctxext is imported. What a member is expected to be comes from
what the running torch has before the import, never from a release number.
"""
import json
import os

import pytest

from install_env import failing_compiler
from support import ROOT, python

NEWER_VERSIONS = ["2.16.0", "2.16.0a0+git1234abc"]

# Prints, as JSON: what torch had before the import, the warnings the
# import raised, features(), which torch_ctxext modules it loaded, and
# whether each native member is the very object it was before.
IMPORT_AS_NEWER = r"""
import inspect, json, sys, warnings
import torch
from torch.autograd.function import BackwardCFunction, FunctionCtx
torch.__version__ = sys.argv[1]
MEMBERS = ("apply", "apply_boxed", "apply_jvp", "input_grad_buffers", "mark_dirty",
           "mark_non_differentiable", "save_for_backward", "save_for_forward",
           "set_materialize_grads", "set_output_grad_dtype")
owner = lambda m: BackwardCFunction if m.startswith("apply") else FunctionCtx
before = {m: inspect.getattr_static(owner(m), m, None) for m in MEMBERS}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torch_ctxext
print(json.dumps({
    "had": {m: before[m] is not None for m in MEMBERS},
    "untouched": {m: inspect.getattr_static(owner(m), m, None) is before[m] for m in MEMBERS if before[m] is not None},
    "warnings": [[w.category.__name__, str(w.message)] for w in caught],
    "features": torch_ctxext.features(),
    "modules": sorted(k for k in sys.modules if k.startswith("torch_ctxext")),
}))
"""


def _python(code, *args, timeout=600, **env):
    return python(*args, code=code, timeout=timeout, PYTHONPATH=ROOT, **env)


@pytest.mark.parametrize("version", NEWER_VERSIONS)
def test_a_newer_torch_imports_as_a_no_op_with_a_warning_naming_the_tested_range(version):
    result = _python(IMPORT_AS_NEWER, version)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    newer = [message for category, message in seen["warnings"] if category == "NewerTorchWarning"]
    assert len(newer) == 1, seen["warnings"]
    assert "tested with torch 2.6 to 2.15" in newer[0] and version in newer[0]
    # Nothing of the extension is loaded or built into a torch it was not tested with.
    assert seen["modules"] == ["torch_ctxext", "torch_ctxext._features", "torch_ctxext._releases"]
    for member, had in seen["had"].items():
        if had:
            assert seen["features"][member] == "native"
            assert seen["untouched"][member], f"{member} was replaced on a newer torch"
        else:  # a regression of that torch: reported, not patched
            assert seen["features"][member].startswith(f"unavailable: torch {version} is newer"), seen["features"]
            assert "should provide it natively" in seen["features"][member]


def test_an_older_torch_is_still_refused_with_the_requirement_to_install():
    result = _python("import torch; torch.__version__ = '2.5.1'; import torch_ctxext")
    assert result.returncode != 0
    assert "ImportError: torch_ctxext supports torch 2.6 to 2.15, but torch 2.5.1 is installed" in result.stderr
    assert "pip install 'torch>=2.6'" in result.stderr


# A member the newer torch lacks: one the running torch lacks already, or,
# where it has them all (native 2.15), set_output_grad_dtype removed from it.
CHECK_AS_NEWER = r"""
import sys
import torch
from torch.autograd.function import FunctionCtx
torch.__version__ = "2.16.0"
if hasattr(FunctionCtx, "input_grad_buffers") and hasattr(FunctionCtx, "set_output_grad_dtype"):
    del FunctionCtx.set_output_grad_dtype
member = "input_grad_buffers" if not hasattr(FunctionCtx, "input_grad_buffers") else "set_output_grad_dtype"
from torch_ctxext.__main__ import main
print("MEMBER", member)
sys.exit(main(["check", "-k", "test_" + member + " and not accelerators and not refusals"]))
"""


def test_a_member_a_newer_torch_lacks_is_a_conformance_failure_the_suite_reports():
    result = _python(CHECK_AS_NEWER, timeout=900)
    member = result.stdout.split("MEMBER ", 1)[1].split()[0]
    assert result.returncode == 1, result.stdout + result.stderr  # does not conform; not an ImportError
    assert "ImportError" not in result.stderr
    assert "verdict: does not conform" in result.stdout
    row = next(line for line in result.stdout.splitlines() if line.startswith(member + " "))
    assert row.split()[1] == "unavailable"
    failed = [line for line in result.stdout.splitlines() if line.startswith("FAILED")]
    assert any(f"{member} is unavailable" in line for line in failed), failed[:3]


def test_the_warning_and_the_error_are_public():
    import torch_ctxext

    assert issubclass(torch_ctxext.ExtensionUnavailableWarning, UserWarning)
    assert issubclass(torch_ctxext.NewerTorchWarning, UserWarning)
    assert issubclass(torch_ctxext.MemberUnavailableError, AttributeError)
    assert {"ExtensionUnavailableWarning", "MemberUnavailableError", "NewerTorchWarning"} <= set(torch_ctxext.__all__)


# With no working compiler and an empty cache: what a backward that uses
# ctx.input_grad_buffers (or set_output_grad_dtype in forward) meets.
USE_AFTER_FAILED_BUILD = r"""
import warnings
import torch
from torch.autograd.function import FunctionCtx
lacking = [m for m in ("input_grad_buffers", "set_output_grad_dtype") if not hasattr(FunctionCtx, m)]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torch_ctxext
assert [w.category for w in caught] == [torch_ctxext.ExtensionUnavailableWarning], caught

class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        assert not hasattr(ctx, "input_grad_buffers") and getattr(ctx, "input_grad_buffers", None) is None
        ctx.input_grad_buffers
        return grad * 2

x = torch.ones(3, requires_grad=True)
try:
    Scale.apply(x).sum().backward()
except torch_ctxext.MemberUnavailableError as e:
    print("ERROR", e)
# The failed backward left nothing behind: the next one works.
(x * 3).sum().backward()
assert x.grad.tolist() == [3.0, 3.0, 3.0]
print("LACKING", " ".join(lacking))
"""


def test_a_member_that_could_not_be_provided_says_why_where_it_is_used(tmp_path):
    import torch_ctxext

    if torch_ctxext.features()["input_grad_buffers"] == "native":
        pytest.skip("the running torch provides input_grad_buffers natively: nothing is built")
    result = _python(
        USE_AFTER_FAILED_BUILD, timeout=900,
        CXX=failing_compiler(str(tmp_path)), TORCH_CTXEXT_CACHE=tmp_path / "cache",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    error = result.stdout.split("ERROR ", 1)[1].split("\nLACKING")[0]
    assert error.startswith("ctx.input_grad_buffers is unavailable: torch ")
    assert "torch_ctxext could not provide it: torch_ctxext could not build its C++ extension" in error
    assert "python -m torch_ctxext info" in error
    assert os.path.join(str(tmp_path), "cache") in error  # the build log it names
