"""Conformance of ``ctx.input_grad_buffers`` (FunctionCtx property).

Each test is named after the sentence of the contract (the property's
docstring, torch 2.15) or of the reference behaviour it checks.
"""
import threading

import pytest
import torch
from expecttest import assert_expected_inline
from hypothesis import given, strategies as st
from torch.autograd import Function
from torch.autograd.function import once_differentiable

try:
    from . import _device
except ImportError:  # run as plain files
    import _device


def make_scale(record, fuse=True, backward_hook=None):
    """A Function computing x * w (elementwise) whose backward records the
    entries it sees and, where fuse is set, accumulates grad_x into the buffer."""

    class Scale(Function):
        @staticmethod
        def forward(ctx, x, w, *extra):
            ctx.save_for_backward(x, w)
            return x * w

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            buffers = ctx.input_grad_buffers
            record.append(tuple(None if b is None else b.clone() for b in buffers))
            if backward_hook is not None:
                backward_hook(ctx, buffers)
            grads = []
            for buffer, grad in ((buffers[0], g * w), (buffers[1], g * x)):
                if fuse and buffer is not None:
                    buffer.add_(grad)
                    grads.append(None)
                else:
                    grads.append(grad)
            return (*grads, *([None] * (len(buffers) - 2)))

    return Scale


def leaf(*values, dtype=torch.float32):
    # On the suite's device explicitly: a backward runs on the device's engine
    # thread, where the default device of the test's thread does not apply.
    return torch.tensor(values, dtype=dtype, requires_grad=True, device=_device.selected())


def exposed(entries):
    return [entry is not None for entry in entries]


# --- Each entry corresponds to an argument passed to forward, in order ------


def test_each_entry_corresponds_to_an_argument_passed_to_forward_in_the_same_order():
    """Each entry corresponds to an argument passed to forward(), in the same order."""
    record = []
    Scale = make_scale(record)
    x, w = leaf(1.0, 2.0), leaf(3.0, 4.0)
    y = Scale.apply(x, w, 7, "not a tensor", None)
    ((x * 2).sum() + (w * 5).sum() + y.sum()).backward()
    (entries,) = record
    assert len(entries) == 5
    assert exposed(entries) == [True, True, False, False, False]
    torch.testing.assert_close(entries[0], torch.tensor([2.0, 2.0]))
    torch.testing.assert_close(entries[1], torch.tensor([5.0, 5.0]))


def test_defaults_not_passed_to_an_old_style_forward_are_not_counted():
    """One entry per argument actually passed (defaults not passed do not count)."""
    seen = []

    class WithDefault(Function):
        @staticmethod
        def forward(ctx, x, scale=2.0):
            return x * scale

        @staticmethod
        def backward(ctx, g):
            seen.append(len(ctx.input_grad_buffers))
            return g * 2.0, None

    x = leaf(1.0)
    WithDefault.apply(x).sum().backward()
    assert seen == [1]


# --- A non-None buffer holds the contributions already produced -------------


def test_a_non_none_buffer_contains_gradient_contributions_already_produced():
    """A non-None buffer contains gradient contributions already produced during
    the current backward."""
    record = []
    Scale = make_scale(record)
    x, w = leaf(1.0, 2.0), leaf(3.0, 4.0)
    y = Scale.apply(x, w)
    (y.sum() + (x * torch.tensor([10.0, 20.0])).sum()).backward()
    torch.testing.assert_close(record[0][0], torch.tensor([10.0, 20.0]))


def test_accumulating_into_the_buffer_and_returning_none_gives_the_unfused_gradient():
    """A custom backward may accumulate its contribution directly into the buffer
    and return None for that input."""
    for fuse in (True, False):
        record = []
        Scale = make_scale(record, fuse=fuse)
        x, w = leaf(1.0, 2.0), leaf(3.0, 4.0)
        y = Scale.apply(x, w)
        (y.sum() + x.exp().sum() + (w * w).sum()).backward()
        assert exposed(record[0]) == [True, True]
        torch.testing.assert_close(x.grad, torch.tensor([3.0, 4.0]) + x.detach().exp())
        torch.testing.assert_close(w.grad, torch.tensor([1.0, 2.0]) + 2 * w.detach())


# --- Availability follows backward execution order --------------------------


