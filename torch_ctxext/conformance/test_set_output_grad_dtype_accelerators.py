"""``ctx.set_output_grad_dtype`` on an accelerator.

A declaration applies to the gradient the engine hands to backward wherever
the Function runs: on a side stream, on a second device, on the device's own
engine thread. Needs an accelerator (``--ctx-device``); skipped on the CPU.
"""
import pytest
import torch
from torch.autograd import Function

try:
    from . import _device
except ImportError:  # run as plain files
    import _device

pytestmark = pytest.mark.accelerator

PLACES, place, run_on = _device.PLACES, _device.place, _device.run_on


@pytest.mark.parametrize("declared", [torch.float64, torch.float16, torch.bfloat16, None])
@pytest.mark.parametrize("where", PLACES)
def test_each_declaration_applies_to_the_gradient_backward_receives_on_the_device(where, declared):
    """The gradient reaching backward has the declared dtype (``None``: the
    root gradient's own, uncast), is on the output's device, and backward
    runs on the stream its forward ran on."""
    device, stream = place(where)
    seen = {}

    class Declared(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.set_output_grad_dtype(declared)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            seen["dtype"], seen["device"] = g.dtype, g.device
            seen["stream"] = _device.current_stream(g.device)
            return (g * 2).to(torch.float32)

    x = torch.tensor([1.0, 2.0], device=device, requires_grad=True)
    y = run_on(stream, lambda: Declared.apply(x))
    root_dtype = torch.float64 if declared is None else torch.float32
    torch.autograd.backward(y, torch.ones(2, dtype=root_dtype, device=device))
    _device.synchronize()
    assert seen["dtype"] == (root_dtype if declared is None else declared)
    assert seen["device"] == device
    assert seen["stream"] == (stream if stream is not None else _device.current_stream(device))
    torch.testing.assert_close(x.grad.cpu(), torch.full((2,), 2.0, device="cpu"))
