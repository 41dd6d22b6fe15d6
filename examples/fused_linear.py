"""A drop-in ``nn.Linear`` whose backward accumulates into the engine's buffers.

The implementation is ``torch_ctxext.nn.FusedLinear`` (read it in
``torch_ctxext/nn/linear.py``); this file re-exports it under the name the
examples, tests and benchmarks import, so that there is one FusedLinear,
the one held to the contract (``check_function``, DDP, FSDP2, autocast,
``torch.compile``: ``docs/training-stacks.md``). ``torch_ctxext.nn.fuse(model)``
swaps it in for every ``nn.Linear`` of a model. On torch 2.15 installing
torch_ctxext costs nothing: it builds and patches nothing there.

    >>> import torch, torch_ctxext
    >>> from fused_linear import FusedLinear
    >>> FusedLinear is torch_ctxext.nn.FusedLinear
    True
"""
from torch_ctxext.nn import FusedLinear, FusedLinearFunction

__all__ = ["FusedLinear", "FusedLinearFunction"]
