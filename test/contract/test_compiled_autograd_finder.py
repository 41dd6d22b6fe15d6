"""The finder that patches compiled autograd on its import (torch 2.6-2.12,
where the boxed-grads path is torch_ctxext's) leaves ``sys.meta_path`` as it
found it once its job is done, and never edits the list while it looks:
another thread's import walking ``sys.meta_path`` meanwhile skips no
finder.
"""
import json

import pytest

import torch_ctxext
from support import python

needs_boxed_path = pytest.mark.skipif(
    torch_ctxext.features().get("apply_boxed") != "torch_ctxext",
    reason="boxed grads are native on this torch: no finder",
)


def run(code):
    result = python(code=code)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


WATCHED = """
import json, sys
before = list(sys.meta_path)
import torch_ctxext
from torch_ctxext._backport import boxed_grads
finders = [f for f in sys.meta_path if isinstance(f, boxed_grads._PatchOnImport)]
edits = []

class Watched(list):
    # Every edit of the live list that involves the finder.
    def remove(self, item):
        if isinstance(item, boxed_grads._PatchOnImport):
            edits.append("remove")
        return super().remove(item)

    def insert(self, at, item):
        if isinstance(item, boxed_grads._PatchOnImport):
            edits.append("insert")
        return super().insert(at, item)

sys.meta_path = Watched(sys.meta_path)
import torch._dynamo.compiled_autograd as compiled_autograd
compiler = compiled_autograd.AutogradCompilerInstance
from torch.autograd.function import BackwardCFunction
patched = hasattr(compiler.proxy_call_backward, "__wrapped__") or hasattr(
    BackwardCFunction._compiled_autograd_key, "__wrapped__")
print(json.dumps({
    "finders_after_import": len(finders),
    "edits": edits,
    "left": [type(f).__name__ for f in sys.meta_path if isinstance(f, boxed_grads._PatchOnImport)],
    "others_in_order": [f for f in sys.meta_path if f in before] == before,
    "patched": patched,
}))
"""


@needs_boxed_path
def test_the_finder_leaves_meta_path_as_it_found_it_once_compiled_autograd_is_patched():
    said = run(WATCHED)
    assert said["finders_after_import"] == 1
    assert said["patched"]
    assert said["left"] == [] and said["others_in_order"]
    assert said["edits"] == ["remove"]  # taken out once, at the end; never put back


@needs_boxed_path
def test_no_finder_when_compiled_autograd_is_already_imported():
    said = run("""
        import json, sys
        import torch._dynamo.compiled_autograd
        before = list(sys.meta_path)
        import torch_ctxext
        print(json.dumps(list(sys.meta_path) == before))
        """)
    assert said is True
