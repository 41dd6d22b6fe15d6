"""advise()'s watch through torch_ctxext's extension (csrc/advise_watch.cpp):
its walk finds the slots and producers Python's walk finds, in the same
order; its C++ hooks see what Python's hooks see, so the report is the same
either way; where it cannot watch (compiled autograd) Python's hooks do, and
a hook the engine never called is said, never raised into the step; a
finished watch sees nothing more.

The watch is torch_ctxext's extension's on torch 2.6 to 2.14, and on a torch
that provides every member itself (2.15) the build made for it alone, which
only advise() loads (torch_ctxext/_ext/advise_module.py): these tests skip
only where neither is there (2.15 without that build: `python -m torch_ctxext
build` makes it), and test_advise*.py check the Python watch everywhere.
"""

import pytest
import torch
from torch.autograd.function import BackwardCFunction

import torch_ctxext
from torch_ctxext._advise import graph
from torch_ctxext._ext import advise_module
from doubling_functions import doubling, fuse_into_buffer

from where_fusing_pays import MODELS

_C = graph._extension() or advise_module.load()
pytestmark = pytest.mark.skipif(
    getattr(_C, "advise_watch", None) is None,
    reason=f"no C++ watch: torch_ctxext's extension (torch 2.6 to 2.14) is not loaded, and advise()'s "
           f"own build is not there ({advise_module.choice})")

Fused = doubling(fuse_into_buffer)


def leaf(*shape):
    return torch.randn(*shape, requires_grad=True)


def graph_of_model(name, fused=False):
    workload = MODELS[name]()
    if fused:
        torch_ctxext.nn.fuse(workload.model)
    return [workload.loss()], []


def two_roots():
    """Two outputs whose graphs share a leaf and an activation."""
    w = leaf(3)
    h = w.sin()
    return [(h * 2).sum(), (h * w).sum()], []


def with_inputs():
    """backward(inputs=[w]): v's producers do not run."""
    w, v = leaf(3), leaf(3)
    return [(w * v).sum() + (w * 2).sum() + (v * 3).sum()], [w]


def custom_function_producers():
    """A custom Function and a built-in op feed one slot."""
    x = leaf(4)
    return [Fused.apply(x).sum() + x.sin().sum() + Fused.apply(x).sum()], []


def a_root_that_is_a_slot():
    """A root gradient and a later node both feed the root's node."""
    w = leaf(3)
    y = w * 2
    return [y, y.sum()], []


GRAPHS = {
    **{f"{name}{'-fused' if fused else ''}": (lambda name=name, fused=fused: graph_of_model(name, fused))
       for name in MODELS for fused in (False, True)},
    "two roots": two_roots,
    "inputs=": with_inputs,
    "custom Function producers": custom_function_producers,
    "a root that is a slot": a_root_that_is_a_slot,
}


def edges(tensors):
    return [graph._edge(t) for t in tensors]


@pytest.mark.parametrize("make", GRAPHS.values(), ids=GRAPHS.keys())
def test_the_watchs_shape_of_a_backward_is_the_one_python_makes_of_its_slots(make):
    """The walk shapes the slots (advise()'s key to a graph it described) as
    graph._shape does from Python's walk; where a custom Function produces,
    it leaves that to Python (which names the Function)."""
    roots, inputs = make()
    found, _ = graph._python_slots(edges(roots), edges(inputs))
    expected = graph._shape([graph.Slot.walked(i, *slot) for i, slot in enumerate(found)])
    watch = _C.advise_watch(edges(roots), edges(inputs), graph.CROSSING)
    try:
        if any(slot.functions for slot in watch.slots):
            assert watch.shape is None
            assert graph._shape([graph.Slot.native(i, s) for i, s in enumerate(watch.slots)]) == expected
        else:
            assert watch.shape == expected and expected[1]
            assert graph._shape(watch.slots) == expected
    finally:
        watch.finish()


