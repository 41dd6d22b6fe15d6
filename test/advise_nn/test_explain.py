"""torch_ctxext.explain: why an entry of ctx.input_grad_buffers is None.

Every reason explain() can give is produced here by building the situation:
on the CPU in this process, and the accelerator ones (``refused``,
``streams_unrecorded``, ``later_producers_unvalidated``) on the test device
in a fresh interpreter. ``later_producers_unvalidated`` without a device:
test_hardening_engine_hooks.py. Not built: ``nested`` (a strided nested
tensor cannot be an argument of a custom Function: apply raises
"NestedTensorImpl doesn't support sizes"; a jagged one is a tensor subclass
and is reported as ``subclass``, tested).

The extension gives each reason as a code and its detail (owner counts,
the refusal's kind and streams); the sentences are Python's.
"""
import importlib.util
import json
import threading

import pytest
import torch
from torch.autograd.function import FunctionCtx
from torch.utils._pytree import tree_map

import torch_ctxext
from torch_ctxext._ext import loader as _extension
from torch_ctxext._explain import explain
from support import python

BACKPORT = torch_ctxext.features()["input_grad_buffers"] == "torch_ctxext"
needs_extension = pytest.mark.skipif(
    not BACKPORT,
    reason="detailed reasons come from torch_ctxext's C++ extension (torch 2.13/2.14); "
    "this torch provides input_grad_buffers natively and the extension is not loaded",
)
native_only = pytest.mark.skipif(BACKPORT, reason="what explain() says without the extension")


class Probe(torch.autograd.Function):
    """Sum of its tensor arguments; its backward records explain(ctx) before
    reading ctx.input_grad_buffers, after reading it (still holding the
    tuple) and with the tuple passed as buffers=; it fuses where it can."""

    seen = {}

    @staticmethod
    def forward(ctx, *args):
        return sum(a for a in args if isinstance(a, torch.Tensor)) * 1.0

    @staticmethod
    def backward(ctx, g):
        seen = Probe.seen
        if BACKPORT:  # the extension's (code, detail) per argument
            seen["raw"] = _extension.load().explain_input_grad_buffers(ctx)
        seen["before"] = explain(ctx)
        buffers = ctx.input_grad_buffers
        seen["read"] = tuple(b is not None for b in buffers)
        if BACKPORT:
            seen["holding"] = explain(ctx)
        seen["passed"] = explain(ctx, buffers=buffers)
        grads = []
        for need, b in zip(ctx.needs_input_grad, buffers):
            if b is not None:
                b.add_(g)
                grads.append(None)
            else:
                grads.append(g if need else None)
        return tuple(grads)


class Produce(torch.autograd.Function):
    """Identity whose backward hands ``make(g)`` to x: the gradient another
    consumer puts in the buffer."""

    @staticmethod
    def forward(ctx, x, make):
        ctx.make = make
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return ctx.make(g), None


class Wrapper(torch.Tensor):
    """A minimal __torch_dispatch__ subclass (a plain as_subclass tensor is no
    subclass to the engine: it has no Python dispatch key)."""

    @staticmethod
    def __new__(cls, elem):
        r = torch.Tensor._make_wrapper_subclass(
            cls, elem.shape, dtype=elem.dtype, device=elem.device, strides=elem.stride()
        )
        r.elem = elem
        return r

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.elem if isinstance(t, Wrapper) else t  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


def leaves(n=3, k=2):
    gen = torch.Generator().manual_seed(0)
    return [torch.rand(n, generator=gen).requires_grad_() for _ in range(k)]


def run(build, **backward_kwargs):
    Probe.seen = {}
    build().backward(**backward_kwargs)
    return Probe.seen


C = torch.rand(3)


# --- inside a backward: explain(ctx), with the extension -------------------------


@needs_extension
def test_exposed_and_no_earlier_producer():
    x, z = leaves()
    seen = run(lambda: Probe.apply(x, z).sum() + (x * C).sum())
    before = seen["before"]
    assert before.codes == ("exposed", "no_earlier_producer")
    assert before[0].exposed and not before[1].exposed
    assert "no earlier producer" in before[1].text
    assert "consumers of the input created after this Function" in before[1].text
    assert seen["read"] == (True, False)
    assert seen["raw"] == [("exposed", {}), ("no_earlier_producer", {})]
    assert before[1].detail == {}
    assert "[1] None: no earlier producer" in str(before)
    assert str(before).startswith("ctx.input_grad_buffers of Probe:")
    torch.testing.assert_close(x.grad, torch.ones(3) + C)


