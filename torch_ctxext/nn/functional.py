"""``torch_ctxext.nn.functional``: functional forms of the drop-ins, for weights used outside their module.

A weight applied through ``F.linear`` by another module than its own (a
language model's head tied to its token embedding and written
``F.linear(h, self.embed.weight)``, a tied autoencoder's decoder
``F.linear(z, self.encoder.weight.t())``) returns its gradient as a view of
the product (``weight.t()``'s backward), which the engine cannot add into:
every later gradient of that weight is summed out of place, and
``fuse(model)`` cannot help, since no module is called. :func:`linear`,
with ``F.linear``'s signature, computes the same product through
:class:`~torch_ctxext.nn.FusedLinearFunction`: its gradients are tensors of
their own, and added into the engine's buffers where exposed.
``torch_ctxext.advise(model)`` names each such use ("routes"), by the module
whose forward makes it and the attribute it reads.

    >>> import torch
    >>> from torch_ctxext.nn import FusedEmbedding
    >>> from torch_ctxext.nn.functional import linear
    >>> embed = FusedEmbedding(10, 4)
    >>> h = embed(torch.tensor([[1, 2, 3]]))
    >>> linear(h, embed.weight).sum().backward()       # the lookup adds into the head's gradient
    >>> embed.weight.grad.shape
    torch.Size([10, 4])
"""
from .linear import FusedLinearFunction

__all__ = ["linear"]


def linear(input, weight, bias=None, *, fuse=True):
    """``F.linear(input, weight, bias)``, whose backward adds into the
    engine's buffers where exposed (``fuse=False``: never reads them)."""
    return FusedLinearFunction.apply(input, weight, bias, fuse)
