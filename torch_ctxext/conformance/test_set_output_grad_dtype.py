"""Conformance: ``FunctionCtx.set_output_grad_dtype``.

Contract text: docstring of ``FunctionCtx.set_output_grad_dtype`` in torch
2.15's ``torch/autograd/function.py`` (the same text as
``torch_ctxext/_backport/output_grad_dtype.py``), and the section
``ctx.set_output_grad_dtype(*dtypes)`` of the upstream reference notes.

The gradient a consumer hands back through ``Tensor.to`` is already cast back
to the source dtype by ``ToCopyBackward``, so to observe what the engine does
with a gradient of *another* dtype these tests feed it either as a root
gradient or through ``ToDtype`` below, whose backward returns the gradient in a
chosen dtype.
"""

import re
from dataclasses import dataclass
from typing import Optional

import expecttest
import pytest
import torch
from hypothesis import given, strategies as st
from torch.autograd import Function

DEVIATION = "set_output_grad_dtype"

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
FLOAT_IDS = [str(d).replace("torch.", "") for d in FLOATS]


def _other_float(dtype):
    """A floating dtype different from ``dtype``."""
    return torch.float16 if dtype == torch.float64 else torch.float64


class ToDtype(Function):
    """Identity whose backward hands the gradient back in a chosen dtype."""

    @staticmethod
    def forward(ctx, y, dtype):
        ctx.dtype = dtype
        return y.clone()

    @staticmethod
    def backward(ctx, g):
        return g.to(ctx.dtype), None


def _function_in_style(style, outputs, set_up, backward):
    """A Function whose forward returns ``outputs(x)`` and whose ctx is set up
    by ``set_up(ctx, x, output)``: in forward (``style`` "forward") or in
    setup_context ("setup_context"); ``backward``, if given, is its backward."""
    if style == "forward":

        class SetUpInForward(Function):
            @staticmethod
            def forward(ctx, x):
                output = outputs(x)
                set_up(ctx, x, output)
                return output

        if backward is not None:
            SetUpInForward.backward = staticmethod(backward)
        return SetUpInForward

    class SetUpInSetupContext(Function):
        @staticmethod
        def forward(x):
            return outputs(x)

        @staticmethod
        def setup_context(ctx, inputs, output):
            set_up(ctx, inputs[0], output)

    if backward is not None:
        SetUpInSetupContext.backward = staticmethod(backward)
    return SetUpInSetupContext


def _scale(style, decls, scale=2.0, out_dtype=torch.float32, rec=None):
    """y = (scale * x).to(out_dtype); ``decls`` is a tuple of declarations, or
    None to omit the call. backward records the dtype it receives."""
    rec = {} if rec is None else rec

    def declare(ctx, x, output):
        if decls is not None:
            ctx.set_output_grad_dtype(*decls)

    def backward(ctx, g):
        rec.setdefault("dtypes", []).append(g.dtype)
        rec.setdefault("values", []).append(g.detach().double().clone())
        return g.float() * scale

    return _function_in_style(style, lambda x: (x * scale).to(out_dtype), declare, backward), rec


def _leaf(n=2, dtype=torch.float32):
    return torch.arange(1, n + 1, dtype=dtype).requires_grad_()


def _apply_error(fn, *args):
    with pytest.raises(RuntimeError) as e:
        fn.apply(*args)
    return str(e.value)


# --------------------------------------------------------------- where


@pytest.mark.parametrize("style", ["forward", "setup_context"])
def test_declaration_works_from_forward_or_setup_context(style):
    """This should be called at most once, from either the :func:`setup_context` or :func:`forward` methods."""
    fn, rec = _scale(style, (torch.float64,))
    x = _leaf()
    fn.apply(x).sum().backward()  # SumBackward hands back float32
    assert rec["dtypes"] == [torch.float64]
    torch.testing.assert_close(x.grad, torch.full((2,), 2.0))


# ---------------------------------------------------- concrete dtype


