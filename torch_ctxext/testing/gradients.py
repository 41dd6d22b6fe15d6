"""Rules of the gradients: backward against finite differences (or against
the reference you state as the intended gradient), and double backward.

Every backward has its own forward on fresh copies of the sample (see
_jacobian.py), so a backward that can run only once per graph, or a
forward that changes an ``out`` buffer in place, is checked as it is.
The mode is chosen by size unless you choose it (``fast_mode=``): exact
Jacobians when they take at most ``_core.SLOW_LIMIT`` runs of the Function
and fit in a quarter of the time left, random projections otherwise.
"""
import torch

from . import _compare as compare
from . import _jacobian as jac
from ._common import error_text, same_values
from ._core import FunctionProblem, choose_mode, problem_tolerances, reference_problem
from ._function_info import is_once_differentiable
from ._options import reference_name
from ._subject import BudgetSpent
from .report import FAILED, PASSED, SKIPPED, register

RULES = register({
    "reference.matches_forward": (
        "the reference stated as the intended gradient computes the same outputs as forward"
    ),
    "gradcheck": (
        "backward's gradients match finite differences, or the reference's gradients "
        "where one is given as the intended gradient"
    ),
    "gradgradcheck": (
        "double backward matches finite differences of backward, or backward is "
        "@once_differentiable"
    ),
})

_FIX_FIRST_ORDER = (
    "backward must return, for each input, the gradient of the outputs with respect to "
    "that input (grad_output times the Jacobian): check the formula against the forward. "
    "If backward is deliberately not the derivative (straight-through estimator, "
    "gradient reversal or scaling), state the intended gradient: "
    "check_function(..., reference=fn, reason='why'), with fn computing the same outputs "
    "with plain torch operations whose gradient is the one you intend"
)
_FIX_RAISED = (
    "backward must run on the gradients the engine hands it and return one value per "
    "input of forward: a gradient of that input's shape, or None"
)
_FIX_REFERENCE = (
    "backward must return the gradients of the reference (the intended gradient you "
    "stated): check the formula, or the reference"
)
_FIX_DOUBLE = (
    "make backward differentiable (compute it with differentiable torch operations: no "
    ".detach(), .data, torch.no_grad() or numpy), or decorate it with "
    "@torch.autograd.function.once_differentiable so that double backward raises a clear "
    "error instead of giving wrong values"
)


def _names(subject, mismatch):
    i = subject.grad_positions[mismatch.input]
    k = subject.differentiable_outputs[mismatch.output] if mismatch.output is not None else None
    return i, k


def _report_mismatches(subject, report, mismatches, fix, head):
    """A gradcheck failure per mismatch, ``head(output, input)`` before its
    text."""
    for m in mismatches:
        i, k = _names(subject, m)
        out = f"output {k}" if k is not None else "all outputs"
        report.add("gradcheck", FAILED, f"{head(out, subject.name_of(i))}: {m.text}",
                   subject=f"{subject.name_of(i)}, {out}", fix=fix)


def _deviation_note(subject, report, error):
    """Upstream deviation 2 explains a backward that fails only when an
    output has no gradient, on a torch with native declared dtypes."""
    if (subject.declared is not None and ("only" in error.stage or "no gradient" in error.stage)
            and report.providers.get("set_output_grad_dtype") == "native"):
        return (
            "\nNote: on this torch an output without a gradient reaches backward as zeros "
            "in the output's dtype, not the declared one (upstream deviation 2, "
            "docs/deviations.md)"
        )
    return ""


def check(subject, report):
    opts = subject.options
    if not subject.grad_positions:
        for name in ("gradcheck", "gradgradcheck"):
            report.add(name, SKIPPED, "no floating point sample argument requires grad")
        return
    if not subject.differentiable_outputs:
        why = ("no output requires grad (every output is an integer or bool tensor, marked "
               "non-differentiable, or not a tensor): there is no gradient to check")
        for name in ("gradcheck", "gradgradcheck"):
            report.add(name, SKIPPED, why)
        return
    if not opts.on("gradcheck"):
        report.add("gradcheck", SKIPPED, opts.off_reason("gradcheck"))
        report.add("gradgradcheck", SKIPPED, "gradcheck is off: " + opts.off_reason("gradcheck"))
        return
    problem = FunctionProblem(subject)
    try:
        ok = _first_order(subject, report, problem)
    except BudgetSpent:
        report.add("gradcheck", SKIPPED, subject.budget.skip_reason())
        ok = None
    if ok is None:
        report.add("gradgradcheck", SKIPPED, "first-order gradients were not checked")
        return
    if not ok:
        report.add("gradgradcheck", SKIPPED, "the first-order check failed (see gradcheck)")
        return
    try:
        _second_order(subject, report, problem)
    except BudgetSpent:
        report.add("gradgradcheck", SKIPPED, subject.budget.skip_reason())


