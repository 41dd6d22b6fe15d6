"""The ctx contract under torch.compile and compiled autograd.

What happens (measured on torch 2.13 + torch_ctxext and native torch 2.15;
2.14 has torch's own set_output_grad_dtype and torch_ctxext's
input_grad_buffers; see docs/reliability.md):

* Dynamo does not trace ``ctx.set_output_grad_dtype`` (torch's own, 2.14 on:
  an AttributeError on its stand-in FunctionCtx, which lacks the
  ``output_grad_dtypes`` the method reads; backport: the call cannot be traced):
  ``fullgraph=True`` raises ``Unsupported``; otherwise the graph breaks at the
  Function, which runs eagerly with the declared dtype. The gradients equal
  eager's.
* While Dynamo traces a backward that reads ``ctx.input_grad_buffers``, the
  read raises: on 2.15 an AttributeError, which Dynamo handles as above (the
  frame runs eagerly and the real buffers are exposed). It never reads as
  all-None. On the backport the property's Python getter is inlined and the
  graph breaks at its call into the C extension (``Unsupported`` naming
  ``input_grad_buffers``), with the same outcome: the frame runs eagerly and
  the real buffers are exposed.
* Compiled autograd traces every backward; reading ``input_grad_buffers``
  there raises "input_grad_buffers can only be accessed from the currently
  executing autograd.Function backward()" on both (2.15 wraps it in
  InternalTorchDynamoError). Declared gradient dtypes are honoured by compiled
  autograd.
* The portable pattern: ``(None,) * n if torch.compiler.is_compiling() else
  ctx.input_grad_buffers`` gives the out-of-place fallback to both tracers
  (``fullgraph=True`` works) and the real buffers in eager.
"""
import pytest
import torch
from torch.autograd import Function

import torch_ctxext

FEATURES = torch_ctxext.features()
BACKPORT = FEATURES["input_grad_buffers"] == "torch_ctxext"

try:
    import torch._dynamo
    from torch._dynamo import compiled_autograd
    from torch._dynamo.testing import CompileCounter

    torch.compile(lambda t: t + 1, backend="eager")(torch.ones(1))
    COMPILE_ERROR = None
except Exception as e:  # pragma: no cover - depends on the machine
    COMPILE_ERROR = f"torch.compile cannot run here: {type(e).__name__}: {e}"

pytestmark = pytest.mark.skipif(COMPILE_ERROR is not None, reason=str(COMPILE_ERROR))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


SEEN = []


class Matmul(Function):
    """The README's fused matmul: accumulates grad_x into the buffer when the
    engine exposes one."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x @ weight

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        x_buffer, _ = ctx.input_grad_buffers
        SEEN.append(("buffer", x_buffer is not None))
        if x_buffer is not None:
            x_buffer.addmm_(grad_output, weight.t())
            grad_x = None
        else:
            grad_x = grad_output @ weight.t()
        return grad_x, x.t() @ grad_output


class GuardedMatmul(Function):
    """The same, with the portable guard: no buffers while a tracer runs."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x @ weight

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        if torch.compiler.is_compiling():
            x_buffer = None
        else:
            x_buffer, _ = ctx.input_grad_buffers
        if x_buffer is not None:
            x_buffer.addmm_(grad_output, weight.t())
            grad_x = None
        else:
            grad_x = grad_output @ weight.t()
        return grad_x, x.t() @ grad_output


class HalfGrad(Function):
    """Declares a float64 gradient for its float32 output."""

    @staticmethod
    def forward(ctx, x):
        ctx.set_output_grad_dtype(torch.float64)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        SEEN.append(("dtype", g.dtype))
        return (g * 2).to(torch.float32)


class Model(torch.nn.Module):
    """x -> Function(x, weight) -> sum, plus sin(x): x is used again after the
    Function, so its gradient reaches x's buffer before the Function's
    backward runs (the fused path in eager)."""

    function = None

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(3, 2, generator=gen))

    def forward(self, x):
        return self.function.apply(x, self.weight).sum() + torch.sin(x).sum()


class MatmulModel(Model):
    function = Matmul


class GuardedModel(Model):
    function = GuardedMatmul


class HalfGradModel(Model):
    def forward(self, x):
        return (HalfGrad.apply(x) @ self.weight).sum() + torch.sin(x).sum()


def gradients(model, compiled=None, compiled_autograd_backend=None):
    SEEN.clear()
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(1), requires_grad=True)
    model.weight.grad = None
    fn = compiled if compiled is not None else model
    if compiled_autograd_backend is not None:
        with compiled_autograd._enable(torch.compile(backend=compiled_autograd_backend)):
            fn(x).backward()
    else:
        fn(x).backward()
    return x.grad.clone(), model.weight.grad.clone(), list(SEEN)


def assert_same(a, b):
    torch.testing.assert_close(a[0], b[0])
    torch.testing.assert_close(a[1], b[1])


# ---------------------------------------------------------- torch.compile


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_declared_grad_dtype_under_torch_compile_matches_eager(backend):
    model = HalfGradModel()
    eager = gradients(model)
    compiled = gradients(model, torch.compile(model, backend=backend))
    assert eager[2] == compiled[2] == [("dtype", torch.float64)]
    assert_same(eager, compiled)


def test_declared_grad_dtype_is_not_traced_fullgraph_raises_unsupported():
    model = HalfGradModel()
    with pytest.raises(torch._dynamo.exc.Unsupported) as info:
        gradients(model, torch.compile(model, backend="aot_eager", fullgraph=True))
    # The reason depends on how far Dynamo gets ("Observed exception" where
    # torch provides the method, 2.14 on; a skipped C function on the
    # backport): it is a clean Unsupported either way.
    assert "INTERNAL ASSERT" not in str(info.value)


