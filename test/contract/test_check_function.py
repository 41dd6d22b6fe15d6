"""torch_ctxext.testing.check_function and the ctx_contract pytest fixture.

Correct Functions pass; realistically broken ones are caught, each with a
message naming the rule, the input or output concerned and the fix.
"""
import importlib.metadata
import textwrap

import pytest
import torch
from torch.autograd.function import once_differentiable

import check_corpus as corpus
from check_corpus import sample
from check_corpus.forward_mode import Exp  # torch's own docstring example
import torch_ctxext
from torch_ctxext.pytest_plugin import ctx_contract  # noqa: F401  (the fixture)
from torch_ctxext.testing import ContractViolation, check_function

NATIVE_DTYPES = torch_ctxext.features()["set_output_grad_dtype"] == "native"


def failures(report, name):
    return [r for r in report.failures if r.name == name]


def expect_violation(fn, *args, rule, subject=None, says=(), **options):
    """check_function raises; the failure of ``rule`` names ``subject`` and
    contains every text of ``says``. Returns the report."""
    with pytest.raises(ContractViolation) as info:
        check_function(fn, *args, **options)
    report = info.value.report
    assert isinstance(info.value, AssertionError)
    found = failures(report, rule)
    assert found, str(report)
    failure = found[0]
    if subject is not None:
        assert failure.subject == subject, str(report)
    for text in says:
        assert text in str(failure), str(report)
    assert failure.fix, str(report)
    # The message of the AssertionError is the readable report.
    assert f"FAIL  {rule}" in str(info.value)
    assert "fix:" in str(info.value)
    return report


# --- correct Functions ----------------------------------------------------------


class Matmul(torch.autograd.Function):
    """The example of the input_grad_buffers docstring."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x @ weight

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        x_buffer, _ = ctx.input_grad_buffers
        if x_buffer is not None:
            # Computes grad_x and adds it to the existing buffer.
            x_buffer.addmm_(grad_output, weight.t())
            grad_x = None
        else:
            grad_x = grad_output @ weight.t()
        grad_weight = x.t() @ grad_output
        return grad_x, grad_weight


class Trig(torch.autograd.Function):
    """The example of the set_output_grad_dtype docstring."""

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


class SortValues(torch.autograd.Function):
    """Values and indices; the indices are marked non-differentiable."""

    @staticmethod
    def forward(ctx, x):
        values, indices = x.sort()
        ctx.mark_non_differentiable(indices)
        ctx.save_for_backward(indices)
        return values, indices

    @staticmethod
    def backward(ctx, grad_values, _grad_indices):
        (indices,) = ctx.saved_tensors
        return torch.zeros_like(grad_values).scatter(-1, indices, grad_values)


class MulAdd_(torch.autograd.Function):
    """x.mul_(2).add_(y) in place, marked dirty."""

    @staticmethod
    def forward(ctx, x, y):
        x.mul_(2).add_(y)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g * 2, g


class BoxedFanout(torch.autograd.Function):
    """boxed_grads_call: frees each output's gradient once used."""

    boxed_grads_call = True

    @staticmethod
    def forward(ctx, x):
        return x * 2, x * 3

    @staticmethod
    def backward(ctx, grads):
        total = grads[0] * 2
        del grads[0]
        total = total + grads[0] * 3
        grads.clear()
        return total


class FusedScaledAdd(torch.autograd.Function):
    """x + alpha * y with a non-tensor argument; fuses both inputs."""

    @staticmethod
    def forward(ctx, x, y, alpha):
        ctx.alpha = alpha
        return x + alpha * y

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        x_buffer, y_buffer, _ = ctx.input_grad_buffers
        if x_buffer is not None:
            x_buffer.add_(g)
            grad_x = None
        else:
            grad_x = g
        if y_buffer is not None:
            y_buffer.add_(g, alpha=ctx.alpha)
            grad_y = None
        else:
            grad_y = g * ctx.alpha
        return grad_x, grad_y, None


