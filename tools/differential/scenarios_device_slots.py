"""Differential scenarios on an accelerator: the slots of a multi-output producer.

A producer with two outputs (a two-output Function, ``unbind``) is one
consumer with two buffer slots. These scenarios expose slot 1 of such a
consumer (or slot 0, with a later producer reaching slot 1) and let a
producer created earlier reach the slot later: on the same stream, on
another stream, from another engine thread (the second device's). One more
puts the consumer's two slots on two devices, so that they accumulate on
different streams. Each observes what a user would: which entries the
Function's backward got, the error text, the gradient of the leaf.

Registered into scenarios_device.DEVICE_SCENARIOS (``run.py --device``);
``DEVICE`` is read from there when a scenario runs.
"""
import torch
from torch.autograd import Function

import scenarios_device as device_scenarios
from scenarios_device import describe_entries, read, values


def _module():
    return getattr(torch, device_scenarios.DEVICE.type)


class TwoOutputs(Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1, x * 2

    @staticmethod
    def backward(ctx, grad_a, grad_b):
        return grad_a + 2 * grad_b


PRODUCERS = {  # name: (x's shape, the two outputs of x)
    "two_output_function": ((3,), TwoOutputs.apply),
    "unbind": ((2, 3), lambda x: x.unbind(0)),
}


def fusing(record):
    """t * 3; backward records its entries and fuses into t's exposed buffer."""

    class Fuse(Function):
        @staticmethod
        def forward(ctx, t):
            return t * 3

        @staticmethod
        def backward(ctx, g):
            entries = read(ctx)
            record.append(describe_entries(entries))
            if isinstance(entries, str):
                raise RuntimeError(entries)
            if entries[0] is not None:
                entries[0].add_(g * 3)
                return None
            return g * 3

    return Fuse


def error_text(e):
    """The error, without the thread ids of a thread refusal (they differ run to run)."""
    text = str(e)
    return text.split(" on thread ", 1)[0] if "engine thread" in text else text


def observe(x, record, backward):
    """Run ``backward``; the leaf's gradient or the error, and what was read."""
    out = {}
    try:
        backward()
        _module().synchronize()
        out["x_grad"] = values(x.grad)
    except RuntimeError as e:
        out["error"] = error_text(e)
    out["reads"] = record
    return out


def later_producer(where, t):
    """(t * 7).sum(), created before the Function so that it reaches t's slot
    after it: on the same stream, a side stream, or the second device's thread."""
    if where == "same_stream":
        return (t * 7).sum()
    if where == "other_stream":
        side = _module().Stream(t.device)
        with _module().stream(side):
            early = (t * 7).sum()
        _module().current_stream(t.device).wait_stream(side)
        return early
    if where == "other_thread":
        second = torch.device(t.device.type, 1)
        return (t.to(second) * 7).sum().to(t.device)
    raise ValueError(where)


def _slot_scenario(producer, fused_slot, where):
    def run():
        shape, split = PRODUCERS[producer]
        record = []
        Fuse = fusing(record)
        x = torch.ones(shape, device=device_scenarios.DEVICE, requires_grad=True)
        a, b = split(x)
        early = later_producer(where, b)  # always into slot 1
        fused = b if fused_slot == 1 else a
        loss = early + Fuse.apply(fused).sum() + (fused * 5).sum() + (b * 2).sum()
        return observe(x, record, loss.backward)

    name = f"device_slots_{producer}_slot{fused_slot}_exposed_later_into_slot1_{where}"
    device_scenarios.DEVICE_SCENARIOS.append((name, run))


for _producer in PRODUCERS:
    for _where in ("same_stream", "other_stream", "other_thread"):
        _slot_scenario(_producer, 1, _where)
    for _where in ("other_stream", "other_thread"):
        _slot_scenario(_producer, 0, _where)


class OnTwoDevices(Function):
    @staticmethod
    def forward(ctx, x, other):
        return x * 1, (x * 2).to(other)

    @staticmethod
    def backward(ctx, grad_a, grad_b):
        return grad_a + 2 * grad_b.to(grad_a.device), None


def slot1_on_another_device_than_its_consumer():
    """Slot 0 on the consumer's device (its stream), slot 1 on the second
    device (its first producer's stream), slot 0 filled first; slot 1 read
    from the second device's thread."""
    first = device_scenarios.DEVICE
    second = torch.device(first.type, 1)
    record = []
    Fuse = fusing(record)
    x = torch.ones(3, device=first, requires_grad=True)
    a, b = OnTwoDevices.apply(x, second)
    loss = Fuse.apply(b).sum().to(first) + (b * 5).sum().to(first) + (a * 7).sum()
    return observe(x, record, loss.backward)


device_scenarios.DEVICE_SCENARIOS.append(
    ("device_slots_two_output_function_slot1_on_another_device_than_its_consumer",
     slot1_on_another_device_than_its_consumer)
)
