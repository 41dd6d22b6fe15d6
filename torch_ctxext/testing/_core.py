"""What the rule families share about comparing numbers: the Function as a
map for the Jacobian checks (:class:`FunctionProblem`), how its Jacobian is
checked (:func:`choose_mode`), the one tolerance table (:data:`TOLERANCES`)
and the comparison of two tensors (:func:`close`, :func:`max_abs`).

The checker has two layers. The machinery: this module and the other
modules named with an underscore (``_common``, ``_compare``, ``_jacobian``,
``_subject``, ...) and ``report``. On top of it, the rule families, one
module per family (``forward``, ``gradients``, ``forward_ad``, ...): a
family imports only from the machinery, never from another family
(test/contract/test_check_function_layers.py checks it).
"""
import time

import torch

from . import _jacobian as jac
from ._common import as_tuple, is_float, wide

# --- the one tolerance table ---------------------------------------------------

_HALF = (torch.float16, torch.bfloat16)
_SINGLE = (torch.float32, torch.complex64)

# What is compared -> precision -> (eps, atol, rtol). eps is the step of
# finite differences (None where none are taken). The user's ``eps=``,
# ``atol=`` and ``rtol=`` replace these wherever the checker honours them
# (see :func:`tolerances`).
TOLERANCES = {
    # A derivative (backward, double backward, jvp) against finite
    # differences of forward, or jvp against backward along random
    # directions: the difference quotient keeps about half the digits.
    "finite_differences": {
        "half": (1e-1, 1e-1, 1e-1),
        "single": (1e-3, 1e-2, 1e-2),
        "double": (1e-6, 1e-5, 1e-3),
    },
    # Two computations of the same quantity, without finite differences
    # (the Function against the reference you state, a batched run against
    # the loop over the batch): rounding only.
    "rounding": {
        "half": (None, 1e-2, 1e-2),
        "single": (None, 1e-4, 1e-4),
        "double": (None, 1e-7, 1e-7),
    },
    # input_grad_buffers: the fused path (the backward accumulates into the
    # engine's buffer in place, in the input's own dtype, e.g. addmm_) against
    # the fallback (it returns a gradient the engine adds out of place). The
    # same sum in another order and with other kernels, rounded in the input's
    # dtype at each step, so looser than "rounding" in float32 and below; the
    # mistakes this rule tells apart (a contribution counted twice, dropped
    # or overwritten) are as large as the gradients themselves, far above
    # these numbers.
    "input_grad_buffers": {
        "half": (None, 1e-1, 1e-1),
        "single": (None, 1e-2, 1e-2),
        "double": (None, 1e-7, 1e-7),
    },
}


def precision(dtypes):
    """"half", "single" or "double": the lowest precision among ``dtypes``
    (double where none is a floating dtype)."""
    dtypes = list(dtypes)
    if any(d in _HALF for d in dtypes):
        return "half"
    if any(d in _SINGLE for d in dtypes):
        return "single"
    return "double"


def tolerances(kind, dtypes, options=None):
    """(eps, atol, rtol) of the table's entry ``kind`` at the lowest
    precision among ``dtypes``; each replaced by the user's option
    (``options.eps`` / ``.atol`` / ``.rtol``) where one is given, 0
    included."""
    numbers = TOLERANCES[kind][precision(dtypes)]
    if options is None:
        return numbers
    given = (options.eps, options.atol, options.rtol)
    return tuple(mine if mine is not None else default for mine, default in zip(given, numbers))


def problem_tolerances(kind, subject, problem):
    """:func:`tolerances` for ``problem``'s inputs and outputs, with the
    user's options."""
    outs = problem.outputs if problem.outputs is not None else problem.values()
    dtypes = [t.dtype for t in problem.inputs] + [o.dtype for o in outs]
    return tolerances(kind, dtypes, subject.options)


# --- comparing two tensors -----------------------------------------------------