@pytest.mark.parametrize("make", GRAPHS.values(), ids=GRAPHS.keys())
def test_the_extensions_walk_finds_the_slots_and_producers_pythons_walk_finds_in_the_same_order(make):
    roots, inputs = make()
    found, _ = graph._python_slots(edges(roots), edges(inputs))
    expected = [graph.Slot.walked(i, *slot) for i, slot in enumerate(found)]
    watch = _C.advise_watch(edges(roots), edges(inputs), graph.CROSSING)
    try:
        native = [graph.Slot.native(i, slot) for i, slot in enumerate(watch.slots)]
        assert len(native) == len(expected) > 0
        for slot, n in zip(expected, native):
            assert n.consumer is slot.consumer and n.nr == slot.nr
            # the consumer's op and number, its leaf, the gradient's size by its metadata
            assert (n.op, n.seq, n.leaf, n.grad_bytes) == (slot.op, slot.seq, slot.leaf, slot.grad_bytes)
            assert n.grad_bytes is not None
            # op, number and output index of each producer; a custom Function's ctx itself
            assert [(op, seq, pos) for op, seq, _, pos in n.producers] \
                == [(op, seq, pos) for op, seq, _, pos in slot.producers]
            assert [node for _, _, node, _ in n.producers] \
                == [node if isinstance(node, BackwardCFunction) else None for _, _, node, _ in slot.producers]
    finally:
        watch.finish()


@pytest.mark.parametrize("make", GRAPHS.values(), ids=GRAPHS.keys())
def test_a_repeated_graphs_leaves_and_outcome_read_without_the_slots_view_are_what_its_slots_say(make):
    """A training loop's repeated step is known by its shape, its leaves and
    what reached its slots; the watch gives those without making its Python
    view of the slots (graph.Found, graph.Producer), and they are the ones
    read from that view once it is made."""
    roots, inputs = make()
    grads = [torch.ones_like(r) for r in roots]
    record = graph.Backward(roots, grads, inputs, False, shaped=True)
    try:
        torch.autograd.backward(roots, grads, inputs=inputs or None)
        record.finish()
        lazy = record.native.functions == 0  # a custom Function producer: the view was made at once
        leaves, outcome = record.leaves(), record.outcome()
        assert (record._slots is None) == lazy  # reading them made no view
        from_view = [s.leaf for s in record.slots if s.leaf is not None]
        assert len(leaves) == len(from_view) and all(a is b for a, b in zip(leaves, from_view))
        assert outcome == record.outcome() and hash(outcome) == hash(record.outcome())
        assert any(arrivals for arrivals, _, _ in outcome)
    finally:
        record.release()


def test_a_graph_of_one_shape_that_saw_something_else_has_another_outcome():
    """The outcome of a repeated graph is what reached its slots this time:
    the same shape with a root gradient that arrives, then one that does
    not, then one that does again."""
    def outcome(root_arrives):
        w = leaf(3)
        y = w * 2
        roots, grads = [y, y.sum()], [torch.ones(3), torch.ones(())]
        record = graph.Backward(roots, grads if root_arrives else None, [], False, shaped=True)
        try:
            torch.autograd.backward(roots, grads)
            record.finish()
            assert record._slots is None  # read from the watch, not from its view
            return record.shape, record.outcome()
        finally:
            record.release()

    (shape, arrived), (same_shape, nothing), (_, again) = outcome(True), outcome(False), outcome(True)
    assert shape == same_shape and arrived != nothing and again == arrived
    assert [kind for _, kind, _, _ in arrived[0][0]] == [graph.GRADIENT, graph.GRADIENT]
    assert [kind for _, kind, _, _ in nothing[0][0]] == [graph.NOTHING, graph.GRADIENT]


def report(step, model=None, python_watch=False, monkeypatch=None):
    if python_watch:
        monkeypatch.setattr(graph, "_native_watch", lambda *args: (None, False))
    seen = []
    original = graph.Backward.finish

    def finish(self):
        seen.append(self.native is not None)
        return original(self)

    monkeypatch.setattr(graph.Backward, "finish", finish)
    with torch_ctxext.advise(model) as r:
        step()
    monkeypatch.undo()
    assert seen and all(s is not python_watch for s in seen)  # watched the way asked
    return r.as_dict()


