"""Rules of the forward: it runs, marks what it changes in place, and its
outputs that cannot carry a gradient are treated as such."""
import functools

import torch

from ._common import as_tuple, error_text, is_float_dtype, same_values
from ._spy import GradInfo, spy_backward
from ._subject import OutputInfo
from .report import FAILED, NOTED, PASSED, register

RULES = register({
    "forward": "Function.apply runs on the sample arguments",
    "mark_dirty": "every input that forward changes in place is passed to ctx.mark_dirty",
    "mark_non_differentiable": (
        "outputs that cannot carry a gradient (integer or bool dtype, or marked with "
        "ctx.mark_non_differentiable) do not require grad"
    ),
})


def check(subject, report):
    """Run forward once, recording the ctx calls; False if it cannot run."""
    _, passed = subject.fresh()
    before = {i: (passed[i]._version, passed[i].detach().clone()) for i in subject.positions}
    subject.calls.clear()
    subject.recording = True
    try:
        with subject.seeded():
            outs = subject.apply(passed)
    except Exception as exc:  # noqa: BLE001 - reported
        fix = "see the error; the remaining checks need a forward that runs"
        if "set_output_grad_dtype" in str(exc):
            fix = (
                "declare one torch.dtype or None per value forward returns: a floating "
                "point or complex dtype of the output's kind, None for non-tensor and "
                "non-differentiable outputs"
            )
        report.add("forward", FAILED, error_text(exc), fix=fix, exception=exc)
        return False
    finally:
        subject.recording = False
    report.add("forward", PASSED)
    subject.forward_ran = True
    outs = as_tuple(outs)
    nondiff = subject.marked("mark_non_differentiable")
    subject.outputs = [_info(k, o, nondiff) for k, o in enumerate(outs)]
    for method, _, args in subject.calls:
        if method == "set_output_grad_dtype":
            subject.declared = tuple(args)
        elif method == "save_for_forward":
            subject.saved_for_forward = True
        elif method == "save_for_backward":
            subject.saved_for_backward = True
    _check_mark_dirty(subject, report, passed, before)
    subject.calls.clear()
    del outs, nondiff
    _first_backward(subject)
    _check_non_differentiable(subject, report)
    return True


def _info(k, o, nondiff):
    if not isinstance(o, torch.Tensor):
        return OutputInfo(k, False, None, None, False, False)
    return OutputInfo(k, True, o.dtype, tuple(o.shape), o.requires_grad,
                      any(o is m for m in nondiff))


def _check_mark_dirty(subject, report, passed, before):
    dirty = subject.marked("mark_dirty")
    problems = []
    for i in subject.positions:
        version, snapshot = before[i]
        t = passed[i]
        changed = t._version != version or not same_values(t.detach(), snapshot)
        if not changed:
            continue
        subject.dirtied.add(i)
        if not any(t is d for d in dirty):
            how = "its values changed" if t._version == version else "its version counter moved"
            problems.append((i, how))
    for i, how in problems:
        report.add(
            "mark_dirty",
            FAILED,
            f"forward changed {subject.name_of(i)} in place ({how}) without "
            "ctx.mark_dirty: autograd does not know the tensor's value changed, "
            "so gradients through it (and saved copies of it) are wrong",
            subject=subject.name_of(i),
            fix=f"call ctx.mark_dirty({subject.param(i)}) in forward and return the "
            "modified tensor as an output, or work on a copy (x = x.clone())",
        )
    if not problems:
        changed = [subject.name_of(i) for i in sorted(subject.dirtied)]
        report.add("mark_dirty", PASSED, "inputs changed in place: " + (", ".join(changed) or "none"))


def _first_backward(subject):
    """One backward, recording what backward received for each output."""
    if not any(o.differentiable for o in subject.outputs):
        return
    seen = []
    try:
        _, passed = subject.fresh()
        with spy_backward(subject.fn, lambda received, returned: seen.append(received)):
            with subject.seeded():
                subject.backward_with_fresh_grads(subject.apply(passed))
    except Exception:  # noqa: BLE001 - the gradient checks report it
        pass
    if seen:
        subject.backward_received = seen[0]


@functools.lru_cache(maxsize=None)
def integer_output_behaviour():
    """What the running torch does with an integer output, marked and not:
    {marked: (requires_grad, what backward receives)}, measured once."""
    seen = {}

    class TopIndex(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, mark):
            index = x.argmax().reshape(1)
            if mark:
                ctx.mark_non_differentiable(index)
            return x * 2, index

        @staticmethod
        def backward(ctx, g, g_index):
            seen["received"] = GradInfo.of(g_index)
            return g * 2, None

    result = {}
    for mark in (False, True):
        x = torch.ones(2, requires_grad=True)
        y, index = TopIndex.apply(x, mark)
        y.sum().backward()
        result[mark] = (index.requires_grad, str(seen.pop("received", "no call")))
    return result


def _check_non_differentiable(subject, report):
    behaviour = integer_output_behaviour()
    same = behaviour[False] == behaviour[True]
    problems = 0
    for o in subject.outputs:
        if not o.is_tensor or (is_float_dtype(o.dtype) and not o.marked):
            continue
        integer = not is_float_dtype(o.dtype)
        dtype = str(o.dtype).replace("torch.", "")
        received = (
            str(subject.backward_received[o.index])
            if subject.backward_received is not None and o.index < len(subject.backward_received)
            else None
        )
        if o.requires_grad:  # cannot happen on the torch releases supported
            problems += 1
            report.add(
                "mark_non_differentiable", FAILED,
                f"{o.name} ({dtype}) requires grad although it "
                + ("has an integer dtype" if integer else "was marked non-differentiable"),
                subject=o.name,
                fix="report this to torch_ctxext with the Function",
            )
            continue
        got = f"; backward received {received} for it" if received else ""
        if o.marked:
            report.add("mark_non_differentiable", PASSED,
                       f"{o.name} ({dtype}, marked) does not require grad{got}", subject=o.name)
        elif same:
            report.add(
                "mark_non_differentiable", PASSED,
                f"{o.name} ({dtype}, not marked) does not require grad{got}. Integer outputs "
                f"are never differentiable: on torch {torch.__version__} marking one changes "
                "nothing (measured: marked or not, it does not require grad and backward "
                f"receives {behaviour[True][1].replace('of shape [1]', 'of its shape')})",
                subject=o.name,
            )
        else:
            report.add(
                "mark_non_differentiable", NOTED,
                f"{o.name} ({dtype}) is not marked non-differentiable{got}. On torch "
                f"{torch.__version__} that differs from a marked output (measured: "
                f"unmarked {behaviour[False]}, marked {behaviour[True]}, as (requires_grad, "
                "what backward receives))",
                subject=o.name,
                fix=f"call ctx.mark_non_differentiable(...) with {o.name} in forward to get "
                "the documented behaviour",
            )
    if not problems and not report.results_for("mark_non_differentiable"):
        report.add("mark_non_differentiable", PASSED, "no integer, bool or marked output")
