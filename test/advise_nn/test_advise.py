"""torch_ctxext.advise: the report's contract (its table and plain data, the
custom Functions it saw, the backwards it observes) and that a block leaves
nothing behind. The four models and the cross-release report:
test_advise_models.py."""
import json

import pytest
import torch
from torch.autograd.function import BackwardCFunction, FunctionCtx

import torch_ctxext
from torch_ctxext._advise import graph, modules
from torch_ctxext._advise.table import fmt_bytes as format_bytes
from doubling_functions import doubling, fuse_into_buffer


def reads_and_drops(ctx, g):
    """Reads x's buffer and returns None without writing it (loses 2g)."""
    ctx.input_grad_buffers
    return None


def reads_but_returns(ctx, g):
    """Reads x's buffer, then returns x's gradient anyway (the fallback)."""
    ctx.input_grad_buffers
    return g * 2


Fused = doubling(fuse_into_buffer)  # y = 2x, adds into x's buffer where exposed
Unfused = doubling(reads_but_returns)
Dropping = doubling(reads_and_drops)


def two_uses(x, function=Fused):
    """x read by sin (created last, so it runs first) and by ``function``."""
    return function.apply(x).sum() + x.sin().sum()


def test_each_slot_has_the_required_keys_and_the_report_is_json_serialisable():
    model = torch.nn.Linear(3, 3)
    with torch_ctxext.advise(model) as report:
        sum(model(torch.randn(2, 3) * k).sum() for k in range(3)).backward()
    data = json.loads(json.dumps(report.as_dict()))
    assert {"slots", "temporary_bytes", "avoided_bytes", "avoidable_bytes", "functions"} <= data.keys()
    for slot in data["slots"]:
        assert {"name", "producers", "grad_bytes", "fused", "temporaries"} <= slot.keys()
    assert {s["name"] for s in data["slots"]} == {"weight", "bias"}
    assert [len(s["producers"]) for s in data["slots"]] == [3, 3]


def test_the_table_lists_the_largest_saving_first_with_its_drop_in():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    with torch_ctxext.advise(model) as report:
        sum(model(torch.randn(4, 8) * k).sum() for k in range(4)).backward()
    rows = str(report).splitlines()
    names = [s.name for s in report.slots]
    assert names == ["0.weight", "1.weight", "0.bias", "1.bias"]
    positions = [next(i for i, r in enumerate(rows) if f"  {n} <- " in r) for n in names]
    assert positions == sorted(positions)
    assert "0: Linear -> torch_ctxext.nn.FusedLinear" in str(report)


# What a Function does with the buffer it was handed for x (x is read by sin
# first): (Function, used, fused producers, temporaries the engine added).
HANDLINGS = [
    ("writes it and returns None", Fused, 1, 1, 0),
    ("returns its gradient anyway", Unfused, 0, 0, 1),
    ("returns None without writing it", Dropping, 0, 0, 0),
]


@pytest.mark.parametrize("function, used, fused, temporaries", [h[1:] for h in HANDLINGS],
                         ids=[h[0] for h in HANDLINGS])
def test_a_buffer_counts_as_used_only_where_the_function_wrote_it_and_returned_none(
        function, used, fused, temporaries):
    x = torch.randn(5, requires_grad=True)
    with torch_ctxext.advise() as report:
        two_uses(x, function).backward()
    stats = report.functions["doubling.<locals>.F"]
    assert (stats.reads, stats.exposed, stats.used) == (1, 1, used)
    slot = report.slots[0]
    assert (slot.name, slot.kind, len(slot.producers)) == ("leaf tensor [5]", "tensor", 2)
    assert (slot.fused, slot.temporaries, slot.avoided_bytes) == (fused, temporaries, fused * 5 * 4)


def test_a_fused_write_gives_the_gradient_of_the_step_without_advise():
    x = torch.randn(5, requires_grad=True)
    with torch_ctxext.advise():
        two_uses(x).backward()
    torch.testing.assert_close(x.grad, 2 + x.detach().cos())


UNKNOWN = "None (reason needs torch_ctxext's extension)"
# How x's buffer stands when Fused reads it, the step, and the reason the
# report gives for its None (with the extension, and without it: native 2.15,
# where the watch itself sees that nothing reached the slot yet).
NONE_REASONS = [
    ("nothing ran before it", lambda x: Fused.apply(x).sum(), "no earlier producer", "no earlier producer"),
    ("it runs first of two producers", lambda x: x.sin().sum() + Fused.apply(x).sum(),
     "no earlier producer", "no earlier producer"),
    ("an expanded gradient came first", lambda x: Fused.apply(x).sum() + x.sum(),
     "not dense (expanded, overlapping)", UNKNOWN),
]


