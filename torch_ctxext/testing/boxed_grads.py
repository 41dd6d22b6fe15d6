"""Rule of ``boxed_grads_call = True``: a gradient backward removes from the
list is freed by the time backward returns (which is what boxing is for)."""
import weakref

import torch

from ._common import as_tuple, error_text
from ._spy import patched
from .report import FAILED, PASSED, SKIPPED, register

RULES = register({
    "boxed_grads.released": (
        "with boxed_grads_call, a gradient backward removes from the list is "
        "freed (nothing else keeps it) by the time backward returns"
    ),
})
NAME = "boxed_grads.released"


def _shares_storage(a, b):
    try:
        return (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                and a.device == b.device)
    except (RuntimeError, NotImplementedError):
        return a is b


def check(subject, report):
    if not getattr(subject.fn, "boxed_grads_call", False):
        return
    bw = subject.fn._backward_cls
    if not hasattr(bw, "apply_boxed"):
        report.add(NAME, SKIPPED, "this torch has no boxed grads call")
        return
    seen = []

    def spy(original):
        def apply_boxed(ctx, *args):
            grads = args[0] if len(args) == 1 and isinstance(args[0], list) else None
            if grads is None:
                return original(ctx, *args)
            refs = [(k, weakref.ref(g)) for k, g in enumerate(grads) if isinstance(g, torch.Tensor)]
            result = original(ctx, *args)
            remaining = {id(g) for g in grads}
            returned = [t for t in as_tuple(result) if isinstance(t, torch.Tensor)]
            kept, removed = [], []
            for k, ref in refs:
                g = ref()
                if g is None:
                    removed.append(k)
                    continue
                if id(g) in remaining:
                    continue
                removed.append(k)
                if not any(_shares_storage(g, t) for t in returned):
                    kept.append(k)
                del g
            seen.append((kept, removed, len(refs)))
            return result

        return apply_boxed

    _, passed = subject.fresh(subject.dtype)
    try:
        with patched(bw, "apply_boxed", spy), subject.seeded():
            outs = subject.apply(passed)
            subject.backward_with_fresh_grads(outs)
    except Exception as exc:  # noqa: BLE001 - reported elsewhere too
        report.add(NAME, FAILED, f"backward raised: {error_text(exc)}", fix="see the error",
                   exception=exc)
        return
    if not seen:
        report.add(NAME, SKIPPED, "the engine did not call apply_boxed")
        return
    kept, removed, total = seen[0]
    for k in kept:
        report.add(
            NAME, FAILED,
            f"backward removed output {k}'s gradient from the list but it is still "
            "referenced when backward returns (kept on ctx, in a global or a "
            "closure, or in a copy of the list): its memory is not released, which "
            "is what boxed_grads_call is for",
            subject=f"output {k}",
            fix="do not keep gradients (or copies of the list) beyond their use: take "
            "them with grads.pop() / del grads[i] / grads.clear() and let the last "
            "reference go",
        )
    if not kept:
        detail = f"{len(removed)} of {total} gradient(s) removed and freed"
        if not removed:
            detail = ("backward removes no gradient from the list: boxed_grads_call "
                      "frees nothing early here")
        report.add(NAME, PASSED, detail)
