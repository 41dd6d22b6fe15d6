"""Conformance: ``FunctionCtx.mark_non_differentiable``.

Contract text: docstring of ``FunctionCtx.mark_non_differentiable`` in torch
2.15's ``torch/autograd/function.py``.
"""

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.autograd import Function
from torch.autograd.function import once_differentiable

try:
    from ._helpers import float_dtypes, make_tensor, seeds, small_shapes, tensor_specs
except ImportError:
    from _helpers import float_dtypes, make_tensor, seeds, small_shapes, tensor_specs


class SortForward(Function):
    @staticmethod
    def forward(ctx, x):
        values, idx = x.sort()
        ranks = idx.to(x.dtype)  # a floating-point output, differentiable unless marked
        ctx.mark_non_differentiable(idx, ranks)
        ctx.save_for_backward(idx)
        return values, idx, ranks

    @staticmethod
    def backward(ctx, g1, g2, g3):
        (idx,) = ctx.saved_tensors
        return torch.zeros_like(g1).scatter(-1, idx, g1)


class SortSetupContext(Function):
    @staticmethod
    def forward(x):
        values, idx = x.sort()
        return values, idx, idx.to(x.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        values, idx, ranks = output
        ctx.mark_non_differentiable(idx, ranks)
        ctx.save_for_backward(idx)

    @staticmethod
    def backward(ctx, g1, g2, g3):
        (idx,) = ctx.saved_tensors
        return torch.zeros_like(g1).scatter(-1, idx, g1)


def test_docstring_example_mark_non_differentiable_sort():
    """This is used e.g. for indices returned from a sort. See example:: class Func(Function): ... ctx.mark_non_differentiable(idx) ..."""

    class Func(Function):
        @staticmethod
        def forward(ctx, x):
            sorted, idx = x.sort()
            ctx.mark_non_differentiable(idx)
            ctx.save_for_backward(x, idx)
            return sorted, idx

        @staticmethod
        @once_differentiable
        def backward(ctx, g1, g2):  # still need to accept g2
            x, idx = ctx.saved_tensors
            grad_input = torch.zeros_like(x)
            grad_input.index_add_(0, idx, g1)
            return grad_input

    x = torch.tensor([0.3, -1.2, 2.5, 0.1], dtype=torch.double, requires_grad=True)
    sorted, idx = Func.apply(x)
    assert sorted.requires_grad and not idx.requires_grad
    assert torch.equal(sorted.detach(), x.detach().sort().values)
    assert torch.equal(idx, x.detach().sort().indices)
    assert torch.autograd.gradcheck(lambda t: Func.apply(t)[0], (x,))


@pytest.mark.parametrize("fn", [SortForward, SortSetupContext], ids=["forward", "setup_context"])
@settings(deadline=None)
@given(spec=tensor_specs(shapes=st.integers(1, 4).map(lambda n: (n,))))
def test_mark_non_differentiable_works_from_forward_or_setup_context(fn, spec):
    """This should be called at most once, in either the :func:`setup_context` or :func:`forward` methods, and all arguments should be tensor outputs."""
    shape, dtype, seed = spec
    x = make_tensor(shape, dtype, seed, requires_grad=True)
    values, idx, ranks = fn.apply(x)
    assert values.requires_grad
    assert not idx.requires_grad and idx.grad_fn is None
    assert ranks.dtype == dtype and not ranks.requires_grad and ranks.grad_fn is None
    w = make_tensor(shape, dtype, seed + 1)
    (values * w).sum().backward()
    expected = torch.zeros_like(w).scatter(-1, idx, w)
    torch.testing.assert_close(x.grad, expected)


@settings(deadline=None)
@given(
    marked=st.lists(st.booleans(), min_size=1, max_size=4),
    dtype=float_dtypes,
    seed=seeds,
)
def test_non_differentiable_outputs_do_not_require_grad(marked, dtype, seed):
    """This will mark outputs as not requiring gradients, ..."""
    x = make_tensor((2,), dtype, seed, requires_grad=True)

    class Outs(Function):
        @staticmethod
        def forward(ctx, x):
            outs = tuple(x * (i + 1) for i in range(len(marked)))
            ctx.mark_non_differentiable(*[o for o, m in zip(outs, marked) if m])
            return outs

        @staticmethod
        def backward(ctx, *grads):
            return sum(g * (i + 1) for i, g in enumerate(grads))

    outs = Outs.apply(x)
    assert len(outs) == len(marked)
    for o, m in zip(outs, marked):
        assert o.requires_grad is (not m)
        assert (o.grad_fn is None) is m


@settings(deadline=None)
@given(
    data=st.data(),
    n=st.integers(min_value=2, max_value=4),
    dtype=float_dtypes,
    seed=seeds,
)
def test_non_differentiable_outputs_still_get_a_zero_gradient_of_the_output_shape(data, n, dtype, seed):
    """You still need to accept a gradient for each output in :meth:`~Function.backward`, but it's always going to be a zero tensor with the same shape as the shape of a corresponding output."""
    shapes = [data.draw(small_shapes) for _ in range(n)]
    marked = data.draw(st.lists(st.booleans(), min_size=n, max_size=n).filter(lambda m: not all(m)))
    x = make_tensor((2,), dtype, seed, requires_grad=True)
    seen = {}

    class Outs(Function):
        @staticmethod
        def forward(ctx, x):
            outs = tuple(
                (x.sum() * (i + 1)).expand(shape).clone() for i, shape in enumerate(shapes)
            )
            ctx.mark_non_differentiable(*[o for o, m in zip(outs, marked) if m])
            return outs

        @staticmethod
        def backward(ctx, *grads):
            seen["grads"] = grads
            total = sum(g.sum() * (i + 1) for i, g in enumerate(grads))
            return torch.ones(2, dtype=dtype, device=total.device) * total

    outs = Outs.apply(x)
    # Every output, marked ones included, takes part in the loss; the marked
    # ones are constants there, so their gradient must still arrive as zeros.
    loss = sum((o * (i + 2)).sum() for i, o in enumerate(outs))
    loss.backward()
    grads = seen["grads"]
    assert len(grads) == n
    for g, o, m, i in zip(grads, outs, marked, range(n)):
        assert isinstance(g, torch.Tensor)
        assert g.shape == o.shape
        if m:
            assert not g.any(), "gradient of a non-differentiable output must be zeros"
        else:
            torch.testing.assert_close(g, torch.full_like(o, i + 2).detach())


@pytest.mark.xfail(
    strict=True,
    reason=(
        "torch 2.13 and 2.15: with ctx.set_materialize_grads(False) the gradient of a "
        "non-differentiable output reaches backward as None, not as 'always ... a zero tensor'"
    ),
)
def test_non_differentiable_output_gradient_is_a_zero_tensor_even_with_materialize_grads_false():
    """... but it's always going to be a zero tensor with the same shape as the shape of a corresponding output."""
    seen = {}

    class SortNoMaterialize(Function):
        @staticmethod
        def forward(ctx, x):
            values, idx = x.sort()
            ctx.mark_non_differentiable(idx)
            ctx.set_materialize_grads(False)
            ctx.save_for_backward(idx)
            return values, idx

        @staticmethod
        def backward(ctx, g1, g2):
            seen["g2"] = g2
            (idx,) = ctx.saved_tensors
            return torch.zeros_like(g1).scatter(-1, idx, g1)

    x = torch.tensor([0.5, -1.0, 2.0], requires_grad=True)
    values, idx = SortNoMaterialize.apply(x)
    values.sum().backward()
    g2 = seen["g2"]
    assert isinstance(g2, torch.Tensor), f"got {g2!r}"
    assert g2.shape == idx.shape and not g2.any()
