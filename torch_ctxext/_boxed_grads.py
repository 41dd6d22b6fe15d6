"""``boxed_grads_call`` / ``BackwardCFunction.apply_boxed`` for torch < 2.13.

With ``boxed_grads_call = True`` on a Function class, backward receives its
grads as one mutable list that holds the only references to them, so removing
an entry frees that gradient while backward is still running. The C++
extension moves the engine's grads into that list and has the engine's call
reach ``apply_boxed`` (see csrc/boxed_grads.cpp); this module gives
``BackwardCFunction`` the 2.13 ``apply`` / ``apply_boxed``.
"""
import torch
from torch.autograd.function import BackwardCFunction, Function

from . import _features

_C = None


def _user_fn(ctx):
    cls = ctx._forward_cls
    backward_fn, vjp_fn = cls.backward, cls.vjp
    if backward_fn is not Function.backward and vjp_fn is not Function.vjp:
        raise RuntimeError(
            "Implementing both 'backward' and 'vjp' for a custom "
            "Function is not allowed. You should only implement one "
            "of them."
        )
    return vjp_fn if vjp_fn is not Function.vjp else backward_fn


def apply(self, *args):
    r"""
    Apply method used when executing this Node during the backward.

    Called by the autograd engine (non-boxed path) and by direct
    grad_fn.apply() calls. When boxed_grads_call is True, boxes
    grads into a mutable list before calling user's backward.
    """
    user_fn = _user_fn(self)
    if getattr(self._forward_cls, "boxed_grads_call", False):
        args = (list(args),)
    return user_fn(self, *args)


def apply_boxed(self, *args):
    r"""
    Apply method called by the autograd engine when boxed_grads_call
    is True. Grads arrive as a single mutable list argument, allowing
    backward to free individual grads mid-execution.
    """
    return _user_fn(self)(self, *args)


def _engine_entry(ctx, grads, *placeholders):
    """Where the engine's call lands for a boxed Function (csrc/boxed_grads.cpp):
    ``grads`` holds the only references to the gradients."""
    return ctx.apply_boxed(grads)


def _sample_ctx_and_install():
    class _Probe(Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return g

    out = _Probe.apply(torch.zeros(1, requires_grad=True))
    _C.install_boxed_grads_path(out.grad_fn, _engine_entry)


def install(ext):
    global _C
    _C = ext
    try:
        _sample_ctx_and_install()
    except RuntimeError as e:
        # The engine hook could not be placed (an unrecognised torch build):
        # everything else still works; features() says why this does not.
        _features.UNAVAILABLE["apply_boxed"] = str(e)
        return
    BackwardCFunction.apply = apply
    _features.PROVIDED.add("apply")
    BackwardCFunction.apply_boxed = apply_boxed
    Function.boxed_grads_call = False
