"""check_function's options and what its report says about how it checked:
the intended gradient (reference=) and every opt-out with its reason, the
gradcheck mode chosen by size, the time budget, and a checker that only
ever reports."""
import warnings

import check_corpus as corpus
import pytest
import torch

from torch_ctxext.testing import _runner, check_function
from torch_ctxext.testing._options import DEFAULT_TIME_BUDGET

# torch's docstring example, and a sigmoid whose backward forgets (1 - y).
from test_check_function import Exp, WrongSigmoid  # noqa: E402

sample = corpus.sample
STE_REASON = "straight-through estimator: round's gradient is taken as 1"


# --- the intended gradient and opt-outs --------------------------------------------


def test_straight_through_estimator_passes_against_its_stated_gradient():
    report = check_function(corpus.estimators.RoundSTE, sample(3, 4, scale=2.0),
                            reference=corpus.estimators.round_ste_reference, reason=STE_REASON)
    assert report.passed
    assert report.results_for("reference.matches_forward")[0].status == "passed"
    (gradcheck,) = report.results_for("gradcheck")
    assert gradcheck.detail.startswith(
        f'backward gives the gradients of the reference round_ste_reference, the intended '
        f'gradient ("{STE_REASON}")')
    assert report.gradient_mode == "against the reference round_ste_reference (no finite differences)"
    # Everything else is still checked.
    assert report.results_for("gradgradcheck")[0].status == "passed"
    assert report.results_for("backward.repeatable")[0].status == "passed"
    text = str(report)
    assert (f"opted out: reference: gradients are compared with those of the reference "
            f'round_ste_reference instead of finite differences ("{STE_REASON}")') in text


def test_straight_through_estimator_without_a_stated_gradient_says_how_to_state_it():
    report = check_function(corpus.estimators.RoundSTE, sample(3, 4, scale=2.0),
                            raise_on_failure=False)
    (failure,) = report.failures
    assert failure.name == "gradcheck" and "reference=fn, reason=" in failure.fix


def test_a_reference_that_computes_other_values_is_reported():
    report = check_function(corpus.estimators.RoundSTE, sample(3, 4, scale=2.0),
                            reference=lambda x: x * 1.0, raise_on_failure=False)
    assert [f.name for f in report.failures] == ["reference.matches_forward"]
    assert "the reference must compute the same values as forward" in report.failures[0].fix
    assert report.results_for("gradcheck")[0].status == "skipped"
    assert "opted out: reference: gradients are compared with those of the reference instead " \
           "of finite differences (no reason given)" in str(report)


def test_every_opt_out_shows_with_its_reason():
    report = check_function(
        corpus.forward_mode.Mul, sample(2, 3), sample(2, 3, seed=1),
        gradcheck="checked in our own test suite", double_backward=False,
        forward_ad="forward mode is not used", vmap="never batched",
    )
    assert [str(o) for o in report.opt_outs] == [
        "gradcheck: backward's gradients are not compared with finite differences "
        '("checked in our own test suite")',
        "double_backward: double backward is not checked (no reason given)",
        'forward_ad: jvp is not checked ("forward mode is not used")',
        'vmap: the vmap rule is not checked ("never batched")',
    ]
    assert report.results_for("gradcheck")[0].detail == (
        'disabled by you: "checked in our own test suite"')
    assert {r.detail for r in report.results_for("jvp")} == {
        'disabled by you: "forward mode is not used"'}
    assert report.results_for("vmap")[0].detail == 'disabled by you: "never batched"'
    text = str(report)
    assert text.count("opted out: ") == 4


@pytest.mark.parametrize("options, message", [
    (dict(reason="why"), "goes with reference="),
    (dict(gradcheck=""), "a reason"),
    (dict(gradcheck=1), "a reason"),
    (dict(reference="not callable"), "callable"),
    (dict(fast_mode="sometimes"), "fast_mode="),
    (dict(time_budget=0), "time_budget="),
    (dict(atol=-1), "atol="),
    (dict(tolerance=1), "unknown options"),
])
def test_options_it_cannot_use_are_refused(options, message):
    with pytest.raises(TypeError, match=message):
        check_function(Exp, sample(3), **options)


# --- sample arguments it cannot check with ----------------------------------------


