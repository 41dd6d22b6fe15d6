"""Differential scenarios: where ``ctx.input_grad_buffers`` must refuse (in
forward or setup_context, after or outside its backward, under create_graph,
anomaly mode or a post hook on the node, around reentrant backward calls) and
what an object that only claims to be a ctx gets (never less safe than native
torch).

Names: ``input_grad_buffers.refusals.<case>``.
"""
import threading
from contextlib import nullcontext
from unittest import mock

import torch
from torch.autograd import Function
from torch.autograd.function import BackwardCFunction, FunctionCtx
from torch.autograd.variable import Variable

from sample_functions import applied_reader, buffer_reader, doubling, doubling_in_setup_context_style
from sample_functions import doubling_with_later_consumer, without_ctx
from scenario_helpers import (
    Section,
    describe_buffers,
    error_of,
    grad_values,
    leaf,
    outcome_of,
    read_buffers,
    tensor_values,
)

REFUSALS = Section("input_grad_buffers.refusals")


# ------------------------------------------- a reader Function in each mode


def reader_case(later=True, create_graph=False, anomaly=None, post_hook=False, observe_grad=True):
    """buffer_reader(x) backward from y.sum() (+ (x*3).sum() with ``later``);
    ``anomaly``: "forward_and_backward" or "backward" (where it is on);
    ``post_hook``: a post hook on the reader's node (its calls counted when
    the grad is observed too)."""
    rec = {}
    F = buffer_reader(rec)
    x = leaf([1.0, 2.0])
    calls = []
    with torch.autograd.set_detect_anomaly(True) if anomaly == "forward_and_backward" else nullcontext():
        y = F.apply(x)
        if post_hook:
            y.grad_fn.register_hook(lambda gi, go: calls.append(1))
        with torch.autograd.set_detect_anomaly(True) if anomaly is not None else nullcontext():
            (y.sum() + (x * 3.0).sum() if later else y.sum()).backward(create_graph=create_graph)
    out = {"rec": without_ctx(rec)}
    if observe_grad:
        out.update(grad_values(x=x))
        if post_hook:
            out["hook_calls"] = len(calls)
    return out


REFUSALS.table(
    reader_case,
    {
        "create_graph": dict(create_graph=True),
        "create_graph_nothing_exposable": dict(later=False, create_graph=True),
        "anomaly": dict(anomaly="forward_and_backward"),
        "anomaly_enabled_only_during_backward": dict(anomaly="backward"),
        "anomaly_nothing_exposable": dict(later=False, anomaly="forward_and_backward", observe_grad=False),
        "post_hook_on_node": dict(post_hook=True),
        "post_hook_nothing_exposable": dict(later=False, post_hook=True, observe_grad=False),
    },
)


def forward_read_case(requires_grad=True, anomaly=False):
    """buffer_reader reading in forward (and backward, when there is one)."""
    rec = {}
    F = buffer_reader(rec, "forward")
    x = torch.tensor([1.0, 2.0], requires_grad=requires_grad)
    with torch.autograd.set_detect_anomaly(True) if anomaly else nullcontext():
        y = F.apply(x)
        if requires_grad:
            y.sum().backward()
    return without_ctx(rec)


REFUSALS.table(
    forward_read_case,
    {
        "read_in_forward": dict(),
        "read_in_forward_no_grad_input": dict(requires_grad=False),
        "anomaly_in_forward_read": dict(anomaly=True),
    },
)


@REFUSALS.scenario
def read_in_setup_context():
    rec = {}

    def setup_context(ctx):
        rec["read"], rec["err"] = read_buffers(ctx)

    x = leaf([1.0, 2.0])
    doubling_in_setup_context_style(setup_context).apply(x).sum().backward()
    return rec


