"""Two custom Functions that make the autograd engine go through torch_ctxext's
hooks, and a backward pass through each, for the subprocesses of
test_hardening_fork.py (a child forked while a hook's lock was held) and
test_two_copies.py (the first copy still provides what it did).

Imports torch only: a subprocess imports torch_ctxext (or a copy of it) when
its scenario says so.
"""
import torch
from torch.autograd import Function


class Uncast(Function):
    """Takes its gradient in whatever dtype it arrives."""

    @staticmethod
    def forward(ctx, x):
        ctx.set_output_grad_dtype(None)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        ctx.seen = g.dtype
        return g * 2


class Linear(Function):
    """README's example: fuses w's gradient into the engine's buffer."""

    # Whether each backward received w's buffer.
    fused = []

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        _, w_buffer = ctx.input_grad_buffers
        Linear.fused.append(w_buffer is not None)
        if w_buffer is not None:
            w_buffer.addmm_(x.t(), g)
            return g @ w.t(), None
        return g @ w.t(), x.t() @ g


def uncast_backward():
    """Backward of Uncast from a float64 gradient, which must reach its
    backward uncast; returns the input leaf."""
    x = torch.ones(3, requires_grad=True)
    y = Uncast.apply(x)
    y.backward(torch.ones(3, dtype=torch.float64))
    assert y.grad_fn.seen == torch.float64, y.grad_fn.seen
    return x


def fused_backward():
    """Backward through three uses of Linear sharing w, whose gradient must be
    right; returns whether any of them received w's buffer."""
    Linear.fused.clear()
    w = torch.ones(4, 4, requires_grad=True)
    x = torch.ones(2, 4)
    sum(Linear.apply(x, w).sum() for _ in range(3)).backward()
    assert torch.equal(w.grad, torch.full((4, 4), 6.0)), w.grad
    return any(Linear.fused)
