"""Rules of ``ctx.input_grad_buffers``, for a Function whose backward reads
it: the fused path (buffer exposed) and the fallback (None) give the same
gradients, and no buffer outlives the backward.

How engine order is arranged: a consumer of input ``x``, ``(x * c).sum()``,
created after the Function call runs first, so its fresh dense gradient
waits in ``x``'s buffer when the Function's backward runs (exposed); the
same consumer created before the call runs after it (None).
"""
import gc

import torch
from torch.autograd.function import FunctionCtx

from ._common import error_text, is_float, random_like
from ._core import close, max_abs, tolerances
from .report import FAILED, PASSED, SKIPPED, register

RULES = register({
    "input_grad_buffers.fused_matches_fallback": (
        "the gradients are the same whether an input's ctx.input_grad_buffers "
        "entry is exposed (fused path) or None (fallback path)"
    ),
    "input_grad_buffers.not_retained": (
        "a buffer from ctx.input_grad_buffers is not kept after backward returns"
    ),
})
FUSED = "input_grad_buffers.fused_matches_fallback"


def _tolerances(subject, fallback):
    """(atol, rtol) for the fused path's gradients against the fallback's."""
    if fallback is None:
        return 0.0, 0.0  # close() needs none: None is close to None only
    _, atol, rtol = tolerances("input_grad_buffers", [fallback.dtype], subject.options)
    return atol, rtol


def _run(subject, i, exposed):
    """Backward of the Function plus an extra consumer (x_i * c).sum() of
    input i, created after the Function (it runs first: the buffer holds its
    fresh dense gradient, exposed) or before (the Function runs first:
    None). Returns (leaf grads, c, reads, alive with graph, alive after)."""
    leaves, passed = subject.fresh(subject.dtype)
    gen = torch.Generator().manual_seed(subject.options.seed + 2)
    c = random_like(passed[i], gen)
    extra = None if exposed else (passed[i] * c).sum()
    subject.run_reads = reads = []
    try:
        with subject.seeded():
            outs = subject.apply(passed)
            if exposed:
                extra = (passed[i] * c).sum()
            if extra.is_complex():
                extra = extra.real
            subject.backward_with_fresh_grads(outs, extra)
    finally:
        subject.run_reads = None
    grads = [None] * len(leaves)
    for j in subject.grad_positions:
        grads[j] = None if leaves[j].grad is None else leaves[j].grad.detach().clone()
        # Retention: nothing but the Function may hold an exposed buffer now.
        # A leaf's .grad may be the buffer itself (AccumulateGrad steals it).
        leaves[j].grad = None
    del extra
    alive_with_graph = [idx for read in reads for idx in read.alive()]
    del outs  # the graph and the ctx go with it
    alive_after = [idx for read in reads for idx in read.alive()]
    if alive_after:  # a reference cycle may hold it: a full collection is slow, so only now
        gc.collect()
        alive_after = [idx for read in reads for idx in read.alive()]
    return grads, c, reads, alive_with_graph, alive_after