@pytest.mark.parametrize("step, with_extension, without", [r[1:] for r in NONE_REASONS],
                         ids=[r[0] for r in NONE_REASONS])
def test_the_reasons_for_none_are_explains_and_what_the_watch_saw(step, with_extension, without):
    x = torch.randn(5, requires_grad=True)
    with torch_ctxext.advise() as report:
        step(x).backward()
    stats = report.functions["doubling.<locals>.F"]
    assert (stats.reads, stats.exposed, stats.fell_back) == (1, 0, 1)
    extension = torch_ctxext.features()["input_grad_buffers"] == "torch_ctxext"
    assert dict(stats.reasons) == {with_extension if extension else without: 1}


def test_without_a_model_tensors_are_named_by_op_and_shape_and_no_drop_in_is_suggested():
    layer = torch.nn.Linear(3, 3)
    with torch_ctxext.advise() as report:
        sum(layer(torch.randn(2, 3) * k).sum() for k in range(2)).backward()
    assert sorted(s.name for s in report.slots) == ["leaf tensor [3, 3]", "leaf tensor [3]"]
    assert report.avoidable_bytes == 0 and not report.drop_ins
    assert any("no model given" in n for n in report.notes)


def test_activations_are_named_by_the_op_that_made_them_and_the_module_call():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    with torch_ctxext.advise(model) as report:
        h = model(torch.randn(2, 4))
        (h * h.exp()).sum().backward()  # h read by mul and exp
    (slot,) = [s for s in report.slots if s.kind == "activation"]
    assert slot.name == "TanhBackward0 in 1"
    assert sorted(p.op for p in slot.producers) == ["ExpBackward0", "MulBackward0"]


class Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.inner(x) * 2  # made by Outer, after inner returned


def test_an_op_after_a_submodule_returned_belongs_to_the_module_that_ran_it():
    model = Outer()
    with torch_ctxext.advise(model) as report:
        h = model(torch.randn(2, 4))
        (h * h.exp()).sum().backward()
    assert [s.name for s in report.slots if s.kind == "activation"] == ["MulBackward0 in Outer"]


class TurnsGradientsOff(torch.nn.Module):
    def forward(self, x):
        y = torch.tanh(x)  # made with gradients on
        torch.set_grad_enabled(False)  # and left off as it returns
        return y


class GradientsBackOn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = TurnsGradientsOff()

    def forward(self, x):
        y = self.inner(x)
        torch.set_grad_enabled(True)
        return y


def test_a_call_that_turns_gradients_off_before_it_returns_still_names_what_it_made():
    model = GradientsBackOn()
    with torch_ctxext.advise(model) as report:
        h = model(torch.randn(2, 4, requires_grad=True))
        (h * h.exp()).sum().backward()
    assert [s.name for s in report.slots if s.kind == "activation"] == ["TanhBackward0 in inner"]


def test_backward_with_inputs_counts_only_the_producers_that_run():
    w = torch.randn(3, requires_grad=True)
    v = torch.randn(3, requires_grad=True)
    with torch_ctxext.advise() as report:
        ((w * v).sum() + (w * 2).sum() + (v * 3).sum()).backward(inputs=[w])
    assert [(s.name, len(s.producers)) for s in report.slots] == [("leaf tensor [3]", 2)]


def test_autograd_grad_is_observed_too():
    w = torch.randn(3, requires_grad=True)
    with torch_ctxext.advise() as report:
        torch.autograd.grad((w * 2).sum() + w.sin().sum(), w)
    assert report.backwards == 1
    assert len(report.slots[0].producers) == 2


def test_several_backwards_in_one_block_add_up():
    w = torch.nn.Linear(3, 3)
    with torch_ctxext.advise(w) as report:
        for _ in range(2):
            sum(w(torch.randn(2, 3) * k).sum() for k in range(3)).backward()
    assert report.backwards == 2
    # the same three producers in both: listed once, their temporaries counted each time
    assert len(report["weight"].producers) == 3 and report["weight"].temporaries == 4


def test_a_block_over_several_steps_numbers_each_forwards_calls_from_one():
    layer = torch.nn.Linear(3, 3)
    with torch_ctxext.advise(layer) as report:
        for _ in range(3):
            sum(layer(torch.randn(2, 3)).sum() for _ in range(3)).backward()
    assert report.backwards == 3 and report["weight"].temporaries == 6
    assert sorted(p.module for p in report["weight"].producers) == ["Linear#1", "Linear#2", "Linear#3"]


