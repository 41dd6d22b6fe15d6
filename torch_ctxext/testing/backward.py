"""Rules of backward as the engine calls it: it leaves the gradients it
receives alone, and whether it can run again on the same graph.

A backward that can run only once per graph (it deletes what it kept on
ctx, or changes a saved tensor in place, as fused cross-entropy kernels do
to save memory) is not a breach of the contract: the engine runs backward
once per graph unless ``retain_graph=True``. It is noted as such, and the
gradient rules check such a Function with a fresh forward per backward.
"""
import torch

from ._common import as_tuple, error_text, random_like, same_values
from ._core import max_abs
from .report import FAILED, NOTED, PASSED, SKIPPED, register

RULES = register({
    "backward.grad_outputs_unchanged": (
        "backward does not change the gradients it receives in place (they can be "
        "the caller's tensors, or shared with another branch of the graph)"
    ),
    "backward.repeatable": (
        "backward can run again on the same graph (retain_graph=True) with the same "
        "result, or else it can run only once per graph (noted, not a breach)"
    ),
})


def _same(a, b):
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and a.dtype == b.dtype and same_values(a, b)


def check(subject, report):
    names = list(RULES)
    if not subject.differentiable_outputs:
        for name in names:
            report.add(name, SKIPPED, "no output requires grad: backward never runs")
        return
    if subject.budget.spent():
        for name in names:
            report.add(name, SKIPPED, subject.budget.skip_reason())
        return
    gen = torch.Generator().manual_seed(subject.options.seed + 3)
    leaves, passed = subject.fresh(subject.dtype)
    with subject.seeded():
        try:
            outs = as_tuple(subject.apply(passed))
            roots = [outs[k] for k in subject.differentiable_outputs]
            cotangents = [random_like(o, gen) for o in roots]
            snapshots = [c.clone() for c in cotangents]
            torch.autograd.backward(roots, cotangents, retain_graph=True)
        except Exception as exc:  # noqa: BLE001 - the gradient rules report it
            for name in names:
                report.add(name, SKIPPED, f"backward raised (see gradcheck): {error_text(exc)}")
            return
        grad_leaves = [leaves[i] for i in subject.grad_positions]
        first = [None if l.grad is None else l.grad.clone() for l in grad_leaves]
        _report_changed(subject, report, roots, cotangents, snapshots)
        for l in grad_leaves:
            l.grad = None
        try:
            torch.autograd.backward(roots, [s.clone() for s in snapshots])
        except Exception as exc:  # noqa: BLE001 - that is what is checked
            report.add(
                "backward.repeatable", NOTED,
                "backward can run only once per graph: a second backward on the same "
                f"graph (retain_graph=True) raises {error_text(exc)}\nThe gradients are "
                "checked with a fresh forward for every backward.",
            )
            return
    second = [l.grad for l in grad_leaves]
    differ = [(i, a, b) for i, a, b in zip(subject.grad_positions, first, second)
              if not _same(a, b)]
    if not differ:
        report.add("backward.repeatable", PASSED,
                   "a second backward on the same graph (retain_graph=True) gives the same gradients")
        return
    i, a, b = differ[0]
    how = (f"max abs difference {max_abs(a, b):.3g}" if a is not None and b is not None
           and a.shape == b.shape else "one of them is None")
    report.add(
        "backward.repeatable", NOTED,
        "backward can run only once per graph: a second backward on the same graph "
        f"(retain_graph=True) gives other gradients, without an error ({subject.name_of(i)}: "
        f"{how}). It changes state it needs (a saved tensor changed in place, state on "
        "ctx).\nThe gradients are checked with a fresh forward for every backward.",
        fix="nothing to do if the Function only ever sees one backward per graph (the "
        "default); to make a second call fail loudly instead of giving wrong gradients, "
        "raise a clear error from backward when it runs again (a flag on ctx)",
    )


def _report_changed(subject, report, roots, cotangents, snapshots):
    changed = []
    for k, c, s in zip(subject.differentiable_outputs, cotangents, snapshots):
        if not _same(c, s):
            changed.append(k)
            report.add(
                "backward.grad_outputs_unchanged", FAILED,
                f"backward changed the gradient it received for output {k} in place "
                f"(max abs difference {max_abs(c, s):.3g} after backward): that tensor can "
                "be the caller's (loss.backward(gradient)) or shared with another branch "
                "of the graph (add hands one gradient to both its inputs), which then sees "
                "the changed values",
                subject=f"output {k}",
                fix="compute a new tensor (grad_output * scale, -grad_output) instead of "
                "changing grad_output in place (mul_, neg_, add_, masked_fill_)",
            )
    if not changed:
        report.add("backward.grad_outputs_unchanged", PASSED)
