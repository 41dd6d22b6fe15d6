"""``torch_ctxext.nn``: drop-in modules whose backward fuses gradient accumulation.

Each is a subclass of the stock module with the same ``__init__``,
parameters and ``state_dict``, whose backward adds its gradients into the
engine's buffers (``ctx.input_grad_buffers``) where a weight or an input
collects several gradients inside one backward, and falls back to the stock
gradient elsewhere:

* :class:`FusedLinear` for ``nn.Linear`` (its Function:
  :class:`FusedLinearFunction`);
* :class:`FusedEmbedding` for ``nn.Embedding``, e.g. a token embedding tied to
  the output projection (:class:`FusedEmbeddingFunction`);
* :class:`FusedLSTMCell` for ``nn.LSTMCell`` unrolled over time.

:func:`fuse` swaps them in for a whole model, in place;
``torch_ctxext.advise(model)`` says where that pays and how much.
"""
from .embedding import FusedEmbedding, FusedEmbeddingFunction
from .fuse import DROP_INS, drop_in_for, fuse
from .linear import FusedLinear, FusedLinearFunction
from .rnn import FusedLSTMCell

__all__ = [
    "DROP_INS",
    "FusedEmbedding",
    "FusedEmbeddingFunction",
    "FusedLSTMCell",
    "FusedLinear",
    "FusedLinearFunction",
    "drop_in_for",
    "fuse",
]
