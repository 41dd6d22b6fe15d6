"""FusedLinear's Function in C++ computes what its Python Function computes.

Where torch_ctxext has a build for the running torch (its extension on torch
2.6 to 2.14; on native 2.15 the build advise() loads too), ``FusedLinear``
runs, on plain CPU tensors, the same Function written in C++
(``csrc/fused_linear.cpp``): a Python ``autograd.Function`` costs about
15 us a call more than ``nn.Linear``, more than a small layer's whole saving.
The route is only that: every observable of a step (the output, the
gradients of the input, the weight and the bias, which gradients are added
into the engine's buffers, the errors) is the Python Function's, compared here
bitwise, scenario by scenario. Where the route does not apply (another
device, a subclass, a mode, autocast, forward AD, a strided input it does not
fold), FusedLinear runs the Python Function, as it does on native torch 2.15
without that build.
"""
import contextlib

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import torch_ctxext
from torch_ctxext import _explain, _features
from torch_ctxext._ext import advise_module
from torch_ctxext.nn import (FusedEmbedding, FusedGRUCell, FusedLinear, FusedLSTMCell, FusedMultiheadAttention,
                             linear)
from torch_ctxext.nn.conv1d import conv1d_drop_in
from torch_ctxext.nn.functional import linear as linear_function

# The extension behind ctx.input_grad_buffers (2.6 to 2.14), or on native 2.15
# the build advise() loads too, where one was made (CI builds it).
EXTENSION = linear.cpp_function_build()
ROUTE = getattr(EXTENSION, "fused_linear", None)
needs_route = pytest.mark.skipif(ROUTE is None, reason=f"no build with the C++ Function: {advise_module.choice}")
F = 8  # features


def additions():
    return EXTENSION._testing.fused_linear_additions()


@contextlib.contextmanager
def route(name):
    """The drop-ins find their C++ Function ("cpp") or none ("python")."""
    saved = dict(linear._routes)
    for function in linear.CPP_FUNCTIONS:
        linear._routes[function] = getattr(EXTENSION, function) if name == "cpp" else None
    try:
        yield
    finally:
        linear._routes.clear()
        linear._routes.update(saved)


def test_on_plain_cpu_tensors_fusedlinear_and_fusedconv1d_run_the_cpp_function_where_torch_ctxext_has_a_build():
    x = torch.randn(2, F, requires_grad=True)
    nodes = [FusedLinear(F, F, bias=bias)(x).grad_fn for bias in (True, False)]
    nodes.append(conv1d_drop_in(StandInConv1D)(F, F)(x).grad_fn)
    if ROUTE is None:  # native torch 2.15 without advise()'s build: the Python Functions
        assert _features.loaded_extension() is None
        assert [type(node).__name__ for node in nodes] == [
            "FusedLinearFunctionBackward", "FusedLinearFunctionBackward", "FusedConv1DFunctionBackward"]
    else:
        assert [node.name() for node in nodes] == [
            f"torch::autograd::CppNode<torch_ctxext::FusedLinearFunction<{bias}, {out_in}, true> >"
            for bias, out_in in (("true", "true"), ("false", "true"), ("true", "false"))]


@needs_route
def test_the_build_carries_every_cpp_function_the_drop_ins_look_up():
    assert [name for name in linear.CPP_FUNCTIONS if not callable(getattr(EXTENSION, name, None))] == []


# ---------------------------------------------------------------- the same step

def leaf(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype).requires_grad_()


def used(times, make_input=lambda: leaf(4, F)):
    """One FusedLinear applied to ``times`` inputs, summed."""
    def build():
        layer = FusedLinear(F, F)
        xs = [make_input() for _ in range(times)]
        return [layer, *xs], lambda: sum((layer(x) * (k + 1)).sum() for k, x in enumerate(xs))
    return build


def qkv():
    """Three layers reading one input: its gradient is added into."""
    layers = [FusedLinear(F, F) for _ in range(3)]
    x = leaf(4, F)
    return [*layers, x], lambda: sum((layer(x) * (k + 1)).sum() for k, layer in enumerate(layers))


def configured(times, **options):
    def build():
        layer = FusedLinear(F, F, bias=options.get("bias", True), dtype=options.get("dtype"))
        if options.get("frozen"):
            layer.weight.requires_grad_(False)
        xs = [leaf(4, F, dtype=layer.weight.dtype) for _ in range(times)]
        return [layer, *xs], lambda: sum((layer(x) * (k + 1)).sum() for k, x in enumerate(xs))
    return build