class Linear(torch.autograd.Function):
    """setup_context style; fuses only in first-order backward, so that it is
    also twice differentiable."""

    @staticmethod
    def forward(x, w, b):
        return x @ w.t() + b

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w, b = inputs
        ctx.save_for_backward(x, w)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        fuse = not torch.is_grad_enabled()  # the property is first-order only
        x_buffer = ctx.input_grad_buffers[0] if fuse else None
        if x_buffer is not None:
            x_buffer.addmm_(g, w)
            grad_x = None
        else:
            grad_x = g @ w
        return grad_x, g.t() @ x, g.sum(0)


class ScaleWithMask(torch.autograd.Function):
    """A floating output marked non-differentiable (a mask) is fine."""

    @staticmethod
    def forward(ctx, x):
        mask = (x > 0).to(x.dtype)
        ctx.mark_non_differentiable(mask)
        return x * 3, mask

    @staticmethod
    def backward(ctx, g, _g_mask):
        return g * 3


def test_matmul_from_the_input_grad_buffers_docstring_passes():
    report = check_function(Matmul, sample(4, 3), sample(3, 2, seed=1))
    assert report.passed
    fused = report.results_for("input_grad_buffers.fused_matches_fallback")
    assert [r.status for r in fused] == ["passed", "passed"]
    assert [r.subject for r in fused] == ["input 0 (x)", "input 1 (weight)"]
    assert report.results_for("input_grad_buffers.not_retained")[0].status == "passed"
    assert report.results_for("gradcheck")[0].status == "passed"
    # Double backward: the property is first-order only, which is documented.
    (double,) = report.results_for("gradgradcheck")
    assert double.status == "skipped" and "create_graph=True" in double.detail
    assert "check_function(Matmul)" in str(report) and "PASS  gradcheck" in str(report)


def test_trig_from_the_set_output_grad_dtype_docstring_passes(capsys):
    # Its backward demonstrates dtypes, not the derivative: no finite differences.
    x = sample(3, dtype=torch.float16)
    report = check_function(Trig, x, gradcheck=False)
    assert report.passed
    (honoured,) = report.results_for("set_output_grad_dtype.honoured")
    assert honoured.status == "passed"
    # float32 declared; t2's own dtype; None passes the other-dtype root gradient through.
    assert honoured.detail == "backward received (float32, float16, float64)"
    assert "torch.float32 torch.float16 torch.float64" in capsys.readouterr().out


def test_trig_gradient_is_not_the_derivative_and_gradcheck_says_so():
    expect_violation(Trig, sample(3, dtype=torch.float16), rule="gradcheck", says=["Jacobian mismatch"])


def test_half_matmul_from_the_docs_passes_with_the_backport():
    # The mixed-precision example of docs/set_output_grad_dtype.md.
    HalfMatmul = corpus.dtypes.HalfMatmul
    x, w = sample(4, 8), sample(8, 2, seed=1)
    if NATIVE_DTYPES:
        # Upstream deviation 2: a materialized zero gradient arrives as float16,
        # and this backward (g @ w.t() with float32 w) then fails.
        report = expect_violation(
            HalfMatmul, x, w, rule="gradcheck", says=["no gradient for any output", "deviation 2"]
        )
    else:
        report = check_function(HalfMatmul, x, w)
        assert report.passed
        assert "declares gradient dtypes" in report.precision  # checked in its own dtypes
        assert report.results_for("gradcheck")[0].status == "passed"
    assert report.results_for("set_output_grad_dtype.honoured")[0].status == "passed"


@pytest.mark.parametrize(
    "fn, make_args",
    [
        (Exp, lambda: (sample(5),)),
        (SortValues, lambda: (sample(6),)),
        (MulAdd_, lambda: (sample(4), sample(4, seed=1))),
        (BoxedFanout, lambda: (sample(3),)),
        (FusedScaledAdd, lambda: (sample(2, 3), sample(2, 3, seed=1), 0.5)),
        (Linear, lambda: (sample(4, 3), sample(2, 3, seed=1), sample(2, seed=2))),
        (ScaleWithMask, lambda: (sample(5),)),
    ],
    ids=lambda v: getattr(v, "__name__", ""),
)
def test_correct_functions_pass(fn, make_args):
    report = check_function(fn, *make_args())
    assert report.passed, str(report)
    assert report.results_for("forward")[0].status == "passed"


