"""y = 2x, the custom Function the hardening tests build their cases from:
each case states only what its forward, backward or jvp does differently;
and its correct fused backward.

Imports torch only (the tests, and the scripts they run in subprocesses with
this folder on PYTHONPATH, import torch_ctxext themselves).
"""
from torch.autograd import Function


def doubling(backward, in_forward=None, jvp=None):
    """A Function y = 2x whose forward runs ``in_forward(ctx)`` first (when
    given), whose backward is ``backward(ctx, g)`` and whose jvp, when given,
    ``jvp(ctx, t)``. Its class is named F (an answer that names the node
    reads FBackward)."""

    class F(Function):
        @staticmethod
        def forward(ctx, x):
            if in_forward is not None:
                in_forward(ctx)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return backward(ctx, g)

    if jvp is not None:
        F.jvp = staticmethod(jvp)
    return F


def fuse_into_buffer(ctx, g, exposed=None):
    """The correct fused backward of y = 2x: 2g goes into x's buffer where it
    is exposed (and None is returned), else 2g is returned; appends to the
    list ``exposed``, when given, whether the buffer was."""
    (b,) = ctx.input_grad_buffers
    if exposed is not None:
        exposed.append(b is not None)
    if b is not None:
        b.add_(g * 2)
        return None
    return g * 2
