"""Conformance: ``FunctionCtx.save_for_backward`` (and ``@once_differentiable``,
which its documentation prescribes for Functions without double backward).

Contract text: docstring of ``FunctionCtx.save_for_backward`` in torch 2.15's
``torch/autograd/function.py``.
"""

import gc
import weakref

import expecttest
import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.autograd import Function
from torch.autograd.function import once_differentiable

try:
    from ._helpers import (
        Exp, Mul, as_on_cpu, assert_saved_as_pattern, make_tensor, node_named, once_differentiable_square,
        saving_with_nones, tensor_specs,
    )
except ImportError:
    from _helpers import (
        Exp, Mul, as_on_cpu, assert_saved_as_pattern, make_tensor, node_named, once_differentiable_square,
        saving_with_nones, tensor_specs,
    )


# --- Functions shared by several tests ------------------------------------


class MulSavedInSetupContext(Function):
    @staticmethod
    def forward(x, w):
        return x * w

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w = inputs
        ctx.save_for_backward(x, w)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, g * x


class ExpOnCtx(Function):
    """Anti-pattern: the output is stored directly on ctx."""

    @staticmethod
    def forward(ctx, x):
        result = x.exp()
        ctx.result = result
        return result

    @staticmethod
    def backward(ctx, g):
        return g * ctx.result


def _double_scalars():
    a = torch.tensor(1.3, requires_grad=True, dtype=torch.double)
    b = torch.tensor(-0.7, requires_grad=True, dtype=torch.double)
    return a, b


class IntermediarySaved(Function):
    """The save_for_backward docstring example, without @once_differentiable."""

    @staticmethod
    def forward(ctx, x, y, z):
        w = x * z
        out = x * y + y * z + w * y
        ctx.save_for_backward(x, y, w, out)
        ctx.z = z
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, y, w, out = ctx.saved_tensors
        z = ctx.z
        gx = grad_out * (y + y * z)
        gy = grad_out * (x + z + w)
        return gx, gy, None


# --- Docstring example ----------------------------------------------------


def test_docstring_example_save_for_backward_func():
    """Example:: class Func(Function): ... ctx.save_for_backward(x, y, w, out) ... d = Func.apply(a, b, c)"""

    class Func(Function):
        @staticmethod
        def forward(ctx, x: torch.Tensor, y: torch.Tensor, z: int):
            w = x * z
            out = x * y + y * z + w * y
            ctx.save_for_backward(x, y, w, out)
            ctx.z = z  # z is not a tensor
            return out

        @staticmethod
        @once_differentiable
        def backward(ctx, grad_out):
            x, y, w, out = ctx.saved_tensors
            z = ctx.z
            gx = grad_out * (y + y * z)
            gy = grad_out * (x + z + w)
            gz = None
            return gx, gy, gz

    a = torch.tensor(1.0, requires_grad=True, dtype=torch.double)
    b = torch.tensor(2.0, requires_grad=True, dtype=torch.double)
    c = 4
    d = Func.apply(a, b, c)

    # out = x*y + y*z + x*z*y = 2 + 8 + 8
    assert d.item() == 18.0
    assert d.requires_grad
    d.backward()
    assert a.grad.item() == 10.0  # y + y*z
    assert b.grad.item() == 9.0  # x + z + w


# --- One test per documented behaviour ------------------------------------


@pytest.mark.parametrize("fn", [Mul, MulSavedInSetupContext], ids=["forward", "setup_context"])
@settings(deadline=None)
@given(spec=tensor_specs())
def test_save_for_backward_works_from_forward_or_setup_context(fn, spec):
    """``save_for_backward`` should be called at most once, in either the :func:`setup_context` or :func:`forward` methods."""
    shape, dtype, seed = spec
    x = make_tensor(shape, dtype, seed, requires_grad=True)
    w = make_tensor(shape, dtype, seed + 1, requires_grad=True)
    fn.apply(x, w).sum().backward()
    torch.testing.assert_close(x.grad, w.detach())
    torch.testing.assert_close(w.grad, x.detach())


def test_save_for_backward_refuses_non_tensor_arguments():
    """``save_for_backward`` should be called ... and only with tensors."""

    class SaveInt(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x, None, 3)
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return g

    with pytest.raises(TypeError) as e:
        SaveInt.apply(torch.ones(2, requires_grad=True))
    expecttest.assert_expected_inline(
        str(e.value), """save_for_backward can only save variables, but argument 2 is of type int"""
    )


