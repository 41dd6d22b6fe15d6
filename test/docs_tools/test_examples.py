"""examples/: FusedLinear is a drop-in nn.Linear that fuses, and the shared-layer model trains as without it."""
import contextlib
import doctest
import io

import pytest
import torch

import torch_ctxext

import fused_linear
import shared_layers
from fused_linear import FusedLinear, FusedLinearFunction
from shared_layers import SharedLayerModel, set_fusion, shifted_token_batch, train


def pair(in_features=6, out_features=5, bias=True):
    """An nn.Linear and a FusedLinear with the same parameters."""
    torch.manual_seed(0)
    plain = torch.nn.Linear(in_features, out_features, bias=bias)
    fused = FusedLinear(in_features, out_features, bias=bias)
    fused.load_state_dict(plain.state_dict())
    return plain, fused


def grads(layer, x, loss_of):
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    with torch_ctxext.explain() as report:
        loss_of(layer, x).backward()
    stats = report[FusedLinearFunction] if FusedLinearFunction in report else None
    return [x.grad] + [p.grad for p in layer.parameters()], stats


# Ways of using one layer inside one backward: (name, loss_of(layer, x), how
# many times the layer is applied, whether x's buffer is exposed).
USES = [
    ("weight used three times", lambda m, x: sum((m(x * k) ** 2).sum() for k in (1, 2, 3)), 3, False),
    ("3-d input, weight used twice",
     lambda m, x: (m(x.view(2, 2, 6)) * m(x.view(2, 2, 6) + 1)).sum(), 2, False),
    # x * 2 is created after the layer: its gradient is in x's buffer when
    # the layer's backward runs.
    ("input used again afterwards", lambda m, x: m(x).sum() + (x * 2).sum(), 1, True),
    ("used once", lambda m, x: m(x).pow(2).sum(), 1, False),
]


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("name, loss_of, applied, x_exposed", USES, ids=[u[0] for u in USES])
def test_fused_linear_gives_nn_linear_gradients_and_fuses(name, loss_of, applied, x_exposed, bias):
    plain, fused = pair(bias=bias)
    x = torch.randn(4, 6)
    expected, _ = grads(plain, x, loss_of)
    got, stats = grads(fused, x, loss_of)
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e)
    # Every application but the first to run backward finds the weight's
    # (and the bias's) buffer.
    assert stats.exposed == (applied - 1) * (2 if bias else 1) + x_exposed


def test_fused_linear_is_a_drop_in_nn_linear():
    plain, fused = pair()
    assert isinstance(fused, torch.nn.Linear)
    assert fused.state_dict().keys() == plain.state_dict().keys()
    x = torch.randn(3, 6)
    torch.testing.assert_close(fused(x), plain(x))
    assert "fuse=True" in repr(fused)


def test_fuse_false_never_reads_the_buffers():
    plain, fused = pair()
    fused.fuse = False
    x = torch.randn(4, 6)
    loss_of = USES[0][1]
    expected, _ = grads(plain, x, loss_of)
    got, stats = grads(fused, x, loss_of)
    assert stats is None  # no read at all
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e)


def test_under_autocast_the_weight_gradient_is_float32_and_fused():
    plain, fused = pair()
    seen = []

    def loss_of(m, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs = [m(x * k) for k in (1, 2)]
        for o in outs:
            o.register_hook(lambda g: seen.append(g.dtype))
        return sum((o.float() ** 2).sum() for o in outs)

    x = torch.randn(4, 6)
    got, stats = grads(fused, x, loss_of)
    assert seen == [torch.float32, torch.float32]
    assert stats.exposed == 2
    assert all(g.dtype == torch.float32 for g in got)
    expected, _ = grads(plain, x, loss_of)  # bfloat16 gradients: close, not equal
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, atol=0.05, rtol=0.05)


def test_shared_layer_model_fuses_every_use_of_the_block_but_the_first():
    depth = 4
    torch.manual_seed(0)
    model = SharedLayerModel(depth=depth)
    tokens, targets = shifted_token_batch(2, 5, 64, torch.Generator().manual_seed(0))
    with torch_ctxext.explain() as report:
        model.loss(tokens, targets).backward()
    stats = report[FusedLinearFunction]
    assert stats.reads == 2 * depth
    # fc1 and fc2, weight and bias: depth - 1 uses each find a buffer.
    assert stats.exposed == 2 * 2 * (depth - 1)


def test_shared_layer_model_loss_curve_is_the_nn_linear_one():
    curves = {}
    for name, linear in (("nn.Linear", torch.nn.Linear), ("fused", FusedLinear)):
        torch.manual_seed(0)
        curves[name] = train(SharedLayerModel(depth=3, linear=linear), steps=5)
    torch.testing.assert_close(curves["fused"], curves["nn.Linear"])
    assert curves["fused"][-1] < curves["fused"][0]


def test_set_fusion_switches_every_fused_linear():
    model = set_fusion(SharedLayerModel(depth=2), False)
    assert [m.fuse for m in model.modules() if isinstance(m, FusedLinear)] == [False, False]


def test_example_script_runs():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert shared_layers.main(["--steps", "2", "--depth", "3"]) == 0
    text = out.getvalue()
    assert "FusedLinearFunction: 6 read(s), 8 exposed" in text


def test_docstring_example_runs():
    result = doctest.testmod(fused_linear, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_tied_output_embedding_finds_no_buffer_because_the_lookup_runs_later():
    """The output projection is created after the embedding lookup, so it runs
    first in backward: the weight's slot is still empty (the lookup's
    gradient comes later and the engine adds it)."""
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(10, 4)
    tokens = torch.tensor([1, 2, 3])
    with torch_ctxext.explain() as report:
        FusedLinearFunction.apply(embedding(tokens) * 2, embedding.weight, None, True).sum().backward()
    stats = report[FusedLinearFunction]
    assert stats.exposed == 0 and stats.fell_back == 2
    if torch_ctxext.features()["input_grad_buffers"] == "torch_ctxext":
        assert stats.reasons == {"no earlier producer": 2, "not a tensor argument": 2}
    fused_grad, embedding.weight.grad = embedding.weight.grad, None
    torch.nn.functional.linear(embedding(tokens) * 2, embedding.weight).sum().backward()
    torch.testing.assert_close(fused_grad, embedding.weight.grad)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_fused_linear_function_passes_check_function(bias):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, generator=gen, requires_grad=True)
    w = torch.randn(2, 4, generator=gen, requires_grad=True)
    b = torch.randn(2, generator=gen, requires_grad=True) if bias else None
    report = torch_ctxext.testing.check_function(FusedLinearFunction, x, w, b, True)
    assert report.passed, str(report)
    # Every tensor input's fused path was compared with its fallback, and
    # double backward (which takes the fallback) was checked too.
    names = [r.name for r in report.results if not r.failed and "SKIP" not in str(r)]
    assert names.count("input_grad_buffers.fused_matches_fallback") == (3 if bias else 2)
    assert "gradgradcheck" in names


def test_double_backward_takes_the_fallback():
    plain, fused = pair()
    x = torch.randn(4, 6, requires_grad=True)
    results = []
    for layer in (plain, fused):
        loss = sum((layer(x * k) ** 2).sum() for k in (1, 2))
        (gx,) = torch.autograd.grad(loss, x, create_graph=True)
        results.append(torch.autograd.grad(gx.sum(), layer.weight)[0])
    torch.testing.assert_close(results[1], results[0])
