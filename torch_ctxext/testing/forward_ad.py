"""Rules of forward mode (``Function.jvp``, run by ``ctx.apply_jvp`` under
``torch.autograd.forward_ad``), for a Function that defines ``jvp``:
what jvp reads was saved with ``ctx.save_for_forward``, its tangents are
the derivative (finite differences, or the reference's forward-mode
tangents where you stated the intended gradient), and it is the same
linear map as backward."""
import functools
import warnings

import torch
import torch.autograd.forward_ad as fwAD

from . import _compare as compare
from . import _jacobian as jac
from ._common import error_text
from ._core import FunctionProblem, choose_mode, problem_tolerances, reference_problem
from ._function_info import defines_jvp
from ._options import reference_name
from ._subject import BudgetSpent
from .report import FAILED, PASSED, SKIPPED, register

RULES = register({
    "jvp.save_for_forward": (
        "the tensors jvp reads from ctx.saved_tensors were saved with ctx.save_for_forward "
        "(ctx.save_for_backward alone leaves them out of jvp's reach)"
    ),
    "jvp.finite_differences": (
        "jvp's output tangents match finite differences of forward, or the reference's "
        "forward-mode tangents where one is given as the intended gradient"
    ),
    "jvp.matches_backward": (
        "jvp and backward are the same linear map: u . jvp(v) equals backward(u) . v"
    ),
})


