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
import torch
import torch.nn.functional as F

from ._buffers import readable_buffers
from ._matmul import backward as matmul_backward
from ._matmul import fold, is_column_major
from .linear import fused_linear

__all__ = ["linear", "FusedTransposedLinearFunction"]


class FusedTransposedLinearFunction(torch.autograd.Function):
    """``F.linear(x, weight.t(), bias)``, i.e. ``x @ weight + bias``, with
    ``weight`` itself as the argument: its gradient reaches ``weight`` as a
    tensor of its own (``weight.t()``'s backward would make it a view), and
    is added into the engine's buffer where exposed.

    ``forward(ctx, x, weight, bias, fuse)``: ``bias`` may be ``None``.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, fuse):
        # What aten::linear multiplies and saves, whatever x's strides, as
        # FusedLinearFunction.forward does (_matmul.fold).
        needs_weight = ctx.needs_input_grad[1]
        saved = fold(x, needs_weight)
        if saved is x or saved is None:
            out = F.linear(x, weight.t(), bias)
        else:
            out = F.linear(saved, weight.t(), bias).view(x.shape[:-1] + weight.shape[1:])
        ctx.save_for_backward(saved if needs_weight else None, weight)
        ctx.fuse = fuse
        ctx.has_bias = bias is not None
        ctx.x_dim = x.dim()
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.x_column_major = x.dim() == 2 and is_column_major(x)
        if out.dtype != weight.dtype:
            ctx.set_output_grad_dtype(weight.dtype)
        return out

    @staticmethod
    def stock_gradient_is_view(ctx, index):
        """As ``FusedLinearFunction.stock_gradient_is_view``."""
        return index in (1, 2) or (index == 0 and (ctx.x_dim != 2 or ctx.x_column_major))

    @staticmethod
    def backward(ctx, grad_out):
        return matmul_backward(ctx, grad_out, readable_buffers(ctx, ctx.fuse)[:3], stored_out_in=False)


def _transposed_of(weight):
    """The 2-D tensor ``weight`` is the ``.t()`` of (a view sharing its
    storage, with its shape and strides swapped), or None."""
    base = weight._base
    if (base is None or weight.dim() != 2 or base.dim() != 2 or weight.shape != base.shape[::-1]
            or weight.stride() != base.stride()[::-1] or weight.storage_offset() != base.storage_offset()):
        return None
    return base


def linear(input, weight, bias=None, *, fuse=True):
    """``F.linear(input, weight, bias)``, whose backward adds into the
    engine's buffers where exposed (``fuse=False``: never reads them).

    A ``weight`` that is another tensor's ``.t()`` (a tied autoencoder's
    decoder, ``linear(z, self.encoder.weight.t())``) is applied as that
    tensor, so the gradient reaches it without a view in between."""
    transposed = _transposed_of(weight) if torch.is_grad_enabled() else None
    if transposed is not None:
        return FusedTransposedLinearFunction.apply(input, transposed, bias, fuse)
    return fused_linear(input, weight, bias, fuse)  # FusedLinear's Function (in C++ where it can)