def test_a_backward_of_a_forward_run_before_the_block_is_observed_without_module_calls():
    layer = torch.nn.Linear(3, 3)
    loss = sum(layer(torch.randn(2, 3)).sum() for _ in range(2))
    with torch_ctxext.advise(layer) as report:
        loss.backward()
    assert not report.failures and report.backwards == 1
    assert report["weight"].temporaries == 1
    assert [p.module for p in report["weight"].producers] == [None, None]  # no call of it was seen


def test_a_backward_without_a_slot_still_ends_its_forward_for_the_numbering_of_the_next():
    layer = torch.nn.Linear(3, 3)
    with torch_ctxext.advise(layer) as report:
        layer(torch.randn(2, 3)).sum().backward()  # one gradient each: no slot
        sum(layer(torch.randn(2, 3)).sum() for _ in range(2)).backward()
    assert report.backwards == 2
    assert sorted(p.module for p in report["weight"].producers) == ["Linear#1", "Linear#2"]


def test_a_block_kept_open_over_many_steps_reports_as_many_rows_as_one_step():
    cell = torch.nn.LSTMCell(4, 8)
    x = torch.randn(3, 2, 4)

    def step():
        h = c = torch.zeros(2, 8)
        for t in range(3):
            h, c = cell(x[t], (h, c))
        (h.sum() + c.sum()).backward()

    with torch_ctxext.advise(cell) as one:
        step()
    with torch_ctxext.advise(cell) as many:
        for _ in range(modules.KEPT_FORWARDS + 3):
            step()
    assert many.backwards == modules.KEPT_FORWARDS + 3
    assert [s.name for s in many.slots] == [s.name for s in one.slots]
    assert [len(s.producers) for s in many.slots] == [len(s.producers) for s in one.slots]
    assert many.temporary_bytes == many.backwards * one.temporary_bytes
    assert many.avoidable_bytes == many.backwards * one.avoidable_bytes
    do_this = str(many).splitlines()[3]
    assert f"over {many.backwards} backwards ({format_bytes(one.avoidable_bytes)} per backward)" in do_this, do_this
    assert str(one).splitlines()[3].endswith(f"saves {format_bytes(one.avoidable_bytes)} per step: 1 x FusedLSTMCell")


def test_a_backward_that_repeats_a_filed_one_is_filed_without_accounting_it_again(monkeypatch):
    """A training loop's steps repeat one graph and what reached it: the
    report files what the first step filed (its slots, savings and drop-ins
    scaled by the steps), accounting the slots once, block per step or not."""
    from torch_ctxext import _advise

    cell = torch.nn.LSTMCell(4, 8)
    x = torch.randn(3, 2, 4)

    def step():
        cell.zero_grad(set_to_none=True)
        h = c = torch.zeros(2, 8)
        for t in range(3):
            h, c = cell(x[t], (h, c))
        (h.sum() + c.sum()).backward()

    _advise._DESCRIBED.pop(id(cell), None)
    accounted = []
    account = _advise.account
    monkeypatch.setattr(_advise, "account", lambda *args: accounted.append(1) or account(*args))
    with torch_ctxext.advise(cell) as one:
        step()
    first = len(accounted)
    assert first > 0
    with torch_ctxext.advise(cell) as again:
        step()
    with torch_ctxext.advise(cell) as many:
        for _ in range(3):
            step()
    assert len(accounted) == first  # replayed, not accounted
    assert again.as_dict() == one.as_dict()
    d, o = many.as_dict(), one.as_dict()
    assert [s["name"] for s in d["slots"]] == [s["name"] for s in o["slots"]]
    for key in ("temporary_bytes", "avoidable_bytes"):
        assert d[key] == 3 * o[key] > 0
    assert [(x["module"], x["avoidable_bytes"]) for x in d["drop_ins"]] \
        == [(x["module"], 3 * x["avoidable_bytes"]) for x in o["drop_ins"]]
    assert [s["temporaries"] for s in d["slots"]] == [3 * s["temporaries"] for s in o["slots"]]



