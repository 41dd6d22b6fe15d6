"""torch_ctxext.nn.fuse(model) swaps in only the drop-ins that pay: the
modules advise says save bytes (weights, or inputs, that receive more than
one gradient in a step), from a report, a step it watches, or the latest
advise block on the model; everything=True swaps every stock module."""
import pytest
import torch

import torch_ctxext
from torch_ctxext.nn import FusedLinear, fuse


class Shared(torch.nn.Module):
    """``block`` applied three times, ``embed`` and ``head`` once each."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(4, 8)
        self.block = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        h = self.embed(x)
        for _ in range(3):
            h = self.block(h).tanh()
        return self.head(h)


def step_of(model):
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))

    def step():
        model(x).sum().backward()

    return step


def classes(model):
    return {name: type(module).__name__ for name, module in model.named_children()}


PAID = {"embed": "Linear", "block": "FusedLinear", "head": "Linear"}


def test_fuse_with_a_report_leaves_single_use_linears_alone():
    model = Shared()
    with torch_ctxext.advise(model) as report:
        step_of(model)()
    assert fuse(model, report) is model
    assert classes(model) == PAID


def test_fuse_with_a_report_of_another_model_built_the_same_way_matches_modules_by_path():
    advised, model = Shared(), Shared()
    with torch_ctxext.advise(advised) as report:
        step_of(advised)()
    fuse(model, report)
    assert classes(model) == PAID and classes(advised) == {n: "Linear" for n in PAID}


def test_fuse_watching_a_step_leaves_single_use_linears_alone_and_the_gradients_as_they_were():
    model = Shared()
    model.block.weight.grad = torch.ones_like(model.block.weight)
    fuse(model, step=step_of(model))
    assert classes(model) == PAID
    assert torch.equal(model.block.weight.grad, torch.ones_like(model.block.weight))
    assert model.head.weight.grad is None


def test_fuse_alone_follows_the_latest_advise_block_on_the_model():
    model = Shared()
    with torch_ctxext.advise(model):
        step_of(model)()
    fuse(model)
    assert classes(model) == PAID


def test_fuse_everything_swaps_every_stock_module():
    model = Shared()
    with torch_ctxext.advise(model):
        step_of(model)()
    fuse(model, everything=True)
    assert classes(model) == {n: "FusedLinear" for n in PAID}


def test_a_model_fused_where_it_pays_has_the_stock_models_gradients_and_saves_what_advise_promised():
    stock, model = Shared(), Shared()
    model.load_state_dict(stock.state_dict())
    with torch_ctxext.advise(stock) as promised:
        step_of(stock)()
    fuse(model, promised)
    with torch_ctxext.advise(model) as fused:
        step_of(model)()
    assert fused.avoided_bytes == promised.avoidable_bytes > 0 and fused.avoidable_bytes == 0
    for (name, p), q in zip(stock.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


def test_fuse_says_what_it_needs():
    with pytest.raises(TypeError, match="not both"):
        fuse(Shared(), torch_ctxext.advise(Shared()), step=lambda: None)
    with pytest.raises(TypeError, match="advise"):
        fuse(Shared(), {"block": 1})
    model = Shared()
    with pytest.raises(RuntimeError, match="no backward ran"):
        fuse(model, step=lambda: model(torch.randn(2, 4)))
    assert all(not isinstance(m, FusedLinear) for m in model.modules())


def test_fuses_docstring_example_runs_as_written():
    import doctest
    import sys

    result = doctest.testmod(sys.modules["torch_ctxext.nn.fuse"], optionflags=doctest.ELLIPSIS)
    assert result.attempted and not result.failed


def test_a_drop_in_whose_fused_add_allocates_more_than_it_saves_is_neither_advised_nor_swapped():
    """A tied embedding two floats wide that scales its rows by their
    frequency: its fused add would allocate each row's count and scale (12
    bytes a row) to save an 8-byte row of gradient. Only the head pays."""
    def tied():
        model = torch.nn.ModuleDict({"embedding": torch.nn.Embedding(16, 2, scale_grad_by_freq=True),
                                     "head": torch.nn.Linear(2, 16, bias=False)})
        model["head"].weight = model["embedding"].weight
        return model

    tokens = torch.arange(32).reshape(4, 8) % 16
    model = tied()
    with torch_ctxext.advise(model) as report:
        model["head"](model["embedding"](tokens)).sum().backward()
    assert [p.drop_in for p in report["embedding.weight"].producers] == ["FusedLinear", "FusedEmbedding"]
    assert {d.module for d in report.drop_ins.values()} == {"head"}
    fuse(model, report)
    assert classes(model) == {"embedding": "Embedding", "head": "FusedLinear"}
