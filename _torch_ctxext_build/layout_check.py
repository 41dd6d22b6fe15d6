"""The layout probe: does the engine read back as the extension's headers say?

Run in a child process, once per build and torch (``layout_verdict``), never
in a user's process: it runs a Function forward and two backwards, and a
backward starts the autograd engine (its device threads, a device query).

The extension reads, and for two members writes, torch's internal structures
(THPFunction, the node's InputMetadata and VariableInfo, the GraphTask) by
the layout of the headers it was compiled with. :func:`mismatches` runs a
probe Function and compares everything the extension reads of it with what
Python knows of it; :func:`facts` notes what the import needs and could only
learn from a graph. It needs torch and the extension only (``layout_probe``
imports it in the probe's process, never elsewhere).
"""
import torch
from torch.autograd import Function

SHAPE = (2, 3)


class _Probe(Function):
    """Outputs of known dtypes, shapes and differentiability; a backward that
    reads the running graph task."""

    tasks = []
    ext = None

    @staticmethod
    def forward(ctx, x, n, frozen):
        ctx.set_materialize_grads(False)
        flags = (x > 0).to(torch.int64)
        ctx.mark_non_differentiable(flags)
        return x * frozen.to(x.dtype), flags

    @staticmethod
    def backward(ctx, g, _):
        _Probe.tasks.append(_Probe.ext.read_task_layout())
        return g, None, None


def mismatches(ext):
    """{structure: what did not read back as expected} (empty: all did), for
    the structures ``ctx``, ``node``, ``metadata`` and ``task``. A probe that
    raises reports every structure: nothing it reads can be trusted."""
    try:
        return _mismatches(ext)
    except Exception as e:
        return {part: f"the layout probe failed ({type(e).__name__}: {e})" for part in ("ctx", "node", "metadata", "task")}


def facts(ext):
    """What the import needs to know of this torch's binaries and cannot
    find without building a graph: on torch < 2.13, where PyNode's vtable
    lies in libtorch_python (the boxed-grads path replaces its apply slot;
    libtorch_python exports no symbol for it from 2.7 on). Facts that
    cannot be found are left out (their member is then unavailable)."""
    found = {}
    if hasattr(ext, "pynode_vtable_offset"):
        x = torch.ones(1, dtype=torch.float32, device="cpu", requires_grad=True)
        out, _ = _Probe.apply(x, 7, torch.ones(1, dtype=torch.float64))
        try:
            found["pynode_vtable_offset"] = ext.pynode_vtable_offset(out.grad_fn)
        except RuntimeError as e:
            found["pynode_vtable_offset_error"] = str(e)
    return found


def _mismatches(ext):
    """{structure: what did not read back as expected}."""
    found = {}
    x = torch.ones(SHAPE, dtype=torch.float32, device="cpu", requires_grad=True)
    frozen = torch.ones(SHAPE, dtype=torch.float64, device="cpu")
    out, _ = _Probe.apply(x, 7, frozen)
    ctx = out.grad_fn
    facts = ext.read_ctx_layout(ctx)
    basicsize = torch._C._FunctionBase.__basicsize__
    if facts["ctx_size"] != basicsize:
        found["ctx"] = (
            f"the ctx object is {basicsize} bytes in this torch but "
            f"{facts['ctx_size']} in the headers the extension was built with"
        )
    elif facts["is_variable_input"] != [True, False, True] or facts["materialize_grads"]:
        found["ctx"] = "the ctx's fields do not read back as the probe set them"
    if not facts["has_node"] or not facts["node_points_back"]:
        found["node"] = "the ctx's autograd node does not read back as its node"
    elif facts["edge_valid"] != [True, False]:
        found["node"] = "the node's edges do not read back as the probe's inputs"
    expected_inputs = ([torch.float32, None], [list(SHAPE), []], [False, True])
    got_inputs = (facts["input_dtype"], facts["input_shape"], facts["input_default"])
    expected_outputs = ([torch.float32, torch.int64], [list(SHAPE), list(SHAPE)])
    got_outputs = (facts["output_dtype"], facts["output_shape"])
    if got_inputs != expected_inputs or got_outputs != expected_outputs:
        found["metadata"] = (
            "the node's input metadata or the ctx's output info does not read "
            "back as the probe's outputs"
        )
    _Probe.ext = ext
    _Probe.tasks = []
    out.sum().backward()
    (task,) = _Probe.tasks
    x2 = torch.ones(SHAPE, dtype=torch.float32, device="cpu", requires_grad=True)
    out2, _ = _Probe.apply(x2, 7, frozen)
    torch.autograd.grad(out2.sum(), [x2], create_graph=True)
    task_grad = _Probe.tasks[-1]
    expected_task = {"found": True, "post_processing": False, "holds_lock": False}
    if not all(task.get(k) == v for k, v in expected_task.items()) or (
        task["creates_graph"],
        task["exec_info_empty"],
        task_grad["creates_graph"],
        task_grad["exec_info_empty"],
    ) != (False, True, True, False):
        found["task"] = "the running graph task does not read back as the backward that runs it"
    return found