def test_a_block_whose_steps_alternate_two_graphs_reports_what_fresh_descriptions_would(monkeypatch):
    """Repeated backwards are filed when the report is next read (a step
    adds one entry), between graphs described afresh: the report is the one
    made with nothing kept."""
    from torch_ctxext import _advise

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
    x = torch.randn(2, 4)

    def step(uses):
        model.zero_grad(set_to_none=True)
        h = x
        for _ in range(uses):
            h = model(h)
        h.sum().backward()

    def block():
        with torch_ctxext.advise(model) as report:
            for uses in (2, 2, 3, 2, 3, 3, 2):
                step(uses)
        return report.as_dict()

    _advise._DESCRIBED.pop(id(model), None)
    kept = block()
    monkeypatch.setattr(_advise, "_DESCRIBED_PER_MODEL", 0)  # nothing kept: each described afresh
    _advise._DESCRIBED.clear()
    fresh = block()
    assert kept == fresh and kept["backwards"] == 7
    assert any(len(d["slots"]) > 1 for d in kept["drop_ins"]), kept["drop_ins"]

def test_a_failure_filing_a_backward_is_noted_and_never_raised_into_the_step(monkeypatch):
    from torch_ctxext import _advise

    def broken(*args):
        raise ValueError("boom")

    monkeypatch.setattr(_advise, "account", broken)
    w = torch.randn(3, requires_grad=True)
    with torch_ctxext.advise() as report:
        (w * 2 + w.sin()).sum().backward()
    assert torch.equal(w.grad, 2 + w.detach().cos())
    assert "a backward could not be fully observed: ValueError: boom" in report.notes


def test_a_block_kept_open_keeps_the_calls_of_its_last_forwards_only():
    layer = torch.nn.Linear(3, 3)
    with torch_ctxext.advise(layer) as report:
        calls = torch_ctxext._advise.engine._sessions[-1]._calls
        for _ in range(3 * modules.KEPT_FORWARDS):
            sum(layer(torch.randn(2, 3)).sum() for _ in range(2)).backward()
            assert sum(len(forward) for forward, *_ in calls._kept) <= 2 * modules.KEPT_FORWARDS
    assert sorted(p.module for p in report["weight"].producers) == ["Linear#1", "Linear#2"]


