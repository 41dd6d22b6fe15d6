"""The drop-ins of torch_ctxext.nn allocate what their stock modules allocate,
whatever their input's strides, less exactly what advise promises.

For a contiguous, transposed, expanded, sliced and channels-last input (and
a token-mixing block, a Linear applied along the sequence axis of a
transposed activation), the bytes the CPU allocator hands out in a step
(forward and backward) and in its backward alone drop by the stock step's
promise (``avoidable_bytes``), which the fused step's report calls avoided;
never less, and never below zero: a drop-in used once allocates exactly
what its stock module does. Measured as benchmarks/bench_advise.py measures
(benchmarks/bench.py's ``backward_peak_bytes``, after two warm-up steps).
"""
import copy

import pytest
import torch
import torch.nn.functional as F

import torch_ctxext
from torch_ctxext.nn import fuse

import bench

B, T, C = 4, 16, 8

def layouts(B, T, C):
    """An input of shape (B, T, C) laid out each way, from a leaf of its own:
    name -> (make the leaf, lay it out)."""
    return {
        "contiguous": (lambda: torch.randn(B, T, C), lambda a: a),
        "transposed": (lambda: torch.randn(B, C, T), lambda a: a.transpose(1, 2)),
        "expanded": (lambda: torch.randn(1, T, C), lambda a: a.expand(B, T, C)),
        "sliced": (lambda: torch.randn(B, T, 2 * C), lambda a: a[..., 1::2]),
        "sliced-rows": (lambda: torch.randn(B, 2 * T, C), lambda a: a[:, :T]),
        "channels-last": (lambda: torch.randn(B, 2, T, C).contiguous(memory_format=torch.channels_last),
                          lambda a: a),
        "matrix-transposed": (lambda: torch.randn(C, B * T), lambda a: a.t()),
        "matrix-expanded": (lambda: torch.randn(1, C), lambda a: a.expand(B * T, C)),
    }


LAYOUTS = layouts(B, T, C)


class Step:
    """A model and its loss on an input laid out one way, from a fixed leaf."""

    def __init__(self, model, layout, run):
        make, lay = LAYOUTS[layout]
        self.model, self.lay, self.run = model, lay, run
        self.leaf = make().requires_grad_()

    def loss(self):
        return self.run(self.model, self.lay(self.leaf)).square().mean()

    def zero(self):
        self.model.zero_grad(set_to_none=True)
        self.leaf.grad = None


def allocations(step):
    """Bytes allocated by a whole step and by its backward alone."""
    for _ in range(2):
        step.zero()
        step.loss().backward()
    step.zero()
    whole = bench.backward_peak_bytes(lambda: step.loss().backward())["allocated_bytes"]
    step.zero()
    loss = step.loss()
    backward = bench.backward_peak_bytes(loss.backward)["allocated_bytes"]
    return whole, backward


def check(make_model, layout, run):
    """Promise (stock report) = avoided (fused report) = measured drop, >= 0,
    and the fused gradients are the stock ones."""
    torch.manual_seed(0)
    stock_model = make_model()
    fused_model = fuse(copy.deepcopy(stock_model), everything=True)
    stock, fused = Step(stock_model, layout, run), Step(fused_model, layout, run)
    fused.leaf = stock.leaf.detach().clone().requires_grad_()
    with torch_ctxext.advise(stock.model) as promised:
        stock.loss().backward()
    with torch_ctxext.advise(fused.model) as avoided:
        fused.loss().backward()
    for (name, p), q in zip(stock.model.named_parameters(), fused.model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-5, msg=name)
    torch.testing.assert_close(fused.leaf.grad, stock.leaf.grad, rtol=1e-5, atol=1e-5)
    (stock_whole, stock_backward), (fused_whole, fused_backward) = allocations(stock), allocations(fused)
    assert promised.avoidable_bytes == avoided.avoided_bytes
    assert stock_whole - fused_whole == promised.avoidable_bytes, (stock_whole, fused_whole)
    assert stock_backward - fused_backward == promised.avoidable_bytes, (stock_backward, fused_backward)
    return promised.avoidable_bytes


def linear():
    return torch.nn.Sequential(torch.nn.Linear(C, 2 * C))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_linear_used_once_allocates_what_nn_linear_allocates(layout):
    assert check(linear, layout, lambda m, x: m(x)) == 0


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_linear_used_twice_allocates_what_nn_linear_allocates_less_the_promise(layout):
    saved = check(linear, layout, lambda m, x: m(x) * m(x.tanh()))
    assert saved > 0


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("layout", ["transposed", "expanded", "channels-last"])
def test_a_linear_with_a_frozen_weight_allocates_what_nn_linear_allocates(layout, bias):
    """A frozen weight: nn.Linear multiplies a strided input as a batch,
    without folding it into a copy, and so does the drop-in."""
    def model():
        m = torch.nn.Sequential(torch.nn.Linear(C, 2 * C, bias=bias))
        m[0].weight.requires_grad_(False)
        return m

    check(model, layout, lambda m, x: m(x) * m(x.tanh()))


class MLP(torch.nn.Module):
    def __init__(self, features, hidden):
        super().__init__()
        self.fc1 = torch.nn.Linear(features, hidden)
        self.fc2 = torch.nn.Linear(hidden, features)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class TokenMixing(torch.nn.Module):
    """MLP-Mixer's block, applied ``depth`` times with shared weights: the
    token MLP is a Linear along the sequence axis of the transposed,
    normalised activation."""

    def __init__(self, tokens=64, channels=32, depth=2):
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(channels)
        self.norm2 = torch.nn.LayerNorm(channels)
        self.tokens = MLP(tokens, 2 * tokens)
        self.channels = MLP(channels, 2 * channels)
        self.depth = depth

    def forward(self, x):
        for _ in range(self.depth):
            x = x + self.tokens(self.norm1(x).transpose(1, 2)).transpose(1, 2)
            x = x + self.channels(self.norm2(x))
        return x