@settings(deadline=None)
@given(spec=tensor_specs(), n=st.integers(min_value=1, max_value=4))
def test_saved_tensors_gives_back_the_saved_tensors_in_backward(spec, n):
    """In :func:`backward`, saved tensors can be accessed through the :attr:`saved_tensors` attribute."""
    shape, dtype, seed = spec
    inputs = [make_tensor(shape, dtype, seed + i, requires_grad=True) for i in range(n)]
    seen = {}

    class SaveAll(Function):
        @staticmethod
        def forward(ctx, *xs):
            out = torch.stack(xs).sum(0)
            ctx.save_for_backward(*xs, out)
            return out

        @staticmethod
        def backward(ctx, g):
            seen["saved"] = ctx.saved_tensors
            return tuple(g for _ in range(n))

    out = SaveAll.apply(*inputs)
    out.sum().backward()
    saved = seen["saved"]
    assert isinstance(saved, tuple)
    assert len(saved) == n + 1
    for got, want in zip(saved, [*inputs, out]):
        assert got.data_ptr() == want.data_ptr()
        assert torch.equal(got, want)
        assert got.dtype == dtype and got.shape == want.shape


@pytest.mark.upstream_deviation("save_for_backward", "anomaly-hint", until=(2, 10))
def test_save_for_backward_refuses_tensors_modified_in_place():
    """Before returning them to the user, a check is made to ensure they weren't used in any in-place operation that modified their content."""

    class E(Exp):
        """Exp, named as in the message below."""

    x = torch.ones(3, requires_grad=True)
    y = E.apply(x)
    z = y * 1
    y.add_(1)
    with pytest.raises(RuntimeError) as e:
        z.sum().backward()
    expecttest.assert_expected_inline(
        as_on_cpu(node_named(str(e.value))),
        """one of the variables needed for gradient computation has been modified by an inplace operation: [torch.FloatTensor [3]], which is output 0 of E, is at version 1; expected version 0 instead. Hint: enable anomaly detection to find the operation that failed to compute its gradient, with torch.autograd.set_detect_anomaly(True, check_nan=False).""",
    )


@settings(deadline=None)
@given(spec=tensor_specs(), pattern=st.lists(st.booleans(), min_size=1, max_size=5))
def test_save_for_backward_accepts_none(spec, pattern):
    """Arguments can also be ``None``. This is a no-op."""
    shape, dtype, seed = spec
    x = make_tensor(shape, dtype, seed, requires_grad=True)
    seen = {}
    saving_with_nones("save_for_backward", pattern, seen).apply(x).sum().backward()
    assert_saved_as_pattern(seen["saved"], pattern, x)
    torch.testing.assert_close(x.grad, torch.full_like(x, 3).detach())


@settings(deadline=None)
@given(spec=tensor_specs())
def test_saving_on_ctx_directly_instead_gives_incorrect_gradients_after_in_place_use(spec):
    """All tensors intended to be used in the backward pass should be saved with ``save_for_backward`` (as opposed to directly on ``ctx``) to prevent incorrect gradients."""
    shape, dtype, seed = spec
    x = make_tensor(shape, dtype, seed, requires_grad=True)
    correct = x.detach().exp() * 2  # d/dx (2 * exp(x))

    y = ExpOnCtx.apply(x)
    y.mul_(2)  # modifies the tensor ExpOnCtx's backward reads from ctx
    y.sum().backward()
    # The stale ctx attribute is silently used: the gradient is twice too big.
    torch.testing.assert_close(x.grad, 2 * correct)

    x.grad = None
    y = Exp.apply(x)
    y.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_saving_an_output_on_ctx_directly_leaks_it_and_save_for_backward_does_not():
    """All tensors intended to be used in the backward pass should be saved with ``save_for_backward`` (as opposed to directly on ``ctx``) to prevent ... memory leaks."""
    gc.collect()
    gc.disable()
    try:
        x = torch.randn(3, requires_grad=True)
        y = Exp.apply(x)
        saved_ref = weakref.ref(y)
        del y
        assert saved_ref() is None, "an output saved with save_for_backward must die with its graph"

        y = ExpOnCtx.apply(x)
        ctx_ref = weakref.ref(y)
        del y
        # ctx -> output -> grad_fn (ctx): a reference cycle only the GC can break.
        assert ctx_ref() is not None
    finally:
        gc.enable()
        gc.collect()
    assert ctx_ref() is None


