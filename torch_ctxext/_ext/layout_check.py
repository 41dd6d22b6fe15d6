"""Layout fingerprints, checked when the extension is loaded.

The extension reads, and for two members writes, torch's internal structures
(THPFunction, the node's InputMetadata and VariableInfo, the GraphTask, on
torch 2.12 PyNode's vtable) by the layout of the headers it was compiled
with. The build check in ``loader`` compares version and git hash; a
torch built from an edited tree, with an ``Unknown`` git hash, or patched by
a distribution passes it with a different layout. So before anything is
installed, a probe Function is run and everything the extension reads of it
is compared with what Python knows of it. A member whose structures do not
read back as expected is not installed; ``features()`` says why.

The probe runs inside whatever the importing code is doing: under
``no_grad`` or ``inference_mode``, inside a custom backward, under autocast,
a TorchDispatchMode or FakeTensorMode, inside a functorch transform, while
Dynamo traces the frame that imports. :func:`probe_modes` gives it the modes
it needs and hides the importer's, so that the probe reads the same facts
in every case (and the importer's modes see none of its operations).
"""
import contextlib

import torch
from torch.autograd import Function

# What each member reads or writes by layout.
NEEDS = {
    "input_grad_buffers": ("ctx", "node", "task"),
    "set_output_grad_dtype": ("ctx", "node", "metadata"),
    "apply_boxed": ("ctx", "node", "metadata"),
}

SHAPE = (2, 3)


class _Probe(Function):
    """Outputs of known dtypes, shapes and differentiability; a backward that
    reads the running graph task."""

    tasks = []

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


@contextlib.contextmanager
def probe_modes(ext):
    """The thread-local state an import-time probe needs, whatever the
    importer's: grad mode on and outside inference mode (else the probe
    builds no graph), no autocast (it would change the probe's dtypes), no
    functorch transform (its Function would need setup_context, and backward
    is refused inside grad transforms), no TorchDispatchMode, fake or proxy
    mode and no TorchFunctionMode such as ``torch.device("meta")`` (the
    importer's mode must neither see nor change the probe's operations).
    Everything is restored on exit. Deterministic algorithms and anomaly
    mode need nothing: the probe runs the same under them.

    Restored includes functorch's thread-local state not existing: clearing
    the interpreter stack creates it, and where it exists every graph task
    deep-copies it, a cost on every backward of the process (``ext``, the
    extension, sees and drops it)."""
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack
    from torch.utils._python_dispatch import _disable_current_modes

    had_functorch_state = ext.functorch_tls_exists()
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(temporarily_clear_interpreter_stack())
            stack.enter_context(torch._C._DisableFuncTorch())
            stack.enter_context(torch.inference_mode(False))
            stack.enter_context(torch.enable_grad())
            stack.enter_context(torch.autocast("cpu", enabled=False))
            stack.enter_context(torch._C.DisableTorchFunction())
            stack.enter_context(_disable_current_modes())
            stack.enter_context(torch._C._DisableTorchDispatch())
            yield
    finally:
        if not had_functorch_state:
            ext.drop_functorch_tls()


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


def unavailable_members(ext):
    """{member: reason} for the members whose structures did not read back
    as expected on this torch (empty when all did)."""
    try:
        with probe_modes(ext):
            found = _mismatches(ext)
    except Exception as e:  # a probe that cannot even run: trust nothing
        found = {part: f"the layout probe failed ({type(e).__name__}: {e})" for part in ("ctx", "node", "metadata", "task")}
    return verdicts(found)


def verdicts(found):
    """The members that depend on a structure in ``found``, with the reason."""
    result = {}
    for member, parts in NEEDS.items():
        bad = [found[p] for p in parts if p in found]
        if bad:
            result[member] = (
                f"torch {torch.__version__} does not lay out its autograd "
                f"structures as the headers torch_ctxext was built with ({bad[0]}); "
                "rebuild torch_ctxext against this torch, from the same source tree"
            )
    return result
