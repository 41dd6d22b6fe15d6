"""y = 2x, the custom Function the hardening tests build their cases from:
each case states only what its forward, backward or jvp does differently.

Imports torch only (the tests import torch_ctxext themselves).
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
