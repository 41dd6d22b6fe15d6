"""Conformance: ``BackwardCFunction.apply_jvp`` and the ``Function.jvp``
contract it serves (forward-mode AD of a custom Function).

Contract text: docstrings of ``BackwardCFunction.apply_jvp`` and
``Function.jvp`` in torch 2.15's ``torch/autograd/function.py``.
"""

import expecttest
import pytest
import torch
import torch.autograd.forward_ad as fwAD
from hypothesis import given, settings, strategies as st
from torch.autograd import Function
from torch.autograd.function import FunctionCtx

try:
    from ._helpers import float_dtypes, linear_map, make_tensor, make_tensors, record_calls, seeds, tensor_specs
except ImportError:
    from _helpers import float_dtypes, linear_map, make_tensor, make_tensors, record_calls, seeds, tensor_specs

# torch's first use of forward AD loads jit decompositions, which warns that
# torch.jit.script is deprecated; that is not part of the contract under test.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")


class ExpMul(Function):
    """out = exp(x) * y, with jvp and vjp from tensors saved on ctx."""

    @staticmethod
    def forward(ctx, x, y):
        e = x.exp()
        ctx.save_for_forward(e, y)
        ctx.save_for_backward(e, y)
        return e * y

    @staticmethod
    def jvp(ctx, x_t, y_t):
        e, y = ctx.saved_tensors
        return e * y * x_t + e * y_t

    @staticmethod
    def backward(ctx, g):
        e, y = ctx.saved_tensors
        return g * e * y, g * e


@settings(deadline=None)
@given(spec=tensor_specs())
def test_apply_jvp_is_called_during_the_forward_under_forward_mode_ad(spec):
    """Apply method used when executing forward mode AD during the forward"""
    shape, dtype, seed = spec
    calls = []

    class Spied(Function):
        @staticmethod
        def forward(ctx, x):
            calls.append(("forward", ()))
            return x * 2

        @staticmethod
        def jvp(ctx, t):
            calls.append(("jvp", (t,)))
            return t * 2

        @staticmethod
        def backward(ctx, g):
            calls.append(("backward", ()))
            return g * 2

    record_calls(Spied._backward_cls, "apply_jvp", calls)
    x = make_tensor(shape, dtype, seed, requires_grad=True)
    t = make_tensor(shape, dtype, seed + 1)

    # No forward-mode AD: apply_jvp is not used (not in forward, not in backward).
    Spied.apply(x).sum().backward()
    assert [c for c, _ in calls] == ["forward", "backward"]

    calls.clear()
    with fwAD.dual_level():
        out = Spied.apply(fwAD.make_dual(x.detach(), t))
        # Already done when apply returns: it ran during the forward.
        assert [c for c, _ in calls] == ["forward", "apply_jvp", "jvp"]
        torch.testing.assert_close(fwAD.unpack_dual(out).tangent, 2 * t)


@settings(deadline=None)
@given(spec=tensor_specs())
def test_apply_jvp_with_save_for_forward_under_forward_mode_ad(spec):
    """Apply method used when executing forward mode AD during the forward (jvp reading tensors saved with ``save_for_forward``)."""
    x, y, xt, yt = make_tensors(spec, 4)
    with fwAD.dual_level():
        out = ExpMul.apply(fwAD.make_dual(x, xt), fwAD.make_dual(y, yt))
        primal, tangent = fwAD.unpack_dual(out)
        # Ground truth: forward AD through the same computation in plain ops.
        reference = fwAD.unpack_dual(fwAD.make_dual(x, xt).exp() * fwAD.make_dual(y, yt)).tangent
    torch.testing.assert_close(primal, x.exp() * y)
    torch.testing.assert_close(tangent, reference)


@settings(deadline=None)
@given(
    kinds=st.lists(st.sampled_from(["dual", "int", "str", "none"]), min_size=1, max_size=5).filter(
        lambda ks: "dual" in ks
    ),
    spec=tensor_specs(),
)
def test_jvp_receives_ctx_then_one_tangent_per_input_and_none_for_non_tensor_inputs(kinds, spec):
    """It must accept a context :attr:`ctx` as the first argument, followed by as many inputs as the :func:`forward` got (None will be passed in for non tensor inputs of the forward function)."""
    shape, dtype, seed = spec
    seen = {}
    args, tangents = [], []
    for i, k in enumerate(kinds):
        if k == "dual":
            tangents.append(make_tensor(shape, dtype, seed + i))
            args.append((make_tensor(shape, dtype, seed + 100 + i), tangents[-1]))
        else:
            tangents.append(None)
            args.append({"int": i, "str": "s", "none": None}[k])

    class Mixed(Function):
        @staticmethod
        def forward(ctx, *xs):
            return sum(x for x in xs if isinstance(x, torch.Tensor))

        @staticmethod
        def jvp(ctx, *ts):
            seen["ctx"] = ctx
            seen["tangents"] = ts
            return sum(t for t in ts if t is not None)

    with fwAD.dual_level():
        real_args = [fwAD.make_dual(*a) if isinstance(a, tuple) else a for a in args]
        out = Mixed.apply(*real_args)
        out_tangent = fwAD.unpack_dual(out).tangent
    assert isinstance(seen["ctx"], FunctionCtx)
    assert len(seen["tangents"]) == len(kinds)
    for got, want in zip(seen["tangents"], tangents):
        if want is None:
            assert got is None
        else:
            torch.testing.assert_close(got, want)
    torch.testing.assert_close(out_tangent, sum(t for t in tangents if t is not None))


