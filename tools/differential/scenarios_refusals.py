"""Differential scenarios: where ``input_grad_buffers`` must refuse, and what
an object that only claims to be a ctx gets (issue: never less safe than
native torch). Registered into ``scenarios.SCENARIOS``; run by run.py.

Scenario names start with ``q16_``.
"""
import threading
from unittest import mock

import torch
from torch.autograd import Function
from torch.autograd.function import BackwardCFunction, FunctionCtx
from torch.autograd.variable import Variable

from scenarios import E, R, scenario


def _leaf(*values):
    return torch.tensor(values, requires_grad=True)


def _outcome(fn):
    try:
        value = fn()
    except Exception as e:  # noqa: BLE001
        return E(e)
    if isinstance(value, tuple):
        return {"entries": [None if v is None else R(v) for v in value]}
    return {"value": type(value).__name__}


class _Reader(Function):
    """y = 2x whose backward calls ctx.on_backward(ctx) first."""

    @staticmethod
    def forward(ctx, x, on_backward):
        ctx.on_backward = on_backward
        return x * 2

    @staticmethod
    def backward(ctx, g):
        ctx.on_backward(ctx)
        return g * 2, None


def _read_in_backward(backward_kwargs=None, under=None, later=True):
    seen = []

    def read(ctx):
        if under is None:
            seen.append(_outcome(lambda: ctx.input_grad_buffers))
        else:
            with under():
                seen.append(_outcome(lambda: ctx.input_grad_buffers))

    x = _leaf(1.0, 2.0)
    y = _Reader.apply(x, read)
    loss = y.sum() + ((x * 3).sum() if later else 0)
    loss.backward(**(backward_kwargs or {}))
    return {"read": seen[0], "grad": R(x.grad)}


@scenario
def q16_create_graph_read_under_no_grad():
    return _read_in_backward({"create_graph": True}, under=torch.no_grad)


@scenario
def q16_plain_backward_read_under_enable_grad():
    return _read_in_backward(under=torch.enable_grad)


@scenario
def q16_stale_capture_stream_override():
    set_override = getattr(torch.autograd.graph, "set_override_stale_capture_stream", None)
    if set_override is None:
        return {"skipped": "no set_override_stale_capture_stream"}
    set_override(True)
    try:
        plain = _read_in_backward()
        with torch.autograd.set_detect_anomaly(True):
            under_anomaly = _read_in_backward()
    finally:
        set_override(False)
    return {"plain": plain, "under_anomaly": under_anomaly}


@scenario
def q16_post_hook_read_after_backward():
    x = _leaf(1.0, 2.0)
    y = _Reader.apply(x, lambda ctx: None)
    y.grad_fn.register_hook(lambda grad_inputs, grad_outputs: None)
    y.sum().backward()
    return _outcome(lambda: y.grad_fn.input_grad_buffers)


@scenario
def q16_post_processing_read_of_outer_ctx():
    seen, outer = [], []

    def read_outer():
        seen.append(_outcome(lambda: outer[0].input_grad_buffers))

    class Inner(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            Variable._execution_engine.queue_callback(read_outer)
            return g * 2

    def outer_backward(ctx):
        outer.append(ctx)
        q = torch.ones(2, requires_grad=True)
        with torch.enable_grad():
            Inner.apply(q).sum().backward()

    x = _leaf(1.0, 2.0)
    _Reader.apply(x, outer_backward).sum().backward()
    return {"read": seen[0], "grad": R(x.grad)}


def _reentrant(call):
    def run():
        with torch.enable_grad():
            call()

    out = _outcome(run)
    return out if "exc_type" in out else "no error"


@scenario
def q16_direct_engine_call_after_exposure():
    seen = []

    def body(ctx):
        seen.append(ctx.input_grad_buffers[0] is not None)
        q = _leaf(1.0)
        seen.append(
            _reentrant(
                lambda: Variable._execution_engine.run_backward(
                    ((q * 2).sum(),), (torch.ones(()),), False, False, (), True, True
                )
            )
        )

    x = _leaf(1.0, 2.0)
    (_Reader.apply(x, body).sum() + (x * 5).sum()).backward()
    return {"seen": seen, "grad": R(x.grad)}


@scenario
def q16_reentrant_refusal_per_graph_task():
    second_read = threading.Event()
    seen = {}

    def body(ctx):
        name = threading.current_thread().name
        seen[name + "_exposed"] = ctx.input_grad_buffers[0] is not None
        if name == "first":
            second_read.wait(timeout=60)
            q = _leaf(1.0)
            seen[name] = _reentrant(lambda: torch.autograd.grad((q * 2).sum(), [q]))
        else:
            second_read.set()

    x = _leaf(1.0, 2.0)
    loss = _Reader.apply(x, body).sum() + (x * 5).sum()
    threads = [
        threading.Thread(target=lambda: torch.autograd.grad(loss, [x], retain_graph=True), name=n)
        for n in ("first", "second")
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return dict(sorted(seen.items()))


@scenario
def q16_second_order_fused_under_no_grad():
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

    x = _leaf(1.0, 2.0)
    (g,) = torch.autograd.grad(Square.apply(x).sum() + (x * x).sum(), x, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), x)
    return {"g": R(g), "gg": R(gg)}


class _Liar(list):
    @property
    def __class__(self):
        return BackwardCFunction


@scenario
def q16_objects_claiming_to_be_a_ctx():
    getter = FunctionCtx.input_grad_buffers.fget
    declare = FunctionCtx.set_output_grad_dtype
    fake = mock.MagicMock(spec=BackwardCFunction)
    return {
        "getter_mock": _outcome(lambda: getter(fake)),
        "getter_liar": _outcome(lambda: getter(_Liar())),
        "getter_functionctx": _outcome(lambda: getter(FunctionCtx())),
        "getter_functionbase": _outcome(lambda: getter(torch._C._FunctionBase())),
        "declare_mock": _outcome(lambda: declare(fake, torch.float32)),
        "declare_liar": _outcome(lambda: declare(_Liar(), torch.float32)),
    }


class _BoxedIdentity(Function):
    boxed_grads_call = True

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grads):
        (g,) = grads
        return g


@scenario
def q16_boxed_grads_from_several_threads_on_one_graph():
    x = torch.zeros(3, requires_grad=True)
    out = _BoxedIdentity.apply(x)
    wrong = []

    def run(index):
        for step in range(50):
            g = torch.full((3,), float(index * 1000 + step))
            (grad_x,) = torch.autograd.grad(out, x, g, retain_graph=True)
            if not torch.equal(grad_x, g):
                wrong.append(index)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    direct = out.grad_fn.apply(torch.tensor([5.0, 6.0, 7.0]))
    return {"wrong": len(wrong), "direct_apply": R(direct)}
