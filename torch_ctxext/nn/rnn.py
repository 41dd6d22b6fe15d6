"""``FusedLSTMCell``: a drop-in ``nn.LSTMCell`` whose weights' gradients accumulate in place.

A cell unrolled over T steps uses each of its four parameters T times inside
one backward. ``nn.LSTMCell`` returns T gradients of each for the engine to
add; ``FusedLSTMCell`` computes the gates with one Function,
:class:`FusedLSTMGatesFunction` (both products and both biases, as
``FusedLinearFunction`` computes one), so every step after the first to run
backward adds its weight and bias gradients into the buffers (``addmm_``,
``addmv_``). The rest of the cell is ``nn.LSTMCell``'s CPU
computation, operation for operation (``aten::lstm_cell``): the same forward,
bit for bit, on the CPU; on an accelerator torch's own cell runs a fused
kernel (``_thnn_fused_lstm_cell``), which this cell does not use.

Where torch_ctxext has a build for the running torch (as for
``FusedLinear``: ``nn/linear.py``), a step on plain CPU tensors runs in C++
(``fused_lstm_cell``, ``csrc/fused_linear.cpp``): its two products as two
nodes of FusedLinear's C++ Function, the rest as above, op for op; the
same bits and the same buffers added into, at about ``nn.LSTMCell``'s cost
a step (docs/benchmarks.md, "FusedLinear's cost per call").

    >>> import torch
    >>> from torch_ctxext.nn import FusedLSTMCell
    >>> cell = FusedLSTMCell(3, 5)
    >>> h = c = torch.zeros(2, 5)
    >>> for x in torch.randn(4, 2, 3):                  # four steps, one weight
    ...     h, c = cell(x, (h, c))
    >>> h.sum().backward()
    >>> cell.weight_hh.grad.shape
    torch.Size([20, 5])
"""
import torch
import torch.nn.functional as F

from ._buffers import readable_buffers
from ._matmul import linear_grads
from .linear import through_cpp

__all__ = ["FusedLSTMCell", "FusedLSTMGatesFunction"]


class FusedLSTMGatesFunction(torch.autograd.Function):
    """An LSTM cell's gates, ``(h @ weight_hh.t() + bias_hh) + (x @ weight_ih.t()
    + bias_ih)``, computed as ``aten::lstm_cell`` does on the CPU, whose
    backward adds the weights', the biases' and the inputs' gradients into
    their buffers where exposed (``FusedLinearFunction``'s backward, twice).

    ``forward(ctx, h, weight_hh, bias_hh, x, weight_ih, bias_ih, fuse)``:
    the biases may be ``None``. One Function per step, not one per product:
    each costs its apply and its node, on every step of an unrolled cell.
    """

    @staticmethod
    def forward(ctx, h, weight_hh, bias_hh, x, weight_ih, bias_ih, fuse):
        gates = F.linear(h, weight_hh, bias_hh).add_(F.linear(x, weight_ih, bias_ih))
        # As aten::addmm saves them: an input only where its weight's
        # gradient needs it.
        needs = ctx.needs_input_grad
        ctx.save_for_backward(h if needs[1] else None, weight_hh, x if needs[4] else None, weight_ih)
        ctx.shapes = (h.shape, h.dtype, x.shape, x.dtype)
        ctx.fuse = fuse
        ctx.has_bias = (bias_hh is not None, bias_ih is not None)
        if gates.dtype != weight_hh.dtype:
            # autocast computed the gates in lower precision (FusedLinearFunction).
            ctx.set_output_grad_dtype(weight_hh.dtype)
        return gates

    @staticmethod
    def stock_gradient_is_view(ctx, index):
        """``FusedLinearFunction.stock_gradient_is_view`` for each of the two
        products: the weights' and the biases' gradients (the inputs are 2-D)."""
        return index in (1, 2, 4, 5)

    @staticmethod
    def backward(ctx, grad_gates):
        h, weight_hh, x, weight_ih = ctx.saved_tensors
        buffers = readable_buffers(ctx, ctx.fuse)
        needs = ctx.needs_input_grad
        # The input's product first: nn.LSTMCell's is created last, so it runs first.
        h_shape, h_dtype, x_shape, x_dtype = ctx.shapes
        grads_ih = linear_grads(grad_gates, x, weight_ih, (needs[3], needs[4], ctx.has_bias[1] and needs[5]),
                                buffers[3:6], True, x_shape, x_dtype)
        grads_hh = linear_grads(grad_gates, h, weight_hh, (needs[0], needs[1], ctx.has_bias[0] and needs[2]),
                                buffers[0:3], True, h_shape, h_dtype)
        return (*grads_hh, *grads_ih, None)


class FusedLSTMCell(torch.nn.LSTMCell):
    """``torch.nn.LSTMCell`` whose gates are computed by FusedLSTMGatesFunction.

    Same ``__init__``, parameters, ``state_dict`` and call signature
    (``cell(input, (h, c))``, batched or not); ``fuse=False`` keeps the
    Function but never reads the buffers. Without grad mode it is
    ``nn.LSTMCell``'s forward, with no Function.
    """

    def __init__(self, *args, fuse=True, **kwargs):
        super().__init__(*args, **kwargs)
        self.fuse = fuse

    def forward(self, input, hx=None):
        if not torch.is_grad_enabled():
            return super().forward(input, hx)  # no gradient: nothing to fuse
        if input.dim() not in (1, 2):
            raise ValueError(
                f"FusedLSTMCell: Expected input to be 1D or 2D, got {input.dim()}D instead"
            )
        if hx is not None and any(h.dim() not in (1, 2) for h in hx):
            raise ValueError(
                "FusedLSTMCell: Expected hx[0] and hx[1] to be 1D or 2D, got "
                f"{hx[0].dim()}D and {hx[1].dim()}D instead"
            )
        batched = input.dim() == 2
        if not batched:
            input = input.unsqueeze(0)
        if hx is None:
            zeros = torch.zeros(input.size(0), self.hidden_size, dtype=input.dtype, device=input.device)
            hx = (zeros, zeros)
        elif not batched:
            hx = (hx[0].unsqueeze(0), hx[1].unsqueeze(0))
        # The whole step in C++ where it may (its two products by the C++
        # Function, one node each as nn.LSTMCell's addmm): a Python Function
        # and a dozen Python-level ops cost more than a small cell's step.
        out = through_cpp("fused_lstm_cell", self.fuse, input, hx[0], hx[1], self.weight_ih, self.weight_hh,
                          self.bias_ih, self.bias_hh)
        hy, cy = self._step(input, *hx) if out is None else out
        if not batched:
            return hy.squeeze(0), cy.squeeze(0)
        return hy, cy

    def _step(self, input, h, c):
        """A batched step with FusedLSTMGatesFunction: aten::lstm_cell on the
        CPU, linear_hh(hx).add_(linear_ih(input)), four chunks activated in
        place, then the cell and hidden state."""
        gates = FusedLSTMGatesFunction.apply(h, self.weight_hh, self.bias_hh, input, self.weight_ih,
                                             self.bias_ih, self.fuse)
        in_gate, forget_gate, cell_gate, out_gate = gates.unsafe_chunk(4, 1)
        in_gate = in_gate.sigmoid_()
        forget_gate = forget_gate.sigmoid_()
        cell_gate = cell_gate.tanh_()
        out_gate = out_gate.sigmoid_()
        cy = (forget_gate * c).add_(in_gate * cell_gate)
        hy = out_gate * cy.tanh()
        return hy, cy

    def extra_repr(self):
        return super().extra_repr() + f", fuse={self.fuse}"