@settings(deadline=None)
@given(spec=tensor_specs(), n=st.integers(min_value=1, max_value=3))
def test_save_for_backward_applies_saved_tensors_hooks(spec, n):
    """All tensors intended to be used in the backward pass should be saved with ``save_for_backward`` ... and enable the application of saved tensor hooks."""
    shape, dtype, seed = spec
    inputs = [make_tensor(shape, dtype, seed + i, requires_grad=True) for i in range(n)]
    packed = []

    def pack(t):
        packed.append(t)
        return ("packed", t)

    def unpack(p):
        tag, t = p
        assert tag == "packed"
        return t * 2  # observable: backward must see the unpacked value

    class SumSaved(Function):
        @staticmethod
        def forward(ctx, *xs):
            ctx.save_for_backward(*xs)
            ctx.not_hooked = xs[0]  # stored on ctx: hooks do not apply
            return torch.stack(xs).sum(0)

        @staticmethod
        def backward(ctx, g):
            return tuple(g * s for s in ctx.saved_tensors)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = SumSaved.apply(*inputs)
    assert len(packed) == n
    for p, x in zip(packed, inputs):
        assert p is x or p.data_ptr() == x.data_ptr()
    out.sum().backward()
    for x in inputs:
        torch.testing.assert_close(x.grad, 2 * x.detach())


def test_saving_an_intermediary_can_break_double_backward():
    """Note that if intermediary tensors, tensors that are neither inputs nor outputs of :func:`forward`, are saved for backward, your custom Function may not support double backward."""
    a, b = _double_scalars()
    fn = lambda a, b: IntermediarySaved.apply(a, b, 4)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (a, b))
    assert not torch.autograd.gradgradcheck(fn, (a, b), raise_exception=False)


def test_once_differentiable_makes_double_backward_raise():
    """Custom Functions that do not support double backward should decorate their :func:`backward` method with ``@once_differentiable`` so that performing double backward raises an error."""
    x = torch.tensor([1.0, 2.0], requires_grad=True, dtype=torch.double)
    y = once_differentiable_square().apply(x)
    (gx,) = torch.autograd.grad((y**2).sum(), x, create_graph=True)
    torch.testing.assert_close(gx.detach(), 4 * x.detach() ** 3)
    with pytest.raises(RuntimeError) as e:
        gx.sum().backward()
    expecttest.assert_expected_inline(
        str(e.value), """trying to differentiate twice a function that was marked with @once_differentiable"""
    )


def test_recomputing_intermediaries_in_backward_supports_double_backward():
    """If you'd like to support double backward, you can either recompute intermediaries based on the inputs during backward ..."""

    class Recompute(Function):
        @staticmethod
        def forward(ctx, x, y, z):
            w = x * z
            out = x * y + y * z + w * y
            ctx.save_for_backward(x, y)
            ctx.z = z
            return out

        @staticmethod
        def backward(ctx, grad_out):
            x, y = ctx.saved_tensors
            z = ctx.z
            w = x * z  # recomputed from the inputs
            return grad_out * (y + y * z), grad_out * (x + z + w), None

    a, b = _double_scalars()
    fn = lambda a, b: Recompute.apply(a, b, 4)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (a, b))
    assert torch.autograd.gradgradcheck(fn, (a, b))


def test_returning_intermediaries_as_outputs_supports_double_backward():
    """If you'd like to support double backward, you can ... return the intermediaries as the outputs of the custom Function."""

    class ReturnIntermediary(Function):
        @staticmethod
        def forward(ctx, x, y, z):
            w = x * z
            out = x * y + y * z + w * y
            ctx.save_for_backward(x, y, w)
            ctx.z = z
            return out, w

        @staticmethod
        def backward(ctx, grad_out, grad_w):
            x, y, w = ctx.saved_tensors
            z = ctx.z
            gx = grad_out * (y + y * z) + grad_w * z
            gy = grad_out * (x + z + w)
            return gx, gy, None

    a, b = _double_scalars()
    fn = lambda a, b: ReturnIntermediary.apply(a, b, 4)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (a, b))
    assert torch.autograd.gradgradcheck(fn, (a, b))
