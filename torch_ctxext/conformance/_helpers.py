"""Shared helpers for the ctx-contract conformance tests.

Only torch, pytest, hypothesis and expecttest may be used here: the suite runs
against bare torch and never imports the package (the release facts come from
``_torch_ctxext_build.releases``: the standard library only, no torch_ctxext).
"""
import re

import torch
from hypothesis import strategies as st
from torch.autograd import Function
from torch.autograd.function import once_differentiable

from _torch_ctxext_build import releases

# (major, minor) of the torch under test, e.g. (2, 13).
TORCH_VERSION = releases.release(torch.__version__)

# Feature detection, as the reference notes recommend (not version numbers).
HAS_BOXED_GRADS = hasattr(torch.autograd.function.BackwardCFunction, "apply_boxed")

FLOAT_DTYPES = (torch.float32, torch.float64)

float_dtypes = st.sampled_from(FLOAT_DTYPES)

# Tiny shapes only: the whole suite must stay fast.
small_shapes = st.lists(st.integers(min_value=1, max_value=3), min_size=0, max_size=2).map(
    tuple
)

# Seeds for make_tensor.
seeds = st.integers(min_value=0, max_value=2**31 - 1)


def make_tensor(shape, dtype, seed, requires_grad=False, low=-2.0, high=2.0):
    """A deterministic random tensor (uses its own generator, not the global
    RNG), on torch's default device (the suite's ``--device``): drawn on the
    CPU, so the values are the same on every device."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.rand(shape, dtype=dtype, generator=gen, device="cpu") * (high - low) + low
    return t.to(torch.empty(0).device).requires_grad_(requires_grad)


def make_tensors(spec, n):
    """``n`` make_tensor()s of one (shape, dtype, seed) spec, from the seeds
    seed, seed + 1, ... (primals and their tangents, say)."""
    shape, dtype, seed = spec
    return [make_tensor(shape, dtype, seed + i) for i in range(n)]


def record_calls(cls, name, calls):
    """Replace ``cls.<name>`` by a wrapper that appends ``(name, args)`` to
    ``calls`` before calling the original."""
    original = getattr(cls, name)

    def wrapper(self, *args):
        calls.append((name, args))
        return original(self, *args)

    setattr(cls, name, wrapper)


# --- sample Functions shared by several tests --------------------------------


class Exp(Function):
    """The example of the ``Function`` docstring: exp, saving its output."""

    @staticmethod
    def forward(ctx, i):
        result = i.exp()
        ctx.save_for_backward(result)
        return result

    @staticmethod
    def backward(ctx, grad_output):
        (result,) = ctx.saved_tensors
        return grad_output * result


class Mul(Function):
    """x * w, saving both inputs in forward."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, g * x


def linear_map(n_in, n_out, seen):
    """out_j = sum_i c[j][i] * x_i, with distinct coefficients: (the Function,
    c). Its backward and its jvp apply the map (transposed for backward) and
    record what they receive in ``seen["grads"]`` / ``seen["tangents"]``."""
    c = [[float(1 + j * n_in + i) for i in range(n_in)] for j in range(n_out)]

    class Linear(Function):
        @staticmethod
        def forward(ctx, *xs):
            return tuple(sum(c[j][i] * xs[i] for i in range(n_in)) for j in range(n_out))

        @staticmethod
        def backward(ctx, *grads):
            seen["grads"] = grads
            return tuple(sum(c[j][i] * grads[j] for j in range(n_out)) for i in range(n_in))

        @staticmethod
        def jvp(ctx, *ts):
            seen["tangents"] = ts
            return tuple(sum(c[j][i] * ts[i] for i in range(n_in)) for j in range(n_out))

    return Linear, c


def fanout(n, backward, boxed=False):
    """A Function returning ``x * (i + 1)`` for i < n (with ``boxed``, its
    ``boxed_grads_call`` is True); its backward returns ``backward(*args)``,
    args being the gradients backward received (boxed: the one list)."""

    class Fanout(Function):
        if boxed:  # otherwise the attribute is Function's default
            boxed_grads_call = True

        @staticmethod
        def forward(ctx, x):
            return tuple(x * (i + 1) for i in range(n))

        @staticmethod
        def backward(ctx, *args):
            return backward(*args)

    return Fanout


def read_error(ctx):
    """ctx.input_grad_buffers, or the message of the RuntimeError reading it raised."""
    try:
        entries = ctx.input_grad_buffers
    except RuntimeError as e:
        return str(e)
    return entries


def fanout_input_grad(grads):
    """The gradient of x for fanout's outputs, given theirs."""
    return sum(g * (i + 1) for i, g in enumerate(grads))


def once_differentiable_square(boxed=False):
    """y = x**2 saving x, whose backward, decorated with @once_differentiable,
    returns 2x * g (with ``boxed``, boxed_grads_call is True and g is the first
    entry of what backward receives)."""

    class OnceDifferentiableSquare(Function):
        if boxed:  # otherwise the attribute is Function's default
            boxed_grads_call = True

        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x**2

        @staticmethod
        @once_differentiable
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 2 * x * (g[0] if boxed else g)

    return OnceDifferentiableSquare


def saving_with_nones(save, pattern, seen):
    """y = 3x whose forward calls ``ctx.<save>`` (save_for_backward or
    save_for_forward) with x where ``pattern`` is True and None where it is
    False; its backward and its jvp record ctx.saved_tensors as seen["saved"]."""

    class SaveWithNones(Function):
        @staticmethod
        def forward(ctx, x):
            getattr(ctx, save)(*[x if is_tensor else None for is_tensor in pattern])
            return x * 3

        @staticmethod
        def backward(ctx, g):
            seen["saved"] = ctx.saved_tensors
            return g * 3

        @staticmethod
        def jvp(ctx, t):
            seen["saved"] = ctx.saved_tensors
            return t * 3

    return SaveWithNones


def assert_saved_as_pattern(saved, pattern, x):
    """``saved`` (a ctx.saved_tensors) holds x where ``pattern`` is True and
    None where it is False."""
    assert len(saved) == len(pattern)
    for got, is_tensor in zip(saved, pattern):
        if is_tensor:
            assert torch.equal(got, x)
        else:
            assert got is None


@st.composite
def tensor_specs(draw, shapes=small_shapes, dtypes=float_dtypes):
    """Draw (shape, dtype, seed)."""
    return draw(shapes), draw(dtypes), draw(seeds)


def as_on_cpu(message):
    """The error text with a tensor's type named as for a CPU tensor
    (``[torch.FloatTensor [3]]``), whatever device the suite runs on
    (``torch.cuda.FloatTensor``, a PrivateUse1 backend's ``testdeviceFloatType``)."""
    return re.sub(
        r"\[\S*?(ComplexFloat|ComplexDouble|BFloat16|Float|Double|Half|Long|Int|Short|Char|Byte|Bool)"
        r"(?:Tensor|Type) \[",
        r"[torch.\1Tensor [",
        message,
    )


def node_named(message):
    """The error text with the custom node's name as torch >= 2.13 prints it
    (torch 2.12 appends "Backward": "output 0 of InplaceBackward")."""
    return re.sub(r"output (\d+) of (\w+?)Backward,", r"output \1 of \2,", message)
