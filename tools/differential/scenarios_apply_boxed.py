"""Differential scenarios for Functions with ``boxed_grads_call = True``
(the boxed apply: backward gets the gradients as one list it may clear):
with ``ctx.input_grad_buffers``, with ``ctx.set_output_grad_dtype``, applied
directly through the node, and from several threads on one graph.

Names: ``apply_boxed.<concern>.<case>``.
"""

import threading

import torch
from torch.autograd import Function

from sample_functions import DECLARATIONS, OMIT, CastGradTo, doubling
from scenario_helpers import Section, describe_buffers, dtype_name, fuse_into, grad_values, leaf, outcome_of
from scenario_helpers import read_buffers, tensor_values

INPUT_GRAD_BUFFERS = Section("apply_boxed.input_grad_buffers")
SET_OUTPUT_GRAD_DTYPE = Section("apply_boxed.set_output_grad_dtype")
THREADS = Section("apply_boxed.threads")


# --------------------------------------------------------- input_grad_buffers


@INPUT_GRAD_BUFFERS.scenario
def boxed_grads_call():
    rec = {}

    class F(Function):
        boxed_grads_call = True

        @staticmethod
        def forward(ctx, x, w):
            return x * w

        @staticmethod
        def backward(ctx, grads):
            rec["grads_type"] = type(grads).__name__
            rec["grads_len"] = len(grads)
            g = grads[0]
            grads.clear()
            b = ctx.input_grad_buffers
            rec["bufs"] = describe_buffers(b)
            return fuse_into(b[0], g * 2.0), g * 2.0

    x = leaf([1.0, 2.0])
    w = leaf([2.0, 2.0])
    y = F.apply(x, w)
    (y.sum() + (x * 3.0).sum()).backward()
    return {"rec": rec, **grad_values(x=x, w=w)}


@INPUT_GRAD_BUFFERS.scenario
def boxed_direct_apply():
    rec = {}

    def backward(ctx, grads):
        rec["grads_type"] = type(grads).__name__
        rec["bufs"], rec["err"] = read_buffers(ctx)
        return grads[0] * 2.0

    x = leaf([1.0, 2.0])
    y = doubling(backward, boxed=True).apply(x)
    out = outcome_of(lambda: tensor_values(y.grad_fn.apply(torch.ones(2))))
    return {"rec": rec, "apply": out}


# ------------------------------------------------------ set_output_grad_dtype


@SET_OUTPUT_GRAD_DTYPE.scenario
def boxed_declared_dtype():
    res = {}
    for k, decl in DECLARATIONS.items():
        rec = {}

        class F(Function):
            boxed_grads_call = True

            @staticmethod
            def forward(ctx, x, decl=decl):
                if decl != OMIT:
                    ctx.set_output_grad_dtype(decl, None)
                return x * 2.0, x * 3.0

            @staticmethod
            def backward(ctx, grads, rec=rec):
                rec["grads_type"] = type(grads).__name__
                rec["dtypes"] = [dtype_name(g) for g in grads]
                g = grads[0]
                grads.clear()
                return g.float() * 2.0

        x = leaf([1.0, 2.0])
        a, b = F.apply(x)
        z = CastGradTo.apply(a, torch.float64)
        r = outcome_of(lambda: (z.sum() + b.sum()).backward())
        res[k] = {"rec": rec, "backward": r, **grad_values(x=x)}
    return res


def boxed_declaring_case(declaration, as_float, outcome, run, observe_x_grad=False):
    """y = 2x, boxed, declaring ``declaration``, whose backward records the
    dtypes it gets and returns 2g (cast to float32 with ``as_float``): what
    ``run(y)`` gives, under the key ``outcome`` (and x.grad with ``observe_x_grad``)."""
    rec = {}

    def backward(ctx, grads):
        rec["dtypes"] = [dtype_name(g) for g in grads]
        return (grads[0].float() if as_float else grads[0]) * 2.0

    F = doubling(backward, in_forward=lambda ctx: ctx.set_output_grad_dtype(declaration), boxed=True)
    x = leaf([1.0, 2.0])
    y = F.apply(x)
    out = {"rec": rec, outcome: outcome_of(lambda: run(y))}
    if observe_x_grad:
        out.update(grad_values(x=x))
    return out


SET_OUTPUT_GRAD_DTYPE.table(
    boxed_declaring_case,
    {
        "boxed_declared_dtype_root_grad": dict(
            declaration=torch.float16,
            as_float=True,
            outcome="backward",
            run=lambda y: y.backward(torch.tensor([1.0, 3.0], dtype=torch.float64)),
            observe_x_grad=True,
        ),
        "boxed_direct_apply_declared": dict(
            declaration=torch.float64,
            as_float=False,
            outcome="apply",
            run=lambda y: dtype_name(y.grad_fn.apply(torch.ones(2))),
        ),
    },
)


# -------------------------------------------------------------------- threads


class _BoxedIdentity(Function):
    boxed_grads_call = True

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grads):
        (g,) = grads
        return g


@THREADS.scenario
def several_threads_on_one_graph():
    x = torch.zeros(3, requires_grad=True)
    out = _BoxedIdentity.apply(x)
    wrong = []

    def run(index):
        for step in range(50):
            g = torch.full((3,), float(index * 1000 + step))
            (grad_x,) = torch.autograd.grad(out, x, g, retain_graph=True)
            if not torch.equal(grad_x, g):
                wrong.append(index)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    direct = out.grad_fn.apply(torch.tensor([5.0, 6.0, 7.0]))
    return {"wrong": len(wrong), "direct_apply": tensor_values(direct)}
