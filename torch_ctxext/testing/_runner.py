"""Runs the rule families in order on one Function and gathers the report.

A family is a module with ``RULES`` and a ``check(subject, report)``
function; adding a rule is adding a module here. Whatever the checked
Function does, the runner only reports: an exception raised by a family
itself (a bug in the checker) becomes an ``error`` result naming the
family, and the next family runs.
"""
import contextlib
import functools
import time
import traceback
import warnings

import torch
from torch.autograd.function import FunctionCtx

from .. import _explain, _features
from . import (
    _precision, backward, boxed_grads, forward, forward_ad, gradients, input_grad_buffers,
    output_grad_dtype, vmap,
)
from ._spy import patched
from ._subject import BudgetSpent, Subject
from .report import ERROR, SKIPPED, FunctionReport

# (what runs, the rule an error or the time budget is reported under)
FAMILIES = [
    (backward.check, "backward.repeatable"),
    (gradients.check, "gradcheck"),
    (output_grad_dtype.check_honoured, "set_output_grad_dtype.honoured"),
    (forward_ad.check, "jvp.finite_differences"),
    (vmap.check, "vmap.matches_loop"),
    (input_grad_buffers.check, input_grad_buffers.FUSED),
    (boxed_grads.check, boxed_grads.NAME),
]

_RECORDED_CTX_METHODS = (
    "mark_dirty", "mark_non_differentiable", "set_output_grad_dtype",
    "save_for_forward", "save_for_backward",
)


@contextlib.contextmanager
def _recording(subject):
    """Record the checked Function's ctx calls and buffer reads."""
    with contextlib.ExitStack() as stack:
        if hasattr(FunctionCtx, "input_grad_buffers"):
            stack.enter_context(_explain.observe(subject.on_read, wants_reasons=True))
        for method in _RECORDED_CTX_METHODS:
            if hasattr(FunctionCtx, method):
                stack.enter_context(patched(FunctionCtx, method, subject.on_ctx_call(method)))
        yield


@functools.lru_cache(maxsize=None)
def _warm_up():
    """torch imports modules on the first backward with explicit gradients
    in a process (about a second); done once, outside the time budget."""
    x = torch.zeros(1, requires_grad=True)
    torch.autograd.backward(x * 2, torch.ones(1))


def _report_error(report, rule, step, exc):
    trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).strip()
    report.add(
        rule, ERROR,
        f"the checker itself raised while checking this ({step}):\n"
        + "\n".join(trace.splitlines()[-6:]),
        fix="this is a bug in torch_ctxext's checker, not in your Function: please report "
        "it with this report; the other checks ran",
    )
    warnings.warn(
        f"torch_ctxext.testing.check_function: internal error in {step}: "
        f"{type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=3,
    )


def _guarded(report, rule, step, run, *args):
    """run(*args); an exception of the checker's own becomes an error result."""
    try:
        return run(*args)
    except BudgetSpent:
        report.add(rule, SKIPPED, args[0].budget.skip_reason())
    except Exception as exc:  # noqa: BLE001 - the checker only ever reports
        _report_error(report, rule, step, exc)
    return None


def run(fn, args, options):
    start = time.perf_counter()
    subject = Subject(fn, args, options)
    report = FunctionReport(
        function=fn.__qualname__,
        torch_version=torch.__version__,
        providers=_features.features(),
        opt_outs=options.opt_outs(),
        time_budget=options.time_budget,
    )
    try:
        with subject.budget.paused():
            _warm_up()
        with _recording(subject):
            _run_families(subject, report)
    finally:
        report.warm_up_seconds = subject.budget.paused_seconds
        report.seconds = time.perf_counter() - start - report.warm_up_seconds
    return report


def _run_families(subject, report):
    if not _guarded(report, "forward", "the forward checks", forward.check, subject, report):
        return
    valid = _guarded(report, "set_output_grad_dtype.valid", "the declared dtypes",
                     output_grad_dtype.check_valid, subject, report)
    if valid is False:
        report.add("gradcheck", SKIPPED, "the declared gradient dtypes are invalid")
        return
    report.precision = _guarded(report, "gradcheck", "choosing the precision",
                                _precision.choose, subject) or ""
    for check, rule in FAMILIES:
        _guarded(report, rule, check.__module__.rsplit(".", 1)[-1], check, subject, report)
