"""Conformance: ``BackwardCFunction.apply``, the method through which the engine
and direct ``grad_fn.apply()`` calls reach a custom Function's backward, and
the ``Function.forward`` / ``setup_context`` / ``backward`` / ``vjp`` contract
it serves (``Function.apply`` is the forward half of the same member).

Contract text: docstrings of ``BackwardCFunction.apply``, ``Function``,
``Function.forward``, ``Function.setup_context`` and ``Function.backward`` in
torch 2.15's ``torch/autograd/function.py``.
"""

import expecttest
import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.autograd import Function
from torch.autograd.function import FunctionCtx

try:
    from ._helpers import (
        Exp, HAS_BOXED_GRADS, Mul, fanout, fanout_input_grad, float_dtypes,
        linear_map, make_tensor, record_calls, seeds, tensor_specs,
    )
except ImportError:
    from _helpers import (
        Exp, HAS_BOXED_GRADS, Mul, fanout, fanout_input_grad, float_dtypes,
        linear_map, make_tensor, record_calls, seeds, tensor_specs,
    )


# --- BackwardCFunction.apply ---------------------------------------------


@settings(deadline=None)
@given(spec=tensor_specs())
def test_engine_calls_apply_on_the_non_boxed_path(spec):
    """Called by the autograd engine (non-boxed path) ..."""
    shape, dtype, seed = spec
    calls = []

    class Spied(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2, x * 3

        @staticmethod
        def backward(ctx, g1, g2):
            calls.append(("backward", (g1, g2)))
            return g1 * 2 + g2 * 3

    record_calls(Spied._backward_cls, "apply", calls)
    if HAS_BOXED_GRADS:
        record_calls(Spied._backward_cls, "apply_boxed", calls)
    x = make_tensor(shape, dtype, seed, requires_grad=True)
    a, b = Spied.apply(x)
    assert calls == []
    (a.sum() + b.sum()).backward()
    assert [name for name, _ in calls] == ["apply", "backward"]
    engine_args = calls[0][1]
    assert len(engine_args) == 2 and all(isinstance(g, torch.Tensor) for g in engine_args)
    torch.testing.assert_close(x.grad, torch.full_like(x, 5).detach())


@settings(deadline=None)
@given(spec=tensor_specs(), n=st.integers(min_value=1, max_value=4))
def test_direct_grad_fn_apply_calls_the_user_backward(spec, n):
    """... and by direct grad_fn.apply() calls."""
    shape, dtype, seed = spec
    seen = {}

    def backward(*grads):
        seen["grads"] = grads
        return fanout_input_grad(grads)

    x = make_tensor(shape, dtype, seed, requires_grad=True)
    outs = fanout(n, backward).apply(x)
    grads = [make_tensor(shape, dtype, seed + 1 + i) for i in range(n)]
    result = outs[0].grad_fn.apply(*grads)
    assert isinstance(seen["grads"], tuple) and len(seen["grads"]) == n
    for got, want in zip(seen["grads"], grads):
        assert got is want
    torch.testing.assert_close(result, sum(g * (i + 1) for i, g in enumerate(grads)))
    assert x.grad is None  # a direct call is not a backward pass


@pytest.mark.skipif(not HAS_BOXED_GRADS, reason="this torch has no boxed grads call")
@settings(deadline=None)
@given(spec=tensor_specs(), n=st.integers(min_value=1, max_value=4))
def test_direct_grad_fn_apply_boxes_grads_into_a_list(spec, n):
    """When boxed_grads_call is True, boxes grads into a mutable list before calling user's backward."""
    shape, dtype, seed = spec
    seen = {}

    def backward(*args):
        seen["args"] = args
        (grads,) = args
        total = fanout_input_grad(grads)
        grads.clear()  # mutable
        return total

    x = make_tensor(shape, dtype, seed, requires_grad=True)
    outs = fanout(n, backward, boxed=True).apply(x)
    grads = [make_tensor(shape, dtype, seed + 1 + i) for i in range(n)]
    result = outs[0].grad_fn.apply(*grads)
    args = seen["args"]
    assert len(args) == 1 and type(args[0]) is list
    assert args[0] == []  # the list backward cleared is the one it received
    torch.testing.assert_close(result, sum(g * (i + 1) for i, g in enumerate(grads)))


# --- Function (class docstring), forward and setup_context -----------------


def test_docstring_example_function_exp():
    """Examples:: class Exp(Function): ... # Use it by calling the apply method: output = Exp.apply(input)"""
    input = torch.tensor([0.5, -1.0, 2.0], dtype=torch.double, requires_grad=True)
    # Use it by calling the apply method:
    output = Exp.apply(input)
    torch.testing.assert_close(output.detach(), input.detach().exp())
    assert type(output.grad_fn) is Exp._backward_cls
    assert torch.autograd.gradcheck(Exp.apply, (input,))


_non_tensor_args = st.one_of(st.integers(-3, 3), st.text(max_size=2), st.none(), st.floats(-1, 1))


@settings(deadline=None)
@given(
    kinds=st.lists(st.one_of(st.just("tensor"), _non_tensor_args), min_size=1, max_size=5),
    dtype=float_dtypes,
    seed=seeds,
)
def test_forward_receives_ctx_then_any_number_of_arguments_of_any_type(kinds, dtype, seed):
    """It must accept a context ctx as the first argument, followed by any number of arguments (tensors or other types)."""
    args = [
        make_tensor((2,), dtype, seed + i, requires_grad=True) if k == "tensor" else k
        for i, k in enumerate(kinds)
    ]
    seen = {}

    class Echo(Function):
        @staticmethod
        def forward(ctx, *received):
            seen["ctx"] = ctx
            seen["args"] = received
            return torch.zeros(2, dtype=dtype)

        @staticmethod
        def backward(ctx, g):
            return (None,) * len(kinds)

    Echo.apply(*args)
    assert isinstance(seen["ctx"], FunctionCtx)
    assert len(seen["args"]) == len(args)
    for got, want in zip(seen["args"], args):
        if isinstance(want, torch.Tensor):
            assert got is want
        else:
            assert got == want or (got != got and want != want)  # NaN-safe


@settings(deadline=None)
@given(spec=tensor_specs(), k=st.integers(-3, 3))
def test_setup_context_receives_the_inputs_tuple_and_the_forward_output(spec, k):
    """The forward no longer accepts a ctx argument. ... ``output`` is the output of the forward, ``inputs`` are a Tuple of inputs to the forward."""
    shape, dtype, seed = spec
    seen = {}

    class Separate(Function):
        @staticmethod
        def forward(x, k):
            out = x * k
            seen["forward_args"] = (x, k)
            seen["forward_out"] = out
            return out

        @staticmethod
        def setup_context(ctx, inputs, output):
            seen["ctx"] = ctx
            seen["inputs"] = inputs
            seen["output"] = output
            ctx.k = inputs[1]

        @staticmethod
        def backward(ctx, g):
            return g * ctx.k, None

    x = make_tensor(shape, dtype, seed, requires_grad=True)
    out = Separate.apply(x, k)
    assert len(seen["forward_args"]) == 2  # no ctx passed to forward
    assert isinstance(seen["ctx"], FunctionCtx)
    assert type(seen["inputs"]) is tuple
    assert seen["inputs"][0] is x and seen["inputs"][1] == k
    assert seen["output"] is seen["forward_out"]
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, k).detach())


