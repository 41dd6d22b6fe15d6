"""``FunctionCtx.input_grad_buffers`` for torch releases that lack it (< 2.15).

The property reads the autograd engine's InputBuffer slots through the C++
extension; this module adds it to ``FunctionCtx`` and guards ``backward`` /
``grad`` against being called reentrantly once a buffer was handed out (the
engine could otherwise accumulate into a buffer the user is still writing).
"""
import torch
from torch.autograd.function import FunctionCtx
from torch.autograd.variable import Variable

from .. import _features

def _input_grad_buffers(self):
    r"""Return existing buffers for accumulating gradients of this Function's inputs.

    Each entry corresponds to an argument passed to
    :meth:`~Function.forward`, in the same order.
    Each entry is ``None`` or the autograd engine's current ``InputBuffer`` for
    that input. A non-``None`` buffer contains gradient contributions already
    produced during the current backward. A custom backward may accumulate its
    contribution directly into the buffer and return ``None`` for that input,
    fusing gradient computation with accumulation and avoiding a separate
    gradient tensor.

    Availability follows backward execution order and is independent for each
    input. An entry is ``None`` when no earlier producer has contributed to
    that input, or when the existing buffer is aliased or cannot safely be
    updated in place.

    For example, ``x`` has another forward use while ``weight`` does not. The
    custom backward conditionally fuses accumulation only for ``grad_x``::

        >>> import torch
        >>> class Matmul(torch.autograd.Function):
        ...     @staticmethod
        ...     def forward(ctx, x, weight):
        ...         ctx.save_for_backward(x, weight)
        ...         return x @ weight
        ...
        ...     @staticmethod
        ...     def backward(ctx, grad_output):
        ...         x, weight = ctx.saved_tensors
        ...         x_buffer, _ = ctx.input_grad_buffers
        ...         if x_buffer is not None:
        ...             # Computes grad_x and adds it to the existing buffer.
        ...             x_buffer.addmm_(grad_output, weight.t())
        ...             grad_x = None
        ...         else:
        ...             grad_x = grad_output @ weight.t()
        ...         grad_weight = x.t() @ grad_output
        ...         return grad_x, grad_weight
        >>> x = torch.randn(4, 3, requires_grad=True)
        >>> weight = torch.randn(3, 2, requires_grad=True)
        >>> other_op = torch.sin
        >>> loss = Matmul.apply(x, weight).sum() + other_op(x).sum()
        >>> loss.backward()
        >>> expected = torch.ones(4, 2) @ weight.detach().t() + x.detach().cos()
        >>> torch.allclose(x.grad, expected)
        True

    If ``other_op`` produces its contribution first, ``x_buffer`` can expose
    that partial sum. If ``Matmul`` runs first, ``x_buffer`` is ``None`` and it
    returns a separate tensor instead. The fallback lets the function work
    under either ordering.

    .. warning::
        A returned buffer is valid only while the current custom ``backward``
        invocation is running. Mutate it synchronously and do not retain it.
        A later producer may replace the engine's buffer, making a retained
        tensor stale.

        After receiving a non-``None`` buffer, calling ``backward`` or
        ``grad`` before the custom backward returns raises an error.

        All engine-scheduled producers that use or subsequently update an
        exposed buffer must execute on the same device, autograd engine thread,
        and stream.

    This property is available only while a Python custom ``backward`` is
    executing during an eager, first-order :meth:`~torch.Tensor.backward`,
    :func:`torch.autograd.backward`, or :func:`torch.autograd.grad` call. It is
    unavailable with ``create_graph=True``, anomaly detection, a post-hook on
    the producing autograd node, or stale capture stream overrides.

    .. note::
        For a leaf input, a non-``None`` entry exposes its execution-local
        ``InputBuffer``, not its existing ``.grad``. All contributions are
        first combined in that buffer. During ``backward``, ``AccumulateGrad``
        then runs once with the completed buffer to update ``.grad`` and run
        its usual hooks. :func:`torch.autograd.grad` instead returns the
        completed buffer without updating ``.grad``.

        During ``backward``, a custom backward that instead accumulates
        directly into a leaf ``.grad`` and returns ``None`` does not use this
        interface. It is responsible for managing ``.grad`` state, including
        initialization and lifetime, synchronization with all other producers,
        and any ``AccumulateGrad`` hook behavior bypassed by the direct write.

    (Contract text of torch 2.15, BSD-3-Clause, (c) PyTorch contributors;
    provided on this torch by torch_ctxext.)
    """
    # One C call: a real ctx (judged by its type, not by ``isinstance``, which
    # a ``__class__`` attribute can fool) is read; anything else (a hand-made
    # FunctionCtx, a mock or a proxy that claims to be a ctx through
    # __class__) gets what torch 2.15's property gives it, the attribute
    # lookup ``self._input_grad_buffers``, and is never read by the layout of
    # a ctx. The property is read in hot backward loops: no Python-level work.
    return _read(self)


def _engine_input_grad_buffers(self):
    """The C getter, for real ctx objects only (judged by their type, not by
    ``isinstance``, which a ``__class__`` attribute can fool)."""
    if not issubclass(type(self), torch._C._FunctionBase):
        raise AttributeError(
            f"'{type(self).__name__}' object has no attribute '_input_grad_buffers'"
        )
    return _C.input_grad_buffers(self)


class _GuardedEngine(torch._C._ImperativeEngine):
    """``Variable._execution_engine`` once a buffer was handed out:
    ``run_backward`` (behind ``backward()``, ``autograd.grad`` and direct
    engine calls) is refused from a backward that read a non-None buffer in
    the running graph task. The guard is a C function: outside any backward
    it costs one thread-local read."""


def _ensure_reentrancy_guard():
    """Put the guarded engine in place (called from C when a buffer is handed
    out and ``Variable._execution_engine`` is not the guarded one)."""
    engine = Variable._execution_engine
    if type(engine) is _GuardedEngine:
        return engine
    _GuardedEngine.run_backward = _C.make_reentrancy_guard(engine.run_backward)
    guarded = _GuardedEngine()
    Variable._execution_engine = guarded
    return guarded


_C = None
_read = None  # _C.input_grad_buffers_property, set by install()


def install(ext):
    """Add the property to FunctionCtx; arm the reentrancy guard. Returns
    what was installed."""
    global _C, _read
    _C = ext
    _read = ext.input_grad_buffers_property
    # Python getters around the C one: torch.compile inlines the property
    # while tracing a backward and falls back to eager at the C call, as it
    # does on torch 2.15; with the C function as fget it cannot.
    for name, getter in (
        ("_input_grad_buffers", _engine_input_grad_buffers),
        ("input_grad_buffers", _input_grad_buffers),
    ):
        prop = property(getter)
        prop.__set_name__(FunctionCtx, name)  # errors name the property as torch's do
        setattr(FunctionCtx, name, prop)
    ext.arm_reentrancy_guard(Variable, _ensure_reentrancy_guard)
    return _features.Installed.of("input_grad_buffers")
