"""Rules of ``torch.func.vmap`` for a Function that defines a vmap rule (a
``vmap`` staticmethod, or ``generate_vmap_rule = True``): batched, it gives
what it gives sample by sample, for its outputs and, through
``torch.func.grad``, for its gradients (per-sample gradients).

The batched run and each per-sample run get their own copies of the
arguments: a Function that changes its input in place (mark_dirty), batched
by a vmap staticmethod that applies it to the batched input, must not give
the loop the inputs the batched run changed."""
import warnings

import torch

from ._common import as_tuple, error_text, fresh_copies, is_float
from ._core import close, max_abs, tolerances
from ._function_info import defines_vmap, uses_setup_context
from .report import FAILED, PASSED, SKIPPED, register

RULES = register({
    "vmap.matches_loop": (
        "under torch.func.vmap the Function's outputs, and its gradients under "
        "torch.func.grad, equal those computed sample by sample"
    ),
})

BATCH = 3


def _batched(subject, which, gen):
    """Arguments with a batch dimension (dim 0) at the positions in ``which``:
    floating samples moved a little per batch element, others repeated."""
    batched, in_dims = [], []
    for i, a in enumerate(subject.args):
        if i not in which:
            batched.append(a.detach().clone() if isinstance(a, torch.Tensor) else a)
            in_dims.append(None)
            continue
        a = a.detach()
        rows = []
        for b in range(BATCH):
            if is_float(a) and b:
                noise = torch.rand(a.shape, generator=gen, dtype=torch.float64) - 0.5
                rows.append(a + (0.1 * noise).to(a.dtype))
            else:
                rows.append(a.clone())
        batched.append(torch.stack(rows))
        in_dims.append(0)
    return batched, tuple(in_dims)


def _tensor_outputs(fn):
    def call(*args):
        return tuple(o for o in as_tuple(fn.apply(*args)) if isinstance(o, torch.Tensor))

    return call


def _close(a, b):
    """The batched result ``a`` equals the loop's ``b``: same dtype, and
    close within rounding (two computations of the same values)."""
    _, atol, rtol = tolerances("rounding", [a.dtype])
    return a.dtype == b.dtype and close(a, b, atol, rtol)


def check(subject, report):
    name = "vmap.matches_loop"
    kind = defines_vmap(subject.fn)
    opts = subject.options
    if kind is None:
        report.add(name, SKIPPED, "the Function defines no vmap rule (a vmap staticmethod "
                   "or generate_vmap_rule = True)")
        return
    if not opts.on("vmap"):
        report.add(name, SKIPPED, opts.off_reason("vmap"))
        return
    if subject.budget.spent():
        report.add(name, SKIPPED, subject.budget.skip_reason())
        return
    if not uses_setup_context(subject.fn):
        report.add(
            name, FAILED,
            f"the Function defines a vmap rule ({kind}) but its forward takes ctx: "
            "torch.func.vmap refuses such a Function",
            fix="move what forward does with ctx into a setup_context(ctx, inputs, output) "
            "staticmethod and drop ctx from forward's arguments",
        )
        return
    if not subject.positions:
        report.add(name, SKIPPED, "no tensor argument to batch")
        return
    gen = torch.Generator().manual_seed(opts.seed + 37)
    configs = [("every tensor argument batched", set(subject.positions))]
    if len(subject.positions) > 1:
        configs.append((f"only {subject.name_of(subject.positions[0])} batched",
                        {subject.positions[0]}))
    call = _tensor_outputs(subject.fn)
    for what, which in configs:
        batched, in_dims = _batched(subject, which, gen)
        problem = _outputs_differ(subject, call, batched, in_dims)
        if problem is None and subject.grad_positions and subject.differentiable_outputs:
            problem = _gradients_differ(subject, batched, in_dims)
        if problem is not None:
            text, fix, *raised = problem  # (text, fix, exception) when the Function raised
            report.add(name, FAILED, f"{what} ({kind}): {text}", subject=what,
                       fix=fix, exception=raised[0] if raised else None)
            return
    report.add(name, PASSED, f"{kind}; outputs" + (
        " and per-sample gradients" if subject.grad_positions and subject.differentiable_outputs
        else "") + " match a loop over the batch, " + " and ".join(w for w, _ in configs))


_FIX = ("the vmap staticmethod must return (outputs, out_dims) such that each sample's "
        "slice is what forward gives for that sample's inputs; with in_dims None an "
        "argument is shared by the whole batch")


def _per_sample(args, in_dims, b):
    return [a[b] if d == 0 else a for a, d in zip(args, in_dims)]


def _outputs_differ(subject, call, batched, in_dims):
    try:
        with subject.seeded(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = torch.func.vmap(call, in_dims=in_dims)(*fresh_copies(batched))
    except Exception as exc:  # noqa: BLE001 - reported
        return f"torch.func.vmap raised {error_text(exc)}", _FIX, exc
    loop = []
    try:
        for b in range(BATCH):
            with subject.seeded():
                loop.append(call(*fresh_copies(_per_sample(batched, in_dims, b))))
    except Exception as exc:  # noqa: BLE001 - reported
        return f"the Function raised on one sample of the batch: {error_text(exc)}", _FIX, exc
    if len(got) != len(loop[0]):
        return f"{len(got)} tensor outputs batched, {len(loop[0])} per sample", _FIX
    for k, g in enumerate(got):
        expected = torch.stack([row[k] for row in loop])
        if not _close(g, expected):
            if g.shape != expected.shape:
                how = f"shape {list(g.shape)}, expected {list(expected.shape)}"
            else:
                how = f"max abs difference {max_abs(g, expected):.3g}"
            return f"output {k} differs from the loop over the batch ({how})", _FIX
    return None


def _gradients_differ(subject, batched, in_dims):
    positions = subject.grad_positions
    outputs = subject.differentiable_outputs

    def loss(*args):
        # Clones of the inputs it differentiates by (functorch's and the
        # loop's leaves): forward may change them in place, which a leaf
        # that requires grad refuses; the gradient flows through the clone.
        outs = as_tuple(subject.fn.apply(*[a.clone() if isinstance(a, torch.Tensor) else a
                                           for a in args]))
        return sum((outs[k] * (k + 1)).sum().real if outs[k].is_complex()
                   else (outs[k] * (k + 1)).sum() for k in outputs)

    try:
        with subject.seeded(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = torch.func.vmap(torch.func.grad(loss, argnums=tuple(positions)),
                                  in_dims=in_dims)(*fresh_copies(batched))
    except Exception as exc:  # noqa: BLE001 - reported
        return (f"per-sample gradients (vmap of torch.func.grad) raised {error_text(exc)}",
                "backward must work on the batched tensors vmap gives it: use torch "
                "operations only (no .item(), numpy or data-dependent Python control flow)",
                exc)
    for n, i in enumerate(positions):
        rows = []
        for b in range(BATCH):
            args = fresh_copies(_per_sample(batched, in_dims, b))
            args[i].requires_grad_(True)
            try:
                with subject.seeded():
                    (g,) = torch.autograd.grad(loss(*args), [args[i]], allow_unused=True)
            except Exception as exc:  # noqa: BLE001 - the gradient rules report it
                return (f"backward raised on one sample of the batch: {error_text(exc)}",
                        "see gradcheck", exc)
            rows.append(torch.zeros_like(args[i]) if g is None else g)
        expected = torch.stack(rows)
        if not _close(got[n], expected):
            return (f"the per-sample gradient for {subject.name_of(i)} differs from the loop "
                    "over the batch", _FIX)
    return None
