"""Conformance: ``FunctionCtx.set_materialize_grads``.

Contract text: docstring of ``FunctionCtx.set_materialize_grads`` in torch
2.15's ``torch/autograd/function.py``.
"""

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from hypothesis import given, settings, strategies as st
from torch.autograd import Function
from torch.autograd.function import once_differentiable

try:
    from ._helpers import float_dtypes, make_tensor, seeds, small_shapes
except ImportError:
    from _helpers import float_dtypes, make_tensor, seeds, small_shapes

# torch's first use of forward AD loads jit decompositions, which warns that
# torch.jit.script is deprecated; that is not part of the contract under test.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")

DEFAULT = "default"  # do not call set_materialize_grads at all


def _fanout(materialize, where="forward"):
    """A Function taking tensors x_0..x_{n-1} and returning x_i * (i + 1).

    backward and jvp record what they receive."""
    seen = {}

    def configure(ctx, xs):
        ctx.meta = [(x.shape, x.dtype) for x in xs]
        if materialize is not DEFAULT:
            ctx.set_materialize_grads(materialize)

    def scaled_backward(ctx, *grads):
        seen["grads"] = grads
        return tuple(None if g is None else g * (i + 1) for i, g in enumerate(grads))

    def scaled_jvp(ctx, *tangents):
        seen["tangents"] = tangents
        # Returning None for a differentiable output trips an internal
        # assert in torch (see test_apply_jvp.py), so send zeros.
        return tuple(
            torch.zeros(shape, dtype=dtype) if t is None else t * (i + 1)
            for i, (t, (shape, dtype)) in enumerate(zip(tangents, ctx.meta))
        )

    if where == "forward":

        class Fanout(Function):
            @staticmethod
            def forward(ctx, *xs):
                configure(ctx, xs)
                return tuple(x * (i + 1) for i, x in enumerate(xs))

            backward = staticmethod(scaled_backward)
            jvp = staticmethod(scaled_jvp)

    else:

        class Fanout(Function):
            @staticmethod
            def forward(*xs):
                return tuple(x * (i + 1) for i, x in enumerate(xs))

            @staticmethod
            def setup_context(ctx, inputs, output):
                configure(ctx, inputs)

            backward = staticmethod(scaled_backward)
            jvp = staticmethod(scaled_jvp)

    return Fanout, seen


@st.composite
def fanout_case(draw):
    """n inputs (own shape and dtype each) and which of them are 'used'
    (have a gradient / tangent); at least one used and one unused."""
    n = draw(st.integers(min_value=2, max_value=4))
    shapes = [draw(small_shapes) for _ in range(n)]
    dtypes = [draw(float_dtypes) for _ in range(n)]
    used = draw(st.lists(st.booleans(), min_size=n, max_size=n).filter(lambda u: any(u) and not all(u)))
    return shapes, dtypes, used, draw(seeds)


def _run_backward(fn, shapes, dtypes, used, seed):
    xs = [make_tensor(s, d, seed + i, requires_grad=True) for i, (s, d) in enumerate(zip(shapes, dtypes))]
    outs = fn.apply(*xs)
    loss = sum(o.sum() for o, u in zip(outs, used) if u)
    loss.backward()
    return xs, outs


def _run_jvp(fn, shapes, dtypes, used, seed):
    xs = [make_tensor(s, d, seed + i) for i, (s, d) in enumerate(zip(shapes, dtypes))]
    ts = [make_tensor(s, d, seed + 100 + i) for i, (s, d) in enumerate(zip(shapes, dtypes))]
    with fwAD.dual_level():
        args = [fwAD.make_dual(x, t) if u else x for x, t, u in zip(xs, ts, used)]
        outs = fn.apply(*args)
        out_tangents = [fwAD.unpack_dual(o).tangent for o in outs]
    return xs, ts, out_tangents