def _first_order(subject, report, problem):
    """True: gradients right; False: wrong (reported); None: not checked."""
    opts = subject.options
    try:
        first = problem.values()
        again = problem.values(stage="forward, run again")
    except jac.EvaluationError as error:
        report.add("gradcheck", FAILED, f"{error.stage} raised: {error_text(error.exc)}",
                   fix="see the error", exception=error.exc)
        return False
    if not all(a.shape == b.shape and same_values(a, b) for a, b in zip(first, again)):
        report.add(
            "gradcheck", SKIPPED,
            "forward gives different outputs for the same inputs, even with torch's random "
            "state reset before each run: it draws from another random source (numpy, "
            "random) or keeps state between calls. Finite differences cannot check it",
        )
        return None
    if opts.reference is not None:
        return _against_reference(subject, report, problem)
    slow, mode = choose_mode(subject, problem, "backward")
    report.gradient_mode = mode
    eps, atol, rtol = problem_tolerances("finite_differences", subject, problem)
    try:
        if slow:
            mismatches = compare.exact_vjp_check(problem, eps, atol, rtol, subject.budget)
        else:
            mismatches = compare.projected_vjp_check(
                problem, eps, atol, rtol, subject.budget, opts.seed + 11
            )
    except jac.EvaluationError as error:
        fix = _FIX_UNDEFINED if "only" in error.stage else _FIX_RAISED
        report.add("gradcheck", FAILED,
                   f"{error.stage} raised: {error_text(error.exc)}"
                   + _deviation_note(subject, report, error), fix=fix, exception=error.exc)
        return False
    _report_mismatches(subject, report, mismatches, _FIX_FIRST_ORDER,
                       lambda out, wrt: f"Jacobian mismatch for {out} with respect to {wrt}")
    if mismatches or not _undefined_gradients(subject, report, problem):
        return False
    report.add("gradcheck", PASSED,
               f"{mode.split(' ')[0]} mode, eps={eps:g}, atol={atol:g}, rtol={rtol:g}")
    return True


_FIX_UNDEFINED = (
    "make backward work when an output has no gradient: it arrives as a materialized zero "
    "tensor (or None with ctx.set_materialize_grads(False)), and the input gradients must "
    "then be zero or None; where its dtype matters, cast it yourself (g.to(dtype))"
)


def _undefined_gradients(subject, report, problem):
    """Backward when no output has a gradient (an output whose consumers all
    returned None): it must run and give zero or None (gradcheck's
    check_undefined_grad). False when it does not (reported)."""
    stage = "backward with no gradient for any output"
    try:
        grads = problem.undefined_vjp(stage)
    except jac.EvaluationError as error:
        report.add("gradcheck", FAILED, f"{error.stage} raised: {error_text(error.exc)}"
                   + _deviation_note(subject, report, error), fix=_FIX_UNDEFINED,
                   exception=error.exc)
        return False
    for g, i in zip(grads or (), subject.grad_positions):
        if g is not None and bool(g.ne(0).any()):
            report.add("gradcheck", FAILED,
                       f"{stage}: the gradient for {subject.name_of(i)} is not zero "
                       f"(max abs {float(g.abs().max()):.3g})",
                       subject=subject.name_of(i), fix=_FIX_UNDEFINED)
            return False
    return True


