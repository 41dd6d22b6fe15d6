"""A drop-in ``nn.Linear`` whose backward accumulates into the engine's buffers.

The implementation is ``torch_ctxext.nn.FusedLinear`` (read it in
``torch_ctxext/nn/linear.py``); this file re-exports it under the name the
examples, tests and benchmarks import, so that there is one FusedLinear,
the one held to the contract (``check_function``, DDP, FSDP2, autocast,
``torch.compile``: ``docs/training-stacks.md``). ``torch_ctxext.nn.fuse(model)``
swaps it in for every ``nn.Linear`` of a model. On torch 2.15 installing
torch_ctxext costs nothing: it builds and patches nothing there.

    >>> import torch
    >>> from fused_linear import FusedLinear
    >>> layer = FusedLinear(8, 8)
    >>> x = torch.randn(4, 8)
    >>> loss = sum(layer(x * k).sum() for k in range(3))  # one weight, three uses
    >>> loss.backward()
    >>> layer.weight.grad.shape
    torch.Size([8, 8])
"""
from torch_ctxext.nn import FusedLinear, FusedLinearFunction

__all__ = ["FusedLinear", "FusedLinearFunction"]