@REFUSALS.scenario
def read_after_backward_retained_ctx():
    rec, x, y = applied_reader()
    (y.sum() + (x * 3.0).sum()).backward(retain_graph=True)
    ctx = rec["ctx"]
    after, err = read_buffers(ctx)
    ctx2, err2 = read_buffers(y.grad_fn)
    return {
        "rec": without_ctx(rec),
        "after": after,
        "after_err": err,
        "via_grad_fn": ctx2,
        "via_grad_fn_err": err2,
        "grad_fn_is_ctx": y.grad_fn is ctx,
    }


@REFUSALS.scenario
def read_before_backward_via_grad_fn():
    rec, x, y = applied_reader()
    r, err = read_buffers(y.grad_fn)
    return {"read": r, "err": err}


def other_graph_ctx_case(mode=None):
    """Inside one backward, read the buffers of a ctx of another, pending
    graph; ``mode``: "create_graph", "anomaly" or "posthook" on top."""
    rec1, x1, y1 = applied_reader()
    rec = {}

    def backward(ctx, g):
        rec["own"], rec["own_err"] = read_buffers(ctx)
        rec["other"], rec["other_err"] = read_buffers(y1.grad_fn)
        return g * 2.0

    x = leaf([1.0, 2.0])
    with torch.autograd.set_detect_anomaly(mode == "anomaly"):
        y = doubling(backward).apply(x)
        if mode == "posthook":
            y.grad_fn.register_hook(lambda gi, go: None)
        (y.sum() + (x * 3.0).sum()).backward(create_graph=(mode == "create_graph"))
    return rec


REFUSALS.table(
    other_graph_ctx_case,
    {
        "read_other_graph_ctx_inside_backward": dict(),
        "precedence_other_ctx_under_create_graph": dict(mode="create_graph"),
        "precedence_other_ctx_under_anomaly": dict(mode="anomaly"),
        "precedence_other_ctx_under_posthook": dict(mode="posthook"),
    },
)


@REFUSALS.scenario
def direct_grad_fn_apply():
    rec, x, y = applied_reader()
    out = outcome_of(lambda: tensor_values(y.grad_fn.apply(torch.ones(2))))
    return {"rec": without_ctx(rec), "apply": out}


@REFUSALS.scenario
def direct_grad_fn_apply_inside_backward():
    rec, x, yF = applied_reader()
    rec2 = {}

    def backward(ctx, g):
        rec2["inner_apply"] = outcome_of(lambda: tensor_values(yF.grad_fn.apply(torch.ones(2))))
        return g * 2.0

    a = leaf([1.0, 2.0])
    doubling(backward).apply(a).sum().backward()
    return {"rec": without_ctx(rec), "rec2": rec2}


@REFUSALS.scenario
def create_graph_uncaught():
    rec, x, y = applied_reader(catch=False)
    out = outcome_of(lambda: (y.sum() + (x * 3.0).sum()).backward(create_graph=True))
    return {"rec": without_ctx(rec), "outer": out}


@REFUSALS.scenario
def autograd_grad_create_graph():
    rec, x, y = applied_reader()
    (gx,) = torch.autograd.grad(y.sum() + (x * 3.0).sum(), [x], create_graph=True)
    return {"rec": without_ctx(rec), "gx": tensor_values(gx)}


@REFUSALS.scenario
def post_hook_on_other_node():
    rec = {}
    F = buffer_reader(rec)
    a = leaf([1.0, 2.0])
    x = a * 1.0
    x.grad_fn.register_hook(lambda gi, go: None)
    y = F.apply(x)
    (y.sum() + (x * 3.0).sum()).backward()
    return {"rec": without_ctx(rec), **grad_values(a=a)}


@REFUSALS.scenario
def post_hook_create_graph_anomaly_precedence():
    res = {}
    for combo in [
        ("create_graph", "anomaly"),
        ("create_graph", "posthook"),
        ("anomaly", "posthook"),
        ("create_graph", "anomaly", "posthook"),
    ]:
        rec = {}
        F = buffer_reader(rec)
        x = leaf([1.0, 2.0])
        with torch.autograd.set_detect_anomaly("anomaly" in combo):
            y = F.apply(x)
            if "posthook" in combo:
                y.grad_fn.register_hook(lambda gi, go: None)
            (y.sum() + (x * 3.0).sum()).backward(create_graph="create_graph" in combo)
        res["+".join(combo)] = without_ctx(rec)
    return res


