"""``torch_ctxext.nn.fuse(model)``: swap the drop-ins in for the stock modules, in place."""
import torch

from .conv1d import conv1d_drop_in, is_conv1d
from .embedding import FusedEmbedding
from .attention import FusedMultiheadAttention
from .gru import FusedGRUCell
from .linear import FusedLinear
from .rnn import FusedLSTMCell

__all__ = ["DROP_INS", "fuse"]

# Stock module class -> its drop-in: a subclass that only replaces forward
# (and adds the ``fuse`` switch), so the swap keeps every attribute.
DROP_INS = {
    torch.nn.Linear: FusedLinear,
    torch.nn.Embedding: FusedEmbedding,
    torch.nn.LSTMCell: FusedLSTMCell,
    torch.nn.GRUCell: FusedGRUCell,
    torch.nn.MultiheadAttention: FusedMultiheadAttention,
}


def drop_in_for(module):
    """The drop-in class that would replace ``module``, or None.

    Only an exact stock class is swapped: a subclass may override
    ``forward`` (``NonDynamicallyQuantizableLinear`` is never called through
    it), and a module already wrapped by ``fully_shard`` has a class of
    FSDP's making. A ``sparse=True`` embedding has no dense buffer to add into.
    ``transformers``' ``Conv1D`` gets ``FusedConv1D`` (recognised only where
    ``transformers`` is already imported: it is never imported here).
    """
    drop_in = DROP_INS.get(type(module))
    if drop_in is None and is_conv1d(type(module)):
        return conv1d_drop_in(type(module))
    if drop_in is FusedEmbedding and module.sparse:
        return None
    return drop_in


def fuse(model):
    """Swap, in place, every ``nn.Linear``, ``nn.Embedding``, ``nn.LSTMCell``
    and ``transformers``' ``Conv1D`` of ``model`` (``model`` itself included) for its drop-in from
    ``torch_ctxext.nn``; returns ``model``.

    The modules stay the same objects with the same parameters (tied ones
    stay tied), buffers, hooks and ``state_dict``: only their class changes,
    to a subclass whose forward adds gradients into
    ``ctx.input_grad_buffers`` where the engine exposes one
    (:class:`FusedLinear`, :class:`FusedEmbedding`, :class:`FusedLSTMCell`,
    ``FusedConv1D``).
    Call it before wrapping the model (``DistributedDataParallel``,
    ``fully_shard``, ``torch.compile``); subclasses of the stock modules and
    sparse embeddings are left as they are. ``torch_ctxext.advise(model)``
    says which modules it would change and what that saves::

        model = torch_ctxext.nn.fuse(model)
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"fuse() takes a torch.nn.Module (the model whose stock layers to swap), "
            f"got {type(model).__qualname__}"
        )
    for module in model.modules():
        drop_in = drop_in_for(module)
        if drop_in is not None:
            module.__class__ = drop_in
            module.fuse = True
    return model
