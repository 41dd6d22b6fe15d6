"""Differential scenarios for ``ctx.set_output_grad_dtype``: which
declarations it refuses (validation), the dtype a backward then receives,
the documented deviations of torch 2.15 (deviations.txt), dirty and view
outputs, and torch.func transforms. With ``boxed_grads_call``:
scenarios_apply_boxed.py.

Names: ``set_output_grad_dtype.<concern>.<case>``.
"""

from contextlib import nullcontext

import torch
from torch.autograd import Function

from sample_functions import (
    DECLARATIONS,
    OMIT,
    CastGradTo,
    apply_and_backward,
    declaring_function,
    declaring_scale,
    doubling,
    doubling_in_setup_context_style,
    func_declaring_scale,
)
from scenario_helpers import Section, dtype_name, error_of, grad_values, leaf, outcome_of, tensor_values

VALIDATION = Section("set_output_grad_dtype.validation")  # count, type and kind of the declarations
BACKWARD_DTYPE = Section("set_output_grad_dtype.backward_dtype")  # the dtype the gradient arrives in
DEVIATIONS = Section("set_output_grad_dtype.deviations")  # where torch 2.15 breaks the contract (deviations.txt)
MARK_DIRTY = Section("set_output_grad_dtype.mark_dirty")  # in-place (dirty) and view outputs
TORCH_FUNC = Section("set_output_grad_dtype.torch_func")


# ------------------------------------------------------------------ validation


def declaration_case(
    declarations,
    outputs,
    x=(1.0,),
    requires_grad=True,
    no_grad=False,
    style="old",
    non_differentiable=None,
    loss=None,
):
    """forward(x) returns ``outputs(x)`` and declares ``declarations``: did the
    declaration and apply succeed, and (given ``loss``) the backward?"""
    F, rec = declaring_function(
        lambda _: declarations, outputs, style=style, non_differentiable=non_differentiable
    )
    x = torch.tensor(list(x), requires_grad=requires_grad)
    with torch.no_grad() if no_grad else nullcontext():
        return apply_and_backward(F, x, rec, loss)


def _times(n):
    return lambda x: tuple(x * float(i + 1) for i in range(n))


def _double(x):
    return x * 2.0


def _double_and_long(x):
    return x * 2.0, (x * 3.0).long()


def _double_and_str(x):
    return x * 2.0, "s"


f32, f64, i64 = torch.float32, torch.float64, torch.int64

VALIDATION.table(
    declaration_case,
    {
        # how many declarations: one per output
        "count_1out_2decl": dict(declarations=(None, None), outputs=_double, x=(1.0, 2.0)),
        "count_1out_0decl": dict(declarations=(), outputs=_double, x=(1.0, 2.0)),
        "count_2out_1decl": dict(declarations=(None,), outputs=_times(2), x=(1.0, 2.0)),
        "count_4out_3decl": dict(declarations=(None,) * 3, outputs=_times(4), x=(1.0, 2.0)),
        "count_mismatch_no_input_requires_grad": dict(
            declarations=(None, None), outputs=_double, x=(1.0, 2.0), requires_grad=False
        ),
        "count_mismatch_under_no_grad": dict(declarations=(None, None), outputs=_double, x=(1.0, 2.0), no_grad=True),
        "count_mismatch_setup_context": dict(declarations=(None, None), outputs=_double, style="setup"),
        "count_tuple_of_one_output": dict(declarations=(None, None), outputs=lambda x: (x * 2.0,)),
        # what a declaration is: a dtype or None
        "nondtype_str": dict(declarations=("float32",), outputs=_double),
        "nondtype_int": dict(declarations=(3,), outputs=_double),
        "nondtype_tensor": dict(declarations=(torch.tensor(1.0),), outputs=_double),
        "nondtype_python_float_type": dict(declarations=(float,), outputs=_double),
        "nondtype_str_no_input_requires_grad": dict(declarations=("float32",), outputs=_double, requires_grad=False),
        "nondtype_and_count_mismatch_precedence": dict(declarations=("a", "b"), outputs=_double),
        # a concrete dtype only for a differentiable tensor output
        "concrete_for_nontensor_output": dict(
            declarations=(None, None, f32), outputs=lambda x: (x * 2.0, x * 3.0, "s")
        ),
        "concrete_for_nontensor_output_index0": dict(declarations=(f32, None), outputs=lambda x: (5, x * 3.0)),
        "concrete_for_mark_non_differentiable": dict(
            declarations=(None, f32), outputs=lambda x: (x * 2.0, x * 3.0), non_differentiable=[1]
        ),
        "concrete_for_integer_output": dict(declarations=(None, f32), outputs=_double_and_long),
        "concrete_for_integer_output_own_dtype": dict(declarations=(None, i64), outputs=_double_and_long),
        "concrete_for_integer_output_no_input_requires_grad": dict(
            declarations=(None, f32), outputs=_double_and_long, requires_grad=False
        ),
        "concrete_output_no_input_requires_grad": dict(declarations=(f32,), outputs=_double, requires_grad=False),
        "concrete_for_tensor_output_under_no_grad": dict(declarations=(f64,), outputs=_double, no_grad=True),
        "concrete_for_nontensor_no_input_requires_grad": dict(
            declarations=(None, f32), outputs=_double_and_str, requires_grad=False
        ),
        "concrete_for_nontensor_under_no_grad": dict(declarations=(None, f32), outputs=_double_and_str, no_grad=True),
        "concrete_for_nontensor_setup_context": dict(declarations=(None, f32), outputs=_double_and_str, style="setup"),
        "all_none_valid_for_nontensors": dict(
            declarations=(None, None, None),
            outputs=lambda x: (x * 2.0, "s", 3),
            loss=lambda y: y[0].sum().backward(),
        ),
    },
)


