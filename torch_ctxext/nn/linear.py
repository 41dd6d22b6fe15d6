"""``FusedLinear``: a drop-in ``nn.Linear`` whose backward accumulates into the engine's buffers.

``FusedLinear`` is an ``nn.Linear`` (same parameters, same ``state_dict``,
same ``__init__``): where a weight is used several times inside one backward
(a layer shared across depth as in ALBERT, an unrolled recurrent cell,
micro-batches applied to one weight), each use after the first adds its
weight gradient straight into the buffer the engine already holds
(``addmm_``, one kernel, no temporary) instead of returning a new
``D_out x D_in`` tensor for the engine to add. ``torch_ctxext.nn.fuse(model)``
swaps it in for every ``nn.Linear`` of a model; ``torch_ctxext.advise``
says where that pays.

On torch 2.15 ``ctx.input_grad_buffers`` and ``ctx.set_output_grad_dtype``
are native; on torch 2.6 to 2.14 ``import torch_ctxext`` provides them.

Three rules it follows (``docs/input_grad_buffers.md``):

* every fused path has an out-of-place fallback, since whether a buffer is
  there depends on the engine's order (the first use to run backward finds
  none);
* an input accumulated into gets ``None`` as its returned gradient;
* under a tracer (``torch.compile``, compiled autograd) and under
  ``create_graph=True`` the buffers are not read (the property would raise):
  the Function is traced, or differentiated twice, with the fallback, and
  eager first-order backward still fuses.

Under ``torch.autocast`` the output is in the autocast dtype (bfloat16, say)
while the parameters stay float32: the Function then declares
``ctx.set_output_grad_dtype(weight.dtype)``, so backward receives a float32
gradient, computes the weight and bias gradients in float32 and accumulates
them into the float32 buffers without a cast.

The bias's fused path still sums the output gradient over the rows
(``g.sum(0)``, ``D_out`` elements): it saves the engine's add and the
returned tensor, not that sum.

    >>> import torch
    >>> from torch_ctxext.nn import FusedLinear
    >>> layer = FusedLinear(8, 8)
    >>> x = torch.randn(4, 8)
    >>> loss = sum(layer(x * k).sum() for k in range(3))  # one weight, three uses
    >>> loss.backward()
    >>> layer.weight.grad.shape
    torch.Size([8, 8])
"""
import torch
import torch.nn.functional as F

from ._buffers import readable_buffers

__all__ = ["FusedLinear", "FusedLinearFunction"]


def _as_matrix(t):
    """(..., features) -> (rows, features), a view where possible."""
    return t.reshape(-1, t.shape[-1])


class FusedLinearFunction(torch.autograd.Function):
    """``y = x @ weight.t() + bias`` whose backward fuses gradient accumulation.

    ``forward(ctx, x, weight, bias, fuse)``: ``bias`` may be ``None``; ``fuse``
    False gives the plain out-of-place backward (for comparisons).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, fuse):
        out = F.linear(x, weight, bias)
        ctx.save_for_backward(x, weight)
        ctx.fuse = fuse
        ctx.has_bias = bias is not None
        if out.dtype != weight.dtype:
            # autocast computed the output in lower precision: take its
            # gradient in the parameters' precision.
            ctx.set_output_grad_dtype(weight.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        x_buf, w_buf, b_buf, _ = readable_buffers(ctx, ctx.fuse)
        g = _as_matrix(grad_out)
        grad_x = grad_w = grad_b = None

        if ctx.needs_input_grad[0]:
            g_x = g.to(x.dtype)
            w_x = weight.to(x.dtype)
            if x_buf is not None and x_buf.is_contiguous() and x_buf.dtype == x.dtype:
                x_buf.view(-1, x.shape[-1]).addmm_(g_x, w_x)
            else:
                grad_x = (g_x @ w_x).view(x.shape)
        if ctx.needs_input_grad[1]:
            x2 = _as_matrix(x).to(g.dtype)
            if w_buf is not None and w_buf.dtype == g.dtype:
                w_buf.addmm_(g.t(), x2)
            else:
                grad_w = (g.t() @ x2).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            if b_buf is not None and b_buf.dtype == g.dtype:
                b_buf.add_(g.sum(0))
            else:
                grad_b = g.sum(0)
        return grad_x, grad_w, grad_b, None


class FusedLinear(torch.nn.Linear):
    """``torch.nn.Linear`` with :class:`FusedLinearFunction` as its forward.

    ``fuse=False`` (or setting ``.fuse`` later) keeps the Function but never
    reads the buffers: the same computation, unfused.
    """

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, fuse=True):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.fuse = fuse

    def forward(self, x):
        return FusedLinearFunction.apply(x, self.weight, self.bias, self.fuse)

    def extra_repr(self):
        return super().extra_repr() + f", fuse={self.fuse}"
