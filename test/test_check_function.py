"""torch_ctxext.testing.check_function and the ctx_contract pytest fixture.

Correct Functions pass; realistically broken ones are caught, each with a
message naming the rule, the input or output concerned and the fix.
"""
import importlib.metadata
import textwrap

import pytest
import torch
from torch.autograd.function import once_differentiable

import torch_ctxext
from torch_ctxext.pytest_plugin import ctx_contract  # noqa: F401  (the fixture)
from torch_ctxext.testing import ContractViolation, check_function

NATIVE_DTYPES = torch_ctxext.features()["set_output_grad_dtype"] == "native"


def sample(*shape, dtype=torch.float32, seed=0, requires_grad=True):
    gen = torch.Generator().manual_seed(seed)
    t = torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1
    return t.to(dtype).requires_grad_(requires_grad)


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


class HalfMatmul(torch.autograd.Function):
    """The mixed-precision example of docs/set_output_grad_dtype.md."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        ctx.set_output_grad_dtype(torch.float32)
        return x.half() @ w.half()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w.t(), x.t() @ g


class Exp(torch.autograd.Function):
    """torch's own docstring example; twice differentiable."""

    @staticmethod
    def forward(ctx, i):
        result = i.exp()
        ctx.save_for_backward(result)
        return result

    @staticmethod
    def backward(ctx, grad_output):
        (result,) = ctx.saved_tensors
        return grad_output * result


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
    x, w = sample(4, 8), sample(8, 2, seed=1)
    if NATIVE_DTYPES:
        # Upstream deviation 2: a materialized zero gradient arrives as float16,
        # and this backward (g @ w.t() with float32 w) then fails.
        report = expect_violation(
            HalfMatmul, x, w, rule="gradcheck", says=["undefined output grads", "deviation 2"]
        )
    else:
        report = check_function(HalfMatmul, x, w)
        assert report.passed
        assert "sample's dtypes" in report.precision  # float64 copies cannot run it
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
    assert report.precision == "checked in float64"


def test_dirty_input_is_recorded_and_its_buffer_check_skipped():
    report = check_function(MulAdd_, sample(4), sample(4, seed=1))
    assert report.results_for("mark_dirty")[0].detail == "inputs changed in place: [0]"

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


class DeclaresIntegerGradDtype(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.set_output_grad_dtype(torch.int64)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


def test_fused_path_that_double_counts_is_caught():
    expect_violation(
        DoubleCount,
        sample(4, 3),
        sample(3, 2, seed=1),
        rule="input_grad_buffers.fused_matches_fallback",
        subject="input 0 (x)",
        says=["counts this Function's contribution twice", "return None for an input"],
    )


def test_fused_path_that_overwrites_the_buffer_is_caught():
    expect_violation(
        OverwritesBuffer,
        sample(4, 3),
        sample(3, 2, seed=1),
        rule="input_grad_buffers.fused_matches_fallback",
        subject="input 0 (x)",
        says=["overwrote the buffer", "never copy_"],
    )


def test_fused_path_that_accumulates_into_a_copy_is_caught():
    expect_violation(
        AccumulatesIntoACopy,
        sample(4, 3),
        sample(3, 2, seed=1),
        rule="input_grad_buffers.fused_matches_fallback",
        subject="input 0 (x)",
        says=["lost this Function's contribution", "in place"],
    )


def test_buffer_kept_on_ctx_is_caught():
    expect_violation(
        KeepsBufferOnCtx,
        sample(4, 3),
        sample(3, 2, seed=1),
        rule="input_grad_buffers.not_retained",
        subject="input 0 (x)",
        says=["still alive after backward returned", "on ctx"],
    )


def test_buffer_kept_in_a_global_is_caught():
    try:
        expect_violation(
            KeepsBufferGlobally,
            sample(4, 3),
            sample(3, 2, seed=1),
            rule="input_grad_buffers.not_retained",
            subject="input 0 (x)",
            says=["in a global"],
        )
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


def test_integer_output_not_marked_non_differentiable_is_caught():
    expect_violation(
        TopKUnmarked,
        sample(5),
        rule="mark_non_differentiable",
        subject="output 1",
        says=["torch.int64", "ctx.mark_non_differentiable"],
    )


def test_wrong_gradient_is_caught_by_finite_differences():
    expect_violation(
        WrongSigmoid,
        sample(5),
        rule="gradcheck",
        subject="input 0 (x), output 0",
        says=["Jacobian mismatch for output 0 with respect to input 0"],
    )


def test_non_differentiable_backward_without_once_differentiable_is_caught():
    expect_violation(
        DetachedBackward,
        sample(4),
        rule="gradgradcheck",
        says=["once_differentiable"],
    )


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
        check_function(DeclaresIntegerGradDtype, sample(3))
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
        "input_grad_buffers", "mark_dirty", "mark_non_differentiable", "set_output_grad_dtype")}
    apply_boxed = BoxedKeepsGrads._backward_cls.__dict__.get("apply_boxed")
    check_function(BoxedKeepsGrads, sample(3), raise_on_failure=False)
    check_function(Trig, sample(3, dtype=torch.float16), gradcheck=False)
    after = {n: FunctionCtx.__dict__.get(n) for n in before}
    assert after == before
    assert BoxedKeepsGrads._backward_cls.__dict__.get("apply_boxed") is apply_boxed
    assert "apply" not in Trig._backward_cls.__dict__


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