@settings(deadline=None)
@given(spec=tensor_specs())
def test_tensors_stored_directly_on_ctx_are_not_rejected(spec):
    """Tensors should not be stored directly on `ctx` (though this is not currently enforced for backward compatibility)."""
    shape, dtype, seed = spec

    class OnCtx(Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.w = w
            return x * w

        @staticmethod
        def backward(ctx, g):
            return g * ctx.w, None

    x = make_tensor(shape, dtype, seed, requires_grad=True)
    w = make_tensor(shape, dtype, seed + 1)
    OnCtx.apply(x, w).sum().backward()
    torch.testing.assert_close(x.grad, w)


# --- Function.backward / vjp ----------------------------------------------


@settings(deadline=None)
@given(
    kinds=st.lists(st.sampled_from(["tensor", "int", "str"]), min_size=1, max_size=5).filter(
        lambda ks: "tensor" in ks
    ),
    spec=tensor_specs(),
)
def test_backward_receives_one_argument_per_output_and_none_for_non_tensor_outputs(kinds, spec):
    """It must accept a context :attr:`ctx` as the first argument, followed by as many outputs as the :func:`forward` returned (None will be passed in for non tensor outputs of the forward function)."""
    shape, dtype, seed = spec
    seen = {}

    class Mixed(Function):
        @staticmethod
        def forward(ctx, x):
            return tuple(
                x * (i + 1) if k == "tensor" else (i if k == "int" else "s") for i, k in enumerate(kinds)
            )

        @staticmethod
        def backward(ctx, *grads):
            seen["ctx"] = ctx
            seen["grads"] = grads
            return sum(g * (i + 1) for i, g in enumerate(grads) if g is not None)

    x = make_tensor(shape, dtype, seed, requires_grad=True)
    outs = Mixed.apply(x)
    sum(o.sum() for o in outs if isinstance(o, torch.Tensor)).backward()
    assert isinstance(seen["ctx"], FunctionCtx)
    grads = seen["grads"]
    assert len(grads) == len(kinds)
    for g, k, o in zip(grads, kinds, outs):
        if k == "tensor":
            assert torch.equal(g, torch.ones_like(o))
        else:
            assert g is None


def test_backward_must_return_as_many_values_as_forward_inputs():
    """... and it should return as many tensors, as there were inputs to :func:`forward`."""

    class W(Function):
        @staticmethod
        def forward(ctx, x, y):
            return x + y

        @staticmethod
        def backward(ctx, g):
            return g

    with pytest.raises(RuntimeError) as e:
        W.apply(torch.ones(2, requires_grad=True), torch.ones(2)).sum().backward()
    expecttest.assert_expected_inline(
        str(e.value), """function WBackward returned an incorrect number of gradients (expected 2, got 1)"""
    )


@settings(deadline=None)
@given(
    n_in=st.integers(1, 3),
    n_out=st.integers(1, 3),
    dtype=float_dtypes,
    seed=seeds,
)
def test_each_backward_argument_is_the_gradient_of_its_output_and_each_return_value_the_gradient_of_its_input(
    n_in, n_out, dtype, seed
):
    """Each argument is the gradient w.r.t the given output, and each returned value should be the gradient w.r.t. the corresponding input."""
    seen = {}
    Linear, c = linear_map(n_in, n_out, seen)
    xs = [make_tensor((2,), dtype, seed + i, requires_grad=True) for i in range(n_in)]
    weights = [make_tensor((2,), dtype, seed + 10 + j) for j in range(n_out)]
    outs = Linear.apply(*xs)
    sum((o * w).sum() for o, w in zip(outs, weights)).backward()
    for g, w in zip(seen["grads"], weights):
        torch.testing.assert_close(g, w)
    for i, x in enumerate(xs):
        torch.testing.assert_close(x.grad, sum(c[j][i] * weights[j] for j in range(n_out)))


@settings(deadline=None)
@given(spec=tensor_specs(), k=st.integers(-3, 3))
def test_backward_may_return_none_for_non_tensor_inputs_and_inputs_not_requiring_grad(spec, k):
    """If an input is not a Tensor or is a Tensor not requiring grads, you can just pass None as a gradient for that input."""
    shape, dtype, seed = spec

    class MulK(Function):
        @staticmethod
        def forward(ctx, x, y, k):
            ctx.save_for_backward(y)
            ctx.k = k
            return x * y * k

        @staticmethod
        def backward(ctx, g):
            (y,) = ctx.saved_tensors
            return g * y * ctx.k, None, None

    x = make_tensor(shape, dtype, seed, requires_grad=True)
    y = make_tensor(shape, dtype, seed + 1)
    MulK.apply(x, y, k).sum().backward()
    torch.testing.assert_close(x.grad, y * k)
    assert y.grad is None


def test_gradients_passed_to_backward_can_be_non_contiguous():
    """The strides of the gradients passed to :func:`backward` are undefined: they are not guaranteed to be contiguous or to match the strides of the corresponding forward outputs, so implementations must not assume a particular memory layout."""
    # This sentence states a non-guarantee; the test pins that a layout other
    # than the output's really does reach backward (so the warning matters).
    seen = []

    class Record(Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            seen.append(g)
            return g

    x = torch.randn(2, 3, requires_grad=True)
    out = Record.apply(x)
    assert out.is_contiguous()
    out.sum().backward()  # sum's gradient is an expanded (stride 0) tensor
    out = Record.apply(x)
    out.backward(torch.ones(3, 2).t())  # a transposed root gradient
    assert len(seen) == 2
    for g in seen:
        assert g.shape == out.shape
        assert not g.is_contiguous()
        assert g.stride() != out.stride()


@settings(deadline=None)
@given(flags=st.lists(st.booleans(), min_size=1, max_size=4), dtype=float_dtypes, seed=seeds)
def test_needs_input_grad_tells_which_inputs_need_gradient(flags, dtype, seed):
    """It also has an attribute :attr:`ctx.needs_input_grad` as a tuple of booleans representing whether each input needs gradient."""
    seen = {}

    class Sum(Function):
        @staticmethod
        def forward(ctx, *args):
            seen["forward"] = ctx.needs_input_grad
            return sum(a for a in args if isinstance(a, torch.Tensor))

        @staticmethod
        def backward(ctx, g):
            seen["backward"] = ctx.needs_input_grad
            return tuple(g if need else None for need in ctx.needs_input_grad)

    xs = [make_tensor((2,), dtype, seed + i, requires_grad=f) for i, f in enumerate(flags)]
    out = Sum.apply(*xs, 7)  # a trailing non-tensor argument never needs grad
    expected = tuple(flags) + (False,)
    assert seen["forward"] == expected
    if any(flags):
        out.sum().backward()
        assert type(seen["backward"]) is tuple and seen["backward"] == expected
        for x, f in zip(xs, flags):
            assert (x.grad is not None) is f
    else:
        assert not out.requires_grad


@settings(deadline=None)
@given(spec=tensor_specs())
def test_defining_vjp_is_equivalent_to_defining_backward(spec):
    """(Defining this function is equivalent to defining the ``vjp`` function.)"""
    shape, dtype, seed = spec

    class WithVjp(Function):
        """Mul with its backward defined as vjp instead."""

        forward = staticmethod(Mul.forward)
        vjp = staticmethod(Mul.backward)

    results = []
    for fn in (WithVjp, Mul):
        x = make_tensor(shape, dtype, seed, requires_grad=True)
        w = make_tensor(shape, dtype, seed + 1, requires_grad=True)
        g = make_tensor(shape, dtype, seed + 2)
        out = fn.apply(x, w)
        direct = out.grad_fn.apply(g)
        out.backward(g)
        results.append((x.grad, w.grad, direct))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(results[0][0], w.detach() * g)