@needs_extension
@pytest.mark.parametrize("names_what_it_wraps", [True, False])
def test_the_reasons_are_the_extensions_where_something_wrapped_the_property(monkeypatch, names_what_it_wraps):
    """A profiler or a debugging patch that wrapped ctx.input_grad_buffers
    (with functools.wraps or not) leaves explain(ctx) and the report of
    `with explain()` with the extension's reasons."""
    real = FunctionCtx.__dict__["input_grad_buffers"]

    def wrapped(ctx):
        return real.fget(ctx)

    if names_what_it_wraps:
        wrapped.__wrapped__ = real.fget
    monkeypatch.setattr(FunctionCtx, "input_grad_buffers", property(wrapped))
    x, z = leaves()
    assert run(lambda: Probe.apply(x, z).sum() + (x * C).sum())["before"].codes == ("exposed", "no_earlier_producer")
    with explain() as report:
        run(lambda: Probe.apply(x, z).sum() + (x * C).sum())
    assert report[Probe].reasons["no earlier producer"] == 1, report


@needs_extension
def test_not_a_tensor_argument():
    x, _ = leaves()
    seen = run(lambda: Probe.apply(x, 3).sum())
    assert seen["before"][1].code == "not_a_tensor"
    assert seen["before"][1].text == "None: not a tensor argument"


@needs_extension
def test_does_not_require_grad():
    x, _ = leaves()
    seen = run(lambda: Probe.apply(x, C).sum())
    assert seen["before"][1].code == "no_gradient"
    assert "does not require grad" in seen["before"][1].text


@needs_extension
def test_not_needed_by_this_backward():
    x, z = leaves()
    seen = run(lambda: Probe.apply(x, z).sum() + (x * C).sum(), inputs=[z])
    assert seen["before"][0].code == "not_needed"
    assert "backward(inputs=...)" in seen["before"][0].text


@needs_extension
def test_not_dense_expanded_gradient_of_sum():
    x, z = leaves()
    seen = run(lambda: Probe.apply(x, z).sum() + x.sum())
    assert seen["before"][0].code == "not_dense"
    assert "not dense (expanded, overlapping)" == seen["before"][0].label


@needs_extension
def test_shared_with_another_tensor_names_the_owner_count():
    x, z = leaves()
    # add hands one gradient tensor to both of its inputs
    seen = run(lambda: Probe.apply(x, z).sum() + ((x + z) * C).sum())
    reason = seen["before"][0]
    assert seen["raw"][0] == ("shared", {"owners": 1})  # a count, not a sentence
    assert reason.code == "shared" and reason.owners == 1 and reason.detail == {"owners": 1}
    assert reason.label == "shared with another tensor (1 other owner)"
    assert "shared with another tensor (1 other owner:" in reason.text


@needs_extension
def test_storage_shared_views_of_one_storage():
    x, z = leaves()
    seen = run(lambda: Probe.apply(x, z).sum() + (torch.stack([x, z]) * C).sum())
    reason = seen["before"][0]
    assert seen["raw"][0] == ("storage_shared", {"owners": 2})
    assert reason.code == "storage_shared" and reason.owners == 2
    assert reason.label == "shared with another tensor (its storage has 2 other owners)"
    assert "storage is shared with another tensor (2 other owners" in reason.text


@needs_extension
def test_a_subclass_gradient():
    x, z = leaves()
    seen = run(lambda: Probe.apply(x, z).sum() + Produce.apply(x, lambda g: Wrapper(g * 1)).sum())
    assert seen["before"][0].code == "subclass"
    assert seen["before"][0].label == "a subclass"


@needs_extension
def test_a_jagged_nested_tensor_is_a_subclass():
    nt = torch.nested.nested_tensor(
        [torch.rand(2), torch.rand(3)], layout=torch.jagged, requires_grad=True
    )

    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a * 2

        @staticmethod
        def backward(ctx, g):
            Probe.seen["before"] = explain(ctx)
            return g * 2

    Probe.seen = {}
    y = Twice.apply(nt)
    z = nt * 3
    (y.values().sum() + z.values().sum()).backward()
    assert Probe.seen["before"].codes == ("subclass",)


@needs_extension
def test_a_zero_tensor_gradient():
    x, z = leaves()
    seen = run(
        lambda: Probe.apply(x, z).sum()
        + Produce.apply(x, lambda g: torch._efficientzerotensor(g.shape)).sum()
    )
    assert seen["before"][0].code == "zero_tensor"
    assert seen["before"][0].label == "a zero tensor"


