"""Conformance: ``FunctionCtx.save_for_forward``.

Contract text: docstring of ``FunctionCtx.save_for_forward`` in torch 2.15's
``torch/autograd/function.py``.
"""

import expecttest
import pytest
import torch
import torch.autograd.forward_ad as fwAD
from hypothesis import given, settings, strategies as st

try:
    from ._helpers import assert_saved_as_pattern, make_tensor, make_tensors, saving_with_nones, tensor_specs
except ImportError:
    from _helpers import assert_saved_as_pattern, make_tensor, make_tensors, saving_with_nones, tensor_specs

# torch's first use of forward AD loads jit decompositions, which warns that
# torch.jit.script is deprecated; that is not part of the contract under test.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")


class MulJvpSavedInForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y):
        ctx.save_for_forward(x, y)
        return x * y

    @staticmethod
    def jvp(ctx, x_t, y_t):
        x, y = ctx.saved_tensors
        return y * x_t + x * y_t


class MulJvpSavedInSetupContext(torch.autograd.Function):
    @staticmethod
    def forward(x, y):
        return x * y

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_forward(*inputs)

    @staticmethod
    def jvp(ctx, x_t, y_t):
        x, y = ctx.saved_tensors
        return y * x_t + x * y_t


def test_docstring_example_save_for_forward_func():
    """Example:: class Func(torch.autograd.Function): ... ctx.save_for_forward(x, y) ... d = Func.apply(a_dual, b, c)"""
    # Adapted: in the docstring the lines after the class are (wrongly)
    # indented into the class body; they are dedented here.

    class Func(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: torch.Tensor, y: torch.Tensor, z: int):
            ctx.save_for_backward(x, y)
            ctx.save_for_forward(x, y)
            ctx.z = z
            return x * y * z

        @staticmethod
        def jvp(ctx, x_t, y_t, _):
            x, y = ctx.saved_tensors
            z = ctx.z
            return z * (y * x_t + x * y_t)

        @staticmethod
        def vjp(ctx, grad_out):
            x, y = ctx.saved_tensors
            z = ctx.z
            return z * grad_out * y, z * grad_out * x, None

    a = torch.tensor(1.0, requires_grad=True, dtype=torch.double)
    t = torch.tensor(1.0, dtype=torch.double)
    b = torch.tensor(2.0, requires_grad=True, dtype=torch.double)
    c = 4

    with fwAD.dual_level():
        a_dual = fwAD.make_dual(a, t)
        d = Func.apply(a_dual, b, c)
        primal, tangent = fwAD.unpack_dual(d)
        assert primal.item() == 8.0  # 1 * 2 * 4
        assert tangent.item() == 8.0  # z * y * x_t = 4 * 2 * 1

    # The vjp half of the example works too.
    d = Func.apply(a, b, c)
    d.backward()
    assert a.grad.item() == 8.0 and b.grad.item() == 4.0


@pytest.mark.parametrize(
    "fn", [MulJvpSavedInForward, MulJvpSavedInSetupContext], ids=["forward", "setup_context"]
)
@settings(deadline=None)
@given(spec=tensor_specs())
def test_save_for_forward_works_from_forward_or_setup_context(fn, spec):
    """``save_for_forward`` should be called at most once, in either the :func:`setup_context` or :func:`forward` methods."""
    x, y, xt, yt = make_tensors(spec, 4)
    with fwAD.dual_level():
        out = fn.apply(fwAD.make_dual(x, xt), fwAD.make_dual(y, yt))
        tangent = fwAD.unpack_dual(out).tangent
    torch.testing.assert_close(tangent, y * xt + x * yt)


def test_save_for_forward_refuses_non_tensor_arguments():
    """``save_for_forward`` should be called at most once ... and all arguments should be tensors."""

    class SaveInt(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_forward(x, 1)
            return x.clone()

        @staticmethod
        def jvp(ctx, t):
            return t

    with pytest.raises(AssertionError) as e:
        SaveInt.apply(torch.ones(2))
    expecttest.assert_expected_inline(
        str(e.value),
        """save_for_forward expects all arguments to be tensors; you should save non-tensors as attributes on ctx.""",
    )


@settings(deadline=None)
@given(spec=tensor_specs(), n=st.integers(min_value=1, max_value=3))
def test_saved_tensors_in_jvp_are_the_tensors_saved_for_forward(spec, n):
    """In :func:`jvp`, saved objects can be accessed through the :attr:`saved_tensors` attribute."""
    shape, dtype, seed = spec
    xs = [make_tensor(shape, dtype, seed + i) for i in range(n)]
    ts = [make_tensor(shape, dtype, seed + 10 + i) for i in range(n)]
    seen = {}

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *xs):
            doubled = [x * 2 for x in xs]
            # Different tensors for backward: jvp must see the forward ones.
            ctx.save_for_backward(*[x * 100 for x in xs])
            ctx.save_for_forward(*doubled)
            return torch.stack(xs).sum(0)

        @staticmethod
        def jvp(ctx, *tangents):
            seen["saved"] = ctx.saved_tensors
            return sum(s * t for s, t in zip(ctx.saved_tensors, tangents))

        @staticmethod
        def backward(ctx, g):
            return tuple(g for _ in range(n))

    with fwAD.dual_level():
        out = Scale.apply(*[fwAD.make_dual(x, t) for x, t in zip(xs, ts)])
        tangent = fwAD.unpack_dual(out).tangent
    assert len(seen["saved"]) == n
    for got, x in zip(seen["saved"], xs):
        torch.testing.assert_close(got, x * 2)
    torch.testing.assert_close(tangent, sum(2 * x * t for x, t in zip(xs, ts)))


@settings(deadline=None)
@given(spec=tensor_specs(), pattern=st.lists(st.booleans(), min_size=1, max_size=5))
def test_save_for_forward_accepts_none(spec, pattern):
    """Arguments can also be ``None``. This is a no-op."""
    shape, dtype, seed = spec
    x = make_tensor(shape, dtype, seed)
    xt = make_tensor(shape, dtype, seed + 1)
    seen = {}
    with fwAD.dual_level():
        out = saving_with_nones("save_for_forward", pattern, seen).apply(fwAD.make_dual(x, xt))
        tangent = fwAD.unpack_dual(out).tangent
    assert_saved_as_pattern(seen["saved"], pattern, x)
    torch.testing.assert_close(tangent, xt * 3)
