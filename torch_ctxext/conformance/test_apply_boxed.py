"""Conformance: ``BackwardCFunction.apply_boxed`` and ``Function.boxed_grads_call``.

Contract text: docstrings of ``BackwardCFunction.apply_boxed`` and of the
``boxed_grads_call`` attribute in torch 2.15's ``torch/autograd/function.py``,
and the "Boxed grads" section of the upstream 2.15 reference notes.
"""

import weakref

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.autograd import Function

try:
    from ._helpers import (
        HAS_BOXED_GRADS, fanout, fanout_input_grad, float_dtypes, make_tensor,
        once_differentiable_square, record_calls, seeds, tensor_specs,
    )
except ImportError:
    from _helpers import (
        HAS_BOXED_GRADS, fanout, fanout_input_grad, float_dtypes, make_tensor,
        once_differentiable_square, record_calls, seeds, tensor_specs,
    )

pytestmark = pytest.mark.skipif(not HAS_BOXED_GRADS, reason="this torch has no boxed grads call")


def _loss_with_fresh_grads(outs, weights):
    """Each output's gradient is produced by a MulBackward node: a fresh
    tensor that nobody but the engine (and then the boxed list) owns."""
    return sum((o * w).sum() for o, w in zip(outs, weights))


def _backward_with_fresh_grads(fn, n, shape, dtype, seed):
    """Backward through the fanout ``fn`` from random weights of its n outputs
    (_loss_with_fresh_grads); x's gradient must be exact. Returns the weights."""
    x = make_tensor(shape, dtype, seed, requires_grad=True)
    weights = [make_tensor(shape, dtype, seed + 1 + i) for i in range(n)]
    _loss_with_fresh_grads(fn.apply(x), weights).backward()
    torch.testing.assert_close(x.grad, fanout_input_grad(weights))
    return weights


@settings(deadline=None)
@given(spec=tensor_specs(), n=st.integers(min_value=1, max_value=3))
def test_engine_calls_apply_boxed_when_boxed_grads_call_is_true(spec, n):
    """Apply method called by the autograd engine when boxed_grads_call is True."""
    shape, dtype, seed = spec
    calls = []
    fn = fanout(n, fanout_input_grad, boxed=True)
    record_calls(fn._backward_cls, "apply", calls)
    record_calls(fn._backward_cls, "apply_boxed", calls)
    x = make_tensor(shape, dtype, seed, requires_grad=True)
    outs = fn.apply(x)
    sum(o.sum() for o in outs).backward()
    assert [name for name, _ in calls] == ["apply_boxed"]
    (args,) = [args for _, args in calls]
    assert len(args) == 1 and type(args[0]) is list
    torch.testing.assert_close(x.grad, torch.full_like(x, sum(range(1, n + 1))).detach())


@settings(deadline=None)
@given(spec=tensor_specs(), n=st.integers(min_value=1, max_value=4))
def test_boxed_backward_receives_a_single_list_instead_of_individual_grads(spec, n):
    """When True, ``backward(ctx, grads)`` receives a single list instead of ``backward(ctx, *grads)``."""
    shape, dtype, seed = spec
    seen = {}

    def body(*args):
        seen["args"] = args
        (grads,) = args
        seen["copy"] = list(grads)
        return sum(g * (i + 1) for i, g in enumerate(grads))

    weights = _backward_with_fresh_grads(fanout(n, body, boxed=True), n, shape, dtype, seed)
    args = seen["args"]
    assert len(args) == 1 and type(args[0]) is list
    assert len(seen["copy"]) == n
    for g, w in zip(seen["copy"], weights):
        torch.testing.assert_close(g, w)  # grads in output order


@settings(deadline=None)
@given(
    data=st.data(),
    n=st.integers(min_value=1, max_value=4),
    dtype=float_dtypes,
    seed=seeds,
)
def test_apply_boxed_receives_one_list_whose_removed_entries_are_freed_before_backward_returns(data, n, dtype, seed):
    """Grads arrive as a single mutable list argument, allowing backward to free individual grads mid-execution."""
    remove = data.draw(st.lists(st.booleans(), min_size=n, max_size=n).filter(any))
    shape = data.draw(st.sampled_from([(), (3,), (2, 2)]))
    report = {}

    def body(grads):
        assert type(grads) is list and len(grads) == n
        refs = [weakref.ref(g) for g in grads]
        total = sum(g * (i + 1) for i, g in enumerate(grads))
        for i in reversed(range(n)):
            if remove[i]:
                del grads[i]
        # Still inside backward: removed grads must already be gone.
        report["alive"] = [r() is not None for r in refs]
        return total

    _backward_with_fresh_grads(fanout(n, body, boxed=True), n, shape, dtype, seed)
    assert report["alive"] == [not r for r in remove]