@pytest.mark.parametrize("via", ["backward", "autograd.grad"])
@pytest.mark.parametrize("declared", FLOATS, ids=FLOAT_IDS)
def test_concrete_dtype_guaranteed_for_root_gradient_of_another_dtype(declared, via):
    """Pass a :class:`torch.dtype` and the engine guarantees the gradient handed to backward has that dtype."""
    fn, rec = _scale("forward", (declared,))
    x = _leaf()
    y = fn.apply(x)
    root = torch.tensor([1.0, 3.0], dtype=_other_float(declared))
    if via == "backward":
        y.backward(gradient=root)
        gx = x.grad
    else:
        (gx,) = torch.autograd.grad(y, x, root)
    assert rec["dtypes"] == [declared]
    torch.testing.assert_close(rec["values"][0], torch.tensor([1.0, 3.0], dtype=torch.float64))
    assert gx.dtype == torch.float32
    torch.testing.assert_close(gx, torch.tensor([2.0, 6.0]))


@pytest.mark.parametrize("declared", FLOATS, ids=FLOAT_IDS)
def test_concrete_dtype_guaranteed_for_one_consumer_of_another_dtype(declared):
    """Pass a :class:`torch.dtype` and the engine guarantees the gradient handed to backward has that dtype."""
    fn, rec = _scale("forward", (declared,))
    x = _leaf()
    ToDtype.apply(fn.apply(x), _other_float(declared)).sum().backward()
    assert rec["dtypes"] == [declared]
    torch.testing.assert_close(x.grad, torch.full((2,), 2.0))


@pytest.mark.parametrize("declared", FLOATS, ids=FLOAT_IDS)
def test_concrete_dtype_guaranteed_for_several_consumers_of_different_dtypes(declared):
    """Pass a :class:`torch.dtype` and the engine guarantees the gradient handed to backward has that dtype."""
    fn, rec = _scale("forward", (declared,))
    x = _leaf()
    y = fn.apply(x)
    loss = (
        ToDtype.apply(y, torch.float64).sum()
        + ToDtype.apply(y, torch.float16).sum()
        + ToDtype.apply(y, torch.bfloat16).sum()
    )
    loss.backward()
    assert rec["dtypes"] == [declared]  # one call, the accumulated gradient
    torch.testing.assert_close(rec["values"][0], torch.full((2,), 3.0, dtype=torch.float64))
    torch.testing.assert_close(x.grad, torch.full((2,), 6.0))


# --------------------------------------------------------------- None


@pytest.mark.parametrize(
    "out_dtype,incoming,via",
    [
        (torch.float32, torch.float64, "root"),
        (torch.float32, torch.float16, "root"),
        (torch.bfloat16, torch.float32, "root"),
        (torch.float32, torch.float64, "consumer"),
        (torch.float16, torch.bfloat16, "consumer"),
    ],
    ids=["f32-root-f64", "f32-root-f16", "bf16-root-f32", "f32-consumer-f64", "f16-consumer-bf16"],
)
def test_none_passes_the_incoming_dtype_through_uncast(out_dtype, incoming, via):
    """Pass ``None`` and the gradient is handed to backward with whatever dtype it already has."""
    fn, rec = _scale("forward", (None,), out_dtype=out_dtype)
    x = _leaf()
    y = fn.apply(x)
    if via == "root":
        y.backward(torch.tensor([1.0, 3.0], dtype=incoming))
        expected_grad = torch.tensor([2.0, 6.0])
    else:
        ToDtype.apply(y, incoming).sum().backward()
        expected_grad = torch.full((2,), 2.0)
    assert rec["dtypes"] == [incoming]
    torch.testing.assert_close(x.grad, expected_grad)


# ------------------------------------------------------------ default


@pytest.mark.parametrize("out_dtype", FLOATS, ids=FLOAT_IDS)
@pytest.mark.parametrize("how", ["omitted", "own-dtype"])
def test_omitting_the_call_or_own_dtype_keeps_the_default_output_dtype(how, out_dtype):
    """Omit this call (or pass the output's own dtype) and the gradient is handed to backward in the output's dtype, which is the default."""
    decls = None if how == "omitted" else (out_dtype,)
    other = _other_float(out_dtype)
    fn, rec = _scale("forward", decls, out_dtype=out_dtype)
    x = _leaf()
    fn.apply(x).backward(torch.ones(2, dtype=other))  # root gradient
    ToDtype.apply(fn.apply(x), other).sum().backward()  # consumer
    assert rec["dtypes"] == [out_dtype, out_dtype]
    torch.testing.assert_close(x.grad, torch.full((2,), 4.0))