def model_step(name, fused=False):
    workload = MODELS[name]()
    if fused:
        torch_ctxext.nn.fuse(workload.model)
    return workload.model, lambda: workload.loss().backward()


def plain_step(make):
    def step():
        roots, inputs = make()
        grads = [torch.ones_like(r) for r in roots]
        torch.autograd.backward(roots, grads, inputs=inputs or None)

    return None, step


STEPS = {
    **{f"{name}{'-fused' if fused else ''}": (lambda name=name, fused=fused: model_step(name, fused))
       for name in MODELS for fused in (False, True)},
    **{name: (lambda make=make: plain_step(make))
       for name, make in GRAPHS.items() if name in ("two roots", "inputs=", "custom Function producers",
                                                     "a root that is a slot")},
}


@pytest.mark.parametrize("make", STEPS.values(), ids=STEPS.keys())
def test_the_report_is_the_same_whether_the_extensions_hooks_or_pythons_watch_the_step(make, monkeypatch):
    torch.manual_seed(0)
    model, step = make()
    through_python = report(step, model, python_watch=True, monkeypatch=monkeypatch)
    through_extension = report(step, model, monkeypatch=monkeypatch)
    assert through_extension == through_python
    assert through_extension["slots"]


def compiled_autograd():
    from torch._dynamo import compiled_autograd

    return compiled_autograd._enable(torch.compile(backend="eager"))


def linear_step():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)

    def step():
        model.zero_grad(set_to_none=True)
        sum(model(x * k).sum() for k in range(3)).backward()

    return model, step


def test_under_compiled_autograd_pythons_hooks_watch_and_the_report_is_eagers(monkeypatch):
    model, step = linear_step()
    eager = report(step, model, monkeypatch=monkeypatch)
    eager_grad = model.weight.grad.clone()
    with compiled_autograd():
        compiled = report(step, model, python_watch=True, monkeypatch=monkeypatch)
        # and without being told: advise sees that compiled autograd is on
        with torch_ctxext.advise(model) as r:
            step()
    assert compiled == eager == r.as_dict()
    assert torch.equal(model.weight.grad, eager_grad)


def test_a_hook_compiled_autograd_never_calls_is_said_and_never_raised_into_the_step(monkeypatch):
    model, step = linear_step()
    step()
    eager_grad = model.weight.grad.clone()
    monkeypatch.setattr(graph, "_compiled_autograd_on", lambda: False)  # as if the check missed it
    with compiled_autograd():
        with torch_ctxext.advise(model) as r:
            step()
    assert torch.equal(model.weight.grad, eager_grad)
    assert any("compiled autograd, which calls no C++ hook" in n for n in r.notes), r.notes


def test_a_finished_watch_sees_nothing_more_and_a_new_watch_on_a_retained_graph_sees_each_gradient_once():
    w = leaf(3)
    loss = (w * 2).sum() + w.sin().sum()
    first = _C.advise_watch(edges([loss]), [], graph.CROSSING)
    loss.backward(retain_graph=True)
    first.finish()
    seen = first.results()
    assert [len(arrivals) for arrivals, *_ in seen] == [2]
    loss.backward(retain_graph=True)  # its hooks are still on the nodes, disarmed
    assert first.results() == seen
    second = _C.advise_watch(edges([loss]), [], graph.CROSSING)
    loss.backward()
    second.finish()
    assert [[kind for _, kind, _, _ in arrivals] for arrivals, *_ in second.results()] == [[1, 1]]
    assert first.results() == seen