def test_jvp_must_return_as_many_values_as_forward_outputs():
    """... and it should return as many tensors as there were outputs to :func:`forward`."""

    class TwoOutOneTangent(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2, x * 3

        @staticmethod
        def jvp(ctx, t):
            return t * 2

    with pytest.raises(RuntimeError) as e:
        with fwAD.dual_level():
            TwoOutOneTangent.apply(fwAD.make_dual(torch.ones(2), torch.ones(2)))
    expecttest.assert_expected_inline(
        str(e.value), """Function's jvp returned an invalid number of forward gradients (expected 2 but got 1)"""
    )


@settings(deadline=None)
@given(n_in=st.integers(1, 3), n_out=st.integers(1, 3), dtype=float_dtypes, seed=seeds)
def test_each_jvp_argument_is_the_tangent_of_its_input_and_each_return_value_the_tangent_of_its_output(
    n_in, n_out, dtype, seed
):
    """Each argument is the gradient w.r.t the given input, and each returned value should be the gradient w.r.t. the corresponding output."""
    seen = {}
    Linear, c = linear_map(n_in, n_out, seen)
    xs = [make_tensor((2,), dtype, seed + i) for i in range(n_in)]
    ts = [make_tensor((2,), dtype, seed + 10 + i) for i in range(n_in)]
    with fwAD.dual_level():
        outs = Linear.apply(*[fwAD.make_dual(x, t) for x, t in zip(xs, ts)])
        out_tangents = [fwAD.unpack_dual(o).tangent for o in outs]
    for got, t in zip(seen["tangents"], ts):
        torch.testing.assert_close(got, t)
    for j, ot in enumerate(out_tangents):
        torch.testing.assert_close(ot, sum(c[j][i] * ts[i] for i in range(n_in)))


@settings(deadline=None)
@given(spec=tensor_specs())
def test_jvp_may_return_none_for_non_tensor_outputs_and_non_differentiable_outputs(spec):
    """If an output is not a Tensor or the function is not differentiable with respect to that output, you can just pass None as a gradient for that input."""
    shape, dtype, seed = spec

    class Mixed(Function):
        @staticmethod
        def forward(ctx, x):
            flat = x * 3
            ctx.mark_non_differentiable(flat)
            return x * 2, flat, x > 0, "not a tensor"

        @staticmethod
        def jvp(ctx, t):
            return t * 2, None, None, None

    x = make_tensor(shape, dtype, seed)
    t = make_tensor(shape, dtype, seed + 1)
    with fwAD.dual_level():
        a, flat, positive, s = Mixed.apply(fwAD.make_dual(x, t))
        torch.testing.assert_close(fwAD.unpack_dual(a).tangent, 2 * t)
        assert fwAD.unpack_dual(flat).tangent is None
        assert fwAD.unpack_dual(positive).tangent is None
        assert s == "not a tensor"
        torch.testing.assert_close(flat, x * 3)


@pytest.mark.xfail(
    strict=True,
    raises=RuntimeError,
    reason=(
        "torch 2.6 to 2.15: returning None from jvp for a differentiable floating-point "
        "output (e.g. one that does not depend on the inputs) hits an INTERNAL ASSERT "
        "('Expected both tensor and its forward grad to be floating point or complex') "
        "instead of meaning a zero/absent tangent"
    ),
)
def test_jvp_may_return_none_for_an_output_that_does_not_depend_on_the_inputs():
    """If an output is not a Tensor or the function is not differentiable with respect to that output, you can just pass None as a gradient for that input."""

    class WithConstant(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2, torch.ones(2)

        @staticmethod
        def jvp(ctx, t):
            return t * 2, None

    with fwAD.dual_level():
        a, const = WithConstant.apply(fwAD.make_dual(torch.ones(2), torch.ones(2)))
        torch.testing.assert_close(fwAD.unpack_dual(a).tangent, torch.full((2,), 2.0))
        tangent = fwAD.unpack_dual(const).tangent
        assert tangent is None or not tangent.any()


@settings(deadline=None)
@given(
    value=st.one_of(st.integers(), st.text(max_size=3), st.none(), st.tuples(st.integers(), st.booleans())),
    spec=tensor_specs(),
)
def test_ctx_carries_any_value_from_forward_to_jvp(value, spec):
    """You can use the :attr:`ctx` object to pass any value from the forward to this functions."""
    shape, dtype, seed = spec
    seen = {}
    sentinel = object()

    class Carry(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.value = value
            ctx.sentinel = sentinel
            ctx.scale = 3
            return x * 3

        @staticmethod
        def jvp(ctx, t):
            seen["value"] = ctx.value
            seen["sentinel"] = ctx.sentinel
            return t * ctx.scale

    x = make_tensor(shape, dtype, seed)
    t = make_tensor(shape, dtype, seed + 1)
    with fwAD.dual_level():
        out = Carry.apply(fwAD.make_dual(x, t))
        torch.testing.assert_close(fwAD.unpack_dual(out).tangent, 3 * t)
    assert seen["value"] == value
    assert seen["sentinel"] is sentinel