def test_docstring_example_simple_func_and_func():
    """Example:: class SimpleFunc(Function): ... return g1 + g2  # No check for None necessary ... b, _ = Func.apply(a)  # induces g2 to be undefined"""

    class SimpleFunc(Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone(), x.clone()

        @staticmethod
        @once_differentiable
        def backward(ctx, g1, g2):
            return g1 + g2  # No check for None necessary

    # We modify SimpleFunc to handle non-materialized grad outputs
    class Func(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.set_materialize_grads(False)
            ctx.save_for_backward(x)
            return x.clone(), x.clone()

        @staticmethod
        @once_differentiable
        def backward(ctx, g1, g2):
            (x,) = ctx.saved_tensors
            grad_input = torch.zeros_like(x)
            if g1 is not None:  # We must check for None now
                grad_input += g1
            if g2 is not None:
                grad_input += g2
            return grad_input

    a = torch.tensor(1.0, requires_grad=True)
    b, _ = Func.apply(a)  # induces g2 to be undefined
    b.backward()
    assert a.grad.item() == 1.0

    a = torch.tensor(1.0, requires_grad=True)
    b, _ = SimpleFunc.apply(a)  # g2 is undefined too, but materialized
    b.backward()
    assert a.grad.item() == 1.0


@settings(deadline=None)
@given(case=fanout_case())
def test_materialize_grads_defaults_to_true(case):
    """Set whether to materialize grad tensors. Default is ``True``."""
    shapes, dtypes, used, seed = case
    fn, seen = _fanout(DEFAULT)
    _run_backward(fn, shapes, dtypes, used, seed)
    assert all(isinstance(g, torch.Tensor) for g in seen["grads"])
    for g, u in zip(seen["grads"], used):
        if not u:
            assert not g.any()


@pytest.mark.parametrize("where", ["forward", "setup_context"])
@pytest.mark.parametrize("materialize", [True, False])
@settings(deadline=None)
@given(case=fanout_case())
def test_set_materialize_grads_works_from_forward_or_setup_context(where, materialize, case):
    """This should be called only from either the :func:`setup_context` or :func:`forward` methods."""
    shapes, dtypes, used, seed = case
    fn, seen = _fanout(materialize, where)
    _run_backward(fn, shapes, dtypes, used, seed)
    for g, u in zip(seen["grads"], used):
        if not u:
            assert (g is None) is (not materialize)


@settings(deadline=None)
@given(case=fanout_case())
def test_set_materialize_grads_true_expands_undefined_grads_to_zeros_before_backward(case):
    """If ``True``, undefined grad tensors will be expanded to tensors full of zeros prior to calling the :func:`backward` ... methods."""
    shapes, dtypes, used, seed = case
    fn, seen = _fanout(True)
    xs, outs = _run_backward(fn, shapes, dtypes, used, seed)
    grads = seen["grads"]
    assert len(grads) == len(outs)
    for g, o, u in zip(grads, outs, used):
        assert isinstance(g, torch.Tensor)
        assert g.shape == o.shape and g.dtype == o.dtype
        if u:
            assert torch.equal(g, torch.ones_like(o))
        else:
            assert torch.equal(g, torch.zeros_like(o))
    for i, (x, u) in enumerate(zip(xs, used)):
        torch.testing.assert_close(x.grad, torch.full_like(x, (i + 1) if u else 0).detach())


@settings(deadline=None)
@given(case=fanout_case())
def test_set_materialize_grads_true_expands_undefined_tangents_to_zeros_before_jvp(case):
    """If ``True``, undefined grad tensors will be expanded to tensors full of zeros prior to calling the ... :func:`jvp` methods."""
    shapes, dtypes, used, seed = case
    fn, seen = _fanout(True)
    xs, ts, out_tangents = _run_jvp(fn, shapes, dtypes, used, seed)
    tangents = seen["tangents"]
    assert len(tangents) == len(xs)
    for t_in, x, t, u in zip(tangents, xs, ts, used):
        assert isinstance(t_in, torch.Tensor)
        assert t_in.shape == x.shape and t_in.dtype == x.dtype
        if u:
            torch.testing.assert_close(t_in, t)
        else:
            assert torch.equal(t_in, torch.zeros_like(x))
    for i, (ot, t, u) in enumerate(zip(out_tangents, ts, used)):
        torch.testing.assert_close(ot, t * (i + 1) if u else torch.zeros_like(t))


@settings(deadline=None)
@given(case=fanout_case())
def test_set_materialize_grads_false_hands_none(case):
    """Set whether to materialize grad tensors. (Example: ``ctx.set_materialize_grads(False)`` ... ``if g1 is not None:  # We must check for None now``)"""
    shapes, dtypes, used, seed = case
    fn, seen = _fanout(False)
    xs, outs = _run_backward(fn, shapes, dtypes, used, seed)
    grads = seen["grads"]
    assert len(grads) == len(outs)
    for g, o, u in zip(grads, outs, used):
        if u:
            assert torch.equal(g, torch.ones_like(o))
        else:
            assert g is None
    for x, u in zip(xs, used):
        assert (x.grad is None) is (not u)


@settings(deadline=None)
@given(case=fanout_case())
def test_set_materialize_grads_false_hands_none_to_jvp(case):
    """If ``True``, undefined grad tensors will be expanded to tensors full of zeros prior to calling the ... :func:`jvp` methods. (So with ``False`` jvp must check for None, as the example's backward does.)"""
    shapes, dtypes, used, seed = case
    fn, seen = _fanout(False)
    xs, ts, out_tangents = _run_jvp(fn, shapes, dtypes, used, seed)
    tangents = seen["tangents"]
    assert len(tangents) == len(xs)
    for t_in, t, u in zip(tangents, ts, used):
        if u:
            torch.testing.assert_close(t_in, t)
        else:
            assert t_in is None
