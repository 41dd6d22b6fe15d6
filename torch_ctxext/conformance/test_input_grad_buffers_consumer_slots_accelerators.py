"""``ctx.input_grad_buffers`` on an accelerator: each slot of a consumer is judged on its own.

A producer with several outputs (a Function returning two tensors,
``unbind``) is one consumer node with one buffer slot per output. A Function
fed by its second output reads slot 1 of that consumer. The engine records
the accumulation and ready streams of each slot separately, and an exposure
is of one slot: a producer that adds to that slot later is checked against
it, when the engine adds its gradient, while a producer adding to another
slot of the same consumer is not. Every test here needs an accelerator
(``--ctx-device cuda``, ``--ctx-device testdevice``, ...) and is skipped on
the CPU.

Where a release's route leaves a slot ``None`` (torch_ctxext on torch 2.6 and
2.7: every accelerator slot; on 2.6 to 2.9: slots that later producers still
reach, in a process with accelerators), the test checks that the slot is
``None`` and the gradients are still exact (``buffer_exposure``,
docs/compatibility.md).
"""
import contextlib

import pytest
import torch
from torch.autograd import Function

try:
    from . import _device
except ImportError:  # run as plain files
    import _device

pytestmark = pytest.mark.accelerator

DIRECT = "Direct InputBuffer accumulation"


class TwoOutputs(Function):
    """x * 1 and x * 2: one node, whose two inputs in backward are two slots."""

    @staticmethod
    def forward(ctx, x):
        return x * 1, x * 2

    @staticmethod
    def backward(ctx, grad_a, grad_b):
        return grad_a + 2 * grad_b


# Producers with two outputs: (the outputs of x, x's gradient for the given
# per-element gradients of the two outputs, x's shape).
PRODUCERS = {
    "two-output Function": (TwoOutputs.apply, lambda ga, gb: [ga + 2 * gb] * 3, (3,)),
    "unbind": (lambda x: x.unbind(0), lambda ga, gb: [[ga] * 3, [gb] * 3], (2, 3)),
}


def make_fuse(record):
    """t * 3, whose backward records its entries and accumulates into t's
    buffer where it is exposed."""

    class Fuse(Function):
        @staticmethod
        def forward(ctx, t):
            return t * 3

        @staticmethod
        def backward(ctx, g):
            (buffer,) = ctx.input_grad_buffers
            record.append(buffer)
            if buffer is not None:
                buffer.add_(g * 3)
                return None
            return g * 3

    return Fuse


def exposed(record):
    return [entry is not None for entry in record]


def leaf(producer):
    _, _, shape = PRODUCERS[producer]
    return torch.ones(shape, device=_device.selected(), requires_grad=True)


def expected_grad(producer, grad_a, grad_b):
    _, x_grad, _ = PRODUCERS[producer]
    return torch.tensor(x_grad(float(grad_a), float(grad_b)), device="cpu")


def later_producer(where, t):
    """(t * 7).sum(), computed before the Function so that its backward runs
    after it: on a side stream of t's device, or on the second device (its
    nodes run on that device's engine thread, which then adds t's gradient)."""
    if where == "another stream":
        side = _device.new_stream(t.device)
        with _device.stream(side):
            early = (t * 7).sum()
        _device.current_stream(t.device).wait_stream(side)
        return early, side
    second = _device.second_device_or_skip()
    return (t.to(second) * 7).sum().to(t.device), None


def raises_if(refused):
    return pytest.raises(RuntimeError) if refused else contextlib.nullcontext()


def exposed_before_later_producers(buffer_exposure):
    """Whether this release's route exposes an accelerator slot whose
    consumer a later producer will still reach."""
    return buffer_exposure["accelerator_slots"] and buffer_exposure["later_producer_slots"]


# --- a later producer reaching an exposed slot 1 ---------------------------------


@pytest.mark.parametrize("producer", PRODUCERS)
def test_a_later_producer_of_an_exposed_slot_1_on_the_same_thread_and_stream_accumulates(producer, buffer_exposure):
    """Slot 1 of a two-output producer, exposed while its slot 0 is still
    empty and while a producer created earlier has yet to add to slot 1: that
    producer runs later on the same device thread and stream, so its
    contribution accumulates into the fused buffer exactly."""
    split, _, _ = PRODUCERS[producer]
    record = []
    Fuse = make_fuse(record)
    x = leaf(producer)
    a, b = split(x)
    ((b * 7).sum() + Fuse.apply(b).sum() + (b * 5).sum()).backward()
    _device.synchronize()
    assert exposed(record) == [exposed_before_later_producers(buffer_exposure)]
    if record[0] is not None:
        assert record[0].device == x.device
    torch.testing.assert_close(x.grad.cpu(), expected_grad(producer, 0, 7 + 3 + 5))


def refusal_text(where, device, side):
    """(2.15's text for a later producer refused at slot 1, whether it is the
    whole text): a prefix where the text holds thread ids or CUDA's stream
    handles."""
    if where == "another engine thread":
        return f"{DIRECT} requires the same autograd engine thread, but the buffer was exposed on thread ", False
    if device.type == "cuda":  # CUDA names its streams by handle, not by a small id
        return f"{DIRECT} requires the same stream", False
    default = _device.current_stream(device).stream_id
    return (
        f"{DIRECT} requires the same stream, but got producer stream {side.stream_id} on device "
        f"{device}, consumer stream {default} on device {device}, accumulation stream {default} "
        f"on device {device}, and ready stream {default} on device {device}"
    ), True