def through_functional():
    """A weight applied through torch_ctxext.nn.functional.linear (a tied head)."""
    weight = torch.nn.Parameter(torch.randn(F, F) / F)
    xs = [leaf(4, F) for _ in range(3)]
    return [weight, *xs], lambda: sum((linear_function(x, weight) * (k + 1)).sum() for k, x in enumerate(xs))


class StandInConv1D(torch.nn.Module):
    """transformers' ``Conv1D`` as transformers writes it (``weight``: in x
    out), so that its drop-in is tested without transformers installed."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = torch.nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = torch.nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


def conv1d(times, make_input=lambda: leaf(4, F)):
    """One FusedConv1D (GPT-2's layers) applied to ``times`` inputs."""
    def build():
        layer = conv1d_drop_in(StandInConv1D)(F, F)
        xs = [make_input() for _ in range(times)]
        return [layer, *xs], lambda: sum((layer(x) * (k + 1)).sum() for k, x in enumerate(xs))
    return build


def unrolled(cell_class):
    """A FusedGRUCell or FusedLSTMCell unrolled over four steps: on the C++
    route each step's two products are two C++ Functions, on the Python one
    its gates' Function (FusedGRUGatesFunction, FusedLSTMGatesFunction)."""
    def build():
        cell = cell_class(F, F)
        xs = [leaf(4, F) for _ in range(4)]

        def loss():
            h = c = torch.zeros(4, F)
            for x in xs:
                if isinstance(cell, FusedLSTMCell):
                    h, c = cell(x, (h, c))
                else:
                    h = cell(x, h)
            return h.pow(2).sum()
        return [cell, *xs], loss
    return build


def shared_attention():
    """One FusedMultiheadAttention applied three times (a shared encoder
    layer's self-attention): its packed in-projection and out_proj, each
    through the C++ FusedProjectionFunction or the Python one."""
    attention = FusedMultiheadAttention(F, 2)
    x = leaf(5, 3, F)

    def loss():
        y = x
        for _ in range(3):
            y = attention(y, y, y, need_weights=False)[0]
        return y.pow(2).sum()
    return [attention, x], loss


def looked_up(times, padding_idx=None):
    """One FusedEmbedding looked up ``times`` times, summed: every lookup
    after the first to run backward adds its rows into the buffer."""
    def build():
        embedding = FusedEmbedding(20, F, padding_idx=padding_idx)
        tokens = [torch.randint(0, 20, (3, 5)) for _ in range(times)]
        tokens[-1][0, 0] = 0  # (the padding row, where there is one, is looked up)
        return [embedding], lambda: sum((embedding(t) * (k + 1)).sum() for k, t in enumerate(tokens))
    return build


def tied_head():
    """An embedding whose weight is the output projection's (GPT-2's tie): the
    head runs backward first and leaves a buffer the lookup adds into."""
    embedding = FusedEmbedding(20, F)
    head = FusedLinear(F, 20, bias=False)
    head.weight = embedding.weight
    tokens = torch.randint(0, 20, (3, 5))
    return [embedding], lambda: head(embedding(tokens)).pow(2).sum()


def sliced_rows():
    return leaf(8, F)[::2]


def expanded_rows():
    return leaf(1, F).expand(4, F)


def batched():
    return leaf(2, 3, F)


def transposed_batch():
    """A batch whose rows fold into a matrix only by copying (a batch-first
    activation transposed, as nn.MultiheadAttention's batch_first does)."""
    return leaf(3, 2, F).transpose(0, 1)


def frozen_on(make_input):
    """A FusedLinear whose weight is frozen, on three inputs of make_input."""
    def build():
        layer = FusedLinear(F, F)
        layer.weight.requires_grad_(False)
        xs = [make_input() for _ in range(3)]
        return [layer, *xs], lambda: sum((layer(x) * (k + 1)).sum() for k, x in enumerate(xs))
    return build


SCENARIOS = {
    "used once": used(1),
    "used four times": used(4),
    "q, k and v reading one input": qkv,
    "a batch of sequences": used(3, batched),
    "every other row": used(3, sliced_rows),
    "one row expanded": used(3, expanded_rows),
    "a batch that folds only by copying": used(3, transposed_batch),
    "a frozen weight on a batch that folds only by copying": frozen_on(transposed_batch),
    "no bias": configured(3, bias=False),
    "a frozen weight": configured(3, frozen=True),
    "float64": configured(3, dtype=torch.float64),
    "a weight through nn.functional.linear": through_functional,
    "Conv1D used once": conv1d(1),
    "Conv1D on a batch of sequences": conv1d(3, batched),
    "Conv1D on every other row": conv1d(3, sliced_rows),
    "an unrolled GRUCell": unrolled(FusedGRUCell),
    "an unrolled LSTMCell": unrolled(FusedLSTMCell),
    "a shared MultiheadAttention": shared_attention,
    "an embedding looked up four times": looked_up(4),
    "an embedding with a padding row": looked_up(3, padding_idx=0),
    "an embedding tied to the head": tied_head,
}


def run(build, name, backwards=1):
    """Outputs of ``backwards`` backward passes of the scenario through route
    ``name``: the loss, every gradient, and how many gradients were added into
    the engine's buffers (the C++ Function's count; the Python Function's
    non-None entries of ctx.input_grad_buffers)."""
    torch.manual_seed(0)
    with route(name):
        modules, loss_of = build()
        leaves = [p for m in modules for p in ([m] if isinstance(m, torch.Tensor) else m.parameters())]
        exposed = []
        observing = (_explain.observe(lambda ctx, result, raw: exposed.append(sum(t is not None for t in result)))
                     if name == "python" else contextlib.nullcontext())
        before = additions()
        with observing:  # (an observer makes FusedLinear run the Python Function: the point here)
            losses = []
            for _ in range(backwards):
                loss = loss_of()
                loss.backward()
                losses.append(loss.detach())
        added = sum(exposed) if name == "python" else additions() - before
    return losses, [None if p.grad is None else p.grad.clone() for p in leaves], added


@needs_route
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_cpp_function_gives_the_python_functions_output_gradients_and_additions_bitwise(scenario):
    (cpp_loss, cpp_grads, cpp_added), (py_loss, py_grads, py_added) = (
        run(SCENARIOS[scenario], name) for name in ("cpp", "python"))
    assert [torch.equal(a, b) for a, b in zip(cpp_loss, py_loss)] == [True] * len(py_loss)
    assert len(cpp_grads) == len(py_grads)
    for a, b in zip(cpp_grads, py_grads):
        assert (a is None) == (b is None)
        assert a is None or torch.equal(a, b), (a - b).abs().max()
    assert cpp_added == py_added
    if "used once" not in scenario:
        assert cpp_added > 0, "nothing was fused: the scenario tests nothing of the route"


@needs_route
def test_a_retained_graph_runs_backward_again_with_the_same_gradients():
    cpp = run(used(3), "cpp", backwards=2)
    py = run(used(3), "python", backwards=2)
    assert all(torch.equal(a, b) for a, b in zip(cpp[1], py[1]))
    assert cpp[2] == py[2] > 0


@needs_route
@pytest.mark.parametrize("shape, view", [((4, F), lambda x: x), ((3, 2, F), lambda x: x.transpose(0, 1))],
                         ids=["a matrix", "a batch folded by copying"])
def test_the_gradient_of_a_gradient_is_the_python_functions_and_nothing_is_added_into_under_create_graph(shape, view):
    """(A batch folded by copying: the weight's gradient is differentiated
    through the copy, to the input.)"""
    def grads(name):
        torch.manual_seed(0)
        with route(name):
            layer, x = FusedLinear(F, F), leaf(*shape)
            before = additions()
            gx, gw = torch.autograd.grad(layer(layer(view(x))).pow(2).sum(), (x, layer.weight), create_graph=True)
            added = additions() - before
            (gx.sum() + gw.pow(2).sum()).backward()  # (a first-order backward, through both layers again)
            return [layer.weight.grad, layer.bias.grad, x.grad], added
    (cpp, added), (py, _) = grads("cpp"), grads("python")
    assert all(torch.equal(a, b) for a, b in zip(cpp, py))
    assert added == 0


@needs_route
@pytest.mark.parametrize("refusal", ["a post-hook on its node", "anomaly detection"])
def test_where_input_grad_buffers_refuses_both_functions_compute_out_of_place_as_nn_linear(refusal):
    """The property raises there; the drop-ins then add into nothing (a
    drop-in never fails a step its stock module runs)."""
    def grads(kind):
        torch.manual_seed(0)
        layer = torch.nn.Linear(F, F) if kind == "stock" else FusedLinear(F, F)
        xs = [leaf(4, F) for _ in range(3)]
        with route(kind if kind != "stock" else "python"):
            before = additions()
            ys = [layer(x) for x in xs]
            if refusal == "a post-hook on its node":
                for y in ys:
                    y.grad_fn.register_hook(lambda grad_inputs, grad_outputs: None)
            mode = torch.autograd.detect_anomaly(check_nan=False) if refusal == "anomaly detection" else contextlib.nullcontext()
            with mode:
                sum((y * (k + 1)).sum() for k, y in enumerate(ys)).backward()
            return [layer.weight.grad, layer.bias.grad, *(x.grad for x in xs)], additions() - before
    (stock, _), (cpp, added), (py, _) = grads("stock"), grads("cpp"), grads("python")
    assert all(torch.equal(a, b) for a, b in zip(cpp, stock))
    assert all(torch.equal(a, b) for a, b in zip(py, stock))
    assert added == 0


@needs_route
@pytest.mark.parametrize("misuse", ["an input modified after the forward", "a second backward through a freed graph"])
def test_a_misused_graph_raises_the_error_nn_linear_raises(misuse):
    def error(layer):
        x = leaf(4, F)
        x_used = x * 1
        loss = layer(x_used).sum()
        if misuse == "an input modified after the forward":
            with torch.no_grad():
                x_used.add_(1)
        else:
            loss.backward()
        with pytest.raises(RuntimeError) as raised:
            loss.backward()
        return raised.value

    torch.manual_seed(0)
    stock = error(torch.nn.Linear(F, F))
    with route("cpp"):
        cpp = error(FusedLinear(F, F))
    assert str(cpp) == str(stock)
    # and the next backward works
    with route("cpp"):
        layer, x = FusedLinear(F, F), leaf(4, F)
        (layer(x) + layer(x)).sum().backward()
    assert x.grad is not None


@needs_route
def test_under_compiled_autograd_the_cpp_function_gives_the_python_functions_gradients():
    from torch._dynamo import compiled_autograd

    def grads(name):
        torch.manual_seed(0)
        with route(name):
            modules, loss_of = used(3)()
            with compiled_autograd._enable(torch.compile(backend="eager")):
                loss_of().backward()
        return [p.grad for m in modules for p in ([m] if isinstance(m, torch.Tensor) else m.parameters())]
    torch._dynamo.reset()
    cpp = grads("cpp")
    torch._dynamo.reset()
    py = grads("python")
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-6) for a, b in zip(cpp, py))