def test_entry_is_none_when_no_earlier_producer_has_contributed():
    """An entry is None when no earlier producer has contributed to that input
    (the other consumer was created before the Function, so it runs after it)."""
    record = []
    Scale = make_scale(record)
    x, w = leaf(1.0, 2.0), leaf(3.0, 4.0)
    other = (x * 3).sum()  # created first: runs last
    (other + Scale.apply(x, w).sum()).backward()
    assert exposed(record[0]) == [False, False]
    torch.testing.assert_close(x.grad, torch.tensor([6.0, 7.0]))


@pytest.mark.parametrize("leaf_input", [True, False], ids=["leaf", "non-leaf"])
def test_availability_follows_backward_execution_order(leaf_input):
    """Availability follows backward execution order and is independent for each input."""
    record = []
    Scale = make_scale(record)
    a, w = leaf(1.0, 2.0), leaf(3.0, 4.0)
    x = a if leaf_input else a * 1.0
    y = Scale.apply(x, w)
    later = (x * 5).sum()  # created after: runs first, fills x's buffer
    (y.sum() + later).backward()
    assert exposed(record[0]) == [True, False]
    torch.testing.assert_close(a.grad, torch.tensor([8.0, 9.0]))


# --- None when the buffer is aliased or cannot be updated in place ----------


def test_entry_is_none_when_the_gradient_is_aliased_by_another_buffer():
    """An entry is None when the existing buffer is aliased: add passes the same
    gradient tensor to both of its inputs."""
    record = []
    Scale = make_scale(record)
    x, w = leaf(1.0, 2.0), leaf(3.0, 4.0)
    v = w * 1.0
    y = Scale.apply(x, w)
    ((x + v) * 3).sum().add(y.sum()).backward()
    assert record[0][0] is None
    torch.testing.assert_close(x.grad, torch.tensor([6.0, 7.0]))


@pytest.mark.parametrize(
    "producer",
    [
        pytest.param(lambda x: x.sum(), id="sum-expanded"),
        pytest.param(
            lambda x: torch.stack([x, torch.ones(2, requires_grad=True)]).sum(),
            id="stack-view",
        ),
        pytest.param(lambda x: x.view(1, 2).t().sum(), id="view-grad"),
    ],
)
def test_entry_is_none_when_the_buffer_cannot_safely_be_updated_in_place(producer):
    """An entry is None when the existing buffer cannot safely be updated in place
    (expanded, or a view of a shared storage)."""
    record = []
    Scale = make_scale(record)
    x, w = leaf(1.0, 2.0), leaf(3.0, 4.0)
    y = Scale.apply(x, w)
    (y.sum() + producer(x)).backward()
    assert record[0][0] is None


def test_entry_is_none_for_a_root_gradient_given_by_the_caller():
    """A root gradient the caller still holds is aliased: never exposed."""
    record = []
    Scale = make_scale(record)
    a, w = leaf(1.0, 2.0), leaf(3.0, 4.0)
    x = a * 1.0
    y = Scale.apply(x, w)
    gx = torch.tensor([10.0, 20.0])
    torch.autograd.backward([y, x], [torch.ones(2), gx])
    assert record[0][0] is None
    torch.testing.assert_close(gx, torch.tensor([10.0, 20.0]))
    torch.testing.assert_close(a.grad, torch.tensor([13.0, 24.0]))


def test_the_same_slot_reached_through_two_arguments_is_exposed_once():
    """f(x, x): the first entry is the buffer, the second is None."""
    record = []
    Scale = make_scale(record)
    x = leaf(1.0, 2.0)
    y = Scale.apply(x, x)
    (y.sum() + (x * 3).sum()).backward()
    assert exposed(record[0]) == [True, False]
    torch.testing.assert_close(x.grad, 2 * x.detach() + 3)


def test_an_input_that_does_not_require_grad_has_a_none_entry():
    """An entry is None when no producer can contribute: the input does not require grad."""
    record = []
    Scale = make_scale(record)
    x, w = torch.tensor([1.0, 2.0]), leaf(3.0, 4.0)
    y = Scale.apply(x, w)
    (y.sum() + (w * 2).sum()).backward()
    assert exposed(record[0]) == [False, True]
    torch.testing.assert_close(w.grad, torch.tensor([3.0, 4.0]))


# --- Leaf inputs: the execution-local buffer, never .grad -------------------