# ------------------------------------------------------ create_graph


def test_declared_dtype_holds_with_create_graph():
    """Works from `forward` and from `setup_context`; with `create_graph=True`."""
    rec = {}

    class Square(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.set_output_grad_dtype(torch.float64)
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            rec.setdefault("dtypes", []).append(g.dtype)
            return g.float() * 2.0 * x

    x = _leaf(3)
    z = ToDtype.apply(Square.apply(x), torch.float16)
    (gx,) = torch.autograd.grad(z.sum(), x, create_graph=True)
    assert rec["dtypes"] == [torch.float64]
    assert gx.requires_grad
    torch.testing.assert_close(gx, 2.0 * x.detach())
    (ggx,) = torch.autograd.grad(gx.sum(), x)
    torch.testing.assert_close(ggx, torch.full((3,), 2.0))


# ------------------------------------------------------ boxed grads


@pytest.mark.skipif(
    not hasattr(torch.autograd.function.BackwardCFunction, "apply_boxed"),
    reason="boxed_grads_call needs BackwardCFunction.apply_boxed",
)
@pytest.mark.parametrize(
    "declared", [torch.float16, torch.float64, None], ids=["float16", "float64", "None"]
)
def test_declared_dtype_holds_for_boxed_grads_call(declared):
    """Pass a :class:`torch.dtype` and the engine guarantees the gradient handed to backward has that dtype."""
    rec = {}

    class Boxed(Function):
        boxed_grads_call = True

        @staticmethod
        def forward(ctx, x):
            ctx.set_output_grad_dtype(declared, None)
            return x * 2.0, x * 3.0

        @staticmethod
        def backward(ctx, grads):
            rec["type"] = type(grads)
            rec["dtypes"] = [g.dtype for g in grads]
            g1, g2 = grads
            grads.clear()
            return g1.float() * 2.0 + g2.float() * 3.0

    x = _leaf()
    a, b = Boxed.apply(x)
    torch.autograd.backward(
        [ToDtype.apply(a, torch.bfloat16).sum(), b],
        [None, torch.ones(2, dtype=torch.float64)],
    )
    assert rec["type"] is list
    # output 0: declared, or what ToDtype produced; output 1 (None): the root's
    assert rec["dtypes"] == [declared or torch.bfloat16, torch.float64]
    torch.testing.assert_close(x.grad, torch.full((2,), 5.0))


# ---------------------------------------------------- nothing happens


@pytest.mark.parametrize("case", ["input-does-not-require-grad", "no_grad"])
@pytest.mark.parametrize("style", ["forward", "setup_context"])
def test_valid_declaration_does_nothing_without_grad(style, case):
    """Nothing happens (no error) when no input requires grad or under `no_grad`."""
    calls = []
    decls = (torch.float64, None, None, None)

    def outputs(x):
        return x * 2.0, (x * 3.0).long(), (x * 4.0).half(), "not a tensor"

    def declare(ctx, x, output):
        ctx.set_output_grad_dtype(*decls)
        calls.append("declared")

    F = _function_in_style(style, outputs, declare, backward=None)  # never reached
    x = torch.tensor([1.0, 2.0])
    if case == "no_grad":
        x.requires_grad_()
        with torch.no_grad():
            out = F.apply(x)
    else:
        out = F.apply(x)
    assert calls == ["declared"]
    assert [o.requires_grad for o in out[:3]] == [False, False, False]
    assert [o.dtype for o in out[:3]] == [torch.float32, torch.int64, torch.float16]
    torch.testing.assert_close(out[0], torch.tensor([2.0, 4.0]))
    assert out[3] == "not a tensor"


# -------------------------------------------------- docstring example


def test_docstring_example_runs_as_written(capsys):
    """For example:: class Trig(torch.autograd.Function): ... ctx.set_output_grad_dtype(torch.float32, t2.dtype, None, None) ... return t1, t2, t3, "not a tensor" """

    class Trig(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            t1 = x.sin()
            t2 = x.cos()
            t3 = x.tan()
            ctx.set_output_grad_dtype(torch.float32, t2.dtype, None, None)
            return t1, t2, t3, "not a tensor"

        @staticmethod
        def backward(ctx, g1, g2, g3, _):
            print(g1.dtype, g2.dtype, g3.dtype)
            return g1.to(torch.float16) + g2 + g3.to(torch.float16)

    x = torch.ones(3, dtype=torch.float16, requires_grad=True)
    t1, t2, t3, _ = Trig.apply(x)
    (t1.sum() + t2.sum() + t3.double().sum()).backward()
    printed = capsys.readouterr().out.split()
    assert _ == "not a tensor"
    # t1: declared float32; t2: its own dtype (the default).
    assert printed[:2] == ["torch.float32", "torch.float16"]
    # t3 (None): the dtype its consumer hands back, uncast. The docstring prints
    # torch.float64 here, but t3.double()'s ToCopyBackward hands back float16
    # (native 2.15 prints float16 too); assert "uncast" against that consumer.
    probe = t3.detach().requires_grad_()
    (incoming,) = torch.autograd.grad(probe.double().sum(), probe)
    assert printed[2:] == [str(incoming.dtype)]
    torch.testing.assert_close(x.grad, torch.full((3,), 3.0, dtype=torch.float16))


# ----------------------------------------------------------- torch.func


@pytest.mark.parametrize("declared", [torch.float16, torch.float64], ids=["float16", "float64"])
def test_declared_dtype_holds_under_torch_func_grad(declared):
    """Pass a :class:`torch.dtype` and the engine guarantees the gradient handed to backward has that dtype."""
    fn, rec = _scale("setup_context", (declared,))
    result = torch.func.grad(lambda x: fn.apply(x).sum())(torch.tensor([1.0, 2.0]))
    assert rec["dtypes"] == [declared]
    torch.testing.assert_close(result, torch.full((2,), 2.0))


# --------------------------------------------------------------- errors


def _declaring(decls, outputs, non_differentiable=(), style="forward"):
    """A Function returning ``outputs(x)`` that declares ``decls``."""

    def declare(ctx, x, outs):
        if non_differentiable:
            ctx.mark_non_differentiable(*[outs[i] for i in non_differentiable])
        ctx.set_output_grad_dtype(*decls)

    def backward(ctx, *grads):
        return grads[0]

    return _function_in_style(style, outputs, declare, backward)




@pytest.mark.parametrize("style", ["forward", "setup_context"])
def test_called_twice_raises(style):
    """This should be called at most once, from either the :func:`setup_context` or :func:`forward` methods."""
    rec = {}

    def declare_twice(ctx, x, output):
        ctx.set_output_grad_dtype(None)
        with pytest.raises(RuntimeError) as e:
            ctx.set_output_grad_dtype(torch.float64)
        rec["error"] = str(e.value)

    def backward(ctx, g):
        rec["dtype"] = g.dtype
        return g * 2.0

    F = _function_in_style(style, lambda x: x * 2.0, declare_twice, backward)
    F.apply(_leaf()).backward(torch.ones(2, dtype=torch.float16))
    expecttest.assert_expected_inline(
        rec["error"], """set_output_grad_dtype can only be called once"""
    )
    assert rec["dtype"] == torch.float16  # the first declaration (None) holds


@pytest.mark.parametrize("style", ["forward", "setup_context"])
def test_declaration_count_must_match_returned_values(style):
    """The number of declarations must match the number of returned values, and each argument corresponds positionally to the output at the same index."""
    fn = _declaring(
        (None, None, None), lambda x: (x * 1.0, x * 2.0, x * 3.0, x * 4.0), style=style
    )
    expecttest.assert_expected_inline(
        _apply_error(fn, _leaf()),
        """set_output_grad_dtype expected the number of declarations to match the number of outputs: the Function returned 4 values but 3 declarations were provided""",
    )


def test_declaration_must_be_a_dtype_or_none():
    """For each output, pass the dtype your backward should receive its gradient in: a :class:`torch.dtype` or ``None``."""
    fn_str, _ = _scale("forward", ("float32",))
    fn_int, _ = _scale("forward", (3,))
    fn_tensor, _ = _scale("forward", (torch.tensor(1.0),))
    expecttest.assert_expected_inline(
        _apply_error(fn_str, _leaf()),
        """set_output_grad_dtype expects each declaration to be a torch.dtype or None, but got str""",
    )
    expecttest.assert_expected_inline(
        _apply_error(fn_int, _leaf()),
        """set_output_grad_dtype expects each declaration to be a torch.dtype or None, but got int""",
    )
    expecttest.assert_expected_inline(
        _apply_error(fn_tensor, _leaf()),
        """set_output_grad_dtype expects each declaration to be a torch.dtype or None, but got Tensor""",
    )


def test_concrete_dtype_for_non_tensor_output_raises():
    """This is only valid for a differentiable Tensor output. [...] ``None`` [...] is also the only valid choice for a non-Tensor [...] output"""
    fn = _declaring((torch.float32, None), lambda x: ("not a tensor", x * 2.0))
    expecttest.assert_expected_inline(
        _apply_error(fn, _leaf()),
        """set_output_grad_dtype: got a concrete dtype for output 0, but that output is not a differentiable tensor (it is a non-tensor, was marked non-differentiable, or has a non-differentiable dtype). Pass None for output 0 instead.""",
    )
    # the same declaration with None is valid
    _declaring((None, None), lambda x: ("not a tensor", x * 2.0)).apply(_leaf())


def test_concrete_dtype_for_mark_non_differentiable_output_raises():
    """This is only valid for a differentiable Tensor output. [...] ``None`` [...] is also the only valid choice for a [...] non-differentiable output"""
    fn = _declaring((None, torch.float32), lambda x: (x * 2.0, x * 3.0), non_differentiable=(1,))
    expecttest.assert_expected_inline(
        _apply_error(fn, _leaf()),
        """set_output_grad_dtype: got a concrete dtype for output 1, but that output is not a differentiable tensor (it is a non-tensor, was marked non-differentiable, or has a non-differentiable dtype). Pass None for output 1 instead.""",
    )
    _declaring((None, None), lambda x: (x * 2.0, x * 3.0), non_differentiable=(1,)).apply(_leaf())


def test_concrete_dtype_for_integer_output_raises():
    """This is only valid for a differentiable Tensor output. [...] ``None`` [...] is also the only valid choice for a [...] non-differentiable output"""
    fn = _declaring(
        (None, None, torch.int64), lambda x: (x * 2.0, x * 3.0, (x * 4.0).long())
    )
    expecttest.assert_expected_inline(
        _apply_error(fn, _leaf()),
        """set_output_grad_dtype: got a concrete dtype for output 2, but that output is not a differentiable tensor (it is a non-tensor, was marked non-differentiable, or has a non-differentiable dtype). Pass None for output 2 instead.""",
    )
    _declaring((None, None, None), lambda x: (x * 2.0, x * 3.0, (x * 4.0).long())).apply(_leaf())


# ----------------------------------------------------------- deviations


@pytest.mark.upstream_deviation(DEVIATION, 1)
@pytest.mark.parametrize(
    "out_dtype,declared",
    [
        (torch.float32, torch.int64),
        (torch.float32, torch.bool),
        (torch.float32, torch.complex64),
        (torch.complex64, torch.float32),
    ],
    ids=["int64-for-real", "bool-for-real", "complex-for-real", "real-for-complex"],
)
def test_non_differentiable_or_kind_mismatched_dtype_rejected_at_apply(out_dtype, declared):
    """torch_ctxext rejects when declared a dtype that cannot carry a gradient or whose kind (real or complex) differs from its output's"""
    calls = []

    class F(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.set_output_grad_dtype(None, declared)
            return x * 2.0, (x * 3.0).to(out_dtype)

        @staticmethod
        def backward(ctx, g1, g2):
            calls.append("backward")
            return g1

    msg = _apply_error(F, _leaf())
    assert re.search(r"\boutput 1\b", msg), msg
    assert str(declared) in msg, msg
    assert calls == []


@pytest.mark.upstream_deviation(DEVIATION, 2)
def test_materialized_zero_gradient_arrives_in_declared_dtype():
    """Pass a :class:`torch.dtype` and the engine guarantees the gradient handed to backward has that dtype."""
    rec = {}

    class F(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.set_output_grad_dtype(torch.float64, torch.float16)
            return x * 2.0, x * 3.0

        @staticmethod
        def backward(ctx, g1, g2):
            rec["dtypes"] = [g1.dtype, g2.dtype]
            rec["g2"] = g2.detach().clone()
            return g1.float() * 2.0 + g2.float() * 3.0

    x = _leaf()
    a, _unused = F.apply(x)
    a.sum().backward()
    torch.testing.assert_close(rec["g2"].float(), torch.zeros(2))
    assert rec["dtypes"] == [torch.float64, torch.float16]
    torch.testing.assert_close(x.grad, torch.full((2,), 2.0))


@pytest.mark.upstream_deviation(DEVIATION, 3)
def test_call_from_backward_raises():
    """This should be called at most once, from either the :func:`setup_context` or :func:`forward` methods."""

    class F(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2.0

        @staticmethod
        def backward(ctx, g):
            ctx.set_output_grad_dtype(torch.float64)
            return g * 2.0

    y = F.apply(_leaf())
    with pytest.raises(RuntimeError, match=r"set_output_grad_dtype.*forward or setup_context"):
        y.sum().backward()


@pytest.mark.upstream_deviation(DEVIATION, "dirty-view")
@pytest.mark.parametrize("declared", [torch.float16, torch.float64], ids=["float16", "float64"])
def test_declared_dtype_holds_for_output_dirtied_through_a_view(declared):
    """Pass a :class:`torch.dtype` and the engine guarantees the gradient handed to backward has that dtype."""
    rec = {}

    class DoubleInPlace(Function):
        @staticmethod
        def forward(ctx, x):
            x.mul_(2.0)
            ctx.mark_dirty(x)
            ctx.set_output_grad_dtype(declared)
            return x

        @staticmethod
        def backward(ctx, g):
            rec.setdefault("dtypes", []).append(g.dtype)
            return g.float() * 2.0

    a = _leaf(3)
    base = a * 1.0
    out = DoubleInPlace.apply(base[:2])
    z = ToDtype.apply(out, torch.bfloat16)
    (z.sum() + base.sum()).backward()
    torch.testing.assert_close(a.grad, torch.tensor([4.0, 4.0, 1.0]))
    assert rec["dtypes"] and set(rec["dtypes"]) == {declared}


# ----------------------------------------------------------- hypothesis


@dataclass
class OutSpec:
    kind: str  # "diff" | "nondiff" (mark_non_differentiable) | "int" | "nontensor"
    dtype: Optional[torch.dtype] = None
    decl: Optional[torch.dtype] = None
    consumer: str = "unused"  # diff only: "unused" | "to" | "root"
    consumer_dtype: Optional[torch.dtype] = None
    k: int = 1
    c: int = 1


floats = st.sampled_from(FLOATS)


@st.composite
def diff_specs(draw, used=False):
    dtype = draw(floats)
    return OutSpec(
        "diff",
        dtype=dtype,
        decl=draw(st.one_of(st.none(), floats)),
        consumer=draw(st.sampled_from(["to", "root"] if used else ["unused", "to", "root"])),
        consumer_dtype=draw(floats),
        k=draw(st.integers(1, 3)),
        c=draw(st.integers(1, 3)),
    )


@st.composite
def out_specs(draw):
    kind = draw(st.sampled_from(["diff", "nondiff", "int", "nontensor"]))
    if kind == "diff":
        return draw(diff_specs())
    return OutSpec(kind, dtype=draw(floats), c=draw(st.integers(1, 3)))


@st.composite
def function_specs(draw):
    specs = draw(st.lists(out_specs(), min_size=1, max_size=5))
    # at least one differentiable output that backward is reached through
    specs[draw(st.integers(0, len(specs) - 1))] = draw(diff_specs(used=True))
    style = draw(st.sampled_from(["forward", "setup_context"]))
    shape = draw(st.sampled_from([(), (1,), (2,), (2, 3)]))
    seed = draw(st.integers(0, 2**31 - 1))
    return specs, style, shape, seed


def _random_function(specs, style, rec):
    decls = tuple(s.decl for s in specs)
    nondiff = [i for i, s in enumerate(specs) if s.kind == "nondiff"]
    single = len(specs) == 1

    def outputs(x):
        outs = []
        for s in specs:
            if s.kind in ("diff", "nondiff"):
                outs.append((x * s.c).to(s.dtype))
            elif s.kind == "int":
                outs.append((x * s.c).round().to(torch.int64))
            else:
                outs.append(s.c)
        return outs[0] if single else tuple(outs)

    def declare(ctx, x, output):
        ctx.shape, ctx.device = x.shape, x.device
        outs = (output,) if single else output
        if nondiff:
            ctx.mark_non_differentiable(*[outs[i] for i in nondiff])
        ctx.set_output_grad_dtype(*decls)

    def backward(ctx, *grads):
        rec["calls"] = rec.get("calls", 0) + 1
        rec["grads"] = [g.detach().clone() if isinstance(g, torch.Tensor) else g for g in grads]
        gx = torch.zeros(ctx.shape, dtype=torch.float64, device=ctx.device)
        for s, g in zip(specs, grads):
            if s.kind == "diff" and g is not None:
                gx = gx + g.double() * s.c
        return gx.to(torch.float32)

    return _function_in_style(style, outputs, declare, backward)


@given(function_specs())
def test_each_declaration_applies_to_the_output_at_the_same_index(fspec):
    """The number of declarations must match the number of returned values, and each argument corresponds positionally to the output at the same index."""
    specs, style, shape, seed = fspec
    gen = torch.Generator().manual_seed(seed)
    rec = {}
    fn = _random_function(specs, style, rec)
    x = (torch.rand(shape, generator=gen) * 4 - 2).requires_grad_()
    out = fn.apply(x)
    outs = (out,) if len(specs) == 1 else out

    loss, roots, root_grads = None, [], []
    expected = {}  # index -> dtype backward must receive
    reference = torch.zeros(shape, dtype=torch.float64)
    for i, (s, o) in enumerate(zip(specs, outs)):
        if s.kind != "diff":
            assert not isinstance(o, torch.Tensor) or not o.requires_grad
            continue
        assert o.dtype == s.dtype and o.requires_grad
        if s.consumer == "to":
            term = o.to(s.consumer_dtype).sum() * s.k
            loss = term if loss is None else loss + term
            incoming = s.dtype  # ToCopyBackward hands the gradient back in o's dtype
            reference += s.k * s.c
        elif s.consumer == "root":
            # multiples of 1/4 in [-2, 2]: exact in every floating dtype
            r = torch.randint(-8, 9, shape, generator=gen).to(torch.float64) / 4
            roots.append(o)
            root_grads.append(r.to(s.consumer_dtype))
            incoming = s.consumer_dtype
            reference += r * s.c
        else:
            continue
        expected[i] = s.decl if s.decl is not None else incoming
    if loss is not None:
        roots.append(loss)
        root_grads.append(None)
    torch.autograd.backward(roots, root_grads)

    assert rec["calls"] == 1
    grads = rec["grads"]
    assert len(grads) == len(specs)
    for i, s in enumerate(specs):
        g = grads[i]
        if i in expected:
            assert isinstance(g, torch.Tensor), (i, g)
            assert g.dtype == expected[i], (i, s, g.dtype)
        elif s.kind == "diff":  # unused: undefined, or materialized as zeros
            assert g is None or not bool(g.any()), (i, g)
        elif s.kind == "nontensor":
            assert g is None, (i, g)
    assert x.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad.double(), reference, atol=1e-2, rtol=1e-2)


@pytest.mark.upstream_deviation("set_output_grad_dtype", "vmap")
@pytest.mark.parametrize("n_outputs", [1, 2])
def test_declarations_hold_for_a_function_called_under_torch_func_vmap(n_outputs):
    """Functions called under torch.func transforms keep the declared dtypes
    (vmap with generate_vmap_rule, and vmap of grad)."""
    seen = []

    class Twice(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(x):
            return (x * 2, x * 3) if n_outputs == 2 else x * 2

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.set_output_grad_dtype(*([torch.float64] * n_outputs))

        @staticmethod
        def backward(ctx, *grads):
            seen.append([g.dtype for g in grads])
            return (grads[0] * 2 + (grads[1] * 3 if n_outputs == 2 else 0)).float()

    def loss(t):
        out = Twice.apply(t)
        return (out if n_outputs == 1 else out[0] + out[1]).sum()

    x = torch.ones(2, 3)
    grads = torch.func.vmap(torch.func.grad(loss))(x)
    assert seen == [[torch.float64] * n_outputs]
    torch.testing.assert_close(grads, torch.full((2, 3), 2.0 if n_outputs == 1 else 5.0))
