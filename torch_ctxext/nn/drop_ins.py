"""The drop-ins of ``torch_ctxext.nn``: which stock module class each replaces,
the classes made for subclasses, and why a module has none.

advise() reads this to name drop-ins; :func:`~torch_ctxext.nn.fuse` swaps
them in. Nothing here imports advise."""
import torch

from .conv1d import conv1d_drop_in, is_conv1d
from .embedding import FusedEmbedding
from .attention import FusedMultiheadAttention
from .gru import FusedGRUCell
from .linear import FusedLinear
from .rnn import FusedLSTMCell

__all__ = ["DROP_INS", "drop_in_for", "subclass_drop_in", "why_not"]

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

    A stock class gets its drop-in. A subclass of one defined outside torch
    (a scaled embedding, a Linear with a hook of its own) gets a class made
    for it, below both (:func:`subclass_drop_in`), where its own forward
    calls the stock one through ``super()``: the subclass's behaviour stays,
    and the stock part of its forward fuses. Not swapped (:func:`why_not`
    says why): a subclass whose forward replaces the stock one, torch's
    own subclasses (``NonDynamicallyQuantizableLinear`` is never called
    through its forward: ``FusedMultiheadAttention`` fuses it; a module
    already wrapped by ``fully_shard`` has a class of FSDP's making), and a
    ``sparse=True`` embedding (there is no dense buffer to add into).
    ``transformers``' ``Conv1D`` gets ``FusedConv1D`` (recognised only where
    ``transformers`` is already imported: it is never imported here).
    """
    cls = type(module)
    drop_in = DROP_INS.get(cls)
    if drop_in is None and is_conv1d(cls):
        return conv1d_drop_in(cls)
    if drop_in is None and _why_not_subclass(cls) is None:
        drop_in = subclass_drop_in(cls)
    if drop_in is not None and issubclass(drop_in, FusedEmbedding) and module.sparse:
        return None
    return drop_in


def _stock_base(cls):
    """The stock class in DROP_INS that ``cls`` derives from, or None."""
    return next((klass for klass in cls.__mro__[1:] if klass in DROP_INS), None)


def _calls_super_forward(function):
    code = getattr(function, "__code__", None)
    return code is not None and "super" in code.co_names and "forward" in code.co_names


_reasons = {}  # class -> _why_not_subclass's answer (advise asks once per module per block)


def _why_not_subclass(cls):
    """Why a subclass of a stock module gets no drop-in (None: it gets
    one; "": it is no such subclass)."""
    key = (cls, len(DROP_INS))
    if key not in _reasons:
        _reasons[key] = _subclass_reason(cls)
    return _reasons[key]


def _subclass_reason(cls):
    stock = _stock_base(cls)
    if stock is None or any(issubclass(cls, d) for d in DROP_INS.values()):
        return ""
    if any(klass.__module__.split(".")[0] == "torch" for klass in cls.__mro__[:cls.__mro__.index(stock)]):
        return f"{cls.__name__} is torch's own subclass of {stock.__name__}"
    for klass in cls.__mro__[:cls.__mro__.index(stock)]:
        forward = klass.__dict__.get("forward")
        if forward is not None and not _calls_super_forward(forward):
            return (f"{klass.__name__}.forward does not call super().forward(), so "
                    f"torch_ctxext.nn.{DROP_INS[stock].__name__} cannot run inside it")
    return None


def why_not(module):
    """Why ``module`` has no drop-in: a sentence naming its class, or None
    where it has one or is no stock module nor subclass of one."""
    if drop_in_for(module) is not None:
        return None
    reason = _why_not_subclass(type(module))
    if reason:
        return reason
    if isinstance(module, torch.nn.Embedding) and module.sparse:
        return f"{type(module).__name__} is sparse: its gradient has no dense buffer to add into"
    return None


_made = {}


def _remake(stock, state):
    """Unpickle a module of a class :func:`subclass_drop_in` made."""
    cls = subclass_drop_in(stock)
    module = cls.__new__(cls)
    module.__setstate__(state)
    return module


def _reduce_ex(self, protocol):
    return _remake, (type(self).__mro__[1], self.__dict__.copy())


def subclass_drop_in(cls):
    """The drop-in made for ``cls``, a subclass of a stock module: a class
    deriving from ``cls`` then the stock class's drop-in (``Fused`` and its
    name), so ``cls.forward``'s ``super().forward(...)`` runs the drop-in's.
    Made once per class; pickled by ``cls``."""
    made = _made.get(cls)
    if made is None:
        drop_in = DROP_INS[_stock_base(cls)]
        made = _made[cls] = type(f"Fused{cls.__name__}", (cls, drop_in), {
            "__module__": cls.__module__, "__qualname__": f"Fused{cls.__qualname__}",
            "__reduce_ex__": _reduce_ex,
            "__doc__": f"``{cls.__qualname__}`` whose stock part runs as "
                       f":class:`torch_ctxext.nn.{drop_in.__name__}`.",
        })
    return made