class Scale(torch.autograd.Function):
    """y = x * w; w may be a tensor or a number, and need not require grad."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(w if isinstance(w, torch.Tensor) else None)
        ctx.w = w
        return x * w

    @staticmethod
    def backward(ctx, g):
        return g * ctx.w, None


@pytest.mark.parametrize("args", [
    (torch.randn(3), torch.randn(3)),                      # floating, without requires_grad
    (torch.randn(3, dtype=torch.float64), 2.0),
    (torch.arange(3), torch.arange(3)),                    # integer tensors cannot require grad
    (torch.randn(3).requires_grad_().detach(), 2.0),       # a detached copy
], ids=["float", "float64-and-number", "integer", "detached"])
def test_inputs_of_which_none_requires_grad_are_refused(args):
    """gradcheck's rule: without an input that requires grad backward never
    runs, and every gradient rule would be skipped (the Function used to
    pass, "3 passed, 0 failed", unchecked). Bad input: a ValueError before
    anything runs, saying what is wrong and what to pass, whatever
    raise_on_failure says."""
    for raise_on_failure in (True, False):
        with pytest.raises(ValueError) as info:
            check_function(Scale, *args, raise_on_failure=raise_on_failure)
        message = str(info.value)
        assert message.startswith("check_function(Scale): none of the sample arguments is a "
                                  "tensor that requires grad"), message
        assert "torch.autograd.gradcheck refuses such inputs too" in message
        assert "requires_grad=True" in message


def test_a_tensor_that_requires_grad_inside_a_list_is_named_and_refused():
    """apply does not see tensors inside a list: no gradient reaches them.
    The message names the argument and says to pass them separately."""

    class Sum(torch.autograd.Function):
        @staticmethod
        def forward(ctx, xs):
            return sum(x.detach() for x in xs)

        @staticmethod
        def backward(ctx, g):
            return None

    with pytest.raises(ValueError) as info:
        check_function(Sum, [sample(3), sample(3, seed=1)])
    message = str(info.value)
    assert "input 0 (xs) holds tensors that require grad inside a list, tuple or dict" in message
    assert "as separate arguments" in message


@pytest.mark.parametrize("args", [
    (sample(3), torch.randn(3)),            # w does not require grad
    (sample(3), 2.0),                       # w is a number
    (sample(3), torch.arange(1, 4)),        # w is an integer tensor
], ids=["float", "number", "integer"])
def test_inputs_that_require_grad_only_in_part_are_checked(args):
    """One input that requires grad is enough; the gradients checked are
    those of the inputs that require grad."""
    report = check_function(Scale, *args)
    (gradcheck,) = report.results_for("gradcheck")
    assert gradcheck.status == "passed", str(report)
    assert "2 x 3 forwards" in report.gradient_mode  # x only: 3 elements


# --- mode, budget, report ------------------------------------------------------------


def test_small_samples_get_exact_jacobians():
    report = check_function(Exp, sample(5))
    assert report.gradient_mode == "slow (exact Jacobians: 2 x 5 forwards + 5 backwards = 15 runs)"
    assert report.results_for("gradcheck")[0].detail.startswith("slow mode")


def test_moderate_samples_get_random_projections_and_stay_fast():
    case = next(c for c in corpus.CASES if c.id == "zero3_linear_moderate_size")
    report = check_function(case.function, *case.args())
    assert report.gradient_mode == (
        "fast (random projections): exact Jacobians of backward would take 2 x 3136 forwards "
        "+ 2048 backwards = 8320 runs, more than 256")
    assert report.results_for("gradcheck")[0].detail.startswith("fast mode")
    assert report.seconds < DEFAULT_TIME_BUDGET


def test_fast_mode_on_request_still_catches_a_wrong_gradient():
    report = check_function(WrongSigmoid, sample(5), fast_mode=True, raise_on_failure=False)
    assert report.gradient_mode == "fast (fast_mode=True, your choice)"
    assert [f.name for f in report.failures] == ["gradcheck"]
    assert "along random directions" in report.failures[0].detail


def test_checks_that_do_not_fit_the_time_budget_are_skipped_saying_so():
    report = check_function(Exp, sample(5), time_budget=1e-9)
    assert report.passed and report.results_for("forward")[0].status == "passed"
    skipped = [r for r in report.results if "time budget of 1e-09 s was spent" in r.detail]
    assert {r.name for r in skipped} >= {"gradcheck", "backward.repeatable"}
    assert str(report).splitlines()[0].endswith("(budget 1e-09 s)")


def test_report_header_counts_notes_and_gives_the_time():
    report = check_function(corpus.memory.FreesWorkspace, sample(3, 4), sample(4, 2, seed=1))
    head, info, precision, mode = str(report).splitlines()[:4]
    assert head.startswith("check_function(FreesWorkspace): 6 passed, 0 failed, 4 skipped, "
                           "1 noted in ")
    assert head.endswith(f" s (budget {DEFAULT_TIME_BUDGET:g} s)")
    assert info.startswith(f"  torch {torch.__version__}; input_grad_buffers: ")
    assert precision == "  precision: float64 copies of the sample"
    assert mode.startswith("  gradcheck mode: slow (exact Jacobians")
    assert "  NOTE  backward.repeatable\n        found: backward can run only once" in str(report)


def test_complex_functions_are_checked_through_their_real_view():
    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, z):
            ctx.save_for_backward(z)
            return z * z

        @staticmethod
        def backward(ctx, g):
            (z,) = ctx.saved_tensors
            return g * (2 * z).conj()

    class SquareWithoutConj(Square):
        @staticmethod
        def backward(ctx, g):
            (z,) = ctx.saved_tensors
            return g * 2 * z

    z = torch.randn(3, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))
    for fast in (False, True):
        assert check_function(Square, z.requires_grad_(), fast_mode=fast).passed
        report = check_function(SquareWithoutConj, z, fast_mode=fast, raise_on_failure=False)
        assert [f.name for f in report.failures] == ["gradcheck"]


# --- the checker only ever reports -------------------------------------------------------


def test_an_exception_of_the_checker_is_reported_as_an_error_not_raised(monkeypatch):
    def broken_family(subject, report):
        raise IndexError("list index out of range")

    monkeypatch.setattr(_runner, "FAMILIES", [(broken_family, "gradcheck")] + _runner.FAMILIES[1:])
    with pytest.warns(RuntimeWarning, match="internal error in test_check_function_options"):
        report = check_function(Exp, sample(3))  # errors do not fail the report
    (error,) = report.errors
    assert error.name == "gradcheck" and error.status == "error"
    assert "the checker itself raised" in error.detail and "IndexError" in error.detail
    assert "bug in torch_ctxext's checker, not in your Function" in error.fix
    assert "1 checker error(s)" in str(report).splitlines()[0]
    assert report.results_for("input_grad_buffers")  # the other families ran


def test_whatever_the_function_raises_the_checker_reports_it():
    class Raises(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            raise KeyError("state")

        @staticmethod
        def jvp(ctx, t):
            raise ZeroDivisionError

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        report = check_function(Raises, sample(3), raise_on_failure=False)
    assert not report.errors
    assert {f.name for f in report.failures} == {"gradcheck", "jvp.finite_differences"}
    assert "KeyError: 'state'" in report.results_for("gradcheck")[0].detail


# --- tolerances ----------------------------------------------------------------------


class FusedOffByRounding(torch.autograd.Function):
    """A fused path whose gradient is off by 1e-9: rounding at the default
    tolerances, a difference where the user asks for exactness."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (x_buffer,) = ctx.input_grad_buffers
        if x_buffer is not None:
            x_buffer.add_(g * 2 + 1e-9)
            return None
        return g * 2


@pytest.mark.skipif(not hasattr(torch.autograd.function.FunctionCtx, "input_grad_buffers"),
                    reason="no ctx.input_grad_buffers on this torch")
@pytest.mark.parametrize("tolerance", [
    {"atol": 0, "rtol": 0},
    {"atol": 0, "rtol": 1e-12},
    {"atol": 1e-12, "rtol": 0},
])
def test_a_zero_atol_or_rtol_of_the_user_is_honoured_by_the_input_grad_buffers_rules(tolerance):
    x = sample(4, dtype=torch.float64)
    default = check_function(FusedOffByRounding, x, gradcheck="only the buffers are checked")
    (fused,) = default.results_for("input_grad_buffers.fused_matches_fallback")
    assert fused.status == "passed"

    report = check_function(FusedOffByRounding, x, gradcheck="only the buffers are checked",
                            raise_on_failure=False, **tolerance)
    assert [f.name for f in report.failures] == ["input_grad_buffers.fused_matches_fallback"]
    assert "max abs difference 1e-09" in report.failures[0].detail
