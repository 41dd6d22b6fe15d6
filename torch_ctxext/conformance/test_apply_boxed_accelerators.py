"""Boxed grads (``boxed_grads_call = True``) on an accelerator.

The engine hands the grads to ``apply_boxed`` in one mutable list, also when
the node runs on a device's engine thread and stream. Needs an accelerator
(``--ctx-device``); skipped on the CPU.
"""
import weakref

import pytest
import torch
from torch.autograd import Function

try:
    from . import _device
    from ._helpers import HAS_BOXED_GRADS
except ImportError:  # run as plain files
    import _device
    from _helpers import HAS_BOXED_GRADS

pytestmark = [
    pytest.mark.accelerator,
    pytest.mark.skipif(not HAS_BOXED_GRADS, reason="this torch has no boxed grads call"),
]


@pytest.mark.parametrize("where", _device.PLACES)
def test_backward_receives_the_device_grads_in_one_list_it_may_free(where):
    """The grads arrive as a list of the device's tensors, on the forward's
    stream; clearing the list frees them while backward still runs."""
    device, stream = _device.place(where)
    seen = {}

    class Fanout(Function):
        boxed_grads_call = True

        @staticmethod
        def forward(ctx, x):
            return x * 1, x * 2

        @staticmethod
        def backward(ctx, grads):
            seen["list"] = type(grads) is list
            seen["devices"] = [g.device for g in grads]
            seen["stream"] = _device.current_stream(device)
            total = grads[0] + 2 * grads[1]
            refs = [weakref.ref(g) for g in grads]
            grads.clear()
            seen["freed"] = all(r() is None for r in refs)
            return total

    x = torch.tensor([1.0, 2.0], device=device, requires_grad=True)
    a, b = _device.run_on(stream, lambda: Fanout.apply(x))
    ((a * 3).sum() + (b * 5).sum()).backward()
    _device.synchronize()
    assert seen["list"] and seen["devices"] == [device, device]
    assert seen["stream"] == (stream if stream is not None else _device.current_stream(device))
    assert seen["freed"]
    torch.testing.assert_close(x.grad.cpu(), torch.full((2,), 13.0, device="cpu"))