@needs_extension
def test_same_slot_through_two_arguments():
    x, _ = leaves()
    seen = run(lambda: Probe.apply(x, x).sum() + (x * C).sum())
    assert seen["before"].codes == ("exposed", "same_slot")
    assert seen["raw"][1] == ("same_slot", {"argument": 0})
    assert seen["read"] == (True, False)
    assert "same gradient slot as argument 0" in seen["before"][1].text
    assert seen["before"][1].detail == {"argument": 0}
    assert seen["holding"].codes == ("shared", "same_slot")  # read, still held
    assert seen["passed"].codes == ("exposed", "same_slot")
    torch.testing.assert_close(x.grad, 2 * torch.ones(3) + C)


@needs_extension
def test_after_reading_a_held_buffer_counts_as_an_owner_and_the_text_says_so():
    x, z = leaves()
    seen = run(lambda: Probe.apply(x, z).sum() + (x * C).sum())
    holding = seen["holding"][0]
    assert holding.code == "shared" and holding.owners == 1
    assert holding.label == "shared with another tensor (1 other owner)"  # the note is in the text only
    assert "call torch_ctxext.explain(ctx) before reading" in holding.text
    # Passing what was read gives the right answer.
    assert seen["passed"].codes == ("exposed", "no_earlier_producer")


# --- on an accelerator: the test device, in a fresh interpreter ---------------------
#
# The device must be registered before the first backward() of a process, and
# this one has run many. One interpreter builds the three situations; each
# records explain(ctx)'s first reason and what reading ctx.input_grad_buffers
# then gave (the entries' presence, or the error it raised).

ON_THE_DEVICE = """
import json, os, sys
import torch, torch_ctxext_testdevice
import torch_ctxext
from torch.autograd import Function
from torch_ctxext import _features, explain

device = torch.device("testdevice:0")
td = torch.testdevice
out = {"exposure": _features.buffer_exposure()}


def record(name, ctx):
    reason = explain(ctx)[0]
    try:
        read = [b is not None for b in ctx.input_grad_buffers]
    except RuntimeError as e:
        read = str(e)
    out[name] = {"code": reason.code, "detail": reason.detail, "text": reason.text,
                 "label": reason.label, "read": read}
    return read


# 1. x's slot filled on the default stream, the Function's node on a side stream.
class OnSideStream(Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        record("stream", ctx)
        return g * 2


x = torch.ones(3, device=device, requires_grad=True)
side = td.Stream(device)
with td.stream(side):
    y = OnSideStream.apply(x)
td.current_stream(device).wait_stream(side)
(y.sum() + (x * 3).sum()).backward()
out["side"] = side.stream_id


# 2. A CPU buffer reaching a node on the device's thread (it has a stream).
class ToDevice(Function):
    @staticmethod
    def forward(ctx, x):
        return x.to(device) * 2

    @staticmethod
    def backward(ctx, g):
        record("cpu_buffer", ctx)
        return (g * 2).cpu()


x = torch.ones(3, requires_grad=True)
(ToDevice.apply(x).sum().cpu() + (x * 3).sum()).backward()


# 3. x's CPU slot exposed by CpuScale on the CPU thread, then read by
# ToDeviceOnly on the device's thread (it runs after CpuScale, whose
# gradient it needs).
class ToDeviceOnly(Function):
    @staticmethod
    def forward(ctx, x):
        return x.to(device)

    @staticmethod
    def backward(ctx, g):
        record("other_thread", ctx)
        return g.cpu()


class CpuScale(Function):
    @staticmethod
    def forward(ctx, x, w):
        return x * 2 + w.cpu()

    @staticmethod
    def backward(ctx, g):
        buffer, _ = ctx.input_grad_buffers
        out["exposing"] = explain(ctx, buffers=(buffer, None))[0].code
        if buffer is not None:
            buffer.add_(g * 2)
            return None, g.to(device)
        return g * 2, g.to(device)


x = torch.ones(3, requires_grad=True)
try:  # the engine hook refuses ToDeviceOnly's own gradient where it is placed
    (CpuScale.apply(x, ToDeviceOnly.apply(x)).sum() + (x * 3).sum()).backward()
except RuntimeError as e:
    out["backward"] = str(e)
print(json.dumps(out))
sys.stdout.flush()
os._exit(0)  # see test_testdevice.py: shutdown with device threads is not under test
"""


@pytest.fixture(scope="module")
def on_the_device():
    if not BACKPORT:
        pytest.skip("explain()'s accelerator reasons come from torch_ctxext's extension")
    if importlib.util.find_spec("torch_ctxext_testdevice") is None:
        pytest.skip("the test device is not installed (tools/run.py installs it)")
    done = python(code=ON_THE_DEVICE)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def stream(device, stream_id):
    return [device, stream_id]  # a (device, id) tuple; JSON makes it a list


