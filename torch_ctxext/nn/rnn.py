"""``FusedLSTMCell``: a drop-in ``nn.LSTMCell`` whose weights' gradients accumulate in place.

A cell unrolled over T steps uses each of its four parameters T times inside
one backward. ``nn.LSTMCell`` returns T gradients of each for the engine to
add; ``FusedLSTMCell`` computes the gates through
:class:`~torch_ctxext.nn.FusedLinearFunction`, so every step after the first
to run backward adds its weight and bias gradients into the buffers
(``addmm_``, ``add_``). The rest of the cell is ``nn.LSTMCell``'s CPU
computation, operation for operation (``aten::lstm_cell``): the same forward,
bit for bit, on the CPU; on an accelerator torch's own cell runs a fused
kernel (``_thnn_fused_lstm_cell``), which this cell does not use.

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

from .linear import FusedLinearFunction

__all__ = ["FusedLSTMCell"]


class FusedLSTMCell(torch.nn.LSTMCell):
    """``torch.nn.LSTMCell`` whose gates are computed by FusedLinearFunction.

    Same ``__init__``, parameters, ``state_dict`` and call signature
    (``cell(input, (h, c))``, batched or not); ``fuse=False`` keeps the
    Function but never reads the buffers.
    """

    def __init__(self, *args, fuse=True, **kwargs):
        super().__init__(*args, **kwargs)
        self.fuse = fuse

    def forward(self, input, hx=None):
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
        h, c = hx
        # aten::lstm_cell on the CPU: linear_hh(hx).add_(linear_ih(input)),
        # four chunks activated in place, then the cell and hidden state.
        gates = FusedLinearFunction.apply(h, self.weight_hh, self.bias_hh, self.fuse)
        gates = gates.add_(FusedLinearFunction.apply(input, self.weight_ih, self.bias_ih, self.fuse))
        in_gate, forget_gate, cell_gate, out_gate = gates.unsafe_chunk(4, 1)
        in_gate = in_gate.sigmoid_()
        forget_gate = forget_gate.sigmoid_()
        cell_gate = cell_gate.tanh_()
        out_gate = out_gate.sigmoid_()
        cy = (forget_gate * c).add_(in_gate * cell_gate)
        hy = out_gate * cy.tanh()
        if not batched:
            return hy.squeeze(0), cy.squeeze(0)
        return hy, cy

    def extra_repr(self):
        return super().extra_repr() + f", fuse={self.fuse}"
