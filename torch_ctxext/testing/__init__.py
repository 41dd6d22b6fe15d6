"""Check a custom ``torch.autograd.Function`` against the ctx contract.

``check_function(MyFunction, x, w)`` runs ``MyFunction`` through the rules of
the documented contract and returns a :class:`FunctionReport`; when a rule is
broken it raises :class:`ContractViolation` (an ``AssertionError``) carrying
the report. Every failure names the rule, the input or output concerned and
how to fix it. See docs/checking-your-function.md.

The rules, one module per family:

``forward``                 ``forward``, ``mark_dirty``, ``mark_non_differentiable``
``output_grad_dtype``       ``set_output_grad_dtype.valid`` / ``.honoured``
``backward``                ``backward.grad_outputs_unchanged``; ``backward.repeatable``
                            (noted, not failed, when backward can run only once)
``gradients``               ``gradcheck`` (finite differences, or the reference
                            you state as the intended gradient, with
                            ``reference.matches_forward``), ``gradgradcheck``
``forward_ad``              for a Function with ``jvp``: ``jvp.save_for_forward``,
                            ``jvp.finite_differences``, ``jvp.matches_backward``
``vmap``                    for a Function with a vmap rule: ``vmap.matches_loop``
``input_grad_buffers``      ``.fused_matches_fallback``, ``.not_retained``
``boxed_grads``             ``boxed_grads.released``

A family imports only from the core the families share (the modules named
with an underscore, and ``report``), never from another family. The Function
as a map for the Jacobian checks, the choice of their mode and the one table
of tolerances are in ``_core``.

Every run of the Function gets fresh copies of the sample and the same
random state; every backward has its own forward. The checker patches
``FunctionCtx`` (``mark_dirty``, ``mark_non_differentiable``,
``set_output_grad_dtype``, ``save_for_forward``, ``save_for_backward``,
``input_grad_buffers``) and the checked Function's backward class with
recording wrappers while it runs, and restores them afterwards: do not check
Functions from several threads at once.
"""
from torch.autograd.function import Function

from . import _options, _runner, _subject
from .report import RULES, CheckResult, ContractViolation, FunctionReport, OptOut

__all__ = ["check_function", "FunctionReport", "CheckResult", "ContractViolation", "OptOut", "RULES"]


def check_function(function, *sample_args, raise_on_failure=True, **options):
    """Run ``function`` (a ``torch.autograd.Function`` subclass) through the
    ctx contract with ``sample_args`` (what you would pass to ``apply``).

    Gradients are checked by finite differences, exactly (slow mode) for
    small samples and by random projections (fast mode) for larger ones; the
    report says which ran and why. The whole check keeps to a time budget.

    Options:

    * ``reference=fn``, ``reason="why"``: the intended gradient, for a
      backward that is deliberately not the derivative (straight-through
      estimators, gradient reversal or scaling). ``fn`` takes the arguments
      of ``apply``, returns what forward returns, and is written with plain
      torch operations whose gradient is the one you intend (for a
      straight-through round: ``lambda x: x + (x.round() - x).detach()``).
      Backward (and jvp) are then compared with ``fn``'s gradients instead of
      finite differences; everything else is checked as usual. ``reason``
      appears in the report.
    * ``gradcheck``, ``double_backward``, ``forward_ad``, ``vmap``: ``False``
      or a reason (a str) turns that check off; the report lists every such
      opt-out with its reason.
    * ``fast_mode``: ``True`` / ``False`` forces gradcheck's mode (default:
      chosen by size).
    * ``atol``, ``rtol``, ``eps``: finite-difference tolerances and step
      (chosen from the precision otherwise); ``atol`` and ``rtol``, 0
      included, also for the comparisons against the reference and between
      the two paths of ``input_grad_buffers``.
    * ``time_budget``: seconds (default 5; ``None``: no limit). Checks that
      would start after it is spent are skipped, saying so.
    * ``seed``; ``raise_on_failure=False`` returns the report instead of
      raising.

    At least one of ``sample_args`` must be a tensor that requires grad (as
    for ``torch.autograd.gradcheck``): without one backward never runs and
    nothing about gradients could be checked, so the Function would pass
    unchecked.

    Returns a :class:`FunctionReport`. Raises :class:`ContractViolation` (an
    AssertionError) when a check fails: its message starts with the failed
    rule and what was found, followed by the report; when the check failed
    because your forward or backward raised, it is raised ``from`` that
    exception, whose traceback ends at your line, and the report names that
    line (``File "...", line N, in backward``). Raises ``TypeError`` for
    arguments of the wrong type (not a Function, an unknown option) and
    ``ValueError`` for sample arguments of which none requires grad. Whatever
    the Function does, nothing else escapes: an exception of the checker's
    own is reported as an ``error`` result.
    """
    # pytest leaves this frame out of a failure's traceback: what failed is
    # the report in the message and your code in the cause, not this source.
    __tracebackhide__ = True
    if not (isinstance(function, type) and issubclass(function, Function)):
        raise TypeError(
            f"check_function expects a torch.autograd.Function subclass, got {function!r}"
        )
    options = _options.parse(options)
    _subject.refuse_samples_without_grad(function, sample_args)
    report = _runner.run(function, sample_args, options)
    if raise_on_failure and not report.passed:
        raise ContractViolation(report) from report.cause
    return report