def test_a_leaf_input_exposes_its_execution_local_buffer_not_its_existing_grad():
    """For a leaf input, a non-None entry exposes its execution-local InputBuffer,
    not its existing .grad; AccumulateGrad then runs once with the completed buffer."""
    record = []
    Scale = make_scale(record)
    x, w = leaf(1.0, 1.0), leaf(2.0, 2.0)
    x.grad = torch.full((2,), 100.0)
    y = Scale.apply(x, w)
    (y.sum() + (x * 3).sum()).backward()
    torch.testing.assert_close(record[0][0], torch.tensor([3.0, 3.0]))
    torch.testing.assert_close(x.grad, torch.tensor([105.0, 105.0]))


def test_autograd_grad_returns_the_completed_buffer_without_updating_grad():
    """torch.autograd.grad instead returns the completed buffer without updating .grad."""
    record = []
    Scale = make_scale(record)
    x, w = leaf(1.0, 1.0), leaf(2.0, 2.0)
    x.grad = torch.full((2,), 100.0)
    y = Scale.apply(x, w)
    (gx,) = torch.autograd.grad(y.sum() + (x * 3).sum(), [x])
    assert exposed(record[0])[0]
    torch.testing.assert_close(gx, torch.tensor([5.0, 5.0]))
    torch.testing.assert_close(x.grad, torch.tensor([100.0, 100.0]))


def test_backward_with_inputs_accumulates_the_completed_buffer():
    """backward(inputs=[x]) works too: AccumulateGrad runs once with the completed buffer."""
    record = []
    Scale = make_scale(record)
    x, w = leaf(1.0, 1.0), leaf(2.0, 2.0)
    y = Scale.apply(x, w)
    (y.sum() + (x * 3).sum()).backward(inputs=[x])
    assert exposed(record[0])[0]
    torch.testing.assert_close(x.grad, torch.tensor([5.0, 5.0]))
    assert w.grad is None


# --- Works with the other ways of writing and running a Function ------------


def test_works_with_setup_context_style_functions():
    """Works with setup_context-style Functions."""
    class Mul(Function):
        @staticmethod
        def forward(x, w):
            return x * w

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(*inputs)

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            bx, bw = ctx.input_grad_buffers
            assert bx is not None and bw is not None
            bx.add_(g * w)
            bw.add_(g * x)
            return None, None

    x, w = leaf(1.0, 2.0), leaf(3.0, 4.0)
    y = Mul.apply(x, w)
    (y.sum() + (x * 1.0).sum() + (w * 1.0).sum()).backward()
    torch.testing.assert_close(x.grad, torch.tensor([4.0, 5.0]))
    torch.testing.assert_close(w.grad, torch.tensor([2.0, 3.0]))


def _assert_doubling_fuses_before_a_later_consumer(doubling):
    """``doubling`` (y = 2x, its backward fusing 2g into x's exposed buffer)
    applied to x, with x * 3 consumed later: x.grad is 2 + 3."""
    x = leaf(1.0, 2.0)
    y = doubling.apply(x)
    (y.sum() + (x * 3).sum()).backward()
    torch.testing.assert_close(x.grad, torch.tensor([5.0, 5.0]))


def test_works_with_once_differentiable_backward():
    """Works with @once_differentiable."""
    class Double(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        @once_differentiable
        def backward(ctx, g):
            (buffer,) = ctx.input_grad_buffers
            assert buffer is not None
            buffer.add_(g * 2)
            return None

    _assert_doubling_fuses_before_a_later_consumer(Double)


def test_works_with_boxed_grads_call_functions():
    """Works with boxed_grads_call = True."""
    class Boxed(Function):
        boxed_grads_call = True

        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grads):
            assert isinstance(grads, list)
            (g,) = grads
            grads.clear()
            (buffer,) = ctx.input_grad_buffers
            assert buffer is not None
            buffer.add_(g * 2)
            return None

    _assert_doubling_fuses_before_a_later_consumer(Boxed)


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float64, torch.complex64]
)
def test_works_with_reduced_precision_and_complex_buffers(dtype):
    """Works with float16, bfloat16 and complex64 buffers."""
    record = []
    Scale = make_scale(record)
    x, w = leaf(1.0, 2.0, dtype=dtype), leaf(3.0, 4.0, dtype=dtype)
    y = Scale.apply(x, w)
    (y.real.sum() if dtype.is_complex else y.sum()).add((x * 5).real.sum()).backward()
    assert record[0][0] is not None and record[0][0].dtype == dtype
    torch.testing.assert_close(x.grad, (torch.tensor([8.0, 9.0])).to(dtype))