def _against_reference(subject, report, problem):
    opts = subject.options
    reference = reference_problem(subject)
    name = reference_name(opts.reference)
    _, atol, rtol = problem_tolerances("rounding", subject, problem)
    report.gradient_mode = f"against {name} (no finite differences)"
    try:
        mismatches = compare.reference_values_check(problem, reference, atol, rtol)
    except jac.EvaluationError as error:
        report.add("reference.matches_forward", FAILED,
                   f"{error.stage} raised: {error_text(error.exc)}",
                   fix="the reference takes the arguments of apply and returns what forward "
                   "returns (the same number of values, tensors where forward returns tensors)",
                   exception=error.exc)
        return None
    for m in mismatches:
        k = subject.differentiable_outputs[m.output]
        report.add("reference.matches_forward", FAILED, f"output {k}: {m.text}",
                   subject=f"output {k}",
                   fix="the reference must compute the same values as forward; only its "
                   "gradient may differ from the derivative (x + (f(x) - x).detach() has "
                   "the values of f(x) and the gradient of the identity)")
    if mismatches:
        report.add("gradcheck", SKIPPED, "the reference does not compute what forward does")
        return None
    report.add("reference.matches_forward", PASSED, f"{name} computes the same outputs")
    try:
        mismatches = compare.reference_vjp_check(
            problem, reference, atol, rtol, subject.budget, opts.seed + 13
        )
    except jac.EvaluationError as error:
        report.add("gradcheck", FAILED, f"{error.stage} raised: {error_text(error.exc)}",
                   fix="see the error", exception=error.exc)
        return False
    _report_mismatches(subject, report, mismatches, _FIX_REFERENCE,
                       lambda out, wrt: f"gradient of {out} with respect to {wrt} differs "
                       f"from the intended gradient ({name})")
    if mismatches or not _undefined_gradients(subject, report, problem):
        return False
    why = f' ("{opts.reason}")' if opts.reason else " (no reason given)"
    report.add("gradcheck", PASSED,
               f"backward gives the gradients of {name}, the intended gradient{why}; "
               f"atol={atol:g}, rtol={rtol:g}")
    return True


def _second_order(subject, report, first):
    opts = subject.options
    if not opts.on("double_backward"):
        report.add("gradgradcheck", SKIPPED, opts.off_reason("double_backward"))
        return
    if is_once_differentiable(subject.fn):
        report.add("gradgradcheck", SKIPPED, "backward is @once_differentiable")
        return
    gen = torch.Generator().manual_seed(opts.seed + 17)
    outs = first.outputs if first.outputs is not None else first.values()
    cotangents = [jac.unflat(torch.rand(jac.real_numel(o), generator=gen, dtype=torch.float64)
                             * 2 - 1, o) for o in outs]
    problem = jac.SecondOrder(first, cotangents)
    try:
        slow, mode = choose_mode(subject, problem, "double backward")
        eps, atol, rtol = problem_tolerances("finite_differences", subject, problem)
        if slow:
            mismatches = compare.exact_vjp_check(
                problem, eps, atol, rtol, subject.budget, what="double backward"
            )
        else:
            mismatches = compare.projected_vjp_check(
                problem, eps, atol, rtol, subject.budget, opts.seed + 19, what="double backward"
            )
    except jac.EvaluationError as error:
        text = str(error.exc)
        if "input_grad_buffers does not support create_graph=True" in text:
            report.add(
                "gradgradcheck", SKIPPED,
                "backward reads ctx.input_grad_buffers, which raises under "
                "create_graph=True (as documented): this Function has first-order "
                "gradients only. Decorate backward with @once_differentiable to say "
                "so, or read the property only when not torch.is_grad_enabled().",
            )
            return
        fix = _FIX_DOUBLE
        if "in-place operation" in text or "inplace operation" in text:
            fix = ("backward changes a tensor in place that double backward tracks (its "
                   "incoming gradient, or a saved tensor): compute new tensors instead")
        report.add("gradgradcheck", FAILED, f"{error.stage} raised: {error_text(error.exc)}",
                   fix=fix, exception=error.exc)
        return
    n = len(first.inputs)
    for m in mismatches:
        of = subject.name_of(subject.grad_positions[m.output]) if m.output is not None else None
        if m.input < n:
            wrt = subject.name_of(subject.grad_positions[m.input])
        else:
            wrt = f"the gradient of output {subject.differentiable_outputs[m.input - n]}"
        what = f"the gradient of {of}" if of else "the gradients"
        report.add(
            "gradgradcheck", FAILED,
            f"double backward: Jacobian mismatch for {what} with respect to {wrt}: {m.text}",
            subject=f"gradient of {of}, with respect to {wrt}" if of else wrt,
            fix=_FIX_DOUBLE,
        )
    if not mismatches:
        report.add("gradgradcheck", PASSED,
                   f"{mode.split(' ')[0]} mode, eps={eps:g}, atol={atol:g}, rtol={rtol:g}")
