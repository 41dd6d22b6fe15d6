"""``FusedGRUCell``: a drop-in ``nn.GRUCell`` whose weights' gradients accumulate in place.

A cell unrolled over T steps uses each of its four parameters T times inside
one backward. ``nn.GRUCell`` returns T gradients of each for the engine to
add; ``FusedGRUCell`` computes both products of a step with one Function,
:class:`FusedGRUGatesFunction` (the input's and the hidden state's, each with
its bias, as ``FusedLinearFunction`` computes one), so every step after the
first to run backward adds its weight and bias gradients into the buffers
(``addmm_``, ``addmv_``). The rest of the cell is ``nn.GRUCell``'s CPU
computation, operation for operation (``aten::gru_cell``): the same forward,
bit for bit, on the CPU; on an accelerator torch's own cell runs a fused
kernel (``_thnn_fused_gru_cell``), which this cell does not use.

Where torch_ctxext has a build for the running torch (as for
``FusedLinear``: ``nn/linear.py``), a step on plain CPU tensors runs in C++
(``fused_gru_cell``, ``csrc/fused_linear.cpp``): its two products as two
nodes of FusedLinear's C++ Function, the rest as above, op for op; the
same bits and the same buffers added into, at about ``nn.GRUCell``'s cost
a step, where the Python Function and a dozen Python-level ops cost some
40 us more (docs/benchmarks.md, "FusedLinear's cost per call").

    >>> import torch
    >>> from torch_ctxext.nn import FusedGRUCell
    >>> cell = FusedGRUCell(3, 5)
    >>> h = torch.zeros(2, 5)
    >>> for x in torch.randn(4, 2, 3):                  # four steps, one weight
    ...     h = cell(x, h)
    >>> h.sum().backward()
    >>> cell.weight_hh.grad.shape
    torch.Size([15, 5])
"""
import torch
import torch.nn.functional as F

from ._buffers import readable_buffers
from ._matmul import linear_grads
from .linear import through_cpp

__all__ = ["FusedGRUCell", "FusedGRUGatesFunction"]


class FusedGRUGatesFunction(torch.autograd.Function):
    """A GRU cell's two products, ``(x @ weight_ih.t() + bias_ih, h @
    weight_hh.t() + bias_hh)``, whose backward adds the weights', the biases'
    and the inputs' gradients into their buffers where exposed
    (``FusedLinearFunction``'s backward, twice).

    ``forward(ctx, h, weight_hh, bias_hh, x, weight_ih, bias_ih, fuse)``:
    the biases may be ``None``. One Function per step, not one per product:
    each costs its apply and its node, on every step of an unrolled cell.
    """

    @staticmethod
    def forward(ctx, h, weight_hh, bias_hh, x, weight_ih, bias_ih, fuse):
        # aten::gru_cell computes the input's product first.
        igates = F.linear(x, weight_ih, bias_ih)
        hgates = F.linear(h, weight_hh, bias_hh)
        ctx.save_for_backward(h, weight_hh, x, weight_ih)
        ctx.fuse = fuse
        ctx.has_bias = (bias_hh is not None, bias_ih is not None)
        if hgates.dtype != weight_hh.dtype:
            # autocast computed the gates in lower precision (FusedLinearFunction):
            # one declaration per output.
            ctx.set_output_grad_dtype(weight_ih.dtype, weight_hh.dtype)
        return igates, hgates

    @staticmethod
    def stock_gradient_is_view(ctx, index):
        """``FusedLinearFunction.stock_gradient_is_view`` for each of the two
        products: the weights' and the biases' gradients (the inputs are 2-D)."""
        return index in (1, 2, 4, 5)

    @staticmethod
    def backward(ctx, grad_igates, grad_hgates):
        h, weight_hh, x, weight_ih = ctx.saved_tensors
        buffers = readable_buffers(ctx, ctx.fuse)
        needs = ctx.needs_input_grad
        # The hidden state's product first: nn.GRUCell's is created last, so it runs first.
        grads_hh = linear_grads(grad_hgates, h, weight_hh, (needs[0], needs[1], ctx.has_bias[0] and needs[2]),
                                buffers[0:3])
        grads_ih = linear_grads(grad_igates, x, weight_ih, (needs[3], needs[4], ctx.has_bias[1] and needs[5]),
                                buffers[3:6])
        return (*grads_hh, *grads_ih, None)


class FusedGRUCell(torch.nn.GRUCell):
    """``torch.nn.GRUCell`` whose products are computed by FusedGRUGatesFunction.

    Same ``__init__``, parameters, ``state_dict`` and call signature
    (``cell(input, h)``, batched or not); ``fuse=False`` keeps the Function
    but never reads the buffers.
    """

    # The nodes of nn.GRUCell's step that FusedGRUGatesFunction replaces
    # (its two products; advise promises no fusing of the gates' arithmetic).
    stock_ops = ("AddmmBackward0", "MmBackward0", "TBackward0")

    def __init__(self, *args, fuse=True, **kwargs):
        super().__init__(*args, **kwargs)
        self.fuse = fuse

    def forward(self, input, hx=None):
        if input.dim() not in (1, 2):
            raise ValueError(
                f"FusedGRUCell: Expected input to be 1D or 2D, got {input.dim()}D instead"
            )
        if hx is not None and hx.dim() not in (1, 2):
            raise ValueError(
                f"FusedGRUCell: Expected hidden to be 1D or 2D, got {hx.dim()}D instead"
            )
        batched = input.dim() == 2
        if not batched:
            input = input.unsqueeze(0)
        if hx is None:
            hx = torch.zeros(input.size(0), self.hidden_size, dtype=input.dtype, device=input.device)
        elif not batched:
            hx = hx.unsqueeze(0)
        # The whole step in C++ where it may (its two products by the C++
        # Function, one node each as nn.GRUCell's addmm): a Python Function
        # and a dozen Python-level ops cost more than a small cell's step.
        hy = through_cpp("fused_gru_cell", self.fuse, input, hx, self.weight_ih, self.weight_hh, self.bias_ih,
                         self.bias_hh)
        if hy is None:
            hy = self._step(input, hx)
        if not batched:
            return hy.squeeze(0)
        return hy

    def _step(self, input, hx):
        """A batched step with FusedGRUGatesFunction: aten::gru_cell on the
        CPU, both products, three chunks each, the reset and update gates
        activated in place, then the new state."""
        igates, hgates = FusedGRUGatesFunction.apply(hx, self.weight_hh, self.bias_hh, input, self.weight_ih,
                                                     self.bias_ih, self.fuse)
        i_r, i_z, i_n = igates.unsafe_chunk(3, 1)
        h_r, h_z, h_n = hgates.unsafe_chunk(3, 1)
        reset_gate = h_r.add_(i_r).sigmoid_()
        input_gate = h_z.add_(i_z).sigmoid_()
        new_gate = i_n.add(h_n.mul_(reset_gate)).tanh_()
        return (hx - new_gate).mul_(input_gate).add_(new_gate)

    def extra_repr(self):
        return super().extra_repr() + f", fuse={self.fuse}"
