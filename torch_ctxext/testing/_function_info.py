"""What a Function class defines: its forward's argument names, whether
backward is @once_differentiable, whether it uses setup_context, jvp, a
vmap rule."""
import inspect

import torch
from torch.autograd.function import Function, once_differentiable

_ONCE_DIFFERENTIABLE_CODE = once_differentiable(lambda ctx: None).__code__
_BASE_SETUP_CONTEXT = getattr(torch.autograd.function._SingleLevelFunction, "setup_context", None)
_BASE_JVP = getattr(torch.autograd.function._SingleLevelFunction, "jvp", None)
_BASE_VMAP = getattr(Function, "vmap", None)


def user_backward(fn):
    vjp = getattr(fn, "vjp", None)
    if vjp is not None and vjp is not Function.vjp:
        return vjp
    return fn.backward


def is_once_differentiable(fn):
    return getattr(user_backward(fn), "__code__", None) is _ONCE_DIFFERENTIABLE_CODE


def uses_setup_context(fn):
    return getattr(fn, "setup_context", None) is not _BASE_SETUP_CONTEXT


def defines_jvp(fn):
    return getattr(fn, "jvp", None) is not _BASE_JVP


def defines_vmap(fn):
    """'staticmethod', 'generate_vmap_rule' or None."""
    if getattr(fn, "vmap", None) is not _BASE_VMAP:
        return "staticmethod"
    if getattr(fn, "generate_vmap_rule", False):
        return "generate_vmap_rule"
    return None


def arg_names(fn, count):
    try:
        params = list(inspect.signature(fn.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    if params and not uses_setup_context(fn):
        params = params[1:]  # ctx
    names = []
    for i in range(count):
        if i < len(params) and params[i].kind in (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        ):
            names.append(f"input {i} ({params[i].name})")
        else:
            names.append(f"input {i}")
    return names