@pytest.mark.parametrize("where", ["another stream", "another engine thread"])
@pytest.mark.parametrize("producer", PRODUCERS)
def test_a_later_producer_of_an_exposed_slot_1_on_another_stream_or_engine_thread_is_refused(
    producer, where, buffer_exposure
):
    """Slot 1 exposed on the device's default stream and engine thread; a
    producer created earlier on a side stream, or on the second device (whose
    engine thread then adds its gradient), reaches slot 1 later: the engine
    refuses that gradient when it adds it, with 2.15's text, which names the
    producer's stream and slot 1's consumer, accumulation and ready streams,
    or the two threads."""
    split, _, _ = PRODUCERS[producer]
    record = []
    Fuse = make_fuse(record)
    x = leaf(producer)
    a, b = split(x)
    early, side = later_producer(where, b)
    refused = exposed_before_later_producers(buffer_exposure)
    with raises_if(refused) as error:
        (early + Fuse.apply(b).sum() + (b * 5).sum()).backward()
    _device.synchronize()
    assert exposed(record) == [refused]
    if not refused:  # the slot stayed None: nothing to refuse, gradients exact
        torch.testing.assert_close(x.grad.cpu(), expected_grad(producer, 0, 7 + 3 + 5))
        return
    text, whole = refusal_text(where, x.device, side)
    message = str(error.value)
    assert message == text if whole else message.startswith(text), message


# --- a later producer reaching the slot that was not exposed ---------------------


@pytest.mark.parametrize("where", ["another stream", "another engine thread"])
@pytest.mark.parametrize("producer", PRODUCERS)
def test_a_later_producer_of_the_other_slot_is_not_checked_against_slot_0s_exposure(producer, where, buffer_exposure):
    """Slot 0 exposed; a producer created earlier on another stream or engine
    thread reaches slot 1 of the same consumer later. Slot 1 was never
    exposed, so the engine accumulates that gradient as it always does: no
    error, and every gradient is exact."""
    split, _, _ = PRODUCERS[producer]
    record = []
    Fuse = make_fuse(record)
    x = leaf(producer)
    a, b = split(x)
    early, _ = later_producer(where, b)
    (early + Fuse.apply(a).sum() + (a * 5).sum() + (b * 2).sum()).backward()
    _device.synchronize()
    # Slot 0 is reached by no later producer, but its consumer still waits
    # for one (slot 1's): where later producers cannot be validated, None.
    assert exposed(record) == [exposed_before_later_producers(buffer_exposure)]
    torch.testing.assert_close(x.grad.cpu(), expected_grad(producer, 3 + 5, 7 + 2))


# --- the streams recorded for each slot ---------------------------------------------


class OnTwoDevices(Function):
    """x * 1 on x's device and x * 2 on another: one consumer whose slot 0
    accumulates on its own stream and slot 1 on the other device's."""

    @staticmethod
    def forward(ctx, x, other):
        return x * 1, (x * 2).to(other)

    @staticmethod
    def backward(ctx, grad_a, grad_b):
        return grad_a + 2 * grad_b.to(grad_a.device), None


def test_slot_1_is_judged_by_its_own_accumulation_stream(buffer_exposure):
    """A producer whose two outputs live on two devices: slot 0 (on the
    consumer's device) accumulates on the consumer's stream, slot 1 on the
    stream of its first producer, on the second device. Reading slot 1 from a
    node on the second device is refused, with 2.15's text, which names slot
    1's own accumulation stream, though slot 0 was filled first."""
    first = _device.selected()
    second = _device.second_device_or_skip()
    record = []
    Fuse = make_fuse(record)
    x = torch.ones(3, device=first, requires_grad=True)
    a, b = OnTwoDevices.apply(x, second)
    # Backward runs a * 7 (created last) on the first device before it hands
    # b's gradients to the second device's thread: slot 0 is filled first.
    loss = Fuse.apply(b).sum().to(first) + (b * 5).sum().to(first) + (a * 7).sum()
    refused = buffer_exposure["accelerator_slots"]
    with raises_if(refused) as error:
        loss.backward()
    _device.synchronize()
    if not refused:  # no accelerator slot is exposed on this release's route
        assert exposed(record) == [False]
        torch.testing.assert_close(x.grad.cpu(), torch.full((3,), 7.0 + 2 * (3 + 5), device="cpu"))
        return
    assert record == []  # the read raised
    on_first = _device.current_stream(first).stream_id
    on_second = _device.current_stream(second).stream_id
    expected = (
        f"{DIRECT} requires the same stream, but got producer stream {on_second} on device {second}, "
        f"consumer stream {on_first} on device {first}, accumulation stream {on_second} on device "
        f"{second}, and ready stream {on_second} on device {second}"
    )
    if first.type == "cuda":
        assert str(error.value).startswith(f"{DIRECT} requires the same stream"), error.value
    else:
        assert str(error.value) == expected