@functools.lru_cache(maxsize=None)
def _warm_up():
    """torch loads its forward-AD decompositions on the first operation on a
    dual tensor in a process, which takes seconds; done once, outside the
    time budget, so that the first Function checked is not short-changed."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with fwAD.dual_level():
            fwAD.make_dual(torch.zeros(1), torch.zeros(1)) * 2


def _skip_all(report, why):
    for name in RULES:
        report.add(name, SKIPPED, why)


def check(subject, report):
    opts = subject.options
    if not defines_jvp(subject.fn):
        report.add("jvp.finite_differences", SKIPPED,
                   "the Function defines no jvp: forward-mode AD is not available for it")
        return
    if not opts.on("forward_ad"):
        _skip_all(report, opts.off_reason("forward_ad"))
        return
    if not subject.grad_positions or not subject.differentiable_outputs:
        _skip_all(report, "no differentiable input or output")
        return
    if subject.budget.spent():
        _skip_all(report, subject.budget.skip_reason())
        return
    with subject.budget.paused():
        _warm_up()
    problem = FunctionProblem(subject)
    try:
        problem.values()
        problem.jvp([jac.unflat(torch.ones(jac.real_numel(x), dtype=torch.float64), x)
                     for x in problem.inputs])
    except jac.EvaluationError as error:
        _report_jvp_raised(subject, report, error)
        return
    if subject.saved_for_forward:
        report.add("jvp.save_for_forward", PASSED,
                   "forward saves the tensors for jvp with ctx.save_for_forward")
    else:
        report.add("jvp.save_for_forward", PASSED,
                   "forward calls no ctx.save_for_forward and jvp needs no saved tensor")
    try:
        _tangents(subject, report, problem)
    except BudgetSpent:
        report.add("jvp.finite_differences", SKIPPED, subject.budget.skip_reason())
    try:
        _against_backward(subject, report, problem)
    except BudgetSpent:
        report.add("jvp.matches_backward", SKIPPED, subject.budget.skip_reason())


def _report_jvp_raised(subject, report, error):
    if not subject.saved_for_forward and subject.saved_for_backward:
        report.add(
            "jvp.save_for_forward", FAILED,
            f"jvp raised {error_text(error.exc)}\nforward saved tensors with "
            "ctx.save_for_backward only; in jvp, ctx.saved_tensors holds what "
            "ctx.save_for_forward saved (nothing here)",
            fix="call ctx.save_for_forward(...) in forward (or setup_context) with the "
            "tensors jvp reads, besides ctx.save_for_backward for backward",
            exception=error.exc,
        )
        report.add("jvp.finite_differences", SKIPPED, "jvp does not run")
        report.add("jvp.matches_backward", SKIPPED, "jvp does not run")
        return
    report.add("jvp.save_for_forward", PASSED if subject.saved_for_forward else SKIPPED,
               "forward saves tensors with ctx.save_for_forward" if subject.saved_for_forward
               else "forward calls no ctx.save_for_forward")
    fix = ("jvp(ctx, *tangents) receives one tangent per forward input (zeros for an "
           "input without one) and returns one per output (None for a non-tensor output)")
    if "forward grad to be floating point" in str(error.exc):
        fix = ("return a tensor (torch.zeros_like(output) where the tangent is zero), not None, "
               "for a floating point output: torch fails on None there (docs/apply_jvp.md, "
               "caveat)")
    report.add("jvp.finite_differences", FAILED,
               f"{error.stage} raised: {error_text(error.exc)}", fix=fix, exception=error.exc)
    report.add("jvp.matches_backward", SKIPPED, "jvp does not run")


def _tangents(subject, report, problem):
    opts = subject.options
    if opts.reference is not None:
        reference = reference_problem(subject)
        _, atol, rtol = problem_tolerances("rounding", subject, problem)
        try:
            mismatches = compare.reference_jvp_check(
                problem, reference, atol, rtol, subject.budget, opts.seed + 23
            )
        except jac.EvaluationError as error:
            report.add("jvp.finite_differences", SKIPPED,
                       f"{error.stage} raised: {error_text(error.exc)}")
            return
        against = f"the forward-mode tangents of {reference_name(opts.reference)}"
        mode = "against the reference"
    else:
        slow, mode = choose_mode(subject, problem, "jvp")
        eps, atol, rtol = problem_tolerances("finite_differences", subject, problem)
        try:
            mismatches = compare.jvp_check(
                problem, eps, atol, rtol, subject.budget, opts.seed + 29, slow
            )
        except jac.EvaluationError as error:
            report.add("jvp.finite_differences", FAILED,
                       f"{error.stage} raised: {error_text(error.exc)}", fix="see the error",
                       exception=error.exc)
            return
        against = "finite differences"
        mode = mode.split(" ")[0] + " mode"
    for m in mismatches:
        i = subject.grad_positions[m.input]
        k = subject.differentiable_outputs[m.output]
        report.add(
            "jvp.finite_differences", FAILED,
            f"the tangent of output {k} for a tangent of {subject.name_of(i)} differs from "
            f"{against}: {m.text}",
            subject=f"{subject.name_of(i)}, output {k}",
            fix="jvp must return, for each output, the sum over inputs of (Jacobian of the "
            "output with respect to the input) times the input's tangent: check each term "
            "(the product rule gives one per input)",
        )
    if not mismatches:
        report.add("jvp.finite_differences", PASSED, f"tangents match {against} ({mode})")


def _against_backward(subject, report, problem):
    _, atol, rtol = problem_tolerances("finite_differences", subject, problem)
    try:
        mismatches = compare.jvp_vs_vjp_check(
            problem, atol, rtol, subject.budget, subject.options.seed + 31
        )
    except jac.EvaluationError as error:
        report.add("jvp.matches_backward", SKIPPED,
                   f"{error.stage} raised (see gradcheck): {error_text(error.exc)}")
        return
    for m in mismatches:
        i = subject.grad_positions[m.input]
        k = subject.differentiable_outputs[m.output]
        report.add(
            "jvp.matches_backward", FAILED,
            f"output {k} and {subject.name_of(i)}: {m.text}",
            subject=f"{subject.name_of(i)}, output {k}",
            fix="forward mode (jvp) and reverse mode (backward) must compute the same "
            "derivative; the one that disagrees with finite differences (or the reference) "
            "is wrong",
        )
    if not mismatches:
        report.add("jvp.matches_backward", PASSED, "u . jvp(v) equals backward(u) . v")