def close(a, b, atol, rtol):
    """``a`` and ``b`` have the same shape and values, within ``atol +
    rtol * |b|`` for floating tensors (NaN equal to NaN), exactly for
    others; ``a`` is compared in ``b``'s dtype. None is close to None
    only."""
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape:
        return False
    if not is_float(b):
        return torch.equal(a, b)
    return torch.allclose(a.to(b.dtype), b, atol=atol, rtol=rtol, equal_nan=True)


def max_abs(a, b):
    """The largest absolute difference of two tensors of one shape (0.0 when
    they are empty), computed in float64 (complex128 for complex)."""
    if a.numel() == 0:
        return 0.0

    def widened(t):
        t = t.detach()
        return t.to(torch.complex128 if t.is_complex() else torch.float64)

    return float((widened(a) - widened(b)).abs().max())


# --- the Function as a map, for the Jacobian checks -----------------------------

SLOW_LIMIT = 256  # runs of the Function (forward pairs + backwards) for exact Jacobians


class FunctionProblem(jac.Problem):
    """The Function as a map from its differentiable inputs to its
    differentiable outputs; every other argument is a fresh copy per run."""

    def __init__(self, subject, call=None):
        self.subject = subject
        self.call = call or subject.fn.apply
        dtype = subject.dtype
        inputs = []
        for i in subject.grad_positions:
            x = subject.args[i].detach()
            inputs.append(x.to(wide(x.dtype)) if dtype is not None else x)
        super().__init__(inputs, subject.seeded)

    def _forward(self, xs):
        s = self.subject
        values = dict(zip(s.grad_positions, xs))
        passed = []
        for i, a in enumerate(s.args):
            if i in values:
                passed.append(values[i].clone())  # forward may change it in place
            elif isinstance(a, torch.Tensor):
                t = a.detach().clone()
                if s.dtype is not None and is_float(t):
                    t = t.to(wide(t.dtype))
                passed.append(t)
            else:
                passed.append(a)
        outs = as_tuple(self.call(*passed))
        return [outs[k] for k in s.differentiable_outputs]


def reference_problem(subject):
    """The reference stated as the intended gradient, as a map like the
    Function's."""
    return FunctionProblem(subject, call=subject.options.reference)


def _real_size(tensors):
    return sum(jac.real_numel(t) for t in tensors)


def choose_mode(subject, problem, what):
    """(slow?, text) for checking ``problem``'s Jacobian: exact Jacobians
    (slow) when they take at most ``SLOW_LIMIT`` runs of the Function and
    fit in a quarter of the time left, random projections (fast) otherwise,
    unless the user chose (``fast_mode=``)."""
    outs = problem.outputs if problem.outputs is not None else problem.values()
    n_in, n_out = _real_size(problem.inputs), _real_size(outs)
    runs = 2 * n_in + n_out
    formula = f"2 x {n_in} forwards + {n_out} backwards = {runs} runs"
    forced = subject.options.fast_mode
    if forced is not None:
        return (not forced), f"{'fast' if forced else 'slow'} (fast_mode={forced}, your choice)"
    if runs > SLOW_LIMIT:
        return False, (
            f"fast (random projections): exact Jacobians of {what} would take {formula}, "
            f"more than {SLOW_LIMIT}"
        )
    start = time.perf_counter()
    try:
        problem.vjp([torch.ones_like(o) for o in outs], stage="backward")
    except jac.EvaluationError:
        pass  # the check itself reports it; the time until it raised is what it costs
    per_run = time.perf_counter() - start
    left = subject.budget.left()
    if runs * per_run > left / 4:
        return False, (
            f"fast (random projections): exact Jacobians of {what} ({formula}) would take "
            f"about {runs * per_run:.1f} s at {per_run * 1e3:.1f} ms a run, more than a "
            "quarter of the time budget left"
        )
    return True, f"slow (exact Jacobians: {formula})"
