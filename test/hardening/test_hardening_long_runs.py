"""A process that has run more graph tasks than an int can count.

Every ``backward()``, ``grad()`` and reentrant checkpoint is a graph task with
a 64-bit id; torch's ``get_current_graph_task_id()`` hands out an ``int``.
After 2^31 tasks the two differ, and the backport must keep working. Running
2^31 backward passes takes days, so the test moves the engine's own counter
(a static of libtorch_cpu, found through its symbol table) close to the
boundary, in a subprocess, and crosses it.
"""
import os
import shutil
import subprocess

import pytest
import torch

import torch_ctxext
from support import TESTS, python

BACKPORT = torch_ctxext.features()["input_grad_buffers"] == "torch_ctxext"

pytestmark = pytest.mark.skipif(
    not BACKPORT, reason="input_grad_buffers is native: nothing of torch_ctxext runs"
)

LIBTORCH_CPU = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
COUNTER = "torch::autograd::(anonymous namespace)::graph_task_id"


def counter_offset():
    """The engine's graph-task counter's offset in libtorch_cpu.so, or None."""
    if shutil.which("nm") is None:
        return None
    out = subprocess.run(["nm", "-C", LIBTORCH_CPU], capture_output=True, text=True).stdout
    for line in out.splitlines():
        address, _, name = line.split(" ", 2) if line.count(" ") >= 2 else ("", "", "")
        if name == COUNTER:
            return int(address, 16)
    return None


def test_buffers_are_exposed_and_exact_after_two_to_the_31_graph_tasks():
    offset = counter_offset()
    if offset is None:
        pytest.skip("libtorch_cpu.so has no symbol for the engine's task counter here")
    code = f"""
        import ctypes
        import torch
        import torch_ctxext
        from torch_ctxext._ext import loader as _extension
        from doubling_functions import doubling

        def load_base(path):
            with open("/proc/self/maps") as maps:
                for line in maps:
                    fields = line.split()
                    if len(fields) >= 6 and fields[5].endswith("libtorch_cpu.so") and int(fields[2], 16) == 0:
                        return int(fields[0].split("-")[0], 16)

        counter = ctypes.c_uint64.from_address(load_base({LIBTORCH_CPU!r}) + {offset})
        # The counter must be the engine's: it moves by one per backward.
        before = counter.value
        torch.ones(1, requires_grad=True).sum().backward()
        assert counter.value == before + 1, (before, counter.value)
        counter.value = 2**31 - 3

        ids = []

        def note_task_then_fuse(ctx, g):
            ids.append(_extension.load()._testing.current_graph_task_id())
            (buffer,) = ctx.input_grad_buffers
            assert buffer is not None
            buffer.add_(g * 2)
            return None

        Scale = doubling(note_task_then_fuse)

        for step in range(6):
            x = torch.tensor([1.0, 2.0], requires_grad=True)
            (Scale.apply(x).sum() + (x * 5).sum()).backward()
            assert x.grad.tolist() == [7.0, 7.0], x.grad
        assert ids[0] < 2**31 <= ids[-1], ids
        print("ok", ids[0], ids[-1])
    """
    result = python(code=code, path=[TESTS])  # for doubling_functions
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("ok"), result.stdout
