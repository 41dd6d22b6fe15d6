"""``FunctionCtx.set_output_grad_dtype`` for torch releases that lack it (< 2.14).

The declaration is made in ``forward`` or ``setup_context``, before the outputs
exist in the graph; it takes effect once ``Function.apply`` has wrapped them.
``Function.apply`` is therefore wrapped (in C: csrc/output_grad_dtype.cpp) to
apply the pending declarations of the ctx it created. A Function that never
declares pays for two C thread-local updates per call.

Where torch 2.15 breaks its own documented contract, this keeps the contract
(see docs/deviations.md):

1. a dtype that cannot carry a gradient, or of the wrong kind (complex for a
   real output and the reverse), is rejected when declared rather than
   failing inside the engine later;
2. an undefined gradient materialized as zeros arrives in the declared dtype;
3. calling it from ``backward`` raises instead of being ignored.
"""
import sys
import threading
import weakref

import torch
from torch.autograd.function import BackwardCFunction, Function, FunctionCtx

from .. import _features

CALLED_TWICE_ERROR = "set_output_grad_dtype can only be called once"


class _Pending(threading.local):
    """Per thread: (apply depth, ctx) of the declarations made during the
    Function.apply calls still running."""

    def __init__(self):
        self.ctxs = []


_pending = _Pending()
_C = None


def _set_output_grad_dtype(self, *dtypes):
    r"""Declare the gradient dtype for each of this Function's outputs.

    This should be called at most once, from either the
    :func:`setup_context` or :func:`forward` methods. The number of
    declarations must match the number of returned values, and each argument
    corresponds positionally to the output at the same index.

    For each output, pass the dtype your backward should receive its
    gradient in:

    - Pass a :class:`torch.dtype` and the engine guarantees the gradient
      handed to backward has that dtype. This is only valid for a
      differentiable Tensor output.
    - Pass ``None`` and the gradient is handed to backward with whatever
      dtype it already has. This is also the only valid choice for a
      non-Tensor or non-differentiable output, which has no gradient.
    - Omit this call (or pass the output's own dtype) and the gradient is
      handed to backward in the output's dtype, which is the default.

    For example::

        >>> import torch
        >>> class Trig(torch.autograd.Function):
        ...     @staticmethod
        ...     def forward(ctx, x):
        ...         t1 = x.sin()
        ...         t2 = x.cos()
        ...         t3 = x.tan()
        ...         ctx.set_output_grad_dtype(torch.float32, t2.dtype, None, None)
        ...         return t1, t2, t3, "not a tensor"
        ...
        ...     @staticmethod
        ...     def backward(ctx, g1, g2, g3, _):
        ...         print(g1.dtype, g2.dtype, g3.dtype)
        ...         return g1.to(torch.float16) + g2 + g3.to(torch.float16)
        >>> x = torch.ones(3, dtype=torch.float16, requires_grad=True)
        >>> t1, t2, t3, _ = Trig.apply(x)
        >>> half, double = torch.ones(3, dtype=torch.float16), torch.ones(3, dtype=torch.float64)
        >>> torch.autograd.backward([t1, t2, t3], [half, half, double])
        torch.float32 torch.float16 torch.float64

    This ensures that backward receives ``t1``'s gradient in ``float32``,
    keeps the default behavior for ``t2``'s gradient via ``t2.dtype``,
    passes ``t3``'s gradient through uncast with ``None``, and uses ``None``
    as the placeholder for the trailing non-Tensor output.

    Unlike torch 2.15, which accepts them and fails later inside the engine or
    ignores them, torch_ctxext rejects when declared a dtype that cannot carry
    a gradient or whose kind (real or complex) differs from its output's, and
    a call made from ``backward``; and an undefined gradient materialized as
    zeros arrives in the declared dtype (see docs/deviations.md).

    (Contract text of torch 2.15, BSD-3-Clause, (c) PyTorch contributors;
    provided on this torch by torch_ctxext.)
    """
    if not issubclass(type(self), torch._C._FunctionBase):
        # A FunctionCtx made by hand is no autograd node: there is nothing to
        # declare for. Store the declaration as torch 2.15 does, and stop.
        # (Judged by the real type: isinstance honours a __class__ attribute,
        # and a mock or proxy claiming to be a ctx must not reach the
        # extension, which reads a ctx by its layout.)
        if self.output_grad_dtypes is not None:
            raise RuntimeError(CALLED_TWICE_ERROR)
        self.output_grad_dtypes = dtypes
        return
    depth = _C.apply_depth()
    if depth == 0 or _C.differentiable_outputs(self):
        raise RuntimeError(
            "set_output_grad_dtype can only be called from forward or "
            "setup_context while this Function's apply is running on this "
            "thread: it was called from backward or jvp, after apply returned, "
            "or from another thread, where the declaration could no longer take "
            "effect. Declare the gradient dtypes in forward or setup_context."
        )
    if getattr(self, "output_grad_dtypes", None) is not None:
        raise RuntimeError(CALLED_TWICE_ERROR)
    self.output_grad_dtypes = dtypes
    _pending.ctxs.append((depth, self))
    _C.note_declaration()


