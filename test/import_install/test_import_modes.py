"""``import torch_ctxext`` whatever modes the importing code is in.

The import runs nothing of autograd (test_import_leaves_the_process.py):
the layout is verified once per build, in a child process, and on torch <
2.13 the boxed-grads path is found from PyNode's vtable symbol; only where a
torch build does not export that symbol does it apply a sample Function
(a forward, no backward). An import can happen anywhere: under ``no_grad`` or
``inference_mode``, lazily inside a custom backward, under autocast, a
TorchDispatchMode, FakeTensorMode, a functorch transform, while Dynamo
traces a frame, from a helper thread. In every case the members torch_ctxext
backports are installed, the importer's modes are as they were after the
import, and the importer's modes see none of the import's operations.

Each case imports torch_ctxext in a fresh subprocess (this process imported
it long ago); the subprocess loads the build this process loaded, from the
same cache.
"""
import json
import textwrap

import pytest

from install_env import BACKPORTED, needs_extension
from support import python

# Code run in a fresh interpreter; IMPORT is where torch_ctxext is first
# imported, inside the mode of the case. Each case asserts that its mode is
# back as it was after the import.
CASES = {
    "no_grad": """
        with torch.no_grad():
            IMPORT
            assert not torch.is_grad_enabled()
        """,
    "inference_mode": """
        with torch.inference_mode():
            IMPORT
            assert torch.is_inference_mode_enabled() and not torch.is_grad_enabled()
        """,
    "inside_a_custom_backward": """
        class Lazy(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.clone()

            @staticmethod
            def backward(ctx, g):
                IMPORT
                assert not torch.is_grad_enabled()
                return 2 * g

        x = torch.ones(3, requires_grad=True)
        Lazy.apply(x).sum().backward()
        assert x.grad.tolist() == [2.0, 2.0, 2.0]
        """,
    "autocast": """
        with torch.autocast("cpu", dtype=torch.bfloat16):
            IMPORT
            assert torch.is_autocast_cpu_enabled()
            assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
        """,
    "a_torch_dispatch_mode": """
        from torch.utils._python_dispatch import TorchDispatchMode

        class Recording(TorchDispatchMode):
            seen = []

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                self.seen.append(str(func))
                return func(*args, **(kwargs or {}))

        with Recording():
            IMPORT
            torch.ones(1).neg()
        assert Recording.seen == ["aten.ones.default", "aten.neg.default"], Recording.seen
        """,
    "fake_tensor_mode": """
        from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

        with FakeTensorMode():
            IMPORT
            assert isinstance(torch.ones(1), FakeTensor)
        """,
    "a_functorch_grad_transform": """
        def f(x):
            IMPORT
            return x.sin().sum()

        x = torch.ones(2)
        assert torch.allclose(torch.func.grad(f)(x), x.cos())
        """,
    "vmap": """
        def f(x):
            IMPORT
            return x * 2

        assert torch.func.vmap(f)(torch.ones(3, 2)).tolist() == [[2.0, 2.0]] * 3
        """,
    "a_frame_dynamo_traces": """
        # Dynamo runs IMPORT_NAME while it traces (torch.compiler.is_compiling()
        # is True during the import); fullgraph: the import breaks no graph.
        @torch.compile(backend="eager", fullgraph=True)
        def f(x):
            IMPORT
            return x * 2

        assert f(torch.ones(2)).tolist() == [2.0, 2.0]
        """,
    "a_strict_torch_function_mode": """
        # A mode that allows nothing sees nothing of the import, and the
        # import still installs every member (not: unavailable, "layout").
        from torch.overrides import TorchFunctionMode

        class Strict(TorchFunctionMode):
            seen = []

            def __torch_function__(self, func, types, args=(), kwargs=None):
                self.seen.append(getattr(func, "__name__", str(func)))
                raise RuntimeError(f"this mode allows no torch function, got {func}")

        with Strict():
            IMPORT
        assert Strict.seen == [], Strict.seen
        """,
    "a_meta_default_device": """
        with torch.device("meta"):
            IMPORT
            assert torch.ones(1).is_meta
        """,
    "deterministic_algorithms": """
        torch.use_deterministic_algorithms(True)
        IMPORT
        assert torch.are_deterministic_algorithms_enabled()
        """,
    "anomaly_mode": """
        with torch.autograd.detect_anomaly():
            IMPORT
            assert torch.is_anomaly_enabled()
        """,
    "a_helper_thread": """
        import threading

        errors = []

        def run():
            try:
                IMPORT
            except BaseException as e:
                errors.append(e)

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        assert not errors, errors
        """,
    "another_thread_inside_backward": """
        import threading

        inside, release = threading.Event(), threading.Event()

        class Waits(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.clone()

            @staticmethod
            def backward(ctx, g):
                inside.set()
                assert release.wait(60)
                return g

        x = torch.ones(2, requires_grad=True)
        thread = threading.Thread(target=lambda: Waits.apply(x).sum().backward())
        thread.start()
        assert inside.wait(60)
        IMPORT
        release.set()
        thread.join()
        assert x.grad.tolist() == [1.0, 1.0]
        """,
}


# Each script ends with os._exit once it has said what it found: on torch 2.12
# and 2.14 the interpreter's own shutdown aborts now and then ("terminate
# called without an active exception") after a backward ran on a thread other
# than the main one, without torch_ctxext too (2.12: 5 of 20 runs of the
# another_thread_inside_backward case with the imports taken out). These
# tests are about the import, not torch's shutdown (test_testdevice.py does
# the same).
EXIT = "import os, sys\nsys.stdout.flush()\nsys.stderr.flush()\nos._exit(0)\n"


def _script(case):
    body = textwrap.dedent(CASES[case])
    body = "\n".join(
        line.replace("IMPORT", "import torch_ctxext") for line in body.splitlines()
    )
    return (
        "import json, torch\n"
        + body
        + "\nimport torch_ctxext\nprint(json.dumps(torch_ctxext.features()))\n"
        + EXIT
    )


@needs_extension
@pytest.mark.parametrize("case", list(CASES))
def test_an_import_under_any_mode_installs_every_backported_member(case):
    result = python(code=_script(case))
    assert result.returncode == 0, result.stderr
    features = json.loads(result.stdout.splitlines()[-1])
    assert {m: features[m] for m in BACKPORTED} == {m: "torch_ctxext" for m in BACKPORTED}
    assert "ExtensionUnavailableWarning" not in result.stderr, result.stderr


# functorch's thread-local state: absent until something uses functorch, and
# copied into every graph task (and every captured ThreadLocalState) once it
# exists. The boxed-grads sample (where it runs) clears functorch's
# interpreter stack, which creates it; an importer that had none must be
# left with none (else every backward of the process pays for the copy), and
# one that had it keeps it.
FUNCTORCH_STATE_CASES = {
    "an_importer_without_it_is_left_without_it": ("", False),
    "an_importer_with_it_keeps_it": ("torch.func.vmap(lambda x: x * 2)(torch.ones(2, 2))", True),
}


@needs_extension
@pytest.mark.parametrize("case", list(FUNCTORCH_STATE_CASES))
def test_an_import_leaves_functorchs_thread_state_as_it_found_it(case):
    before, expected = FUNCTORCH_STATE_CASES[case]
    script = (
        "import torch\n" + before + "\nimport torch_ctxext\n"
        "print(torch_ctxext._C._testing.functorch_tls_exists())\n" + EXIT
    )
    result = python(code=script)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-1] == str(expected)