def test_twice_differentiable_functions_pass_gradgradcheck():
    for fn, args in [(Exp, (sample(5),)), (Linear, (sample(4, 3), sample(2, 3, seed=1), sample(2, seed=2)))]:
        (double,) = check_function(fn, *args).results_for("gradgradcheck")
        assert double.status == "passed", fn


def test_fused_function_with_a_non_tensor_argument_checks_both_fused_inputs():
    report = check_function(FusedScaledAdd, sample(2, 3), sample(2, 3, seed=1), 0.5)
    fused = report.results_for("input_grad_buffers.fused_matches_fallback")
    assert [(r.subject, r.status) for r in fused] == [
        ("input 0 (x)", "passed"),
        ("input 1 (y)", "passed"),
    ]
    assert report.results_for("gradgradcheck")[0].detail == "backward is @once_differentiable"


def test_buffer_checks_run_without_gradcheck_on_a_float64_sample():
    x = sample(4, 3, dtype=torch.float64)
    w = sample(3, 2, dtype=torch.float64, seed=1)
    report = check_function(DoubleCount, x, w, gradcheck=False, raise_on_failure=False)
    assert [f.name for f in report.failures] == ["input_grad_buffers.fused_matches_fallback"]
    assert report.precision == "the sample's dtypes (float64)"


def test_dirty_input_is_recorded_and_its_buffer_check_skipped():
    report = check_function(MulAdd_, sample(4), sample(4, seed=1))
    assert report.results_for("mark_dirty")[0].detail == "inputs changed in place: input 0 (x)"

    class FusedMulAdd_(MulAdd_):
        @staticmethod
        def backward(ctx, g):
            _, y_buffer = ctx.input_grad_buffers
            if y_buffer is not None:
                y_buffer.add_(g)
                return g * 2, None
            return g * 2, g

    report = check_function(FusedMulAdd_, sample(4), sample(4, seed=1))
    fused = report.results_for("input_grad_buffers.fused_matches_fallback")
    assert [(r.subject, r.status) for r in fused] == [
        ("input 0 (x)", "skipped"),
        ("input 1 (y)", "passed"),
    ]
    assert "changes this input in place" in fused[0].detail


def test_boxed_function_that_frees_its_grads_passes():
    (released,) = check_function(BoxedFanout, sample(3)).results_for("boxed_grads.released")
    assert released.status == "passed"
    assert released.detail == "2 of 2 gradient(s) removed and freed"


# --- broken Functions -------------------------------------------------------------


class DoubleCount(Matmul):
    """Fused path accumulates into the buffer but still returns grad_x."""

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        x_buffer, _ = ctx.input_grad_buffers
        grad_x = grad_output @ weight.t()
        if x_buffer is not None:
            x_buffer.add_(grad_x)  # ... and forgets grad_x = None
        return grad_x, x.t() @ grad_output


class OverwritesBuffer(Matmul):
    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        x_buffer, _ = ctx.input_grad_buffers
        grad_x = grad_output @ weight.t()
        if x_buffer is not None:
            x_buffer.copy_(grad_x)  # should be add_
            grad_x = None
        return grad_x, x.t() @ grad_output


class AccumulatesIntoACopy(Matmul):
    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        x_buffer, _ = ctx.input_grad_buffers
        grad_x = grad_output @ weight.t()
        if x_buffer is not None:
            x_buffer = x_buffer + grad_x  # out of place: the engine never sees it
            grad_x = None
        return grad_x, x.t() @ grad_output


class KeepsBufferOnCtx(Matmul):
    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        (x_buffer, _) = ctx.input_grad_buffers
        ctx.x_buffer = x_buffer  # "for debugging"
        if x_buffer is not None:
            x_buffer.addmm_(grad_output, weight.t())
            return None, x.t() @ grad_output
        return grad_output @ weight.t(), x.t() @ grad_output


BUFFER_CACHE = []


class KeepsBufferGlobally(Matmul):
    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        x_buffer, _ = ctx.input_grad_buffers
        if x_buffer is not None:
            x_buffer.addmm_(grad_output, weight.t())
            BUFFER_CACHE.append(x_buffer.view(-1))  # a view keeps it alive too
            return None, x.t() @ grad_output
        return grad_output @ weight.t(), x.t() @ grad_output