def test_works_with_zero_dim_buffers():
    """Works with 0-dim buffers."""
    record = []
    Scale = make_scale(record)
    x, w = torch.tensor(2.0, requires_grad=True), torch.tensor(3.0, requires_grad=True)
    y = Scale.apply(x, w)
    (y + x * 5).backward()
    assert record[0][0] is not None and record[0][0].dim() == 0
    torch.testing.assert_close(x.grad, torch.tensor(8.0))


def test_works_with_retain_grad_pre_hooks_and_tensor_hooks():
    """Works with retain_grad() non-leaves, pre-hooks on the node, tensor hooks on the input."""
    record, seen = [], []
    Scale = make_scale(record)
    a, w = leaf(1.0, 2.0), leaf(3.0, 4.0)
    x = a * 1.0
    x.retain_grad()
    x.register_hook(lambda g: seen.append(g.clone()))
    y = Scale.apply(x, w)
    y.grad_fn.register_prehook(lambda grads: None)
    (y.sum() + (x * 5).sum()).backward()
    assert exposed(record[0]) == [True, False]
    torch.testing.assert_close(seen[0], torch.tensor([8.0, 9.0]))
    torch.testing.assert_close(x.grad, torch.tensor([8.0, 9.0]))
    torch.testing.assert_close(a.grad, torch.tensor([8.0, 9.0]))


def test_works_from_several_threads_running_backward_at_once():
    """Works from several threads running backward at once."""
    errors, barrier = [], threading.Barrier(4)

    def work():
        try:
            barrier.wait()
            with _device.as_default():
                work_on_the_device()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def work_on_the_device():
        if True:
            for _ in range(20):
                record = []
                Scale = make_scale(record)
                x, w = leaf(1.0, 2.0), leaf(3.0, 4.0)
                y = Scale.apply(x, w)
                (y.sum() + (x * 5).sum()).backward()
                assert exposed(record[0]) == [True, False]
                torch.testing.assert_close(x.grad, torch.tensor([8.0, 9.0]))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


# --- Errors -----------------------------------------------------------------


def error_of(fn):
    with pytest.raises(RuntimeError) as info:
        fn()
    return str(info.value)