# ----------------------------------------------------- where the route does not apply

class Tagged(torch.Tensor):
    pass


class Passing(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class PassingDispatch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def fw_ad():
    import torch.autograd.forward_ad as fwAD
    return fwAD.dual_level()


plain = contextlib.nullcontext

NOT_ROUTED = {
    # name: (the input, given a leaf of 4 x F; the context the call runs in)
    "a tensor subclass": (lambda a: a.as_subclass(Tagged), plain),
    "a torch function mode": (lambda a: a, Passing),
    "a dispatch mode": (lambda a: a, PassingDispatch),
    "autocast": (lambda a: a, lambda: torch.autocast("cpu", dtype=torch.bfloat16)),
    "forward AD": (lambda a: a, fw_ad),
    "a column-major matrix": (lambda a: a.t().contiguous().t(), plain),
    "a vector": (lambda a: a[0], plain),
    "no rows": (lambda a: a[:0], plain),
    "another dtype": (lambda a: a.double(), plain),
}


@needs_route
@pytest.mark.parametrize("case", NOT_ROUTED)
def test_where_the_cpp_function_would_not_compute_alike_fusedlinear_runs_the_python_function(case):
    make, context = NOT_ROUTED[case]
    layer = FusedLinear(F, F)
    x = make(leaf(4, F))
    with route("cpp"), context():
        assert ROUTE(x, layer.weight, layer.bias) is None
        if case == "another dtype":
            with pytest.raises(RuntimeError):  # as nn.Linear: mat1 and mat2 must have the same dtype
                layer(x)
            return
        out = layer(x)
    assert type(out.grad_fn).__name__ != "CppFunction", out.grad_fn


@needs_route
def test_while_advise_or_explain_observes_fusedlinear_runs_the_python_function_whose_reads_they_see():
    layer, x = FusedLinear(F, F), leaf(4, F)
    with route("cpp"), _explain.observe(lambda *a: None):
        assert type(layer(x).grad_fn).__name__ == "FusedLinearFunctionBackward"
    with route("cpp"), torch_ctxext.advise(layer):  # before any backward: advise observes from it on
        assert type(layer(x).grad_fn).__name__ == "FusedLinearFunctionBackward"
    with route("cpp"):
        assert type(layer(x).grad_fn).__name__ == "CppFunction"



def node_names(out):
    """The class names of every node behind ``out``."""
    seen, stack, names = set(), [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


CELLS_NOT_ROUTED = {
    # name: (the states (h, c), given plain ones; the context the step runs in)
    "a subclass hidden state": (lambda h, c: (h.as_subclass(Tagged), c), plain),
    "a subclass cell state": (lambda h, c: (h, c.as_subclass(Tagged)), plain),
    "a torch function mode": (lambda h, c: (h, c), Passing),
    "autocast": (lambda h, c: (h, c), lambda: torch.autocast("cpu", dtype=torch.bfloat16)),
}


@needs_route
@pytest.mark.parametrize("cell_class, case", [(cell_class, case) for cell_class in (FusedGRUCell, FusedLSTMCell)
                                              for case in CELLS_NOT_ROUTED
                                              if cell_class is FusedLSTMCell or "cell state" not in case])
def test_where_the_cpp_step_would_not_compute_alike_the_cells_run_their_gates_python_function(case, cell_class):
    make, context = CELLS_NOT_ROUTED[case]
    lstm = cell_class is FusedLSTMCell
    cell, x = cell_class(F, F), leaf(4, F)
    h, c = make(torch.zeros(4, F), torch.zeros(4, F))
    with route("cpp"), context():
        step = EXTENSION.fused_lstm_cell if lstm else EXTENSION.fused_gru_cell
        states = (h, c) if lstm else (h,)
        assert step(x, *states, cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh) is None
        out = cell(x, (h, c))[0] if lstm else cell(x, h)
    gates = "FusedLSTMGatesFunctionBackward" if lstm else "FusedGRUGatesFunctionBackward"
    assert gates in node_names(out)
    assert "CppFunction" not in node_names(out)


@needs_route
@pytest.mark.parametrize("cell_class", [FusedGRUCell, FusedLSTMCell])
def test_the_cells_unbatched_and_without_a_bias_take_the_cpp_step_with_the_python_steps_gradients(cell_class):
    def grads(name):
        torch.manual_seed(0)
        with route(name):
            cell, x = cell_class(F, F, bias=False), leaf(F)
            h = x.new_zeros(F)
            states = (h, h) if cell_class is FusedLSTMCell else h
            for _ in range(3):
                out = cell(x, states)
                states = out
            (out[0] if isinstance(out, tuple) else out).pow(2).sum().backward()
            return [cell.weight_ih.grad, cell.weight_hh.grad, x.grad], node_names(out[0] if isinstance(out, tuple)
                                                                                    else out)
    (cpp, cpp_nodes), (py, _) = grads("cpp"), grads("python")
    assert "CppFunction" in cpp_nodes
    assert all(torch.equal(a, b) for a, b in zip(cpp, py))


EMBEDDINGS_NOT_ROUTED = {
    # name: (the module's options, the indices given plain ones, the context)
    "scale_grad_by_freq": ({"scale_grad_by_freq": True}, lambda t: t, plain),
    "a subclass index tensor": ({}, lambda t: t.as_subclass(Tagged), plain),
    "a torch function mode": ({}, lambda t: t, Passing),
    "a dispatch mode": ({}, lambda t: t, PassingDispatch),
}


@needs_route
@pytest.mark.parametrize("case", EMBEDDINGS_NOT_ROUTED)
def test_where_the_cpp_lookup_would_not_compute_alike_fusedembedding_runs_the_python_function(case):
    options, make, context = EMBEDDINGS_NOT_ROUTED[case]
    embedding = FusedEmbedding(20, F, **options)
    tokens = make(torch.randint(0, 20, (3, 5)))
    with route("cpp"), context():
        out = embedding(tokens)
    assert "FusedEmbeddingFunctionBackward" in node_names(out)
    assert "CppFunction" not in node_names(out)


@needs_route
def test_int32_indices_take_the_cpp_lookup_and_an_index_out_of_range_raises_nn_embeddings_error():
    embedding, stock = FusedEmbedding(20, F), torch.nn.Embedding(20, F)
    with route("cpp"):
        assert "CppFunction" in node_names(embedding(torch.tensor([1, 2], dtype=torch.int32)))
        with pytest.raises(IndexError) as fused_error:
            embedding(torch.tensor([20]))
    with pytest.raises(IndexError) as stock_error:
        stock(torch.tensor([20]))
    assert str(fused_error.value) == str(stock_error.value)