def test_a_slot_on_another_stream_is_refused_and_the_text_quotes_the_error(on_the_device):
    seen = on_the_device["stream"]
    if not on_the_device["exposure"]["accelerator_slots"]:  # torch 2.6, 2.7
        assert seen["code"] == "streams_unrecorded" and seen["detail"] == {}
        assert seen["label"] == "accelerator buffer, streams not recorded (torch < 2.8)"
        assert seen["read"] == [False]
        return
    side = on_the_device["side"]
    assert seen["code"] == "refused" and seen["label"] == "refused (thread or stream)"
    assert seen["detail"] == {
        "kind": "stream",
        "producer_stream": stream("testdevice:0", side),
        "consumer_stream": stream("testdevice:0", side),
        "accumulation_stream": stream("testdevice:0", side),
        "ready_stream": stream("testdevice:0", 0),
        "message": seen["read"],
    }
    assert seen["read"].startswith("Direct InputBuffer accumulation requires the same stream")
    assert seen["text"] == (
        "refused: reading ctx.input_grad_buffers raises here, because direct accumulation "
        f"into this buffer would cross an engine thread or stream ({seen['read']})"
    )


def test_a_cpu_buffer_on_the_device_thread_is_refused_with_the_streams_it_saw(on_the_device):
    seen = on_the_device["cpu_buffer"]
    assert seen["code"] == "refused"
    assert seen["detail"] == {
        "kind": "streams_present",
        "producer_stream_present": True,
        "consumer_stream_present": False,
        "message": seen["read"],
    }
    assert seen["read"] == (
        "Direct InputBuffer accumulation for a non-accelerator buffer requires producer and "
        "consumer streams to be absent, but got producer stream present: 1 and consumer "
        "stream present: 0"
    )
    assert seen["text"].endswith(f"({seen['read']})")


def test_a_slot_exposed_on_another_engine_thread_is_refused_naming_both_threads(on_the_device):
    seen = on_the_device["other_thread"]
    if not on_the_device["exposure"]["later_producer_slots"]:  # torch 2.6 to 2.9
        # CpuScale's slot, which ToDeviceOnly still reaches, was not exposed,
        # so no thread recorded it: the device thread's stream is refused.
        assert on_the_device["exposing"] == "later_producers_unvalidated"
        assert seen["code"] == "refused" and seen["detail"]["kind"] == "streams_present"
        assert "backward" not in on_the_device
        return
    assert on_the_device["exposing"] == "exposed"
    assert seen["code"] == "refused"
    detail = seen["detail"]
    assert detail["kind"] == "thread" and set(detail) == {"kind", "exposing_thread", "accessing_thread", "message"}
    assert detail["exposing_thread"] != detail["accessing_thread"]
    assert seen["read"] == (
        "Direct InputBuffer accumulation requires the same autograd engine thread, but the "
        f"buffer was exposed on thread {detail['exposing_thread']} and is now being accessed "
        f"on thread {detail['accessing_thread']}"
    )
    assert seen["text"].endswith(f"({seen['read']})")
    # The producer's own gradient then meets the engine hook: the same refusal.
    assert on_the_device["backward"].startswith(seen["read"])


# --- without the extension (native torch 2.15) --------------------------------------


@native_only
def test_native_exposed_same_slot_and_unknown():
    x, z = leaves()
    seen = run(lambda: Probe.apply(x, z).sum() + (x * C).sum())
    assert seen["before"].codes == ("exposed", "unknown")
    assert "needs" not in seen["before"][0].text
    assert "only with its C++ extension (torch 2.6 to 2.14)" in seen["before"][1].text  # _releases' range
    seen = run(lambda: Probe.apply(x, x).sum() + (x * C).sum())
    assert seen["before"].codes == ("exposed", "same_slot")
    assert seen["passed"].codes == ("exposed", "same_slot")


@native_only
def test_native_not_a_tensor_no_gradient_not_needed():
    x, z = leaves()
    assert run(lambda: Probe.apply(x, 3).sum())["before"][1].code == "not_a_tensor"
    assert run(lambda: Probe.apply(x, C).sum())["before"][1].code == "no_gradient"
    assert run(lambda: Probe.apply(x, C, 3).sum())["before"].codes[1:] == (
        "no_gradient_or_not_a_tensor",
        "no_gradient_or_not_a_tensor",
    )
    seen = run(lambda: Probe.apply(x * 1, z).sum(), inputs=[z])
    assert seen["before"][0].code == "not_needed"


