"""``torch_ctxext.nn.fuse(model)``: swap the drop-ins in for the stock modules, in place."""
import torch

from .conv1d import conv1d_drop_in, is_conv1d
from .embedding import FusedEmbedding
from .attention import FusedMultiheadAttention
from .gru import FusedGRUCell
from .linear import FusedLinear
from .rnn import FusedLSTMCell

__all__ = ["DROP_INS", "drop_in_for", "fuse", "subclass_drop_in", "why_not"]

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


def fuse(model, report=None, *, step=None, everything=False):
    """Swap, in place, the stock modules of ``model`` (``model`` itself
    included) whose gradients a drop-in of ``torch_ctxext.nn`` fuses, where
    that pays; returns ``model``.

    What pays is what ``torch_ctxext.advise(model)`` says saves bytes: the
    modules whose weights (or inputs) receive more than one gradient in a
    step. A module used once per step is left as it is: its drop-in would
    save nothing and cost a custom Function's call. Which modules, from:

    * ``report``: an :class:`~torch_ctxext.AdviceReport` of a step of this
      model (or of one built the same way: modules are matched by their
      path), e.g. the one whose "do this" line you read;
    * ``step``: a callable that runs one training step of ``model``, forward
      and backward, which ``fuse`` watches with ``advise`` (each parameter's
      ``.grad`` is put back as it was before the step);
    * neither: the latest report of an ``advise(model)`` block on this very
      model, and where there is none, every module that has a drop-in;
    * ``everything=True``: every ``nn.Linear``, ``nn.Embedding``,
      ``nn.LSTMCell``, ``nn.GRUCell``, ``nn.MultiheadAttention`` and
      ``transformers``' ``Conv1D`` (and their subclasses), used once or not.

    The modules stay the same objects with the same parameters (tied ones
    stay tied), buffers, hooks and ``state_dict``: only their class changes,
    to a subclass whose forward adds gradients into
    ``ctx.input_grad_buffers`` where the engine exposes one
    (:class:`FusedLinear`, :class:`FusedEmbedding`, :class:`FusedLSTMCell`,
    :class:`FusedGRUCell`, :class:`FusedMultiheadAttention`, ``FusedConv1D``).
    A module already fused stays so. Call it before wrapping the model
    (``DistributedDataParallel``, ``fully_shard``, ``torch.compile``). A
    subclass of a stock module whose forward calls ``super().forward`` gets a
    class of both (:func:`subclass_drop_in`); other subclasses and sparse
    embeddings are left as they are (:func:`why_not` says why).

        >>> import torch
        >>> from torch_ctxext.nn import fuse
        >>> model = torch.nn.ModuleDict({"shared": torch.nn.Linear(4, 4), "head": torch.nn.Linear(4, 1)})
        >>> def step():
        ...     x = torch.randn(2, 4)
        ...     for _ in range(3):                       # one layer applied three times
        ...         x = model["shared"](x).tanh()
        ...     model["head"](x).sum().backward()
        >>> fuse(model, step=step)
        ModuleDict(
          (shared): FusedLinear(in_features=4, out_features=4, bias=True, fuse=True)
          (head): Linear(in_features=4, out_features=1, bias=True)
        )
        >>> type(fuse(model, everything=True)["head"]).__name__
        'FusedLinear'
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"fuse() takes a torch.nn.Module (the model whose stock layers to swap), "
            f"got {type(model).__qualname__}"
        )
    if step is not None and report is not None:
        raise TypeError("fuse(model, report, step=...): give a report or a step to watch, not both")
    if step is not None:
        report = _watch(model, step)
    if report is None and not everything:
        from .._advise import latest_report

        report = latest_report(model)
    chosen = None if everything or report is None else _paying(model, report)
    for module in model.modules():
        if chosen is not None and id(module) not in chosen:
            continue
        drop_in = drop_in_for(module)
        if drop_in is not None:
            module.__class__ = drop_in
            module.fuse = True
    return model


def _watch(model, step):
    """The report of ``advise(model)`` around ``step()``, the parameters'
    ``.grad`` put back as they were."""
    from .._advise import advise

    if not callable(step):
        raise TypeError(f"fuse(model, step=...): step must be a callable that runs one training step "
                        f"(forward and backward), got {type(step).__qualname__}")
    grads = [(p, p.grad) for p in model.parameters()]
    for p, _ in grads:
        p.grad = None  # the step's backward would add into them in place
    try:
        with advise(model) as report:
            step()
    finally:
        for p, grad in grads:
            p.grad = grad
    if not report.backwards:
        raise RuntimeError("fuse(model, step=...): no backward ran in step(), so nothing says what pays; "
                           "step() must run the forward and the backward (loss.backward())")
    return report


def _paying(model, report):
    """The ids of ``model``'s modules to which ``report`` attributes a
    saving (its drop-ins' modules, by path; the model itself by its class's name)."""
    if not hasattr(report, "drop_ins"):
        raise TypeError(f"fuse(model, report): report must be what torch_ctxext.advise(model) returned, "
                        f"got {type(report).__qualname__}")
    paths = {advice.module for advice in report.drop_ins.values() if advice.avoidable_bytes > 0}
    root = type(model).__name__
    return {id(module) for path, module in model.named_modules(remove_duplicate=False)
            if (path or root) in paths}