def test_a_token_mixing_block_on_a_transposed_activation_saves_what_advise_promises():
    LAYOUTS["mixer"] = (lambda: torch.randn(8, 64, 32), lambda a: a)
    try:
        saved = check(TokenMixing, "mixer", lambda m, x: m(x))
    finally:
        del LAYOUTS["mixer"]
    assert saved > 0


def test_an_unrolled_lstm_cell_on_sliced_steps_and_an_expanded_state_saves_what_advise_promises():
    class Unrolled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = torch.nn.LSTMCell(C, 2 * C)

        def forward(self, x):  # x: (B, T, C), each step a slice of it
            h = c = x.new_zeros(1, 2 * C).expand(x.shape[0], 2 * C)
            for t in range(x.shape[1]):
                h, c = self.cell(x[:, t], (h, c))
            return h

    assert check(Unrolled, "transposed", lambda m, x: m(x)) > 0


def test_a_tied_embedding_looked_up_by_transposed_indices_saves_what_advise_promises():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = torch.nn.Embedding(32, C)
            self.head = torch.nn.Linear(C, 32, bias=False)
            self.head.weight = self.embedding.weight

        def forward(self, x):  # x: (B, T, C), indices from its transposed signs
            indices = (torch.arange(B * T).reshape(T, B) % 32).t()
            return self.head(self.embedding(indices) + x)

    assert check(Tied, "transposed", lambda m, x: m(x)) > 0


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fused_linear_function_is_twice_differentiable_on_every_layout(layout):
    """A double backward differentiates the weight's gradient through the
    input copied in the forward, as it does through nn.Linear's copy (small
    inputs: gradgradcheck's cost grows with their size)."""
    make, lay = layouts(2, 3, C)[layout]
    gen = torch.Generator().manual_seed(0)
    leaf = make().double().requires_grad_()
    weight = torch.randn(3, C, dtype=torch.float64, generator=gen, requires_grad=True)
    bias = torch.randn(3, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradgradcheck(
        lambda a, w, b: torch_ctxext.nn.FusedLinearFunction.apply(lay(a), w, b, True), (leaf, weight, bias))


class TransposedDecoder(torch.nn.Module):
    """A tied autoencoder's decoder: ``F.linear(x, weight.t(), bias)``, or the
    route advise names for it, ``torch_ctxext.nn.functional.linear``."""

    def __init__(self, routed):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(C, 2 * C, generator=gen))
        self.bias = torch.nn.Parameter(torch.randn(2 * C, generator=gen))
        self.linear = torch_ctxext.nn.functional.linear if routed else F.linear

    def forward(self, x):
        return self.linear(x, self.weight.t(), self.bias)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_transposed_weight_route_allocates_what_f_linear_allocates(layout):
    """functional.linear applies a ``.t()`` weight as the weight itself and
    multiplies and saves what F.linear does, whatever the input's strides."""
    stock = Step(TransposedDecoder(routed=False), layout, lambda m, x: m(x))
    routed = Step(TransposedDecoder(routed=True), layout, lambda m, x: m(x))
    routed.leaf = stock.leaf.detach().clone().requires_grad_()
    stock.loss().backward()
    routed.loss().backward()
    for (name, p), q in zip(stock.model.named_parameters(), routed.model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-5, msg=name)
    torch.testing.assert_close(routed.leaf.grad, stock.leaf.grad, rtol=1e-5, atol=1e-5)
    assert allocations(routed) == allocations(stock)


@pytest.mark.parametrize("needs_input", [True, False], ids=["input", "frozen-input"])
@pytest.mark.parametrize("fused", [True, False], ids=["fuse", "no-fuse"])
@pytest.mark.parametrize("layout", ["matrix", *LAYOUTS])
def test_fused_linear_used_once_returns_what_linear_grads_returns_bit_for_bit(layout, fused, needs_input):
    """With nothing to add into, FusedLinearFunction's backward computes a
    row-major matrix's gradients without linear_grads (the per-call
    shortcut): the same bits as linear_grads, the route of every other case."""
    from torch_ctxext.nn import FusedLinearFunction
    from torch_ctxext.nn._matmul import fold, is_column_major, linear_grads

    make, lay = LAYOUTS.get(layout, (lambda: torch.randn(B * T, C), lambda a: a))
    gen = torch.Generator().manual_seed(0)
    leaf = make().requires_grad_(needs_input)
    weight = torch.randn(3, C, generator=gen, requires_grad=True)
    bias = torch.randn(3, generator=gen, requires_grad=True)
    x = lay(leaf)
    out = FusedLinearFunction.apply(x, weight, bias, fused)
    g = torch.randn(out.shape, generator=gen)
    inputs = (x, weight, bias) if needs_input else (weight, bias)
    got = torch.autograd.grad(out, inputs, g)
    with torch.no_grad():
        expected = linear_grads(g, fold(x.detach(), True), weight.detach(), (needs_input, True, True),
                                (None, None, None), True, x.shape, x.dtype, is_column_major(x))
    expected = [e for e in expected if e is not None]
    assert len(got) == len(expected)
    for a, e in zip(got, expected):
        assert torch.equal(a, e)