def _is_differentiable_dtype(dtype):
    return dtype.is_floating_point or dtype.is_complex


def _apply_declarations(ctx, output):
    """Check ctx's declarations against the outputs apply returned, and make the
    engine honour them. Runs whether or not a graph was recorded, as in torch
    2.15; only the setting needs a graph."""
    dtypes = ctx.output_grad_dtypes
    outputs = output if isinstance(output, tuple) else (output,)
    if _is_vmapped(ctx) and _vmapped_functions_return_out_dims():
        # torch.func.vmap runs a generated Function that returns the user's
        # outputs followed by their batch dims (autograd_function.py,
        # unpack_outputs): the declarations are about the outputs alone, which
        # come first, so indices still line up. torch 2.15 miscounts here.
        out_dims = outputs[-1]
        outputs = outputs[:-1] if isinstance(out_dims, tuple) else outputs[:1]
    if len(dtypes) != len(outputs):
        raise RuntimeError(
            "set_output_grad_dtype expected the number of declarations to match "
            f"the number of outputs: the Function returned {len(outputs)} values "
            f"but {len(dtypes)} declarations were provided"
        )
    differentiable = _C.differentiable_outputs(ctx)
    recorded = bool(differentiable)
    # Up to torch 2.12 the ctx holds its node weakly: when every output was
    # non-differentiable, nothing keeps the node alive and it is gone by now,
    # although a graph was recorded. Its outputs then tell: a differentiable
    # output of a recorded graph requires grad.
    node_gone = not recorded and torch.is_grad_enabled() and any(ctx.needs_input_grad)
    dirty_view_declared = False
    for index, (dtype, out) in enumerate(zip(dtypes, outputs)):
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise RuntimeError(
                "set_output_grad_dtype expects each declaration to be a "
                f"torch.dtype or None, but got {_C.type_name(dtype)}"
            )
        if recorded:
            carries_grad = differentiable[index]
        elif node_gone:
            carries_grad = isinstance(out, torch.Tensor) and out.requires_grad
        else:  # no graph: judge by the value, as far as it can tell
            carries_grad = isinstance(out, torch.Tensor) and _is_differentiable_dtype(
                out.dtype
            )
        if dtype is None:
            if recorded and carries_grad:
                _C.set_output_grad_dtype(ctx, index, None)
            continue
        if not carries_grad:
            raise RuntimeError(
                f"set_output_grad_dtype: got a concrete dtype for output {index}, "
                "but that output is not a differentiable tensor (it is a "
                "non-tensor, was marked non-differentiable, or has a "
                f"non-differentiable dtype). Pass None for output {index} instead."
            )
        # Deviation 1: torch 2.15 accepts these and fails inside the engine.
        if not _is_differentiable_dtype(dtype):
            raise RuntimeError(
                f"set_output_grad_dtype: {dtype} cannot carry a gradient, but it "
                f"was declared for output {index} ({out.dtype}). Declare a floating "
                "point or complex dtype, or None to keep the gradient's own dtype."
            )
        if dtype.is_complex != out.dtype.is_complex:
            kind = "complex" if out.dtype.is_complex else "real"
            raise RuntimeError(
                f"set_output_grad_dtype: output {index} is a {kind} tensor "
                f"({out.dtype}) but {dtype} was declared for its gradient. A real "
                "output needs a real floating point gradient dtype and a complex "
                "output a complex one."
            )
        if recorded:
            _C.set_output_grad_dtype(ctx, index, dtype)
            # An output changed in place through a view (mark_dirty on a view)
            # reaches backward through CopySlices, which calls the node
            # directly, past the engine's cast: cast on entry instead.
            dirty_view_declared |= out.grad_fn is not ctx
    if dirty_view_declared:
        _cast_on_entry(ctx, dtypes)


