"""``boxed_grads_call`` / ``BackwardCFunction.apply_boxed`` for torch < 2.13.

With ``boxed_grads_call = True`` on a Function class, backward receives its
grads as one mutable list that holds the only references to them, so removing
an entry frees that gradient while backward is still running. The C++
extension moves the engine's grads into that list and has the engine's call
reach ``apply_boxed`` (see csrc/boxed_grads.cpp); this module gives
``BackwardCFunction`` the 2.13 ``apply`` / ``apply_boxed``, and makes compiled
autograd refuse boxed Functions with torch 2.13's error.
"""
import importlib.abc
import importlib.util
import inspect
import sys

import torch
from torch.autograd.function import BackwardCFunction, Function

from .. import _features

_C = None


def _both_defined():
    return RuntimeError(
        "Implementing both 'backward' and 'vjp' for a custom "
        "Function is not allowed. You should only implement one "
        "of them."
    )


# apply runs once per backward of every custom Function (non-boxed ones
# too), so it is written out as torch's own BackwardCFunction.apply is, with
# no helper call: the helper cost about 1% of a small Function's
# forward+backward on torch 2.12 (benchmarks/: the idle cost).
def apply(self, *args):
    r"""
    Apply method used when executing this Node during the backward.

    Called by the autograd engine (non-boxed path) and by direct
    grad_fn.apply() calls. When boxed_grads_call is True, boxes
    grads into a mutable list before calling user's backward.
    """
    cls = self._forward_cls
    backward_fn = cls.backward
    vjp_fn = cls.vjp
    if backward_fn is not Function.backward and vjp_fn is not Function.vjp:
        raise _both_defined()
    user_fn = vjp_fn if vjp_fn is not Function.vjp else backward_fn
    if getattr(cls, "boxed_grads_call", False):  # not on torch.func's generated classes
        return user_fn(self, list(args))
    return user_fn(self, *args)


def apply_boxed(self, *args):
    r"""
    Apply method called by the autograd engine when boxed_grads_call
    is True. Grads arrive as a single mutable list argument, allowing
    backward to free individual grads mid-execution.
    """
    cls = self._forward_cls
    backward_fn = cls.backward
    vjp_fn = cls.vjp
    if backward_fn is not Function.backward and vjp_fn is not Function.vjp:
        raise _both_defined()
    return (vjp_fn if vjp_fn is not Function.vjp else backward_fn)(self, *args)


def _install_path():
    """Route PyNode::apply through the boxed path. PyNode's vtable is where
    the layout probe saw it, in a child process (its verdict's facts, kept
    for this very libtorch_python): nothing of autograd runs here."""
    from _torch_ctxext_build import layout_verdict

    from .._ext import loader

    facts = loader.verdict["facts"]  # there is one: members are installed only after it
    offset = facts.get("pynode_vtable_offset")
    # Data from a file: an offset the loader did not take for one (read()
    # refuses those) never reaches the extension as an address.
    if not layout_verdict.is_offset(offset):
        raise RuntimeError(
            "torch_ctxext: the layout probe did not find PyNode's vtable in this torch build "
            f"({facts.get('pynode_vtable_offset_error', 'no offset recorded')}); "
            "boxed_grads_call is unavailable"
        )
    _C.install_boxed_grads_path(offset)


def install(ext):
    """Route PyNode::apply through boxed grads; returns what was installed
    (``apply`` too: torch's own is replaced)."""
    global _C
    _C = ext
    try:
        _install_path()
    except RuntimeError as e:
        # The engine hook could not be placed (an unrecognised torch build):
        # everything else still works; features() says why this does not.
        return _features.Installed.refused("apply_boxed", e)
    BackwardCFunction.apply = apply
    BackwardCFunction.apply_boxed = apply_boxed
    Function.boxed_grads_call = False
    _compiled_autograd_refuses_boxed_functions()
    return _features.Installed.of("apply", "apply_boxed")


COMPILED_AUTOGRAD_MODULE = "torch._dynamo.compiled_autograd"


def _check_not_boxed(ctx):
    """torch 2.13's check (compiled_autograd.py): compiled autograd calls the
    user's backward with bare grads, which a boxed backward cannot take."""
    cls = ctx._forward_cls
    if not hasattr(cls, "_aot_id") and getattr(cls, "boxed_grads_call", False):
        raise RuntimeError(
            f"boxed_grads_call=True on {cls.__name__} "
            "is not supported with compiled autograd. "
        )


def _refuse_boxed(proxy_call_backward):
    """At capture, where torch 2.13 checks: proxy_call_backward receives the
    ctx (torch 2.7 on)."""

    def checked(self, inputs, output_metadatas, saved_tensors, backward_idx, ctx, *rest):
        _check_not_boxed(ctx)
        return proxy_call_backward(
            self, inputs, output_metadatas, saved_tensors, backward_idx, ctx, *rest
        )

    checked.__wrapped__ = proxy_call_backward
    return checked


def _refuse_boxed_when_keyed(compiled_autograd_key):
    """torch 2.6's proxy_call_backward gets no ctx (only its index among the
    captured graph's inputs). Compiled autograd asks each custom Function's
    node for its cache key while capturing (PyNode::compiled_args calls
    ``ctx._compiled_autograd_key()``, the real ctx): the check runs there,
    before anything is traced, with the same error."""

    def checked(self):
        _check_not_boxed(self)
        return compiled_autograd_key(self)

    checked.__wrapped__ = compiled_autograd_key
    checked.__name__ = compiled_autograd_key.__name__
    return checked


def _patch_compiled_autograd(module):
    compiler = module.AutogradCompilerInstance
    if "ctx" in inspect.signature(compiler.proxy_call_backward).parameters:
        if not hasattr(compiler.proxy_call_backward, "__wrapped__"):
            compiler.proxy_call_backward = _refuse_boxed(compiler.proxy_call_backward)
    elif not hasattr(BackwardCFunction._compiled_autograd_key, "__wrapped__"):
        BackwardCFunction._compiled_autograd_key = _refuse_boxed_when_keyed(
            BackwardCFunction._compiled_autograd_key
        )


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches compiled autograd when it is first imported: importing it
    ourselves would load torch._dynamo into every process.

    In ``sys.meta_path`` from torch_ctxext's import (where the boxed path is
    installed and compiled autograd is not yet imported) until compiled
    autograd is patched; then it takes itself out, and ``sys.meta_path`` is
    as it was. It never edits the list while it looks: another thread's
    import walks that same list, and an entry removed and put back under it
    could make it skip a finder."""

    def find_spec(self, fullname, path, target=None):
        if fullname != COMPILED_AUTOGRAD_MODULE:
            return None
        spec = None
        for finder in list(sys.meta_path):  # the others, as the import system would
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch_compiled_autograd(module)
            _leave(self)

        spec.loader.exec_module = exec_and_patch
        return spec


def _leave(finder):
    """Take ``finder`` out of sys.meta_path (once: a single removal)."""
    try:
        sys.meta_path.remove(finder)
    except ValueError:  # someone else did
        pass


def _compiled_autograd_refuses_boxed_functions():
    module = sys.modules.get(COMPILED_AUTOGRAD_MODULE)
    if module is not None:
        _patch_compiled_autograd(module)
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