@settings(deadline=None)
@given(spec=tensor_specs(), n=st.integers(min_value=1, max_value=4))
def test_clearing_the_boxed_list_frees_every_grad_while_backward_runs(spec, n):
    """(Reference, "Boxed grads") the engine calls ``apply_boxed`` with one mutable ``list`` of grads, which holds the only references, so ``grads.clear()`` ... frees them while the backward is still running."""
    shape, dtype, seed = spec
    report = {}

    def body(grads):
        refs = [weakref.ref(g) for g in grads]
        total = sum(g * (i + 1) for i, g in enumerate(grads))
        grads.clear()
        report["alive"] = [r() is not None for r in refs]
        return total

    _backward_with_fresh_grads(fanout(n, body, boxed=True), n, shape, dtype, seed)
    assert report["alive"] == [False] * n


@settings(deadline=None)
@given(spec=tensor_specs(), n=st.integers(min_value=1, max_value=4))
def test_boxed_grads_call_defaults_to_false(spec, n):
    """Bool that specifies if backward should receive grads as a single mutable list argument instead of individual args in an immutable tuple. ... Default is False."""
    shape, dtype, seed = spec
    assert Function.boxed_grads_call is False
    seen = {}
    calls = []

    def backward(*grads):
        seen["grads"] = grads
        return fanout_input_grad(grads)

    Plain = fanout(n, backward)
    assert Plain.boxed_grads_call is False
    record_calls(Plain._backward_cls, "apply_boxed", calls)
    x = make_tensor(shape, dtype, seed, requires_grad=True)
    sum(o.sum() for o in Plain.apply(x)).backward()
    assert calls == []
    grads = seen["grads"]
    assert type(grads) is tuple and len(grads) == n
    assert all(isinstance(g, torch.Tensor) for g in grads)


@pytest.mark.xfail(
    strict=True,
    reason=(
        "torch 2.6 to 2.15: once_differentiable only arms its double-backward error when "
        "one of backward's arguments is a tensor requiring grad; with boxed_grads_call the "
        "only argument is a list, so the gradient silently comes back non-differentiable "
        "and double backward drops this Function's contribution instead of raising"
    ),
)
def test_once_differentiable_makes_double_backward_raise_with_boxed_grads():
    """(save_for_backward) Custom Functions that do not support double backward should decorate their :func:`backward` method with ``@once_differentiable`` so that performing double backward raises an error."""
    x = torch.tensor([1.0, 2.0], requires_grad=True, dtype=torch.double)
    y = once_differentiable_square(boxed=True).apply(x)
    (gx,) = torch.autograd.grad((y**2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        (gx.sum() + (x * x).sum()).backward()


class _Identity(Function):
    """A boxed identity: backward returns the one grad it receives, and
    records the list it was given."""

    boxed_grads_call = True
    received = []

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grads):
        _Identity.received.append(list(grads))
        (g,) = grads
        return g


def test_each_engine_call_hands_its_own_grads_to_backward_from_several_threads():
    """Threads running backward through one retained graph at once (which
    autograd supports) each receive, boxed, the grads of their own call."""
    import threading

    x = torch.zeros(3, requires_grad=True)
    out = _Identity.apply(x)
    errors = []
    barrier = threading.Barrier(8)

    def run(index):
        try:
            barrier.wait()
            for step in range(100):
                g = torch.full((3,), float(index * 1000 + step), device=x.device)
                (grad_x,) = torch.autograd.grad(out, x, g, retain_graph=True)
                if not torch.equal(grad_x, g):
                    errors.append((index, step, grad_x.tolist()))
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    assert errors == []


def test_a_direct_grad_fn_apply_boxes_exactly_the_grads_it_is_given():
    """grad_fn.apply(*grads) called directly boxes its own grads, also after
    engine calls through the same node."""
    x = torch.zeros(2, requires_grad=True)
    out = _Identity.apply(x)
    out.backward(torch.ones(2), retain_graph=True)
    _Identity.received.clear()
    given = torch.tensor([5.0, 6.0])
    result = out.grad_fn.apply(given)
    assert len(_Identity.received) == 1 and len(_Identity.received[0]) == 1
    assert _Identity.received[0][0] is given
    assert torch.equal(result, given)


def test_boxed_grads_call_is_refused_under_compiled_autograd():
    """Compiled autograd calls backward with bare grads: a boxed Function is
    refused with torch's error rather than handed a tensor for its list."""
    from torch._dynamo import compiled_autograd

    x = torch.zeros(2, requires_grad=True)
    out = _Identity.apply(x)
    with pytest.raises(RuntimeError, match="boxed_grads_call=True on _Identity is not supported with compiled autograd"):
        with compiled_autograd._enable(torch.compile(backend="eager")):
            out.sum().backward()