def test_declared_grad_dtype_function_runs_eagerly_outside_the_graphs():
    """What is compiled: Dynamo breaks the graph at the Function (which then
    runs eagerly) and compiles the rest; on native torch and the backport alike."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    model = HalfGradModel()
    eager = gradients(model)
    compiled = gradients(model, torch.compile(model, backend=backend))
    assert_same(eager, compiled)
    assert graphs, "nothing was compiled"
    assert not any("autograd_function_apply" in code for code in graphs)


def test_traced_function_without_declarations_is_in_the_graph():
    """Control for the test above: a Function that declares nothing is traced
    into the graph (the backport's Function.apply wrapper does not hide it)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    model = GuardedModel()
    eager = gradients(model)
    compiled = gradients(model, torch.compile(model, backend=backend, fullgraph=True))
    assert_same(eager, compiled)
    assert len(graphs) == 1 and "autograd_function_apply" in graphs[0]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_input_grad_buffers_under_torch_compile_matches_eager(backend):
    model = MatmulModel()
    eager = gradients(model)
    compiled = gradients(model, torch.compile(model, backend=backend))
    assert eager[2] == [("buffer", True)]
    # The Function is not traced: the frame runs eagerly, with the real buffer.
    assert compiled[2] == [("buffer", True)]
    assert_same(eager, compiled)


# How Dynamo says it cannot trace a C function (a builtin), by the first
# release that says it so (SkipFunctionVariable.call_function in
# torch/_dynamo/variables/functions.py): the wording is Dynamo's and changes
# with the release; the function's name in it is torch_ctxext's.
UNTRACEABLE_BUILTIN = (
    ("2.6", "Graph break due to unsupported builtin"),
    ("2.7", "Dynamo does not know how to trace the builtin"),
)


def since_release(table):
    """The entry of a (first release, value) table that holds for the running torch."""
    return [value for release, value in table if torch.__version__ >= release][-1]


def test_what_input_grad_buffers_reads_as_while_dynamo_traces_backward():
    """It is never all-None while traced: Dynamo stops at the read, so
    ``fullgraph=True`` refuses to compile (without it the frame falls back to
    eager: the test above). What stops it depends on who provides the
    property: torch 2.15's raises an AttributeError on Dynamo's stand-in ctx;
    torch_ctxext's Python getter is inlined up to its call into the C
    extension (``input_grad_buffers_property``), which Dynamo cannot trace."""
    model = MatmulModel()
    with pytest.raises(torch._dynamo.exc.Unsupported) as info:
        gradients(model, torch.compile(model, backend="aot_eager", fullgraph=True))
    if BACKPORT:
        assert since_release(UNTRACEABLE_BUILTIN) in str(info.value)
        assert "input_grad_buffers_property" in str(info.value)
    else:
        assert "'FunctionCtx' object has no attribute '_input_grad_buffers'" in str(info.value)


@pytest.mark.parametrize("fullgraph", [False, True])
def test_guarded_read_compiles_with_the_out_of_place_fallback(fullgraph):
    model = GuardedModel()
    eager = gradients(model)
    counter = CompileCounter()
    compiled = gradients(model, torch.compile(model, backend=counter, fullgraph=fullgraph))
    assert counter.frame_count == 1  # the Function is in the graph
    assert_same(eager, compiled)
    # and eager still fuses afterwards
    x = torch.ones(2, 3, requires_grad=True)
    w = torch.ones(3, 2)
    (GuardedMatmul.apply(x, w).sum() + (x * 1).sum()).backward()
    torch.testing.assert_close(x.grad, torch.full((2, 3), 3.0))


# ------------------------------------------------------- compiled autograd


# Which of torch 2.15's refusals a read under compiled autograd gets, by the
# first release where it gets it: torch 2.6's compiled autograd runs the
# compiled backward with no graph task of the engine running on the thread
# (the read is outside backward); from 2.7 it runs inside the engine's task,
# whose executing node is not this ctx's.
COMPILED_AUTOGRAD_REFUSAL = (
    ("2.6", "input_grad_buffers can only be accessed while autograd is executing backward()"),
    ("2.7", "input_grad_buffers can only be accessed from the currently "
            "executing autograd.Function backward()"),
)


def test_input_grad_buffers_under_compiled_autograd_raises_a_clear_error():
    model = MatmulModel()
    # Native torch wraps it in InternalTorchDynamoError (a RuntimeError); the
    # backport raises it as it is.
    with pytest.raises(RuntimeError) as info:
        gradients(model, compiled_autograd_backend="aot_eager")
    assert str(info.value).split("\n")[0].endswith(since_release(COMPILED_AUTOGRAD_REFUSAL))
    # Nothing is left behind: eager backward fuses again.
    assert gradients(model)[2] == [("buffer", True)]


def test_guarded_read_under_compiled_autograd_matches_eager():
    model = GuardedModel()
    eager = gradients(model)
    compiled = gradients(model, compiled_autograd_backend="aot_eager")
    assert_same(eager, compiled)


def test_declared_grad_dtype_under_compiled_autograd_matches_eager():
    model = HalfGradModel()
    eager = gradients(model)
    compiled = gradients(model, compiled_autograd_backend="aot_eager")
    assert compiled[2] == [("dtype", torch.float64)]
    assert_same(eager, compiled)


def test_compile_and_compiled_autograd_together():
    model = GuardedModel()
    eager = gradients(model)
    compiled = gradients(
        model, torch.compile(model, backend="aot_eager"), compiled_autograd_backend="aot_eager"
    )
    assert_same(eager, compiled)
