"""``torch_ctxext.nn.fuse(model)``: swap the drop-ins in for the stock modules, in place."""
import torch

from .drop_ins import drop_in_for

__all__ = ["fuse"]


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