def test_reading_it_in_forward_raises():
    """This property is available only while a Python custom backward is executing."""

    class ReadInForward(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.input_grad_buffers
            return x

        @staticmethod
        def backward(ctx, g):
            return g

    assert_expected_inline(
        error_of(lambda: ReadInForward.apply(leaf(1.0))),
        """input_grad_buffers can only be accessed while autograd is executing backward()""",
    )


def test_reading_it_after_backward_or_through_a_direct_grad_fn_apply_raises():
    """Outside backward (on a graph not being executed, after backward, or from a direct grad_fn.apply(...) call) it raises."""
    record = []
    Scale = make_scale(record)
    x, w = leaf(1.0), leaf(2.0)
    y = Scale.apply(x, w)
    ctx = y.grad_fn
    assert_expected_inline(
        error_of(lambda: ctx.input_grad_buffers),
        """input_grad_buffers can only be accessed while autograd is executing backward()""",
    )
    assert_expected_inline(
        error_of(lambda: ctx.apply(torch.ones(1))),
        """input_grad_buffers can only be accessed while autograd is executing backward()""",
    )
    y.sum().backward()
    assert_expected_inline(
        error_of(lambda: ctx.input_grad_buffers),
        """input_grad_buffers can only be accessed while autograd is executing backward()""",
    )


def test_reading_another_functions_ctx_inside_a_backward_raises():
    """Available only while *this* Function's backward is executing: another ctx raises."""
    record = []
    Scale = make_scale(record)
    x, w = leaf(1.0), leaf(2.0)
    other = Scale.apply(x, w).grad_fn
    errors = []

    def read_other(ctx, buffers):
        errors.append(error_of(lambda: other.input_grad_buffers))

    Reader = make_scale([], backward_hook=read_other)
    Reader.apply(x, w).sum().backward()
    assert_expected_inline(
        errors[0],
        """input_grad_buffers can only be accessed from the currently executing autograd.Function backward()""",
    )


def run_reader(backward, **kwargs):
    errors = []

    def read(ctx):
        try:
            ctx.input_grad_buffers
        except RuntimeError as e:
            errors.append(str(e))

    class Reader(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            read(ctx)
            return g * 2

    x = leaf(1.0, 2.0)
    y = Reader.apply(x)
    backward(y, x, **kwargs)
    return errors


def test_create_graph_true_raises():
    """It is unavailable with create_graph=True."""
    errors = run_reader(lambda y, x: (y.sum() + (x * 3).sum()).backward(create_graph=True))
    assert_expected_inline(
        errors[0], """input_grad_buffers does not support create_graph=True"""
    )


def test_anomaly_detection_raises():
    """It is unavailable with anomaly detection."""
    with torch.autograd.set_detect_anomaly(True):
        errors = run_reader(lambda y, x: (y.sum() + (x * 3).sum()).backward())
    assert_expected_inline(
        errors[0], """input_grad_buffers does not support anomaly detection"""
    )


def test_a_post_hook_on_the_producing_node_raises():
    """It is unavailable with a post-hook on the producing autograd node."""

    def backward(y, x):
        y.grad_fn.register_hook(lambda grad_inputs, grad_outputs: None)
        (y.sum() + (x * 3).sum()).backward()

    errors = run_reader(backward)
    assert_expected_inline(
        errors[0],
        """input_grad_buffers does not support post-hooks on the producing autograd node because directly accumulated gradients are returned as None and cannot be observed or replaced by those hooks""",
    )


def test_error_precedence_is_post_hook_then_create_graph_then_anomaly():
    """When several apply, the post-hook error wins over create_graph, which wins over anomaly detection."""
    def backward(y, x):
        y.grad_fn.register_hook(lambda grad_inputs, grad_outputs: None)
        with torch.autograd.set_detect_anomaly(True):
            (y.sum() + (x * 3).sum()).backward(create_graph=True)

    assert run_reader(backward)[0].startswith(
        "input_grad_buffers does not support post-hooks"
    )
    with torch.autograd.set_detect_anomaly(True):
        errors = run_reader(
            lambda y, x: (y.sum() + (x * 3).sum()).backward(create_graph=True)
        )
    assert errors[0] == "input_grad_buffers does not support create_graph=True"


@pytest.mark.parametrize("reentrant", ["backward", "grad"])
@pytest.mark.parametrize("mutate_first", [False, True])
def test_calling_backward_or_grad_after_receiving_a_buffer_raises(reentrant, mutate_first):
    """After receiving a non-None buffer, calling backward or grad before the
    custom backward returns raises an error."""
    errors = []

    def call_reentrant(ctx, buffers):
        assert buffers[0] is not None
        if mutate_first:
            buffers[0].add_(0.0)
        q = leaf(1.0)
        try:
            with torch.enable_grad():
                loss = (q * 2).sum()
                if reentrant == "backward":
                    loss.backward()
                else:
                    torch.autograd.grad(loss, [q])
        except RuntimeError as e:
            errors.append(str(e))

    Scale = make_scale([], backward_hook=call_reentrant)
    x, w = leaf(1.0, 2.0), leaf(3.0, 4.0)
    (Scale.apply(x, w).sum() + (x * 5).sum()).backward()
    assert_expected_inline(
        errors[0],
        """Calling backward or grad reentrantly after accessing a non-None ctx.input_grad_buffers entry is not supported""",
    )
    torch.testing.assert_close(x.grad, torch.tensor([8.0, 9.0]))


def test_reentrant_backward_works_when_every_entry_was_none():
    """When every entry was None, reentrant calls work."""
    results = []

    def call_reentrant(ctx, buffers):
        assert all(b is None for b in buffers)
        q = leaf(1.0, 2.0)
        with torch.enable_grad():
            results.append(torch.autograd.grad((q * 7).sum(), [q])[0])

    Scale = make_scale([], backward_hook=call_reentrant)
    x, w = leaf(1.0, 2.0), leaf(3.0, 4.0)
    Scale.apply(x, w).sum().backward()
    torch.testing.assert_close(results[0], torch.tensor([7.0, 7.0]))


def test_a_failed_backward_leaves_no_state_behind():
    """An exception after mutating a buffer propagates; the next backward works,
    and reentrant backward is allowed again."""

    def fail(ctx, buffers):
        assert buffers[0] is not None
        buffers[0].add_(1000.0)
        raise ValueError("boom")

    Failing = make_scale([], backward_hook=fail)
    x, w = leaf(1.0, 2.0), leaf(3.0, 4.0)
    with pytest.raises(ValueError, match="boom"):
        (Failing.apply(x, w).sum() + (x * 5).sum()).backward()
    assert x.grad is None
    record = []
    Scale = make_scale(record)
    (Scale.apply(x, w).sum() + (x * 5).sum()).backward()
    torch.testing.assert_close(x.grad, torch.tensor([8.0, 9.0]))
    q = leaf(1.0)
    (q * 2).sum().backward()
    torch.testing.assert_close(q.grad, torch.tensor([2.0]))


# --- Generated graphs -------------------------------------------------------

OPS = {
    "mul3": lambda t: t * 3.0,
    "sin": torch.sin,
    "square": lambda t: t * t,
    "sum": lambda t: t.sum().expand_as(t),
    "stack": lambda t: torch.stack([t, t * 2]).sum(0),
}


@st.composite
def graphs(draw):
    """Custom Functions mixed with builtin ops sharing leaf and non-leaf inputs,
    created in random order, run by backward, grad or backward(inputs=)."""
    n_nodes = draw(st.integers(1, 6))
    nodes = []
    for _ in range(n_nodes):
        kind = draw(st.sampled_from(["custom", "builtin"]))
        source = draw(st.sampled_from(["x", "w", "h"]))
        op = draw(st.sampled_from(sorted(OPS)))
        nodes.append((kind, source, op))
    runner = draw(st.sampled_from(["backward", "grad", "backward_inputs"]))
    return nodes, runner


def run_graph(nodes, runner, fuse):
    record = []
    Scale = make_scale(record, fuse=fuse)
    x = torch.tensor([1.0, -2.0, 0.5], requires_grad=True)
    w = torch.tensor([0.3, 0.7, -1.1], requires_grad=True)
    h = x * w  # a non-leaf input shared by several consumers
    sources = {"x": x, "w": w, "h": h}
    terms = []
    for kind, source, op in nodes:
        t = sources[source]
        other = sources[_other(source)]
        terms.append(Scale.apply(t, other) if kind == "custom" else OPS[op](t))
    loss = sum((term * (i + 1)).sum() for i, term in enumerate(terms))
    if runner == "grad":
        grads = torch.autograd.grad(loss, [x, w], allow_unused=True)
    elif runner == "backward":
        loss.backward()
        grads = (x.grad, w.grad)
    else:
        loss.backward(inputs=[x])
        grads = (x.grad, None)
    return record, grads


@given(graphs())
def test_generated_graphs_fused_gradients_equal_unfused(graph):
    """Gradients are the same whether the backward accumulates into exposed
    buffers or returns separate tensors."""
    nodes, runner = graph
    fused_record, fused = run_graph(nodes, runner, fuse=True)
    _, plain = run_graph(nodes, runner, fuse=False)
    for a, b in zip(fused, plain):
        if a is None or b is None:
            assert a is None and b is None
        else:
            torch.testing.assert_close(a, b)


@given(graphs())
def test_generated_graphs_expose_exactly_what_the_rule_allows(graph):
    """An entry is non-None exactly when an earlier producer contributed a
    gradient that no other tensor shares (checked on graphs whose earlier
    producers are builtin ops making fresh dense gradients)."""
    nodes, runner = graph
    # Predict, for each custom node, whether its first argument's buffer is
    # exposed: some builtin op created after it on the same source has run
    # (higher sequence number runs first) and that op's gradient is dense and
    # unshared (not the expanded `sum`, not the views of `stack`, not `sum`
    # followed by anything: an in-place accumulation keeps it dense).
    expected = []
    for i, (kind, source, _) in enumerate(nodes):
        if kind != "custom":
            continue
        later = [n for n in nodes[i + 1 :] if _contributes(n, source)]
        if runner == "backward_inputs" and source == "w":
            expected.append(False)
            continue
        expected.append(_predict(later))
    record, _ = run_graph(nodes, runner, fuse=True)
    observed = [entries[0] is not None for entries in reversed(record)]
    assert observed == expected


def _other(source):
    return "w" if source != "w" else "x"


def _contributes(node, source):
    kind, node_source, _ = node
    return node_source == source or (kind == "custom" and _other(node_source) == source)


def _predict(later):
    """Whether the buffer, after the later-created nodes ran, may be exposed."""
    if not later:
        return False
    # The first producer (the last created) decides the slot's tensor; each
    # further producer accumulates into it in place when it is exposable, or
    # replaces it with a fresh sum (exposable again) when it is not.
    state = None
    for kind, _, op in reversed(later):
        fresh_dense = kind == "custom" or op in ("mul3", "sin", "square")
        if state is None:
            state = fresh_dense
        else:
            state = True  # in-place add or a fresh out-of-place sum
    return state
