"""``FusedConv1D``: the drop-in for ``transformers``' ``Conv1D`` (GPT-2, OpenAI GPT, ImageGPT, ...).

``transformers.pytorch_utils.Conv1D(nf, nx)`` is a linear layer whose weight
is stored ``in x out`` (``nx x nf``) and applied with ``addmm``; GPT-2's
attention and MLP are made of it, not of ``nn.Linear``. ``FusedConv1D`` is a
subclass of it (same ``__init__``, parameters, ties and ``state_dict``)
whose backward adds the weight's, the bias's and the input's gradients into
the engine's buffers where a backward accumulates several (micro-batches
summed into one backward, a layer shared across depth), as
:class:`~torch_ctxext.nn.FusedLinear` does for ``nn.Linear``.

The class is made from the ``Conv1D`` of the ``transformers`` installed, on
first use: ``torch_ctxext.nn`` never imports ``transformers`` itself
(``fuse(model)`` recognises a ``Conv1D`` only when ``transformers`` is
already imported, as it is for a model made of it), and
``torch_ctxext.nn.FusedConv1D`` raises ImportError, saying so, where it is
not installed.

    >>> import torch
    >>> from torch_ctxext.nn import FusedConv1DFunction
    >>> x, w, b = torch.randn(4, 3), torch.randn(3, 5, requires_grad=True), torch.zeros(5, requires_grad=True)
    >>> sum(FusedConv1DFunction.apply(x * k, w, b, True).sum() for k in range(3)).backward()
    >>> w.grad.shape                                    # nx x nf, as Conv1D stores it
    torch.Size([3, 5])
"""
import sys

import torch

from ._buffers import readable_buffers
from ._matmul import backward as matmul_backward
from .linear import through_cpp

__all__ = ["FusedConv1DFunction", "conv1d_drop_in", "is_conv1d"]

_MODULE = "transformers.pytorch_utils"


class FusedConv1DFunction(torch.autograd.Function):
    """``y = x @ weight + bias`` (``weight``: ``in x out``), ``Conv1D``'s
    forward, whose backward fuses gradient accumulation.

    ``forward(ctx, x, weight, bias, fuse)``; ``fuse`` False never reads the
    buffers.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, fuse):
        size_out = x.size()[:-1] + (weight.shape[1],)
        folded = x.view(-1, x.size(-1))  # as Conv1D's forward: x must be viewable so
        out = torch.addmm(bias, folded, weight).view(size_out)
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight)
        ctx.fuse = fuse
        ctx.has_bias = True
        ctx.x_shape = x.shape
        ctx.x_dtype = x.dtype
        ctx.x_column_major = False  # Conv1D's forward views x
        if out.dtype != weight.dtype:
            ctx.set_output_grad_dtype(weight.dtype)
        return out

    @staticmethod
    def stock_gradient_is_view(ctx, index):
        """Whether ``Conv1D``'s own backward returns argument ``index``'s
        gradient as a view (the input's, through ``x.view``, and the bias's;
        not the weight's, ``addmm``'s own product): see
        ``FusedLinearFunction.stock_gradient_is_view``."""
        return index in (0, 2)

    @staticmethod
    def backward(ctx, grad_out):
        return matmul_backward(ctx, grad_out, readable_buffers(ctx, ctx.fuse)[:3], stored_out_in=False)


def _stock():
    """transformers' Conv1D, if transformers is already imported."""
    module = sys.modules.get(_MODULE)
    return getattr(module, "Conv1D", None) if module is not None else None


def is_conv1d(cls):
    """Whether ``cls`` is exactly transformers' ``Conv1D`` (without importing it)."""
    return cls is not None and cls is _stock()


def _forward(self, x):
    weight, bias, fuse = self.weight, self.bias, self.fuse
    # The same Function in C++ where there is a build for it and the call is
    # one it computes alike (linear.through_cpp), else the Python Function.
    out = through_cpp("fused_conv1d", fuse, x, weight, bias)
    return out if out is not None else FusedConv1DFunction.apply(x, weight, bias, fuse)


def _repr(self):
    return f"FusedConv1D(nf={self.nf}, nx={self.nx}, fuse={getattr(self, 'fuse', True)})"


_made = {}


def conv1d_drop_in(stock):
    """The ``FusedConv1D`` subclass of ``stock`` (transformers' ``Conv1D``),
    made once per class."""
    cls = _made.get(stock)
    if cls is None:
        def __init__(self, nf, nx, fuse=True):
            stock.__init__(self, nf, nx)
            self.fuse = fuse

        cls = _made[stock] = type("FusedConv1D", (stock,), {
            "__init__": __init__, "forward": _forward, "__repr__": _repr,
            "__module__": __name__, "__qualname__": "FusedConv1D",
            "__doc__": "transformers' ``Conv1D`` with :class:`FusedConv1DFunction` as its forward.",
        })
    return cls


def __getattr__(name):
    if name == "FusedConv1D":
        try:
            from transformers.pytorch_utils import Conv1D
        except ImportError as error:
            raise ImportError(
                "torch_ctxext.nn.FusedConv1D is the drop-in for transformers' Conv1D, which needs "
                f"transformers installed ({error})") from error
        return conv1d_drop_in(Conv1D)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
