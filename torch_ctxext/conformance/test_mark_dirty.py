"""Conformance: ``FunctionCtx.mark_dirty``.

Contract text: docstring of ``FunctionCtx.mark_dirty`` in torch 2.15's
``torch/autograd/function.py``.
"""

import expecttest
import pytest
import torch
from hypothesis import given, settings
from torch.autograd import Function
from torch.autograd.function import once_differentiable

try:
    from ._helpers import make_tensor, node_named, tensor_specs
except ImportError:
    from _helpers import make_tensor, node_named, tensor_specs


class DoubleInPlaceForward(Function):
    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return 2 * g


class DoubleInPlaceSetupContext(Function):
    @staticmethod
    def forward(x):
        x.mul_(2)
        return x

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_dirty(inputs[0])

    @staticmethod
    def backward(ctx, g):
        return 2 * g


def _add_one_untracked(mark, when="after"):
    """A Function that adds one to its input behind autograd's back (through
    numpy, as the docstring example does, where the tensor is on the CPU;
    through ``.data``, which has a version counter of its own, elsewhere),
    optionally calling mark_dirty."""

    class AddOneUntracked(Function):
        @staticmethod
        def forward(ctx, x):
            if mark and when == "before":
                ctx.mark_dirty(x)
            if x.device.type == "cpu":
                x_npy = x.numpy()  # shares storage with x; no version bump
                x_npy += 1
            else:
                x.data.add_(1)  # shares storage with x; no version bump
            if mark and when == "after":
                ctx.mark_dirty(x)
            return x

        @staticmethod
        def backward(ctx, g):
            return g

    return AddOneUntracked


@pytest.mark.upstream_deviation("mark_dirty", "anomaly-hint", until=(2, 10))
@pytest.mark.cpu_only("the docstring's example modifies the tensor through numpy, which shares the memory of CPU tensors only")
def test_docstring_example_mark_dirty_inplace():
    """Examples:: class Inplace(Function): ... ctx.mark_dirty(x) ... b.backward() # RuntimeError: one of the variables needed for gradient computation has been modified by an inplace operation"""

    class Inplace(Function):
        @staticmethod
        def forward(ctx, x):
            x_npy = x.numpy()  # x_npy shares storage with x
            x_npy += 1
            ctx.mark_dirty(x)
            return x

        @staticmethod
        @once_differentiable
        def backward(ctx, grad_output):
            return grad_output

    a = torch.tensor(1.0, requires_grad=True, dtype=torch.double).clone()
    b = a * a
    Inplace.apply(a)  # This would lead to wrong gradients!
    #                   but the engine would not know unless we mark_dirty
    assert a.item() == 2.0
    with pytest.raises(RuntimeError) as e:
        b.backward()  # RuntimeError: one of the variables needed for gradient
        #               computation has been modified by an inplace operation
    expecttest.assert_expected_inline(
        node_named(str(e.value)),
        """one of the variables needed for gradient computation has been modified by an inplace operation: [torch.DoubleTensor []], which is output 0 of Inplace, is at version 1; expected version 0 instead. Hint: enable anomaly detection to find the operation that failed to compute its gradient, with torch.autograd.set_detect_anomaly(True, check_nan=False).""",
    )


@settings(deadline=None)
@given(spec=tensor_specs())
def test_mark_dirty_makes_the_function_the_new_history_of_the_modified_input(spec):
    """Mark given tensors as modified in an in-place operation."""
    shape, dtype, seed = spec
    leaf = make_tensor(shape, dtype, seed, requires_grad=True)
    a = leaf.clone()
    version = a._version
    out = DoubleInPlaceForward.apply(a)
    assert out is a  # in-place: the caller's tensor is the output
    assert a._version > version
    assert type(a.grad_fn) is DoubleInPlaceForward._backward_cls
    torch.testing.assert_close(a.detach(), 2 * leaf.detach())
    a.sum().backward()
    torch.testing.assert_close(leaf.grad, torch.full_like(leaf, 2).detach())


@pytest.mark.parametrize(
    "fn", [DoubleInPlaceForward, DoubleInPlaceSetupContext], ids=["forward", "setup_context"]
)
@settings(deadline=None)
@given(spec=tensor_specs())
def test_mark_dirty_works_from_forward_or_setup_context(fn, spec):
    """This should be called at most once, in either the :func:`setup_context` or :func:`forward` methods."""
    shape, dtype, seed = spec
    leaf = make_tensor(shape, dtype, seed, requires_grad=True)
    a = leaf.clone()
    out = fn.apply(a)
    assert out is a
    assert type(a.grad_fn) is fn._backward_cls
    (a * leaf).sum().backward()  # d/dleaf (2 leaf * leaf) = 4 leaf
    torch.testing.assert_close(leaf.grad, 4 * leaf.detach())


@pytest.mark.upstream_deviation("mark_dirty", "non-input-warning", until=(2, 7))
def test_mark_dirty_warns_for_a_tensor_that_is_not_an_input():
    """This should be called ... and all arguments should be inputs."""

    class MarkNonInput(Function):
        @staticmethod
        def forward(ctx, x):
            y = x * 2
            ctx.mark_dirty(y)
            return y

        @staticmethod
        def backward(ctx, g):
            return 2 * g

    with pytest.warns(UserWarning) as record:
        MarkNonInput.apply(torch.ones(2, requires_grad=True))
    messages = [str(w.message) for w in record if "mark_dirty" in str(w.message)]
    assert len(messages) == 1
    expecttest.assert_expected_inline(
        # The "(Triggered internally at <file>:<line>.)" suffix is build-specific.
        messages[0].split(" (Triggered internally at")[0],
        """ctx.mark_dirty() received a tensor that was not an input. Only input Tensors that have been mutated should be passed to ctx.mark_dirty().""",
    )


@settings(deadline=None)
@given(spec=tensor_specs())
def test_mark_dirty_without_the_call_breaks_the_gradient_check(spec):
    """Every tensor that's been modified in-place in a call to :func:`forward` should be given to this function, to ensure correctness of our checks."""
    shape, dtype, seed = spec
    leaf = make_tensor(shape, dtype, seed, requires_grad=True)

    # Without mark_dirty the check is blind: backward silently returns the
    # gradient at the modified value (2 * (x + 1) instead of 2 * x).
    a = leaf.clone()
    b = a * a
    _add_one_untracked(mark=False).apply(a)
    b.sum().backward()
    torch.testing.assert_close(leaf.grad, 2 * (leaf.detach() + 1))

    # With mark_dirty the same graph is refused.
    leaf.grad = None
    a = leaf.clone()
    b = a * a
    _add_one_untracked(mark=True).apply(a)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        b.sum().backward()
    assert leaf.grad is None


@pytest.mark.parametrize("when", ["before", "after"])
@settings(deadline=None)
@given(spec=tensor_specs())
def test_mark_dirty_before_or_after_the_modification_gives_the_same_result(when, spec):
    """It doesn't matter whether the function is called before or after modification."""
    shape, dtype, seed = spec
    leaf = make_tensor(shape, dtype, seed, requires_grad=True)
    fn = _add_one_untracked(mark=True, when=when)

    a = leaf.clone()
    b = a * a
    version = a._version
    out = fn.apply(a)
    assert out is a
    assert a._version > version
    assert type(a.grad_fn) is fn._backward_cls
    torch.testing.assert_close(a.detach(), leaf.detach() + 1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        b.sum().backward()

    a = leaf.clone()
    fn.apply(a)
    (a * 3).sum().backward()
    torch.testing.assert_close(leaf.grad, torch.full_like(leaf, 3).detach())