@REFUSALS.scenario
def precedence_forward_read_under_create_graph_backward():
    """Forward of an inner Function run (with grad) inside a create_graph backward."""
    rec_in = {}
    Inner = buffer_reader(rec_in, "forward")

    def backward(ctx, g):
        Inner.apply(g)
        return g * 2.0

    x = leaf([1.0, 2.0])
    doubling(backward).apply(x).sum().backward(create_graph=True)
    return without_ctx(rec_in)


# ------------------------------------------------- reentrant backward calls


def reentrant_case(mutate, later=True):
    """A backward that reads its buffers (and, with ``mutate``, fuses into an
    exposed one) and then runs autograd.grad and backward reentrantly."""
    rec = {}

    def read_then_reenter(ctx, g):
        b = ctx.input_grad_buffers
        rec["bufs"] = describe_buffers(b)
        if mutate and b[0] is not None:
            b[0].add_(g * 2.0)
        with torch.enable_grad():
            p = leaf([1.0, 2.0])
            rec["reentrant_grad"] = outcome_of(lambda: tensor_values(torch.autograd.grad((p * 5.0).sum(), [p])[0]))
            q = leaf([1.0, 2.0])
            rec["reentrant_backward"] = outcome_of(lambda: (q * 7.0).sum().backward())
            rec["q.grad"] = tensor_values(q.grad)
        if mutate and b[0] is not None:
            return None
        return g * 2.0

    F = doubling(read_then_reenter)
    x = leaf([1.0, 2.0])
    y = F.apply(x)
    (y.sum() + (x * 3.0).sum() if later else y.sum()).backward()
    return {"rec": rec, **grad_values(x=x)}


REFUSALS.table(
    reentrant_case,
    {
        "reentrant_after_nonnone_before_mutation": dict(mutate=False),
        "reentrant_after_nonnone_after_mutation": dict(mutate=True),
        "reentrant_all_none": dict(mutate=False, later=False),
    },
)


@REFUSALS.scenario
def reentrant_uncaught():
    rec = {}

    def read_then_reenter(ctx, g):
        rec["bufs"] = describe_buffers(ctx.input_grad_buffers)
        with torch.enable_grad():
            p = leaf([1.0, 2.0])
            torch.autograd.grad((p * 5.0).sum(), [p])
        return g * 2.0

    F = doubling(read_then_reenter)
    x = leaf([1.0, 2.0])
    y = F.apply(x)
    out = outcome_of(lambda: (y.sum() + (x * 3.0).sum()).backward())
    return {"rec": rec, "outer": out}


@REFUSALS.scenario
def reentrant_then_read():
    """Reentrant backward first, then read buffers."""

    def reentrant_then_read(ctx, g, rec):
        with torch.enable_grad():
            p = leaf([1.0, 2.0])
            rec["reentrant"] = outcome_of(lambda: tensor_values(torch.autograd.grad((p * 5.0).sum(), [p])[0]))
        rec["bufs"], rec["err"] = read_buffers(ctx)
        return g * 2.0

    return doubling_with_later_consumer(reentrant_then_read)


@REFUSALS.scenario
def read_from_thread_inside_backward():
    def read_from_thread_then_here(ctx, g, rec):
        res = {}

        def t():
            res["bufs"], res["err"] = read_buffers(ctx)

        th = threading.Thread(target=t)
        th.start()
        th.join()
        rec["thread"] = res
        rec["main"], rec["main_err"] = read_buffers(ctx)
        return g * 2.0

    return doubling_with_later_consumer(read_from_thread_then_here)


@REFUSALS.scenario
def read_raises_uncaught_in_forward_type():
    F = doubling(lambda ctx, g: g, in_forward=lambda ctx: ctx.input_grad_buffers)
    x = leaf([1.0])
    return outcome_of(lambda: F.apply(x))


# ------------------------------------- refusals that must be as safe as native