class ReluForgetsMarkDirty(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x.clamp_(min=0)  # in place, not marked dirty
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * (y > 0)


class TopKUnmarked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        values, indices = x.topk(2)
        ctx.save_for_backward(indices)
        ctx.shape = x.shape
        return values, indices  # indices not marked non-differentiable

    @staticmethod
    def backward(ctx, g, _):
        (indices,) = ctx.saved_tensors
        return g.new_zeros(ctx.shape).scatter(-1, indices, g)


class WrongSigmoid(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = x.sigmoid()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y  # forgot (1 - y)


class DetachedBackward(torch.autograd.Function):
    """First-order correct, but backward is not differentiable and not
    declared @once_differentiable: double backward silently gives zeros."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return (3 * x.detach() ** 2 * g).detach()


class BoxedKeepsGrads(torch.autograd.Function):
    boxed_grads_call = True

    @staticmethod
    def forward(ctx, x):
        return x * 2, x * 3

    @staticmethod
    def backward(ctx, grads):
        ctx.seen = list(grads)  # a copy of the list keeps every gradient alive
        total = grads[0] * 2 + grads[1] * 3
        grads.clear()
        return total


@pytest.mark.parametrize(
    "fn, rule, says",
    [
        pytest.param(DoubleCount, "input_grad_buffers.fused_matches_fallback",
                     ["counts this Function's contribution twice", "return None for an input"],
                     id="fused_path_that_double_counts"),
        pytest.param(OverwritesBuffer, "input_grad_buffers.fused_matches_fallback",
                     ["overwrote the buffer", "never copy_"],
                     id="fused_path_that_overwrites_the_buffer"),
        pytest.param(AccumulatesIntoACopy, "input_grad_buffers.fused_matches_fallback",
                     ["lost this Function's contribution", "in place"],
                     id="fused_path_that_accumulates_into_a_copy"),
        pytest.param(KeepsBufferOnCtx, "input_grad_buffers.not_retained",
                     ["still alive after backward returned", "on ctx"],
                     id="buffer_kept_on_ctx"),
        pytest.param(KeepsBufferGlobally, "input_grad_buffers.not_retained",
                     ["in a global"],
                     id="buffer_kept_in_a_global"),
    ],
)
def test_wrong_use_of_the_buffer_is_caught_naming_the_input(fn, rule, says):
    try:
        expect_violation(fn, sample(4, 3), sample(3, 2, seed=1), rule=rule, subject="input 0 (x)",
                         says=says)
    finally:
        BUFFER_CACHE.clear()


def test_in_place_change_without_mark_dirty_is_caught():
    expect_violation(
        ReluForgetsMarkDirty,
        sample(5),
        rule="mark_dirty",
        subject="input 0 (x)",
        says=["changed input 0 (x) in place", "ctx.mark_dirty(x)"],
    )


def integer_output_received(mark):
    """What backward receives for TopK's integer output on this torch, and
    whether that output requires grad: measured here, not assumed."""
    seen = {}

    class TopK(TopKUnmarked):
        @staticmethod
        def forward(ctx, x):
            values, indices = TopKUnmarked.forward(ctx, x)
            if mark:
                ctx.mark_non_differentiable(indices)
            return values, indices

        @staticmethod
        def backward(ctx, g, g_indices):
            seen["g"] = g_indices
            return TopKUnmarked.backward(ctx, g, g_indices)

    values, indices = TopK.apply(sample(5))
    values.sum().backward()
    g = seen["g"]
    return indices.requires_grad, None if g is None else (g.dtype, tuple(g.shape), bool(g.any()))


def test_unmarked_integer_output_is_reported_as_this_torch_treats_it():
    # Integer outputs are never differentiable; marking them changes nothing
    # on the supported releases. The report must say what this torch does.
    unmarked, marked = integer_output_received(False), integer_output_received(True)
    assert unmarked == marked == (False, (torch.int64, (2,), False))
    report = check_function(TopKUnmarked, sample(5))
    (result,) = report.results_for("mark_non_differentiable")
    assert (result.status, result.subject) == ("passed", "output 1")
    assert "output 1 (int64, not marked) does not require grad" in result.detail
    assert "backward received a zero int64 tensor of shape [2] for it" in result.detail
    assert f"on torch {torch.__version__} marking one changes nothing" in result.detail
    assert "materialized" not in result.detail


def test_wrong_gradient_is_caught_by_finite_differences():
    expect_violation(
        WrongSigmoid,
        sample(5),
        rule="gradcheck",
        subject="input 0 (x), output 0",
        says=["Jacobian mismatch for output 0 with respect to input 0"],
    )


def test_non_differentiable_backward_without_once_differentiable_is_caught():
    report = expect_violation(
        DetachedBackward,
        sample(4),
        rule="gradgradcheck",
        says=["once_differentiable"],
    )
    # Double backward is also differentiated with respect to the incoming
    # gradient; a mismatch there names it (the previous checker raised
    # IndexError looking for an input with that index).
    assert [f.subject for f in failures(report, "gradgradcheck")] == [
        "gradient of input 0 (x), with respect to input 0 (x)",
        "gradient of input 0 (x), with respect to the gradient of output 0",
    ]


def test_boxed_function_that_keeps_its_grads_is_caught():
    report = expect_violation(
        BoxedKeepsGrads,
        sample(3),
        rule="boxed_grads.released",
        subject="output 0",
        says=["still referenced when backward returns", "not released"],
    )
    assert [r.subject for r in failures(report, "boxed_grads.released")] == ["output 0", "output 1"]


def test_invalid_declared_gradient_dtype_is_caught():
    # torch_ctxext rejects it when apply returns (forward fails); native torch
    # accepts it (deviation 1) and the checker's own validation reports it.
    with pytest.raises(ContractViolation) as info:
        check_function(corpus.dtypes.DeclaresIntegerGradDtype, sample(3))
    report = info.value.report
    failure = (failures(report, "forward") + failures(report, "set_output_grad_dtype.valid"))[0]
    assert "cannot carry a gradient" in str(failure)
    assert failure.fix


def test_report_can_be_returned_instead_of_raised():
    report = check_function(WrongSigmoid, sample(5), raise_on_failure=False)
    assert not report.passed
    assert [r.name for r in report.failures] == ["gradcheck"]


def test_unknown_option_and_non_function_are_refused():
    with pytest.raises(TypeError, match="unknown options"):
        check_function(Exp, sample(3), tolerance=1)
    with pytest.raises(TypeError, match="torch.autograd.Function subclass"):
        check_function(torch.exp, sample(3))


def test_checker_restores_what_it_patched():
    from torch.autograd.function import FunctionCtx

    before = {n: FunctionCtx.__dict__.get(n) for n in (
        "input_grad_buffers", "mark_dirty", "mark_non_differentiable", "set_output_grad_dtype",
        "save_for_forward", "save_for_backward")}
    apply_boxed = BoxedKeepsGrads._backward_cls.__dict__.get("apply_boxed")
    rng = torch.get_rng_state()
    check_function(BoxedKeepsGrads, sample(3), raise_on_failure=False)
    check_function(Trig, sample(3, dtype=torch.float16), gradcheck=False)
    after = {n: FunctionCtx.__dict__.get(n) for n in before}
    assert after == before
    assert torch.equal(torch.get_rng_state(), rng)  # every run's seeding is undone
    assert BoxedKeepsGrads._backward_cls.__dict__.get("apply_boxed") is apply_boxed
    assert "apply" not in Trig._backward_cls.__dict__


# --- backward as the engine runs it, inputs changed in place, outputs ------------


def test_once_only_backward_is_noted_and_its_gradients_still_checked():
    # Scales its saved gradient in place: a second backward silently differs.
    ce = check_function(corpus.memory.FusedCrossEntropy, sample(4, 5), torch.tensor([1, 0, 4, 2]))
    (note,) = ce.notes
    assert note.name == "backward.repeatable" and ce.passed
    assert "can run only once per graph" in note.detail
    assert "gives other gradients, without an error" in note.detail
    assert "fresh forward for every backward" in note.detail
    assert ce.results_for("gradcheck")[0].status == "passed"
    # Deletes its state: a second backward raises.
    x, w = sample(3, 4), sample(4, 2, seed=1)
    (note,) = check_function(corpus.memory.FreesWorkspace, x, w).notes
    assert "raises AttributeError" in note.detail
    # A wrong gradient is still caught, naming the input.
    report = expect_violation(corpus.memory.FreesWorkspaceWrongGradient, x, w, rule="gradcheck",
                              subject="input 0 (x), output 0", says=["Jacobian mismatch"])
    assert [n.name for n in report.notes] == ["backward.repeatable"]


class AddInto(torch.autograd.Function):
    """out += 2 * x, in place, into a buffer that does not require grad."""

    @staticmethod
    def forward(ctx, out, x):
        out.add_(x, alpha=2)
        ctx.mark_dirty(out)
        return out

    @staticmethod
    def backward(ctx, g):
        return None, 2 * g


class AddIntoWrongScale(AddInto):
    @staticmethod
    def backward(ctx, g):
        return None, 3 * g


def test_an_out_buffer_changed_in_place_gets_a_fresh_copy_per_run():
    out = torch.zeros(4)
    report = check_function(AddInto, out, sample(4))
    assert report.passed, str(report)
    assert not out.any()  # the sample itself is never changed
    expect_violation(AddIntoWrongScale, torch.zeros(4), sample(4), rule="gradcheck",
                     subject="input 1 (x), output 0")  # x, not the buffer


def test_no_differentiable_output_skips_the_gradient_checks_with_the_reason():
    report = check_function(corpus.indexing.Histogram, sample(12), 4)
    assert report.passed
    for name in ("gradcheck", "gradgradcheck"):
        (result,) = report.results_for(name)
        assert result.status == "skipped"
        assert "no output requires grad" in result.detail
        assert "once_differentiable" not in result.detail


def test_backward_that_changes_its_incoming_gradient_in_place_is_caught():
    report = expect_violation(
        corpus.estimators.GradientReversalInPlace, sample(2, 5), 0.7,
        rule="backward.grad_outputs_unchanged", subject="output 0",
        says=["changed the gradient it received for output 0 in place", "instead of changing"],
        reference=corpus.estimators.gradient_reversal_reference,
    )
    assert report.results_for("gradcheck")[0].status == "passed"


def test_declared_float64_gradient_for_a_float32_output_is_checked_in_its_own_dtypes():
    # It made the previous checker raise IndexError.
    x, w = sample(3, 4), sample(4, 2, seed=1)
    report = check_function(corpus.dtypes.Float64Backward, x, w, raise_on_failure=False)
    assert not report.errors
    assert report.precision == (
        "the sample's dtypes (float32): forward declares gradient dtypes "
        "(set_output_grad_dtype), which float64 copies would change")
    if NATIVE_DTYPES:  # upstream deviation 2: zeros arrive as float32 and g @ w.double() fails
        assert [f.name for f in report.failures] == ["gradcheck"]
        assert "deviation 2" in report.failures[0].detail
    else:
        assert report.passed, str(report)
        assert report.results_for("set_output_grad_dtype.honoured")[0].detail == (
            "backward received (float64)")


def test_a_function_fixing_its_own_dtypes_is_not_checked_in_float64_copies():
    class Float32Compute(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.float() * 3

        @staticmethod
        def backward(ctx, g):
            return (g * 3).float()

    report = check_function(Float32Compute, sample(5, dtype=torch.float64))
    assert report.precision == "the sample's dtypes (float64)"
    report = check_function(Float32Compute, sample(5))
    assert report.precision.startswith("the sample's dtypes (float32): the Function fixes its")
    assert "backward returns a float32 gradient for input 0 (x)" in report.precision


# --- forward mode and vmap -------------------------------------------------------


def test_jvp_is_checked_against_finite_differences_and_backward():
    x, y = sample(2, 3), sample(2, 3, seed=1)
    report = check_function(corpus.forward_mode.Mul, x, y)
    assert [(r.name, r.status) for r in report.results_for("jvp")] == [
        ("jvp.save_for_forward", "passed"),
        ("jvp.finite_differences", "passed"),
        ("jvp.matches_backward", "passed"),
    ]
    report = expect_violation(corpus.forward_mode.MulJvpDropsTerm, x, y,
                              rule="jvp.finite_differences", subject="input 1 (y), output 0",
                              says=["differs from finite differences", "product rule"])
    assert {f.name for f in report.failures} == {"jvp.finite_differences", "jvp.matches_backward"}


def test_jvp_reading_tensors_saved_for_backward_only_is_caught():
    expect_violation(corpus.forward_mode.ExpSavedForBackwardOnly, sample(4),
                     rule="jvp.save_for_forward",
                     says=["save_for_backward only", "ctx.save_for_forward(...)"])


def test_function_without_jvp_says_forward_mode_is_not_checked():
    (result,) = check_function(Exp, sample(3)).results_for("jvp")
    assert (result.status, result.detail) == (
        "skipped", "the Function defines no jvp: forward-mode AD is not available for it")


def test_vmap_rule_is_checked_batched_and_per_sample():
    (result,) = check_function(corpus.numpy_functions.NumpySort, sample(2, 4), 1).results_for("vmap")
    assert result.status == "passed"
    assert result.detail.startswith("staticmethod; outputs and per-sample gradients match")
    expect_violation(corpus.numpy_functions.NumpySortVmapForgetsBatchDim, sample(2, 4), 1,
                     rule="vmap.matches_loop", says=["differs from the loop over the batch"])


def test_an_in_place_function_batched_by_its_vmap_rule_gets_fresh_inputs_for_every_run():
    """A correct Function that changes its input in place (mark_dirty) and
    whose vmap staticmethod applies it to the batched input: the batched run
    and the per-sample loop each get their own copy (sharing one, the loop
    scaled what the batched run had already scaled)."""
    case = next(c for c in corpus.CASES if c.id == "frozen_batch_norm_in_place_with_vmap_rule")
    (result,) = check_function(case.function, *case.args()).results_for("vmap")
    assert result.status == "passed", result.detail
    assert "outputs and per-sample gradients match a loop over the batch" in result.detail


def test_vmap_rule_on_a_forward_that_takes_ctx_is_caught():
    class OldStyleWithGeneratedVmap(Exp):
        generate_vmap_rule = True

    expect_violation(OldStyleWithGeneratedVmap, sample(3), rule="vmap.matches_loop",
                     says=["forward takes ctx", "setup_context"])


# --- the pytest fixture ------------------------------------------------------------


def test_ctx_contract_fixture_is_one_line(ctx_contract):
    report = ctx_contract(Matmul, sample(4, 3), sample(3, 2, seed=1))
    assert report.passed
    with pytest.raises(AssertionError, match="counts this Function's contribution twice"):
        ctx_contract(DoubleCount, sample(4, 3), sample(3, 2, seed=1))


def test_plugin_provides_the_fixture_to_a_user_test_suite(tmp_path, capsys):
    (tmp_path / "test_ctx_contract_user.py").write_text(textwrap.dedent(
        """
        import torch
        import torch_ctxext  # noqa: F401

        class Square(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                ctx.save_for_backward(x)
                return x * x

            @staticmethod
            def backward(ctx, g):
                (x,) = ctx.saved_tensors
                return 2 * x * g

        class BadSquare(Square):
            @staticmethod
            def backward(ctx, g):
                (x,) = ctx.saved_tensors
                return x * g

        def test_square(ctx_contract):
            ctx_contract(Square, torch.randn(3, requires_grad=True))

        def test_bad_square(ctx_contract):
            ctx_contract(BadSquare, torch.randn(3, requires_grad=True))
        """
    ))
    registered = any(
        ep.value == "torch_ctxext_pytest"
        for ep in importlib.metadata.entry_points(group="pytest11")
    )
    plugin = [] if registered else ["-p", "torch_ctxext_pytest"]
    # In process (no second torch import): a fresh pytest session on the file.
    code = pytest.main(
        ["-q", "-p", "no:cacheprovider", "-o", "addopts=", *plugin,
         "--rootdir", str(tmp_path), str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert code == pytest.ExitCode.TESTS_FAILED, out
    assert "1 failed, 1 passed" in out, out
    assert "FAIL  gradcheck" in out and "fix:" in out, out
