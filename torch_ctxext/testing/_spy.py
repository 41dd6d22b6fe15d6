"""Temporary wrappers that record what the engine does with the checked
Function (restored when the block exits)."""
import contextlib
from dataclasses import dataclass

import torch

from ._common import as_tuple


@contextlib.contextmanager
def patched(owner, name, make_wrapper):
    """Replace ``owner.<name>`` by ``make_wrapper(original)``; restore after."""
    had_own = name in owner.__dict__
    own = owner.__dict__.get(name)
    original = getattr(owner, name)
    setattr(owner, name, make_wrapper(original))
    try:
        yield original
    finally:
        if had_own:
            setattr(owner, name, own)
        else:
            delattr(owner, name)


@dataclass(frozen=True)
class GradInfo:
    """What a gradient was, without keeping it alive."""

    dtype: torch.dtype | None  # None: the gradient was None
    shape: tuple | None
    zero: bool | None

    @classmethod
    def of(cls, g):
        if not isinstance(g, torch.Tensor):
            return cls(None, None, None)
        try:
            zero = not bool(g.detach().any())
        except RuntimeError:
            zero = None
        return cls(g.dtype, tuple(g.shape), zero)

    def __str__(self):
        if self.dtype is None:
            return "None"
        kind = "a zero" if self.zero else "a"
        return f"{kind} {str(self.dtype).replace('torch.', '')} tensor of shape {list(self.shape)}"


def spy_backward(fn, record):
    """A context manager under which every call of ``fn``'s backward by the
    engine (boxed or not) also calls ``record(received, returned)``: one
    :class:`GradInfo` per gradient backward received and per value it
    returned."""
    bw = fn._backward_cls
    stack = contextlib.ExitStack()
    depth = []

    def spy(original, boxed):
        """apply (grads as arguments) or apply_boxed (one list of grads)."""

        def call(ctx, *args):
            if depth:  # apply calling apply_boxed (or back): one backward
                return original(ctx, *args)
            unboxed = boxed and len(args) == 1 and isinstance(args[0], list)
            received = [GradInfo.of(g) for g in (args[0] if unboxed else args)]
            depth.append(1)
            try:
                result = original(ctx, *args)
            finally:
                depth.pop()
            record(received, [GradInfo.of(g) for g in as_tuple(result)])
            return result

        return call

    stack.enter_context(patched(bw, "apply", lambda original: spy(original, False)))
    if hasattr(bw, "apply_boxed"):
        stack.enter_context(patched(bw, "apply_boxed", lambda original: spy(original, True)))
    return stack