def _is_vmapped(ctx):
    cls = getattr(ctx, "_forward_cls", None)
    return (
        cls is not None
        and cls.__module__ == "torch._functorch.autograd_function"
        and cls.__name__.startswith("Vmapped")
    )


def _vmapped_functions_return_out_dims():
    """From torch 2.7 the generated Function returns ``(*outputs, out_dims)``;
    torch 2.6's returns the outputs alone and hands out_dims over through a
    closure (``get_out_dims``). Told apart by 2.7's ``unpack_outputs``."""
    module = sys.modules.get("torch._functorch.autograd_function")
    return module is not None and hasattr(module, "unpack_outputs")


def _cast(grads, dtypes):
    return [
        g if (d is None or g is None or g.dtype == d) else g.to(d)
        for g, d in zip(grads, dtypes)
    ]


class _CastingApply:
    """ctx.apply / ctx.apply_boxed for a ctx whose grads may bypass the cast.

    Holds the ctx weakly: an instance attribute referring back to its ctx would
    make a reference cycle and delay freeing the saved tensors.
    """

    def __init__(self, ctx, dtypes, name):
        self.ctx = weakref.ref(ctx)
        self.dtypes = dtypes
        self.method = getattr(type(ctx), name)
        self.boxed = name == "apply_boxed"

    def __call__(self, *args):
        ctx = self.ctx()
        if self.boxed:
            (grads,) = args
            grads[:] = _cast(grads, self.dtypes)
            return self.method(ctx, grads)
        return self.method(ctx, *_cast(args, self.dtypes))


def _cast_on_entry(ctx, dtypes):
    ctx.apply = _CastingApply(ctx, dtypes, "apply")
    if hasattr(type(ctx), "apply_boxed"):
        ctx.apply_boxed = _CastingApply(ctx, dtypes, "apply_boxed")


def _resolve(depth, output, ok):
    """Called by the C apply wrapper after a Function.apply at ``depth`` during
    which a declaration was made: apply the declarations of the ctx it created
    (or, when apply raised, drop them)."""
    pending = _pending.ctxs
    mine = [ctx for d, ctx in pending if d == depth]
    pending[:] = [(d, ctx) for d, ctx in pending if d != depth]
    if ok:
        for ctx in mine:
            _apply_declarations(ctx, output)


def _unavailable_reason(ext):
    """Why this member cannot be provided with ``ext`` on the running torch,
    or None. Up to torch 2.9 a None declaration needs the engine hook of
    csrc/output_grad_dtype.h; everything else works on every release."""
    if ext.boundaries["ENGINE_CASTS_TO_OPTIONS_DTYPE"] and not ext.uncast_gradients_available():
        return (
            f"torch {torch.__version__} casts every gradient to the output's dtype "
            "(validate_outputs, before torch 2.10), and libtorch_cpu makes no call "
            "to validate_outputs that torch_ctxext can route around the cast, so "
            "set_output_grad_dtype(None) could not be honoured"
        )
    return None


def install(ext):
    """Add set_output_grad_dtype to FunctionCtx and route Function.apply
    through the declarations; returns what was installed, or why not."""
    global _C
    why = _unavailable_reason(ext)
    if why:
        return _features.Installed.refused("set_output_grad_dtype", why)
    _C = ext
    # Where torch 2.14 keeps it: on the ctx of a real Function (a C member of
    # _FunctionBase there), not on FunctionCtx, which only annotates it.
    BackwardCFunction.output_grad_dtypes = None
    _set_output_grad_dtype.__name__ = "set_output_grad_dtype"
    _set_output_grad_dtype.__qualname__ = "FunctionCtx.set_output_grad_dtype"
    FunctionCtx.set_output_grad_dtype = _set_output_grad_dtype
    if "_torch_ctxext_original_apply" not in Function.__dict__:  # not wrapped yet
        original = Function.__dict__["apply"].__func__
        Function.apply = classmethod(ext.make_apply(original, _resolve))
        Function._torch_ctxext_original_apply = original
    return _features.Installed.of("set_output_grad_dtype")
