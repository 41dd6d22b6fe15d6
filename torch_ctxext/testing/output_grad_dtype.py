"""Rules of ``ctx.set_output_grad_dtype``: declarations are valid, and
backward receives what was declared."""
import torch

from ._common import as_tuple, dtypes_text, error_text
from ._spy import spy_backward
from .report import FAILED, PASSED, SKIPPED, register

RULES = register({
    "set_output_grad_dtype.valid": (
        "each declaration is None or a floating point / complex dtype of the "
        "output's kind, one per output, concrete only for differentiable outputs"
    ),
    "set_output_grad_dtype.honoured": (
        "backward receives each output's gradient in the declared dtype, "
        "whatever the dtype of the root gradient"
    ),
})


def _other_dtype(dtype):
    """A dtype of the same kind that differs from ``dtype``."""
    if dtype.is_complex:
        return torch.complex64 if dtype == torch.complex128 else torch.complex128
    return torch.float32 if dtype == torch.float64 else torch.float64


def check_valid(subject, report):
    """False when the declarations are invalid (nothing else can be trusted)."""
    declared = subject.declared
    if declared is None:
        report.add("set_output_grad_dtype.valid", SKIPPED,
                   "forward does not call set_output_grad_dtype")
        return True
    output_dtypes = [o.dtype for o in subject.outputs]
    problems = 0
    if len(declared) != len(output_dtypes):
        problems += 1
        report.add(
            "set_output_grad_dtype.valid", FAILED,
            f"{len(declared)} declarations for {len(output_dtypes)} outputs",
            fix="declare one dtype or None per value forward returns, non-tensors included",
        )
    native = subject_native(report)
    for k, (d, od) in enumerate(zip(declared, output_dtypes)):
        if d is None:
            continue
        if not isinstance(d, torch.dtype):
            why = f"{d!r} is not a torch.dtype"
        elif od is None or not (od.is_floating_point or od.is_complex):
            why = f"a dtype ({d}) was declared for an output that has no gradient ({od or 'not a tensor'})"
        elif not (d.is_floating_point or d.is_complex):
            why = f"{d} cannot carry a gradient"
            if native:
                why += (" (this torch accepts it and fails inside the engine at "
                        "backward: upstream deviation 1, docs/deviations.md)")
        elif d.is_complex != od.is_complex:
            why = f"{d} is not of the output's kind ({od})"
        else:
            continue
        problems += 1
        report.add(
            "set_output_grad_dtype.valid", FAILED, f"output {k}: {why}",
            subject=f"output {k}",
            fix="declare a floating point dtype for a real output, a complex dtype "
            "for a complex one, or None (required for non-tensor and "
            "non-differentiable outputs)",
        )
    if problems:
        return False
    report.add("set_output_grad_dtype.valid", PASSED, f"declared {dtypes_text(declared)}")
    return True


def subject_native(report):
    return report.providers.get("set_output_grad_dtype") == "native"


def check_honoured(subject, report):
    name = "set_output_grad_dtype.honoured"
    if subject.declared is None:
        return
    seen = []
    _, passed = subject.fresh()
    try:
        with subject.seeded():
            outs = as_tuple(subject.apply(passed))
    except Exception as exc:  # noqa: BLE001 - reported
        report.add(name, FAILED, f"forward raised: {error_text(exc)}", fix="see the error",
                   exception=exc)
        return
    roots, grads, expect = [], [], {}
    declared = subject.declared
    for k, o in enumerate(outs):
        if not (isinstance(o, torch.Tensor) and o.requires_grad):
            continue
        d = declared[k] if k < len(declared) else o.dtype
        root_dtype = _other_dtype(d if d is not None else o.dtype)
        if k < len(declared):
            expect[k] = d if d is not None else root_dtype
        roots.append(o)
        grads.append(torch.ones(o.shape, dtype=root_dtype, device=o.device))
    if not expect:
        report.add(name, SKIPPED, "no differentiable output to check")
        return
    try:
        with spy_backward(subject.fn, lambda received, returned: seen.append(received)):
            with subject.seeded():
                torch.autograd.backward(roots, grads)
    except Exception as exc:  # noqa: BLE001 - reported
        report.add(
            name, FAILED,
            "backward failed when the root gradients had other dtypes than the "
            f"outputs ({dtypes_text([g.dtype for g in grads])}): {error_text(exc)}",
            fix="backward must accept gradients in the declared dtypes; an output "
            "declared None receives its gradient in whatever dtype it arrives",
            exception=exc,
        )
        return
    if not seen:
        report.add(name, SKIPPED, "backward was not called")
        return
    got = seen[0]
    problems = 0
    for n, (k, d) in enumerate(expect.items()):
        if k < len(got) and got[k].dtype != d:
            problems += 1
            report.add(
                name, FAILED,
                f"output {k}: declared {d if declared[k] is not None else 'None'}"
                f", backward received {got[k].dtype} (root gradient {grads[n].dtype})",
                subject=f"output {k}",
                fix="report this: the engine did not apply the declaration "
                "(see docs/set_output_grad_dtype.md)",
            )
    if not problems:
        report.add(name, PASSED, "backward received " + dtypes_text([got[k].dtype for k in expect]))
