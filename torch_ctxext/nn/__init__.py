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
* :class:`FusedLSTMCell` for ``nn.LSTMCell`` unrolled over time, and
  :class:`FusedGRUCell` for ``nn.GRUCell``;
* :class:`FusedMultiheadAttention` for ``nn.MultiheadAttention`` (its
  projections, as ``nn.TransformerEncoderLayer`` and ``nn.Transformer`` use
  it; :class:`FusedProjectionFunction`);
* ``FusedConv1D`` for ``transformers``' ``Conv1D`` (GPT-2's layers; its
  Function: :class:`FusedConv1DFunction`), made from the installed
  ``transformers`` on first use: this package never imports it.

:func:`fuse` swaps them in for a whole model, in place (a subclass of a
stock module too, keeping its forward); :func:`torch_ctxext.nn.functional.linear`
is ``F.linear`` for a weight applied outside its module;
``torch_ctxext.advise(model)`` says where that pays and how much.
"""
from . import functional
from .attention import FusedMultiheadAttention, FusedProjectionFunction
from .conv1d import FusedConv1DFunction
from .embedding import FusedEmbedding, FusedEmbeddingFunction
from .gru import FusedGRUCell, FusedGRUGatesFunction
from .drop_ins import DROP_INS, drop_in_for, subclass_drop_in, why_not
from .fuse import fuse
from .linear import FusedLinear, FusedLinearFunction
from .rnn import FusedLSTMCell, FusedLSTMGatesFunction

__all__ = [
    "DROP_INS",
    "FusedConv1DFunction",
    "FusedEmbedding",
    "FusedEmbeddingFunction",
    "FusedGRUCell",
    "FusedGRUGatesFunction",
    "FusedLSTMCell",
    "FusedLSTMGatesFunction",
    "FusedLinear",
    "FusedLinearFunction",
    "FusedMultiheadAttention",
    "FusedProjectionFunction",
    "drop_in_for",
    "functional",
    "fuse",
    "subclass_drop_in",
    "why_not",
]


def __getattr__(name):
    if name == "FusedConv1D":  # needs transformers: made on first use
        from . import conv1d

        return conv1d.FusedConv1D
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
