"""How the checker is put together: ``import torch_ctxext`` does not load it
(a training process pays nothing for it), first use does; and its rule
families stand on one core, never on each other (torch_ctxext/testing/_core.py).
"""
import ast
import pathlib
import textwrap

import torch_ctxext
from support import python

TESTING = pathlib.Path(torch_ctxext.__file__).parent / "testing"

LAZY_LOADING = textwrap.dedent(
    """
    import sys

    import torch_ctxext

    def loaded():
        return sorted(m for m in ("torch_ctxext.testing", "torch_ctxext._explain",
                                  "torch_ctxext._advise", "torch_ctxext.nn")
                      if m in sys.modules)

    assert loaded() == [], loaded()
    assert {"testing", "explain", "advise", "nn"} <= set(dir(torch_ctxext)), dir(torch_ctxext)
    assert {"testing", "explain", "advise", "nn", "features", "ExtensionUnavailableWarning",
            "MemberUnavailableError", "NewerTorchWarning", "UnloadableBuildWarning"} == set(torch_ctxext.__all__)

    from torch_ctxext.testing import check_function
    assert "torch_ctxext.testing" in sys.modules
    assert torch_ctxext.testing.check_function is check_function

    from torch_ctxext import explain
    assert explain is torch_ctxext.explain is sys.modules["torch_ctxext._explain"].explain

    from torch_ctxext import advise
    assert advise is torch_ctxext.advise is sys.modules["torch_ctxext._advise"].advise
    assert torch_ctxext.nn.fuse is sys.modules["torch_ctxext.nn"].fuse

    try:
        torch_ctxext.no_such_member
    except AttributeError as error:
        assert "no_such_member" in str(error)
    else:
        raise AssertionError("no AttributeError")
    print("ok")
    """
)


def test_import_torch_ctxext_loads_neither_the_checker_nor_explain_nor_advise_nor_nn_until_first_use():
    # A fresh process: this one has imported the checker already.
    result = python(code=LAZY_LOADING)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "ok"


def test_the_explain_context_manager_and_the_checker_work_when_loaded_by_attribute():
    result = python(code=(
        """
        import torch
        import torch_ctxext

        with torch_ctxext.explain() as report:
            x = torch.ones(2, requires_grad=True)
            (x * 2).sum().backward()
        print(type(report).__name__)
        print(type(torch_ctxext.testing.check_function).__name__)
        """
    ))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["BufferReport", "function"]


def _imported_modules(path):
    """The sibling modules of torch_ctxext.testing that ``path`` imports."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                names.add(node.module.split(".")[0])
            else:
                names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "torch_ctxext.testing."):
            names.add(node.module.split(".")[2])
    return names


def test_rule_families_import_only_the_core_never_each_other():
    modules = {p.stem: p for p in TESTING.glob("*.py") if p.stem != "__init__"}
    families = {name for name in modules if not name.startswith("_") and name != "report"}
    assert {"forward", "gradients", "forward_ad", "input_grad_buffers", "vmap"} <= families
    crossing = {
        name: sorted(_imported_modules(modules[name]) & families) for name in sorted(families)
    }
    assert {name: found for name, found in crossing.items() if found} == {}
    # Nor does the core reach up into a family (the runner is what runs them).
    core = set(modules) - families - {"_runner"}
    upward = {name: sorted(_imported_modules(modules[name]) & families) for name in sorted(core)}
    assert {name: found for name, found in upward.items() if found} == {}