def check(subject, report):
    if not hasattr(FunctionCtx, "input_grad_buffers"):
        report.add(FUSED, SKIPPED, "this torch has no ctx.input_grad_buffers")
        return
    if subject.reads == 0:  # no backward has run yet (gradcheck=False, float64 sample)
        try:
            leaves, passed = subject.fresh(subject.dtype)
            with subject.seeded():
                subject.backward_with_fresh_grads(subject.apply(passed))
        except Exception:  # noqa: BLE001 - the runs below report it
            pass
    if subject.reads == 0:
        report.add(FUSED, SKIPPED, "backward does not read ctx.input_grad_buffers")
        return
    if subject.budget.spent():
        report.add(FUSED, SKIPPED, subject.budget.skip_reason())
        return
    candidates = [i for i in subject.positions
                  if subject.args[i].requires_grad and is_float(subject.args[i])]
    retained = set()
    any_exposed = False
    for i in candidates:
        name = subject.name_of(i)
        if i in subject.dirtied:
            report.add(FUSED, SKIPPED, "forward changes this input in place: no later "
                       "consumer of its old value can be arranged", subject=name)
            continue
        try:
            fused, c, reads, alive_graph, alive_after = _run(subject, i, exposed=True)
            fallback, _, fb_reads, fb_alive_graph, fb_alive_after = _run(subject, i, exposed=False)
        except Exception as exc:  # noqa: BLE001 - reported
            report.add(
                FUSED, FAILED,
                "backward raised when another consumer's gradient was waiting in "
                f"the buffer: {error_text(exc)}",
                subject=name, fix="both paths (buffer exposed, buffer None) must run",
                exception=exc,
            )
            continue
        for idx in sorted(set(alive_graph + fb_alive_graph)):
            if idx not in retained:
                retained.add(idx)
                _report_retained(subject, report, idx, idx in set(alive_after + fb_alive_after))
        was_exposed = any(read.exposed[i] for read in reads if i < len(read.exposed))
        any_exposed |= any(any(read.exposed) for read in reads + fb_reads)
        if not reads:
            report.add(FUSED, SKIPPED, "backward did not read ctx.input_grad_buffers in this "
                       "graph", subject=name)
            continue
        if not was_exposed:
            why = reads[0].explanation[i].text if i < len(reads[0].explanation) else "?"
            report.add(FUSED, SKIPPED, f"could not arrange an exposed buffer: {why}", subject=name)
            continue
        mismatches = [
            j for j in range(len(subject.args))
            if isinstance(fused[j], torch.Tensor) or isinstance(fallback[j], torch.Tensor)
            if not close(fused[j], fallback[j], *_tolerances(subject, fallback[j]))
        ]
        if not mismatches:
            report.add(FUSED, PASSED, "exposed and None give the same gradients", subject=name)
            continue
        for j in mismatches:
            kind = _classify(subject, i, j, fused[j], fallback[j], c)
            report.add(
                FUSED, FAILED,
                _diagnose(kind, fused[j], fallback[j]),
                subject=name if j == i else f"{subject.name_of(j)}, with {name}'s buffer exposed",
                fix=_FIXES[kind],
            )
    if any_exposed and not retained:
        report.add("input_grad_buffers.not_retained", PASSED, "no buffer outlives backward")


def _classify(subject, i, j, fused, fallback, c):
    if fused is None or fallback is None:
        return "missing"
    if j != i:
        return "other"
    atol, rtol = _tolerances(subject, fallback)
    c = c.to(fallback.dtype)
    own = fallback - c  # this Function's contribution
    if close(fused, fallback + own, atol, rtol):
        return "twice"
    if close(fused, own, atol, rtol):
        return "overwrote"
    if close(fused, c, atol, rtol):
        return "dropped"
    return "other"


_HEADS = {
    "twice": "the fused path counts this Function's contribution twice: it "
    "accumulated into the buffer and also returned a gradient for the input",
    "overwrote": "the fused path lost the other consumer's contribution: it "
    "overwrote the buffer (copy_ or assignment) instead of adding to it",
    "dropped": "the fused path lost this Function's contribution: it returned "
    "None without accumulating into the buffer in place",
    "missing": "a gradient is missing on one of the paths",
    "other": "the gradients differ",
}
_FIXES = {
    "twice": "return None for an input whose buffer you accumulated into",
    "overwrote": "accumulate in place (buffer.add_(g), buffer.addmm_(...)), never copy_ into the buffer",
    "dropped": "add your contribution into the buffer itself, in place (add_, addmm_), "
    "not into a copy (buffer + g), before returning None",
    "missing": "the fused path (buffer exposed) must compute the same gradient as the "
    "fallback: accumulate into the buffer in place and return None for that "
    "input, and leave the other inputs' gradients unchanged",
}
_FIXES["other"] = _FIXES["missing"]


def _diagnose(kind, fused, fallback):
    head = _HEADS[kind]
    if fused is None or fallback is None:
        return head
    return f"{head} (buffer exposed vs None: max abs difference {max_abs(fused, fallback):.3g})"


def _report_retained(subject, report, idx, outlives_graph):
    where = (
        "in a global, a closure or a class attribute (it outlives the graph)"
        if outlives_graph
        else "on ctx or on something the graph keeps alive (it dies with the graph)"
    )
    report.add(
        "input_grad_buffers.not_retained", FAILED,
        f"the buffer handed out for {subject.name_of(idx)} is still alive after "
        f"backward returned: it is kept {where}. A later producer may replace "
        "the engine's buffer, making the kept tensor stale, and holding it makes "
        "the engine fall back to out-of-place accumulation",
        subject=subject.name_of(idx),
        fix="use the buffer only inside backward, synchronously, and drop every "
        "reference to it (and to views of it) before returning",
    )
