"""In which dtypes gradients are checked.

Finite differences want float64: in float32 a difference quotient keeps
about three digits. So the checks run on float64 copies of the sample when
the Function computes in the dtype it is given. They do not when the
Function fixes its own dtypes, because then the copies would check another
Function than the one you run:

* it declares gradient dtypes (``ctx.set_output_grad_dtype(torch.float32)``
  for a float16 output, or float64 for a float32 one): a float64 copy makes
  the declaration a no-op or changes what backward receives, and a backward
  that returns the declared dtype's gradient (``g.float()``) would then
  round float64 values to float32 and fail double backward for no reason;
* given float64 inputs it still returns narrower outputs or gradients
  (``x.half() @ w.half()``, ``grad.float()``);
* it fails on float64 inputs.

Then the sample's own dtypes are used, with tolerances for that precision,
and the report says why.
"""
import torch

from ._common import as_tuple, dtypes_text, first_lines, is_float, wide
from ._spy import spy_backward


def choose(subject):
    """Set ``subject.dtype`` (None or torch.float64); return the text for
    the report."""
    subject.dtype = None
    floats = [subject.args[i] for i in subject.positions if is_float(subject.args[i])]
    if not floats:
        return ""
    sample = dtypes_text(sorted({t.dtype for t in floats}, key=str))
    if all(t.dtype in (torch.float64, torch.complex128) for t in floats):
        return "the sample's dtypes (float64)"
    if subject.declared is not None and any(isinstance(d, torch.dtype) for d in subject.declared):
        return (
            f"the sample's dtypes {sample}: forward declares gradient dtypes "
            "(set_output_grad_dtype), which float64 copies would change"
        )
    returned = []
    try:
        leaves, passed = subject.fresh(torch.float64)
        with spy_backward(subject.fn, lambda received, result: returned.append(result)):
            with subject.seeded():
                outs = as_tuple(subject.apply(passed))
                subject.backward_with_fresh_grads(outs)
    except Exception as exc:  # noqa: BLE001 - fall back to the sample's dtypes
        line = first_lines(exc, 1)[:120]
        return f"the sample's dtypes {sample} (float64 copies fail: {type(exc).__name__}: {line})"
    narrow = [
        f"output {k} is {str(o.dtype).replace('torch.', '')}"
        for k, o in enumerate(outs)
        if is_float(o) and o.dtype != wide(o.dtype)
    ]
    if returned:
        for i, info in enumerate(returned[0]):
            if (i < len(leaves) and is_float(leaves[i]) and info.dtype is not None
                    and info.dtype != leaves[i].dtype):
                narrow.append(
                    f"backward returns a {str(info.dtype).replace('torch.', '')} gradient for "
                    f"{subject.name_of(i)}"
                )
    if narrow:
        return (
            f"the sample's dtypes {sample}: the Function fixes its own dtypes (given float64 "
            f"copies, {'; '.join(narrow[:3])}), so float64 copies would not check what it does"
        )
    subject.dtype = torch.float64
    return "float64 copies of the sample"