def _leaf(*values):
    return torch.tensor(values, requires_grad=True)


def entries_or_error(fn):
    try:
        value = fn()
    except Exception as e:  # noqa: BLE001
        return error_of(e)
    if isinstance(value, tuple):
        return {"entries": [None if v is None else tensor_values(v) for v in value]}
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
            seen.append(entries_or_error(lambda: ctx.input_grad_buffers))
        else:
            with under():
                seen.append(entries_or_error(lambda: ctx.input_grad_buffers))

    x = _leaf(1.0, 2.0)
    y = _Reader.apply(x, read)
    loss = y.sum() + ((x * 3).sum() if later else 0)
    loss.backward(**(backward_kwargs or {}))
    return {"read": seen[0], "grad": tensor_values(x.grad)}


@REFUSALS.scenario
def create_graph_read_under_no_grad():
    return _read_in_backward({"create_graph": True}, under=torch.no_grad)


@REFUSALS.scenario
def plain_backward_read_under_enable_grad():
    return _read_in_backward(under=torch.enable_grad)


@REFUSALS.scenario
def stale_capture_stream_override():
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


@REFUSALS.scenario
def post_hook_read_after_backward():
    x = _leaf(1.0, 2.0)
    y = _Reader.apply(x, lambda ctx: None)
    y.grad_fn.register_hook(lambda grad_inputs, grad_outputs: None)
    y.sum().backward()
    return entries_or_error(lambda: y.grad_fn.input_grad_buffers)


@REFUSALS.scenario
def post_processing_read_of_outer_ctx():
    seen, outer = [], []

    def read_outer():
        seen.append(entries_or_error(lambda: outer[0].input_grad_buffers))

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
    return {"read": seen[0], "grad": tensor_values(x.grad)}


def reentrant_outcome(call):
    def run():
        with torch.enable_grad():
            call()

    out = entries_or_error(run)
    return out if "exc_type" in out else "no error"


@REFUSALS.scenario
def direct_engine_call_after_exposure():
    seen = []

    def body(ctx):
        seen.append(ctx.input_grad_buffers[0] is not None)
        q = _leaf(1.0)
        seen.append(
            reentrant_outcome(
                lambda: Variable._execution_engine.run_backward(
                    ((q * 2).sum(),), (torch.ones(()),), False, False, (), True, True
                )
            )
        )

    x = _leaf(1.0, 2.0)
    (_Reader.apply(x, body).sum() + (x * 5).sum()).backward()
    return {"seen": seen, "grad": tensor_values(x.grad)}


@REFUSALS.scenario
def reentrant_refusal_per_graph_task():
    second_read = threading.Event()
    seen = {}

    def body(ctx):
        name = threading.current_thread().name
        seen[name + "_exposed"] = ctx.input_grad_buffers[0] is not None
        if name == "first":
            second_read.wait(timeout=60)
            q = _leaf(1.0)
            seen[name] = reentrant_outcome(lambda: torch.autograd.grad((q * 2).sum(), [q]))
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


@REFUSALS.scenario
def second_order_fused_under_no_grad():
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
    return {"g": tensor_values(g), "gg": tensor_values(gg)}


class _Liar(list):
    @property
    def __class__(self):
        return BackwardCFunction


@REFUSALS.scenario
def objects_claiming_to_be_a_ctx():
    getter = FunctionCtx.input_grad_buffers.fget
    declare = FunctionCtx.set_output_grad_dtype
    fake = mock.MagicMock(spec=BackwardCFunction)
    return {
        "getter_mock": entries_or_error(lambda: getter(fake)),
        "getter_liar": entries_or_error(lambda: getter(_Liar())),
        "getter_functionctx": entries_or_error(lambda: getter(FunctionCtx())),
        "getter_functionbase": entries_or_error(lambda: getter(torch._C._FunctionBase())),
        "declare_mock": entries_or_error(lambda: declare(fake, torch.float32)),
        "declare_liar": entries_or_error(lambda: declare(_Liar(), torch.float32)),
    }