@native_only
def test_native_a_tensor_without_grad_and_a_non_tensor_are_told_apart_where_the_order_shows_which():
    # next_functions has an entry (without a node) for C before x's, none
    # after it: C is the tensor, 3 and 4 are not.
    x, _ = leaves()
    codes = run(lambda: Probe.apply(C, x, 3, 4).sum())["before"].codes
    assert (codes[0], codes[2], codes[3]) == ("no_gradient", "not_a_tensor", "not_a_tensor")
    codes = run(lambda: Probe.apply(3, C, x, C).sum())["before"].codes
    assert (codes[0], codes[1], codes[3]) == ("no_gradient_or_not_a_tensor",) * 2 + ("no_gradient",)


# --- both ---------------------------------------------------------------------------


def test_explain_outside_backward_raises_like_the_property():
    x, _ = leaves()
    y = Probe.apply(x, 3)
    with pytest.raises(RuntimeError, match="only be accessed while autograd is executing backward"):
        explain(y.grad_fn)


def test_buffers_without_ctx_is_refused():
    with pytest.raises(TypeError):
        explain(buffers=(None,))


# --- around a backward: with explain() as report -------------------------------------


class Fused(torch.autograd.Function):
    """x * w, fusing x's gradient when it can."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        (w,) = ctx.saved_tensors
        x_buffer, _ = ctx.input_grad_buffers
        if x_buffer is not None:
            x_buffer.addcmul_(g, w)
            return None, None
        return g * w, None


def test_report_counts_exposed_and_fallbacks_per_function():
    x, w = leaves()
    prop = FunctionCtx.__dict__["input_grad_buffers"]
    with explain() as report:
        assert FunctionCtx.__dict__["input_grad_buffers"] is not prop
        (Fused.apply(x, w.detach()).sum() + (x * C).sum()).backward()  # exposed
        Fused.apply(x, w.detach()).sum().backward()  # no earlier producer
        (Fused.apply(x, w.detach()).sum() + x.sum()).backward()  # not dense
    assert FunctionCtx.__dict__["input_grad_buffers"] is prop
    stats = report[Fused]
    assert (stats.reads, stats.exposed, stats.fell_back, stats.not_applicable) == (3, 1, 2, 3)
    assert report.exposed == 1 and report.fell_back == 2
    assert stats.reasons["does not require grad"] == 3
    if BACKPORT:
        assert stats.reasons["no earlier producer"] == 1
        assert stats.reasons["not dense (expanded, overlapping)"] == 1
        assert "no earlier producer" in str(report)
    else:
        assert stats.reasons["None (reason needs torch_ctxext's extension)"] == 2
    text = str(report)
    assert text.startswith("input_grad_buffers, per Function:")
    assert "Fused: 3 read(s), 1 exposed, 2 fell back" in text


def test_report_explanation_is_taken_before_the_read():
    # Inside the block the reasons are computed before the getter hands the
    # buffer out, so an exposed entry is never reported as shared.
    x, z = leaves()
    with explain() as report:
        run(lambda: Probe.apply(x, z).sum() + (x * C).sum())
    assert report[Probe].exposed == 1
    assert report[Probe].reads == 1  # explain(ctx)'s own reads are not counted
    assert all("shared" not in label for label in report[Probe].reasons)


def test_nested_blocks_and_restore_on_error():
    x, w = leaves()
    prop = FunctionCtx.__dict__["input_grad_buffers"]
    with explain() as outer:
        with pytest.raises(ValueError):
            with explain() as inner:
                (Fused.apply(x, w.detach()).sum() + (x * C).sum()).backward()
                raise ValueError
        assert FunctionCtx.__dict__["input_grad_buffers"] is not prop  # outer still active
        Fused.apply(x, w.detach()).sum().backward()
    assert FunctionCtx.__dict__["input_grad_buffers"] is prop
    assert inner[Fused].reads == 1 and outer[Fused].reads == 2
    assert Fused not in explain().report  # a fresh session is empty


def test_reads_on_other_threads_are_counted():
    x, w = leaves()

    def work():
        (Fused.apply(x, w.detach()).sum() + (x * C).sum()).backward()

    with explain() as report:
        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert report[Fused].reads == 4 and report[Fused].exposed == 4


def test_an_empty_report_says_so():
    with explain() as report:
        pass
    assert str(report) == "input_grad_buffers: no Function read ctx.input_grad_buffers"