class GradientPenalty(torch.nn.Module):
    """A forward that runs a backward of its own: its call returns (and is
    filed) after the backward has filed the call it contains."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.inner(x)
        torch.autograd.grad(h.sum() + (h * 2).sum(), x, retain_graph=True)
        return h * 2 + h  # made by GradientPenalty, after inner returned; h read twice


def test_a_call_that_contains_a_backward_still_names_what_it_made():
    model = GradientPenalty()
    with torch_ctxext.advise(model) as report:
        y = model(torch.randn(2, 4, requires_grad=True))
        (y * y.exp()).sum().backward()
    assert report.backwards == 2
    assert sorted(s.name for s in report.slots if s.kind == "activation") == [
        "AddBackward0 in GradientPenalty", "AddmmBackward0 in inner"]


def test_create_graph_is_noted_and_saves_nothing():
    model = torch.nn.Linear(3, 3)
    with torch_ctxext.advise(model) as report:
        loss = sum(model(torch.randn(2, 3) * k).pow(2).sum() for k in range(2))
        torch.autograd.grad(loss, model.weight, create_graph=True)
    assert report.avoidable_bytes == 0
    assert any("create_graph=True" in n for n in report.notes)


def _a_step_advise_cannot_observe(monkeypatch):
    """(the report, the leaf) of a step whose backward advise() fails to describe."""
    def broken(*args, **kwargs):
        raise ValueError("boom")

    monkeypatch.setattr(graph.Backward, "__init__", broken)
    w = torch.randn(3, requires_grad=True)
    with torch_ctxext.advise() as report:
        (w * 2 + w.sin()).sum().backward()
    return report, w


def test_a_failure_to_observe_is_noted_and_never_raised_into_the_step(monkeypatch):
    report, w = _a_step_advise_cannot_observe(monkeypatch)
    assert w.grad is not None
    assert report.notes == ["no model given: advise(model) names parameters and modules and says "
                            "which drop-in would fuse each tensor",
                            "a backward could not be fully observed: ValueError: boom"]


def test_blocks_nest_and_the_last_to_exit_restores_torch():
    before = (torch.autograd._engine_run_backward, torch.autograd.graph._engine_run_backward,
              BackwardCFunction.__dict__["apply"], FunctionCtx.__dict__["input_grad_buffers"])
    w = torch.randn(3, requires_grad=True)
    with torch_ctxext.advise() as outer:
        with torch_ctxext.advise() as inner:
            (w * 2 + w.sin()).sum().backward()
        (w * 3 + w.cos()).sum().backward()
    assert (inner.backwards, outer.backwards) == (1, 2)
    after = (torch.autograd._engine_run_backward, torch.autograd.graph._engine_run_backward,
             BackwardCFunction.__dict__["apply"], FunctionCtx.__dict__["input_grad_buffers"])
    assert after == before


def test_nested_blocks_each_name_their_own_models_calls_and_the_last_unwraps_their_classes():
    first, second = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    stock = (torch.nn.Module.__dict__["__call__"], torch.nn.Module.__dict__["_call_impl"])
    assert "_call_impl" not in torch.nn.Linear.__dict__
    with torch_ctxext.advise(first) as outer:
        with torch_ctxext.advise(second) as inner:
            sum(first(second(torch.randn(2, 3) * k)).sum() for k in range(2)).backward()
        assert "_call_impl" in torch.nn.Linear.__dict__  # the outer block still times its calls
    assert "_call_impl" not in torch.nn.Linear.__dict__ and "__call__" not in torch.nn.Linear.__dict__
    assert (torch.nn.Module.__dict__["__call__"], torch.nn.Module.__dict__["_call_impl"]) == stock  # never touched
    assert sorted(p.module for p in inner["weight"].producers) == ["Linear#1", "Linear#2"]
    assert sorted(p.module for p in outer["weight"].producers) == ["Linear#1", "Linear#2"]


def test_a_call_that_raises_is_not_named_and_the_next_calls_are():
    class Failing(torch.nn.Module):
        def forward(self, x):
            x * 2  # a node made before the error
            raise ValueError("this forward fails")

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), Failing())
    with torch_ctxext.advise(model) as report:
        with pytest.raises(ValueError, match="this forward fails"):
            model(torch.randn(2, 3))
        sum(model[0](torch.randn(2, 3)).sum() for _ in range(2)).backward()
    assert sorted(p.module for p in report["0.weight"].producers) == ["0#2", "0#3"]


class OwnCall(torch.nn.Linear):
    def __call__(self, *args, **kwargs):  # as torch.compile's OptimizedModule has one
        return super().__call__(*args, **kwargs)


def test_a_module_whose_class_has_its_own_call_is_named_once_per_call():
    model = torch.nn.Sequential(OwnCall(3, 3), torch.nn.Linear(3, 3))
    with torch_ctxext.advise(model) as report:
        sum(model(torch.randn(2, 3)).sum() for _ in range(2)).backward()
    assert sorted(p.module for p in report["0.weight"].producers) == ["0#1", "0#2"]
    assert sorted(p.module for p in report["1.weight"].producers) == ["1#1", "1#2"]
    assert "_call_impl" not in torch.nn.Linear.__dict__ and not model[0]._forward_hooks


def test_a_patch_of_a_wrapped_call_made_inside_a_block_stays_after_it(monkeypatch):
    layer = torch.nn.Linear(3, 3)
    calls = []
    with torch_ctxext.advise(layer) as report:
        inside = torch.nn.Linear._call_impl

        def counting(self, *args, **kwargs):
            calls.append(type(self).__name__)
            return inside(self, *args, **kwargs)

        monkeypatch.setattr(torch.nn.Linear, "_call_impl", counting)
        sum(layer(torch.randn(2, 3)).sum() for _ in range(2)).backward()
    assert torch.nn.Linear._call_impl is counting
    layer(torch.randn(2, 3))  # the wrapper left under it passes the call through
    assert calls == ["Linear"] * 3
    assert sorted(p.module for p in report["weight"].producers) == ["Linear#1", "Linear#2"]
    monkeypatch.undo()  # the other patch taken off: the wrapper is back, passing calls through
    with torch_ctxext.advise(layer):
        pass
    assert "_call_impl" not in torch.nn.Linear.__dict__  # and the next block to exit takes it off


def test_a_class_given_a_call_of_its_own_between_two_blocks_is_left_alone_by_the_next(monkeypatch):
    layer = torch.nn.Linear(3, 3)
    with torch_ctxext.advise(layer):  # the model's view is read here, and kept
        sum(layer(torch.randn(2, 3)).sum() for _ in range(2)).backward()
    calls = []
    stock_call = torch.nn.Module.__call__

    def counting(self, *args, **kwargs):  # as a profiler patches a class
        calls.append(type(self).__name__)
        return stock_call(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Linear, "__call__", counting, raising=False)
    with torch_ctxext.advise(layer) as report:
        assert torch.nn.Linear.__call__ is counting  # not wrapped over: its modules get hooks
        sum(layer(torch.randn(2, 3)).sum() for _ in range(2)).backward()
    assert torch.nn.Linear.__call__ is counting and calls == ["Linear"] * 2
    assert sorted(p.module for p in report["weight"].producers) == ["Linear#1", "Linear#2"]


@pytest.mark.parametrize("patched", ["__call__", "_call_impl"])
def test_a_class_given_a_call_of_its_own_inside_the_model_is_timed_by_hooks(patched, monkeypatch):
    layer = torch.nn.Linear(3, 3)
    original = getattr(torch.nn.Module, patched)
    monkeypatch.setattr(torch.nn.Linear, patched, lambda self, *a, **k: original(self, *a, **k), raising=False)
    patch = torch.nn.Linear.__dict__[patched]
    with torch_ctxext.advise(layer) as report:
        assert torch.nn.Linear.__dict__[patched] is patch and layer._forward_hooks
        sum(layer(torch.randn(2, 3)).sum() for _ in range(2)).backward()
    assert torch.nn.Linear.__dict__[patched] is patch and not layer._forward_hooks
    assert sorted(p.module for p in report["weight"].producers) == ["Linear#1", "Linear#2"]


def test_a_module_compiled_in_place_is_named_once_per_call():
    if not torch._dynamo.is_dynamo_supported():
        pytest.skip("torch.compile does not run on this Python")
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    model[0].compile(backend="eager")  # its calls go to the compiled function, not to _call_impl
    with torch_ctxext.advise(model) as report:
        assert "__call__" in torch.nn.Linear.__dict__  # for the compiled module
        sum(model(torch.randn(2, 3)).sum() for _ in range(2)).backward()
    assert sorted(p.module for p in report["0.weight"].producers) == ["0#1", "0#2"]
    assert sorted(p.module for p in report["1.weight"].producers) == ["1#1", "1#2"]
    assert "__call__" not in torch.nn.Linear.__dict__ and "_call_impl" not in torch.nn.Linear.__dict__
    model[1].compile(backend="eager")  # between two blocks: the next reads the model afresh
    with torch_ctxext.advise(model) as report:
        sum(model(torch.randn(2, 3)).sum() for _ in range(2)).backward()
    assert sorted(p.module for p in report["1.weight"].producers) == ["1#1", "1#2"]


def test_a_module_given_a_call_impl_of_its_own_is_named_once_per_call():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    calls = []

    def own(*args, **kwargs):  # as a library patches one module
        calls.append("own")
        return torch.nn.Module._call_impl(model[0], *args, **kwargs)

    model[0]._call_impl = own
    with torch_ctxext.advise(model) as report:
        sum(model(torch.randn(2, 3)).sum() for _ in range(2)).backward()
    assert calls == ["own"] * 2
    assert sorted(p.module for p in report["0.weight"].producers) == ["0#1", "0#2"]
    assert sorted(p.module for p in report["1.weight"].producers) == ["1#1", "1#2"]


def test_bad_input_gets_a_clear_error():
    with pytest.raises(TypeError, match="model must be the torch.nn.Module"):
        torch_ctxext.advise(torch.randn(3))
    block = torch_ctxext.advise()
    with block:
        with pytest.raises(RuntimeError, match="already active"):
            block.__enter__()


class TwiceEmbedded(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 4)

    def forward(self, tokens):
        return self.head(self.emb(tokens)).sum() + self.emb(tokens).sum()


def _twice_embedded_step(model):
    with torch_ctxext.advise(model) as report:
        model(torch.tensor([[1, 2, 3]])).backward()
    return report.as_dict()


class OwnEmbedding(torch.nn.Embedding):
    pass


@pytest.fixture(params=["build", "python"])
def model_views(request, monkeypatch):
    """The model's view read with the build's C++ functions (where this
    torch has a build) or with their Python versions (a torch without one)."""
    if request.param == "python":
        monkeypatch.setattr(modules, "_build_functions",
                            lambda: (modules._python_structure, modules._python_calls_signature))
    elif modules._build_functions()[0] is modules._python_structure:
        pytest.skip("no build with advise()'s C++ watch for this torch")
    monkeypatch.setattr(modules, "_views", modules.ByModel())
    return request.param


@pytest.mark.parametrize("change", ["padding_idx", "replaced module", "fused", "renamed", "replaced parameter",
                                    "class changed"])
def test_a_described_graph_is_described_afresh_when_what_its_names_read_changed(change, model_views):
    model = TwiceEmbedded()
    before = _twice_embedded_step(model)
    assert _twice_embedded_step(model) == before
    if change == "padding_idx":
        model.emb.padding_idx = 0  # the same module: its drop-in's fused path now keeps a row
    elif change == "replaced module":
        model.emb = torch.nn.Embedding(10, 4, padding_idx=0)
    elif change == "fused":
        torch_ctxext.nn.fuse(model)
    elif change == "replaced parameter":  # the same modules: the view of the model reads its parameters too
        model.emb.weight = torch.nn.Parameter(torch.randn(10, 4))
    elif change == "class changed":
        model.emb.__class__ = OwnEmbedding
    else:
        model.embedding = model.emb
        del model.emb
        model.forward = lambda tokens: model.head(model.embedding(tokens)).sum() + model.embedding(tokens).sum()
    after = _twice_embedded_step(model)
    (slot,) = [s for s in after["slots"] if s["name"].endswith("weight") and "emb" in s["name"]]
    if change in ("padding_idx", "replaced module"):
        assert {p["residual_bytes"] for p in slot["producers"]} == {4 * 4}
        assert slot["avoidable_bytes"] == before["slots"][0]["avoidable_bytes"] - 4 * 4
    elif change == "fused":
        assert slot["avoided_bytes"] == before["slots"][0]["avoidable_bytes"] and not slot["avoidable_bytes"]
        assert {p["stock"] for p in slot["producers"]} == {"FusedEmbedding"}
    elif change == "replaced parameter":
        assert slot["name"] == "emb.weight" and slot["kind"] == "parameter"
        assert slot["avoidable_bytes"] == before["slots"][0]["avoidable_bytes"]
        return  # (nothing else differs)
    elif change == "class changed":
        assert {p["stock"] for p in slot["producers"]} == {"OwnEmbedding"}
    else:
        assert slot["name"] == "embedding.weight"
        assert {p["module"] for p in slot["producers"]} == {"embedding#1", "embedding#2"}
    assert after != before


def test_a_block_kept_open_over_a_graph_that_changes_every_step_stays_bounded():
    layer = torch.nn.Linear(3, 3)
    uses = [2 + step % 10 for step in range(30)]  # ten structures: more than a model's descriptions kept
    with torch_ctxext.advise(layer) as report:
        for n in uses:
            sum(layer(torch.randn(2, 3)).sum() for _ in range(n)).backward()
    weight = report["weight"]
    assert report.backwards == 30 and weight.temporaries == sum(n - 1 for n in uses)
    assert sorted(p.module for p in weight.producers) == sorted(f"Linear#{i}" for i in range(1, 12))
    assert len(weight.origins) <= 8


def test_the_descriptions_kept_for_reuse_keep_no_model_alive():
    import gc
    import weakref

    from torch_ctxext import _advise

    model = TwiceEmbedded()
    _twice_embedded_step(model)
    _twice_embedded_step(model)  # the second step reuses the kept description
    assert id(model) in _advise._DESCRIBED
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None
    other = TwiceEmbedded()
    _twice_embedded_step(other)  # a new model's lookup drops the dead one's entries
    assert all(ref() is not None for ref, _ in _advise._DESCRIBED.values())
    assert all(ref() is not None for ref, _ in modules._views.values())  # and its view


def test_a_block_per_step_replays_the_last_step_and_reads_the_model_once(model_views, monkeypatch):
    from torch_ctxext import _advise

    model = TwiceEmbedded()
    reads, keys = [], []
    monkeypatch.setattr(modules.ModelView, "__init__", _counting(modules.ModelView.__init__, reads))
    monkeypatch.setattr(_advise.Advise, "_key", _counting(_advise.Advise._key, keys))
    first = _twice_embedded_step(model)
    assert [_twice_embedded_step(model) for _ in range(3)] == [first] * 3
    assert (len(reads), len(keys)) == (1, 1)  # the later steps: by the view's signature, no key made
    model.head = torch.nn.Linear(4, 4)  # a new module: the view is read again, the step keyed again
    _twice_embedded_step(model)
    assert (len(reads), len(keys)) == (2, 2)


def _counting(function, calls):
    def counted(*args, **kwargs):
        calls.append(1)
        return function(*args, **kwargs)

    return counted


def test_a_block_places_the_custom_functions_watch_only_for_a_backward_that_runs_one():
    # Setting a method of BackwardCFunction or FunctionCtx invalidates the
    # method caches of every custom Function class the process has: a step
    # of built-in ops leaves them as they are; a custom Function, read once
    # and used once (no slot), is still seen.
    apply, getter = BackwardCFunction.__dict__["apply"], FunctionCtx.__dict__["input_grad_buffers"]
    model = torch.nn.Linear(3, 3)
    with torch_ctxext.advise(model) as report:
        sum(model(torch.randn(2, 3)).sum() for _ in range(2)).backward()
        assert BackwardCFunction.__dict__["apply"] is apply
        assert FunctionCtx.__dict__["input_grad_buffers"] is getter
        Unfused.apply(torch.randn(3, requires_grad=True)).sum().backward()
        assert BackwardCFunction.__dict__["apply"] is not apply
    assert BackwardCFunction.__dict__["apply"] is apply and FunctionCtx.__dict__["input_grad_buffers"] is getter
    assert report["weight"].temporaries == 1
    (stats,) = report.functions.values()
    assert stats.reads == 1


def test_a_backward_after_the_block_is_reported_as_none_observed_with_how_to_use_it():
    model = torch.nn.Linear(3, 3)
    x = torch.randn(2, 3)
    with torch_ctxext.advise(model) as report:
        loss = (model(x) + model(x)).sum()
    loss.backward()
    text = str(report)
    assert report.backwards == 0
    assert "nothing to do" not in text  # not a verdict on the model: nothing was measured
    assert text.splitlines()[0] == "torch_ctxext.advise: Linear: no backward ran inside this block, so it measured nothing"
    assert "        loss.backward()" in text  # the block, its backward inside
    assert report.notes == ["Linear ran inside the block but no backward did: a backward after the block "
                            "is not watched; call loss.backward() inside the `with` block"]
    assert report.as_dict()["notes"] == report.notes


def test_a_forward_under_no_grad_is_reported_as_no_graph_to_watch():
    model = torch.nn.Linear(3, 3)
    with torch_ctxext.advise(model) as report, torch.no_grad():
        model(torch.randn(2, 3)).sum()
    assert "nothing to do" not in str(report)
    assert "no backward ran inside this block" in str(report)
    (note,) = report.notes
    assert note.startswith("Linear ran inside the block with gradients off (torch.no_grad() or "
                           "torch.inference_mode()): it made no graph")


def test_a_block_that_ran_nothing_says_so_with_or_without_a_model():
    with torch_ctxext.advise(torch.nn.Linear(3, 3)) as report:
        pass
    assert report.notes == ["neither Linear nor a backward ran inside the block: run the training step, "
                            "call loss.backward() inside the `with` block"]
    with torch_ctxext.advise() as report:
        pass
    assert report.notes[-1] == "no backward ran inside the block: call loss.backward() inside the `with` block"
    assert "nothing to do" not in str(report)


def test_a_report_read_inside_its_block_before_the_backward_says_none_has_run_yet():
    model = torch.nn.Linear(3, 3)
    with torch_ctxext.advise(model) as report:
        before = str(report)
        model(torch.randn(2, 3)).sum().backward()
    assert before.splitlines()[0] == ("torch_ctxext.advise: Linear: no backward has run inside this block yet, "
                                      "so it has measured nothing")
    assert report.backwards == 1 and "0 backwards" not in str(report)


def test_a_backward_that_could_not_be_observed_is_not_reported_as_none_ran(monkeypatch):
    report, _ = _a_step_advise_cannot_observe(monkeypatch)
    assert str(report).splitlines()[0] == (
        "torch_ctxext.advise: no backward inside this block could be observed (the notes say why)")
    assert report.notes[-1] == "a backward could not be fully observed: ValueError: boom"


def test_advise_printed_without_entering_it_says_how_to_use_it():
    model = torch.nn.Linear(3, 3)
    for shown in (str(torch_ctxext.advise(model)), repr(torch_ctxext.advise(model))):
        assert shown.splitlines()[0] == "torch_ctxext.advise(Linear) watches nothing until used as a `with` block"
        assert "    with torch_ctxext.advise(model) as report:" in shown
        assert "        loss.backward()" in shown  # inside the block
    assert str(torch_ctxext.advise()).startswith("torch_ctxext.advise() watches nothing until used")


def test_advise_entered_prints_its_report():
    model = torch.nn.Linear(3, 3)
    block = torch_ctxext.advise(model)
    with block as report:
        model(torch.randn(2, 3)).sum().backward()
    assert str(block) == str(report) and repr(block) == repr(report)