def _backward_of_sum(y):
    y.sum().backward()


def _backward_of_real_sum(y):
    y.real.sum().backward()


def _to_complex64(x):
    return (x * 2.0).to(torch.complex64)


DEVIATIONS.table(  # deviation 1 of docs/deviations.md: dtypes of another kind
    declaration_case,
    {
        "declare_int64": dict(declarations=(i64,), outputs=_double, x=(1.0, 2.0), loss=_backward_of_sum),
        "declare_int64_create_graph": dict(
            declarations=(i64,), outputs=_double, x=(1.0, 2.0), loss=lambda y: y.sum().backward(create_graph=True)
        ),
        "declare_int64_under_no_grad": dict(declarations=(i64,), outputs=_double, x=(1.0, 2.0), no_grad=True),
        "declare_int64_no_input_requires_grad": dict(
            declarations=(i64,), outputs=_double, x=(1.0, 2.0), requires_grad=False
        ),
        "declare_bool": dict(declarations=(torch.bool,), outputs=_double, x=(1.0, 2.0), loss=_backward_of_sum),
        "declare_complex_for_real": dict(
            declarations=(torch.complex64,), outputs=_double, x=(1.0, 2.0), loss=_backward_of_sum
        ),
        "declare_real_for_complex": dict(
            declarations=(f32,), outputs=_to_complex64, x=(1.0, 2.0), loss=_backward_of_real_sum
        ),
        "declare_complex128_for_complex64": dict(
            declarations=(torch.complex128,), outputs=_to_complex64, x=(1.0, 2.0), loss=_backward_of_real_sum
        ),
    },
)


def repeated_call_case(calls, in_setup_context=False, uncaught=False):
    """y = 2x whose forward (with ``in_setup_context``, setup_context) runs
    ``calls(ctx, rec)``: ``rec`` after apply and backward, or (``uncaught``)
    the outcome of apply."""
    rec = {}
    if in_setup_context:
        F = doubling_in_setup_context_style(lambda ctx: calls(ctx, rec))
    else:
        F = doubling(lambda ctx, g: g * 2.0, in_forward=lambda ctx: calls(ctx, rec))
    x = leaf([1.0])
    if uncaught:
        return outcome_of(lambda: F.apply(x))
    F.apply(x).sum().backward()
    return rec


def _declare_then_record_two_more(ctx, rec):
    ctx.set_output_grad_dtype(torch.float32)
    rec["second"] = outcome_of(lambda: ctx.set_output_grad_dtype(torch.float32))
    rec["third_none"] = outcome_of(lambda: ctx.set_output_grad_dtype(None))


def _declare_twice(ctx, rec):
    ctx.set_output_grad_dtype(torch.float32)
    ctx.set_output_grad_dtype(torch.float32)


def _declare_none_then_record_second(ctx, rec):
    ctx.set_output_grad_dtype(None)
    rec["second"] = outcome_of(lambda: ctx.set_output_grad_dtype(None))


VALIDATION.table(
    repeated_call_case,
    {
        "called_twice": dict(calls=_declare_then_record_two_more),
        "called_twice_uncaught": dict(calls=_declare_twice, uncaught=True),
        "called_twice_forward_and_setup_context": dict(calls=_declare_none_then_record_second, in_setup_context=True),
    },
)