def test_bad_input_gets_a_clear_error():
    w = leaf(3)
    loss = (w * 2).sum() + w.sin().sum()
    with pytest.raises(TypeError, match="not an autograd node"):
        _C.advise_watch([(object(), 0)], [], graph.CROSSING)
    watch = _C.advise_watch(edges([loss]), [], graph.CROSSING)
    try:
        with pytest.raises(IndexError, match="no such slot"):
            watch.arrive(5, 0, None)
        with pytest.raises(TypeError, match="must be a Tensor or None"):
            watch.arrive(0, 0, "a gradient")
    finally:
        watch.finish()
    loss.backward()
    assert torch.equal(w.grad, 2 + w.detach().cos())


def test_a_watch_that_fails_to_start_leaves_the_step_right_and_the_next_watch_sees_each_gradient_once(monkeypatch):
    w = leaf(3)
    loss = (w * 2).sum() + w.sin().sum()

    def broken(self, *args, **kwargs):
        raise RuntimeError("boom")

    with monkeypatch.context() as m:  # fails after the extension placed its hooks
        m.setattr(graph.Backward, "_watch", broken)
        with torch_ctxext.advise() as failed:
            loss.backward(retain_graph=True)
    assert any("RuntimeError: boom" in n for n in failed.notes), failed.notes
    assert torch.equal(w.grad, 2 + w.detach().cos())
    w.grad = None
    with torch_ctxext.advise() as r:
        loss.backward()
    assert torch.equal(w.grad, 2 + w.detach().cos())
    (slot,) = r.slots
    assert (len(slot.producers), slot.temporaries) == (2, 1)


def test_what_crosses_from_the_watch_is_named_and_its_kinds_are_pythons():
    """Slots, producers, outcomes and arrivals come as graph's named tuples,
    each kind as the crossing names it (the numbering is Python's alone)."""
    x = leaf(4)
    loss = Fused.apply(x).sum() + x.sin().sum() + (x * 2).sum()
    grad = torch.ones(())

    class Renumbered(graph.CROSSING):
        NOTHING, GRADIENT, FUSED = "nothing", "gradient", "fused"

    watch = _C.advise_watch(edges([loss]), [], Renumbered, grad_tensors=[grad])
    try:
        (found,) = watch.slots
        assert isinstance(found, graph.Found) and found.op.endswith("AccumulateGrad")  # x's
        assert found.seq is None and found.grad_bytes == 16 and found.functions == 1
        assert all(isinstance(p, graph.Producer) for p in found.producers)
        # the custom Function's is named by Python (its op None), the built-in ones by the watch
        function = [p.op is None and isinstance(p.node, BackwardCFunction) for p in found.producers]
        assert sorted(function) == [False, False, True]
        built_in = [i for i, f in enumerate(function) if not f]
        loss.backward(grad)
    finally:
        watch.finish()
    (outcome,) = watch.results()
    assert isinstance(outcome, graph.Outcome) and outcome.given and outcome.first_bytes == 16
    assert all(isinstance(a, graph.Arrival) for a in outcome.arrivals)
    # the built-in producers' arrivals (the custom Function's: engine.py's apply wrapper)
    assert sorted((a.producer, a.kind, a.bytes) for a in outcome.arrivals) \
        == [(i, "gradient", 16) for i in built_in]


def test_a_root_gradient_arrives_in_its_slot_before_any_node_runs():
    w = leaf(3)
    y = w * 2
    root = torch.full((3,), 3.0)
    watch = _C.advise_watch(edges([y, y.sum()]), [], graph.CROSSING, grad_tensors=[root, torch.ones(())])
    try:
        (outcome,) = watch.results()  # before the backward
        assert [(a.producer, a.kind, a.bytes) for a in outcome.arrivals] == [(0, graph.GRADIENT, 12)]
        assert outcome.first_address == root.data_ptr()
    finally:
        watch.finish()


def test_a_crossing_of_another_shape_is_refused():
    class Short(graph.CROSSING):
        from collections import namedtuple

        Arrival = namedtuple("Arrival", "producer kind bytes")

    w = leaf(3)
    loss = (w * 2).sum() + w.sin().sum()
    with pytest.raises(TypeError, match="Arrival must be a named tuple of 4 fields"):
        _C.advise_watch(edges([loss]), [], Short)

