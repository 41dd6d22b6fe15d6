"""Conformance of ``ctx.input_grad_buffers``: where it must refuse.

The places where the property is unavailable or a call after it is refused,
beyond the basic ones in test_input_grad_buffers.py: decided by the running
backward rather than by what the thread happens to be doing, per graph task
rather than per node, during post-processing, with a stale capture stream
override, through every entry into the engine, and for objects that only
claim to be a ctx. Each test is named after the behaviour of torch 2.15 it
checks.

Scenarios that could hang or crash a process when broken run in a
subprocess with a time limit, so that a broken implementation fails the test
instead of stopping the suite.
"""
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from expecttest import assert_expected_inline
from torch.autograd import Function
from torch.autograd.variable import Variable

try:
    from . import _device
    from ._helpers import read_error
except ImportError:  # run as plain files
    import _device
    from _helpers import read_error

TIME_LIMIT_S = 120


def run_isolated(code):
    """Run ``code`` in a fresh interpreter that has imported torch_ctxext when
    the suite did; return its stdout. A hang or a crash fails the test."""
    prelude = "import torch\n"
    if "torch_ctxext" in sys.modules:
        prelude += "import torch_ctxext\n"
    try:
        result = subprocess.run(
            [sys.executable, "-c", prelude + textwrap.dedent(code)],
            capture_output=True,
            text=True,
            timeout=TIME_LIMIT_S,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the scenario did not finish within {TIME_LIMIT_S} s (a hang)")
    assert result.returncode == 0, (
        f"the scenario's process ended with {result.returncode} "
        f"(a negative code is a signal: a crash)\n{result.stderr[-3000:]}"
    )
    return result.stdout


def leaf(*values):
    # On the suite's device explicitly (see test_input_grad_buffers.leaf).
    return torch.tensor(values, requires_grad=True, device=_device.selected())


class Reader(Function):
    """y = 2x, whose backward calls ``ctx.on_backward(ctx)`` first."""

    @staticmethod
    def forward(ctx, x, on_backward):
        ctx.on_backward = on_backward
        return x * 2

    @staticmethod
    def backward(ctx, g):
        ctx.on_backward(ctx)
        return g * 2, None


# --- post-processing --------------------------------------------------------


def test_reading_it_during_backward_post_processing_raises_instead_of_waiting():
    """A final callback of an inner (reentrant) backward reading the outer
    ctx: the engine holds the graph task's lock while callbacks run, and
    torch 2.15 refuses the read rather than waiting for that lock."""
    out = run_isolated(
        """
        from torch.autograd import Function
        from torch.autograd.variable import Variable

        seen = []
        outer = []

        def read_outer():
            try:
                outer[0].input_grad_buffers
                seen.append("no error")
            except RuntimeError as e:
                seen.append(str(e))

        class Inner(Function):
            @staticmethod
            def forward(ctx, x):
                return x * 2

            @staticmethod
            def backward(ctx, g):
                Variable._execution_engine.queue_callback(read_outer)
                return g * 2

        class Outer(Function):
            @staticmethod
            def forward(ctx, x):
                return x * 3

            @staticmethod
            def backward(ctx, g):
                outer.append(ctx)
                q = torch.ones(2, requires_grad=True)
                with torch.enable_grad():
                    Inner.apply(q).sum().backward()
                return g * 3

        x = torch.ones(2, requires_grad=True)
        Outer.apply(x).sum().backward()
        print(seen[0])
        print(x.grad.tolist())
        """
    )
    assert_expected_inline(
        out,
        """\
input_grad_buffers cannot be accessed during backward post-processing
[3.0, 3.0]
""",
    )


# --- create_graph is a property of the backward call ------------------------


def test_create_graph_is_judged_by_the_running_backward_not_the_threads_grad_mode():
    """It is unavailable with create_graph=True, even when the custom
    backward reads it inside torch.no_grad(); and a backward without
    create_graph may read it inside torch.enable_grad()."""
    seen = []

    def under(mode):
        def read(ctx):
            with mode():
                seen.append(read_error(ctx))

        return read

    x = leaf(1.0, 2.0)
    (Reader.apply(x, under(torch.no_grad)).sum() + (x * 3).sum()).backward(create_graph=True)
    x = leaf(1.0, 2.0)
    (Reader.apply(x, under(torch.enable_grad)).sum() + (x * 3).sum()).backward()
    assert seen[0] == "input_grad_buffers does not support create_graph=True"
    assert isinstance(seen[1], tuple) and seen[1][0] is not None


def test_second_order_gradients_are_right_when_backward_fuses_under_no_grad():
    """A fused backward that reads the property and accumulates inside
    torch.no_grad() under create_graph=True is refused, falls back, and
    double backward is exact (a buffer handed out there would take a
    contribution the second-order graph never sees)."""

    class Square(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            with torch.no_grad():
                try:
                    (buffer,) = ctx.input_grad_buffers
                except RuntimeError:
                    buffer = None
                if buffer is not None:
                    buffer.add_(2 * x * g)
                    return None
            return 2 * x * g

    x = leaf(1.0, 2.0)
    # x * x is created after Square: its gradient is in x's buffer first.
    loss = Square.apply(x).sum() + (x * x).sum()
    (g,) = torch.autograd.grad(loss, x, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), x)
    torch.testing.assert_close(g, torch.tensor([4.0, 8.0]))
    torch.testing.assert_close(gg, torch.tensor([4.0, 4.0]))


# --- stale capture stream overrides -----------------------------------------

needs_stale_override = pytest.mark.skipif(
    not hasattr(torch.autograd.graph, "set_override_stale_capture_stream"),
    reason="this torch has no set_override_stale_capture_stream",
)


@needs_stale_override
def test_set_override_stale_capture_stream_true_raises():
    """It is unavailable with stale capture stream overrides."""
    seen = []
    torch.autograd.graph.set_override_stale_capture_stream(True)
    try:
        x = leaf(1.0, 2.0)
        (Reader.apply(x, lambda ctx: seen.append(read_error(ctx))).sum() + (x * 3).sum()).backward()
    finally:
        torch.autograd.graph.set_override_stale_capture_stream(False)
    assert_expected_inline(
        seen[0], """input_grad_buffers does not support set_override_stale_capture_stream(True)"""
    )


@needs_stale_override
def test_anomaly_detection_wins_over_a_stale_capture_stream_override():
    """Error precedence: create_graph, then anomaly detection, then the override."""
    seen = []
    torch.autograd.graph.set_override_stale_capture_stream(True)
    try:
        with torch.autograd.set_detect_anomaly(True):
            x = leaf(1.0, 2.0)
            (Reader.apply(x, lambda ctx: seen.append(read_error(ctx))).sum() + (x * 3).sum()).backward()
    finally:
        torch.autograd.graph.set_override_stale_capture_stream(False)
    assert seen[0] == "input_grad_buffers does not support anomaly detection"


# --- post-hooks: checked before anything else --------------------------------


def test_a_post_hook_on_the_node_is_reported_even_outside_backward():
    """torch 2.15 checks the producing node's post-hooks before checking
    that a backward is running."""
    x = leaf(1.0, 2.0)
    y = Reader.apply(x, lambda ctx: None)
    y.grad_fn.register_hook(lambda grad_inputs, grad_outputs: None)
    assert read_error(y.grad_fn).startswith(
        "input_grad_buffers does not support post-hooks on the producing autograd node"
    )


# --- reentrant backward after an exposure ------------------------------------

REENTRANT = (
    "Calling backward or grad reentrantly after accessing a non-None "
    "ctx.input_grad_buffers entry is not supported"
)


def reentrant_error(call):
    try:
        with torch.enable_grad():
            call()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_direct_engine_call_after_receiving_a_buffer_raises():
    """The refusal covers every entry into the engine, including
    Variable._execution_engine.run_backward itself."""
    seen = []

    def read_then_run_engine(ctx):
        assert ctx.input_grad_buffers[0] is not None
        q = leaf(1.0)

        def call():
            loss = (q * 2).sum()
            Variable._execution_engine.run_backward(
                (loss,), (torch.ones(()),), False, False, (), True, True
            )

        seen.append(reentrant_error(call))

    x = leaf(1.0, 2.0)
    (Reader.apply(x, read_then_run_engine).sum() + (x * 5).sum()).backward()
    assert seen == [REENTRANT]


@pytest.mark.cpu_only(
    "two graph tasks run one node at once only where each calling thread runs its own "
    "task's nodes (the CPU); an accelerator's nodes run one after another on its device thread"
)
def test_each_graph_task_running_the_node_keeps_its_own_refusal():
    """Two threads run backward through one retained graph at once; both read
    a buffer in the same node. A reentrant grad() in the first thread's
    backward is refused after the second thread's read too."""
    second_read = threading.Event()
    seen = {}

    def backward_body(ctx):
        name = threading.current_thread().name
        assert ctx.input_grad_buffers[0] is not None
        if name == "first":
            # Let the second thread read in the same node, then call grad().
            assert second_read.wait(timeout=60)
            q = leaf(1.0)
            seen[name] = reentrant_error(lambda: torch.autograd.grad((q * 2).sum(), [q]))
        else:
            second_read.set()

    x = leaf(1.0, 2.0)
    loss = Reader.apply(x, backward_body).sum() + (x * 5).sum()

    def run():
        torch.autograd.grad(loss, [x], retain_graph=True)

    first = threading.Thread(target=run, name="first")
    second = threading.Thread(target=run, name="second")
    first.start()
    second.start()
    first.join(timeout=120)
    second.join(timeout=120)
    assert not first.is_alive() and not second.is_alive()
    assert seen == {"first": REENTRANT}


def test_a_refusal_ends_with_the_backward_that_received_the_buffer():
    """After the backward that read a buffer returned, the next backward of
    the same retained graph may call grad() reentrantly when it reads no
    buffer."""
    calls = []

    def read_once_then_reenter(ctx):
        if not calls:
            assert ctx.input_grad_buffers[0] is not None
            calls.append("read")
            return
        q = leaf(1.0)
        calls.append(reentrant_error(lambda: torch.autograd.grad((q * 2).sum(), [q])))

    x = leaf(1.0, 2.0)
    loss = Reader.apply(x, read_once_then_reenter).sum() + (x * 5).sum()
    torch.autograd.grad(loss, [x], retain_graph=True)
    torch.autograd.grad(loss, [x])
    assert calls == ["read", "no error"]


# --- objects that only claim to be a ctx -------------------------------------


def test_an_object_that_claims_to_be_a_ctx_is_never_read_as_one():
    """A mock, a proxy or a builtin subclass whose __class__ says
    BackwardCFunction gets what attribute access gives it, as on torch 2.15:
    nothing reads it by a ctx's memory layout."""
    out = run_isolated(
        """
        from unittest import mock
        from torch.autograd.function import BackwardCFunction, FunctionCtx

        class Liar(list):
            @property
            def __class__(self):
                return BackwardCFunction

        def outcome(fn):
            try:
                fn()
                return "ok"
            except Exception as e:
                return type(e).__name__

        fake = mock.MagicMock(spec=BackwardCFunction)
        liar = Liar()
        getter = FunctionCtx.input_grad_buffers.fget
        print(isinstance(fake, BackwardCFunction), isinstance(liar, BackwardCFunction))
        print(outcome(lambda: getter(fake)), outcome(lambda: getter(liar)))
        declare = FunctionCtx.set_output_grad_dtype
        print(outcome(lambda: declare(fake, torch.float32)), outcome(lambda: declare(liar, torch.float32)))
        """
    )
    # isinstance is fooled; nothing crashes; the outcomes are torch 2.15's:
    # the mock answers attribute access, the list has no such attribute, and
    # a mock's declaration slot is already "set".
    assert_expected_inline(
        out,
        """\
True True
ok AttributeError
RuntimeError AttributeError
""",
    )