@VALIDATION.scenario
def concrete_for_nondiff_output_of_nonrequiring_input():
    """Two inputs; output 1 depends only on the non-requiring input."""

    class F(Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.set_output_grad_dtype(torch.float32, torch.float32)
            return x * 2.0, w * 2.0

        @staticmethod
        def backward(ctx, g1, g2):
            return g1 * 2.0, None

    x = leaf([1.0])
    w = torch.tensor([1.0])
    return outcome_of(lambda: [o.requires_grad for o in F.apply(x, w)])


# -------------------------------------------------------------- backward dtype


def per_declaration_case(backward, out_dtype=torch.float32, observe_grad_dtype=False):
    """For each of DECLARATIONS: y = declaring_scale(x) in ``out_dtype``, then
    ``backward(y)``; what backward got and x.grad."""
    res = {}
    for key, declaration in DECLARATIONS.items():
        F, rec = declaring_scale(declaration, out_dtype)
        x = leaf([1.0, 2.0])
        y = F.apply(x)
        r = outcome_of(lambda: backward(y))
        res[key] = {"rec": rec, "backward": r, **grad_values(x=x)}
        if observe_grad_dtype:
            res[key]["x.grad.dtype"] = dtype_name(x.grad)
    return res


def _root_grad_float64(y):
    y.backward(torch.tensor([1.0, 3.0], dtype=torch.float64))


def _one_consumer_float64(y, create_graph=False):
    z = CastGradTo.apply(y, torch.float64)
    z.sum().backward(create_graph=create_graph)


def _consumers_float64_then_float16(y):
    z1 = CastGradTo.apply(y, torch.float64)
    z2 = CastGradTo.apply(y, torch.float16)
    (z1.sum() + z2.sum()).backward()


def _consumers_float16_then_float64(y):
    z2 = CastGradTo.apply(y, torch.float16)
    z1 = CastGradTo.apply(y, torch.float64)
    (z1.sum() + z2.sum()).backward()


BACKWARD_DTYPE.table(
    per_declaration_case,
    {
        "root_grad_other_dtype": dict(backward=_root_grad_float64, observe_grad_dtype=True),
        "one_consumer_returning_float64": dict(backward=_one_consumer_float64, observe_grad_dtype=True),
        "two_consumers_float64_and_float16": dict(backward=_consumers_float64_then_float16),
        "two_consumers_float16_then_float64": dict(backward=_consumers_float16_then_float64),
        "float16_output_consumed_by_float": dict(
            backward=lambda y: y.float().sum().backward(), out_dtype=torch.float16
        ),
        "float16_output_root_float32_grad": dict(
            backward=lambda y: y.backward(torch.tensor([1.0, 3.0])), out_dtype=torch.float16
        ),
        "own_dtype_and_plain_sum": dict(backward=_backward_of_sum, observe_grad_dtype=True),
        "create_graph": dict(backward=lambda y: _one_consumer_float64(y, create_graph=True)),
    },
)


@BACKWARD_DTYPE.scenario
def root_grad_via_autograd_grad():
    res = {}
    for k, decl in DECLARATIONS.items():
        F, rec = declaring_scale(decl)
        x = leaf([1.0, 2.0])
        y = F.apply(x)
        r = outcome_of(
            lambda: [dtype_name(t) for t in torch.autograd.grad(y, x, torch.tensor([1.0, 3.0], dtype=torch.float64))]
        )
        res[k] = {"rec": rec, "grad": r}
    return res


@BACKWARD_DTYPE.scenario
def from_setup_context():
    res = {}
    for k, decl in DECLARATIONS.items():
        rec = {}

        def setup_context(ctx, decl=decl):
            if decl != OMIT:
                ctx.set_output_grad_dtype(decl)

        def backward(ctx, g, rec=rec):
            rec["bwd_dtype"] = dtype_name(g)
            return g.float() * 2.0

        x = leaf([1.0, 2.0])
        y = doubling_in_setup_context_style(setup_context, backward).apply(x)
        r = outcome_of(lambda: _one_consumer_float64(y))
        res[k] = {"rec": rec, "backward": r, **grad_values(x=x)}
    return res


@BACKWARD_DTYPE.scenario
def multi_output_mixed():
    rec = {}

    class F(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.set_output_grad_dtype(torch.float64, None, torch.float16, None)
            return x * 1.0, x * 2.0, x * 3.0, "s"

        @staticmethod
        def backward(ctx, g1, g2, g3, g4):
            rec["dtypes"] = [dtype_name(g1), dtype_name(g2), dtype_name(g3), repr(g4)]
            return g1.float() + g2.float() + g3.float()

    x = leaf([1.0, 2.0])
    a, b, c, _ = F.apply(x)
    (
        CastGradTo.apply(a, torch.float16).sum()
        + CastGradTo.apply(b, torch.float64).sum()
        + CastGradTo.apply(c, torch.float64).sum()
    ).backward()
    return {"rec": rec, **grad_values(x=x)}


@BACKWARD_DTYPE.scenario
def declared_dtype_no_input_requires_grad():
    F, rec = declaring_scale(torch.float64)
    x = torch.tensor([1.0, 2.0])
    y = F.apply(x)
    return {"rec": rec, "requires_grad": y.requires_grad, "grad_fn": y.grad_fn is None}


@BACKWARD_DTYPE.scenario
def declared_dtype_under_no_grad():
    F, rec = declaring_scale(torch.float64)
    x = leaf([1.0, 2.0])
    with torch.no_grad():
        y = F.apply(x)
    return {"rec": rec, "requires_grad": y.requires_grad}


# ------------------------------------------------------------------ deviations


@DEVIATIONS.scenario
def declare_complex_for_real_return_complex():
    rec = {}

    def backward(ctx, g):
        rec["bwd_dtype"] = dtype_name(g)
        return g * 2.0

    x = leaf([1.0, 2.0])
    y = doubling(backward, in_forward=lambda ctx: ctx.set_output_grad_dtype(torch.complex64)).apply(x)
    r = outcome_of(lambda: y.sum().backward())
    return {"rec": rec, "backward": r, **grad_values(x=x), "x.grad.dtype": dtype_name(x.grad)}


@DEVIATIONS.scenario
def materialized_zeros_unused_output():
    res = {}
    for mat in (True, False):
        rec = {}

        class F(Function):
            @staticmethod
            def forward(ctx, x, mat=mat):
                ctx.set_materialize_grads(mat)
                ctx.set_output_grad_dtype(torch.float64, torch.float64)
                return x * 2.0, x * 3.0

            @staticmethod
            def backward(ctx, g1, g2, rec=rec):
                rec["dtypes"] = [dtype_name(g1), dtype_name(g2)]
                rec["vals"] = [tensor_values(g1), tensor_values(g2)]
                return g1.float() * 2.0

        x = leaf([1.0, 2.0])
        a, b = F.apply(x)
        r = outcome_of(lambda: a.sum().backward())
        res["materialize=%s" % mat] = {"rec": rec, "backward": r, **grad_values(x=x)}
    return res


@DEVIATIONS.scenario
def materialized_zeros_unused_output_none_decl():
    rec = {}

    class F(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.set_output_grad_dtype(None, None)
            return x * 2.0, (x * 3.0).half()

        @staticmethod
        def backward(ctx, g1, g2):
            rec["dtypes"] = [dtype_name(g1), dtype_name(g2)]
            return g1.float() * 2.0

    x = leaf([1.0, 2.0])
    a, b = F.apply(x)
    r = outcome_of(lambda: a.sum().backward())
    return {"rec": rec, "backward": r}


def call_from_backward_case(declare_in_forward, calls_in_backward, second_backward=False):
    """y = 2x whose backward calls set_output_grad_dtype(float64)
    ``calls_in_backward`` times (after declaring None in forward, with
    ``declare_in_forward``), its gradient cast to float64 on the way: what
    backward recorded (with ``second_backward``, in each of two backwards)."""
    rec = {}

    def in_forward(ctx):
        if declare_in_forward:
            ctx.set_output_grad_dtype(None)

    def backward(ctx, g):
        rec["bwd_dtype"] = dtype_name(g)
        rec["call"] = outcome_of(lambda: ctx.set_output_grad_dtype(torch.float64))
        if calls_in_backward > 1:
            rec["call_again"] = outcome_of(lambda: ctx.set_output_grad_dtype(torch.float64))
            return g * 2.0
        return g.float() * 2.0

    x = leaf([1.0, 2.0])
    y = doubling(backward, in_forward).apply(x)
    z = CastGradTo.apply(y, torch.float64)
    if not second_backward:
        z.sum().backward()
        return rec
    z.sum().backward(retain_graph=True)
    rec_first = dict(rec)
    rec.clear()
    z.sum().backward()
    return {"first": rec_first, "second_backward": rec}


DEVIATIONS.table(
    call_from_backward_case,
    {
        "call_from_backward": dict(declare_in_forward=False, calls_in_backward=2, second_backward=True),
        "call_from_backward_after_forward_decl": dict(declare_in_forward=True, calls_in_backward=1),
    },
)


@DEVIATIONS.scenario
def call_after_forward_on_grad_fn():
    F, rec = declaring_scale(OMIT)
    x = leaf([1.0, 2.0])
    y = F.apply(x)
    r = outcome_of(lambda: y.grad_fn.set_output_grad_dtype(torch.float64))
    z = CastGradTo.apply(y, torch.float64)
    z.sum().backward()
    return {"call": r, "rec": rec}


# ------------------------------------------------------------------ mark_dirty


def dirty_or_view_case(dirty, input_is_view):
    """For each of DECLARATIONS: a forward that modifies its input in place and
    marks it dirty (``dirty``) or returns a view of it; the input is itself a
    view of a larger tensor (``input_is_view``) or not."""
    res = {}
    for k, decl in DECLARATIONS.items():
        rec = {}

        class F(Function):
            @staticmethod
            def forward(ctx, x, decl=decl):
                if dirty:
                    x.mul_(2.0)
                    ctx.mark_dirty(x)
                if decl != OMIT:
                    ctx.set_output_grad_dtype(decl)
                return x if dirty else x.view_as(x)

            @staticmethod
            def backward(ctx, g, rec=rec):
                rec["bwd_dtype"] = dtype_name(g)
                return g.float() * 2.0 if dirty else g.float()

        r = {}
        if input_is_view:
            a = leaf([1.0, 2.0, 3.0])
            base = a * 1.0
            v = base[:2]
            try:
                out = F.apply(v)
                r["out_grad_fn"] = type(out.grad_fn).__name__
                z = CastGradTo.apply(out, torch.float64)
                (z.sum() + base.sum()).backward()
            except Exception as e:  # noqa: BLE001
                r["error"] = error_of(e)
        else:
            a = leaf([1.0, 2.0])
            x = a * 1.0
            try:
                out = F.apply(x)
                z = CastGradTo.apply(out, torch.float64)
                z.sum().backward()
            except Exception as e:  # noqa: BLE001
                r["error"] = error_of(e)
        res[k] = {"rec": rec, "r": r, **grad_values(a=a)}
    return res


MARK_DIRTY.table(
    dirty_or_view_case,
    {
        "mark_dirty_view_output": dict(dirty=True, input_is_view=True),
        "mark_dirty_nonview_output": dict(dirty=True, input_is_view=False),
        "view_output_not_dirty": dict(dirty=False, input_is_view=False),
    },
)


# ------------------------------------------------------------------ torch.func


def torch_func_case(transform, declarations=("None", "float32", "float64")):
    """For each declaration: ``transform(F)`` of a setup_context-style
    Function declaring it (generate_vmap_rule)."""
    res = {}
    for k in declarations:
        rec = {}
        F = func_declaring_scale(DECLARATIONS[k], rec)
        res[k] = {"rec": rec, "result": outcome_of(lambda: tensor_values(transform(F)))}
    return res


def _func_grad(F):
    return torch.func.grad(lambda x: F.apply(x).sum())(torch.tensor([1.0, 2.0]))


def _func_vjp(F):
    out, fn = torch.func.vjp(F.apply, torch.tensor([1.0, 2.0]))
    return fn(torch.tensor([1.0, 3.0]))[0]


TORCH_FUNC.table(
    torch_func_case,
    {
        "func_grad": dict(transform=_func_grad),
        "func_vjp": dict(transform=_func_vjp),
        "func_vmap": dict(transform=lambda F: torch.func.vmap(F.apply)(torch.ones(2, 3))),
        "func_vmap_grad": dict(
            transform=lambda F: torch.func.vmap(torch.func.grad(lambda x: F.apply(x).sum()))(torch.ones(2, 3)),
            declarations=("None", "float64"),
        ),
    },
)


@TORCH_FUNC.scenario
def func_grad_oldstyle_declaring():
    F, rec = declaring_scale(torch.float64)
    r = outcome_of(lambda: tensor_values(torch.func.grad(lambda x: F.apply(x).sum())(torch.tensor([1.0, 2.0]))))
    return {"rec": rec, "result": r}
