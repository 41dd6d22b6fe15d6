"""Jacobians three ways, for the gradient rules: finite differences of the
forward, backward (vector-Jacobian products) and jvp (Jacobian-vector
products), each evaluation on fresh inputs.

``torch.autograd.gradcheck`` runs one forward and then calls backward many
times on that one graph; a backward that can run only once (it frees its
state, or changes a saved tensor in place) then looks wrong. Here every
backward has its own forward, and gradients are read from the leaves'
``.grad`` after ``torch.autograd.backward`` (what training code does), so a
backward that itself calls ``backward`` (checkpointing) works too.

Complex tensors are handled through their real view: a complex input is two
real inputs (real and imaginary parts), a complex output two real outputs,
with torch's convention that the gradient of a real loss ``L`` is
``dL/d(re) + i dL/d(im)``.
"""
import contextlib
import warnings

import torch
import torch.autograd.forward_ad as fwAD

from ._common import error_text
from ._subject import BudgetSpent


class EvaluationError(Exception):
    """The Function (or reference) raised while being evaluated."""

    def __init__(self, stage, exc):
        super().__init__(f"{stage}: {error_text(exc)}")
        self.stage = stage
        self.exc = exc


# -- real views ----------------------------------------------------------------


def flat(t):
    """The real view of ``t`` as a flat float64 vector."""
    t = t.detach()
    if t.is_complex():
        return torch.view_as_real(t.resolve_conj()).reshape(-1).to(torch.float64)
    return t.reshape(-1).to(torch.float64)


def real_numel(t):
    return t.numel() * (2 if t.is_complex() else 1)


def unflat(vec, like):
    """Inverse of :func:`flat`, in ``like``'s dtype and shape."""
    if like.is_complex():
        real = vec.to(like.dtype.to_real()).reshape(*like.shape, 2)
        return torch.view_as_complex(real.contiguous()).to(like.device)
    return vec.to(like.dtype).reshape(like.shape).to(like.device)


def basis(like, j):
    e = torch.zeros(real_numel(like), dtype=torch.float64)
    e[j] = 1.0
    return unflat(e, like)


def element(like, j):
    """The index of real element j of ``like`` in words: ``[2, 1]``, ``[0].imag``."""
    complex_ = like.is_complex()
    flat_index = j // 2 if complex_ else j
    index = []
    for size in reversed(like.shape):
        index.append(flat_index % size)
        flat_index //= size
    text = "[" + ", ".join(str(n) for n in reversed(index)) + "]"
    if complex_:
        text += ".imag" if j % 2 else ".real"
    return text


def dot(a, b):
    return float((flat(a) * flat(b)).sum())


def zeros_like_or(t, like):
    return t if t is not None else torch.zeros_like(like)


# -- what is differentiated ------------------------------------------------------


class Problem:
    """A function of ``len(inputs)`` tensors to tensors; every evaluation
    builds its own graph from fresh leaves. Subclasses define ``_forward``:
    what it returns must be connected to the leaves it is given."""

    forward_stage = "forward"  # what evaluating the function is called in messages

    def __init__(self, inputs, seeded=contextlib.nullcontext):
        self.inputs = [x.detach() for x in inputs]
        self.seeded = seeded
        self.outputs = None  # the outputs at self.inputs, set by values()

    def _forward(self, xs):
        raise NotImplementedError

    def _run(self, stage, thunk):
        try:
            with self.seeded(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return thunk()
        except (BudgetSpent, EvaluationError):
            raise
        except Exception as exc:  # noqa: BLE001 - the user's code raised
            raise EvaluationError(stage, exc) from exc

    def values(self, xs=None, stage=None):
        xs = self.inputs if xs is None else xs
        stage = stage or self.forward_stage

        def run():
            leaves = [x.detach().clone().requires_grad_(True) for x in xs]
            return [o.detach() for o in self._forward(leaves)]

        out = self._run(stage, run)
        if xs is self.inputs and self.outputs is None:
            self.outputs = out
        elif self.outputs is not None:
            for k, (o, ref) in enumerate(zip(out, self.outputs)):
                if o.shape != ref.shape:
                    raise EvaluationError(stage, ValueError(
                        f"output {k} has shape {list(o.shape)} here but {list(ref.shape)} at the "
                        "sample: its shape depends on the input values, which finite "
                        "differences cannot follow"))
        return out

    def vjp(self, cotangents, xs=None, stage="backward", create_graph=False):
        """Gradients (one per input, None where there is none) of
        ``sum(cotangent . output)`` at ``xs``."""
        xs = self.inputs if xs is None else xs

        def run():
            leaves = [x.detach().clone().requires_grad_(True) for x in xs]
            outs = self._forward(leaves)
            # Copies: a backward that changes its gradient in place must not
            # change the caller's direction vectors.
            pairs = [(o, c.clone()) for o, c in zip(outs, cotangents)
                     if c is not None and o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [c for _, c in pairs],
                                        create_graph=create_graph)
            grads = [None if l.grad is None else l.grad.detach() for l in leaves]
            for l in leaves:
                l.grad = None  # breaks the leaf <-> grad cycle of create_graph
            return grads

        return self._run(stage, run)

    def undefined_vjp(self, stage):
        """Gradients when no output has a gradient (the engine hands backward
        zeros, or None with set_materialize_grads(False)); None if this torch
        cannot make undefined gradients."""
        undefined = getattr(getattr(torch._C, "_functions", None), "UndefinedGrad", None)
        if undefined is None:
            return None

        def run():
            leaves = [x.detach().clone().requires_grad_(True) for x in self.inputs]
            outs = [undefined()(o) for o in self._forward(leaves) if o.requires_grad]
            if outs:
                torch.autograd.backward(outs, [torch.zeros_like(o) for o in outs])
            return [None if l.grad is None else l.grad.detach() for l in leaves]

        return self._run(stage, run)

    def jvp(self, tangents, xs=None, stage="jvp"):
        """Tangents of the outputs (zeros where jvp gave none) for input
        ``tangents`` (zeros where None)."""
        xs = self.inputs if xs is None else xs

        def run():
            with fwAD.dual_level():
                duals = [
                    fwAD.make_dual(x.detach().clone(), zeros_like_or(t, x).clone())
                    for x, t in zip(xs, tangents)
                ]
                outs = self._forward(duals)
                result = []
                for o in outs:
                    primal, tangent = fwAD.unpack_dual(o)
                    result.append(
                        torch.zeros_like(primal) if tangent is None else tangent.detach().clone()
                    )
                return result

        return self._run(stage, run)

    def directional(self, direction, eps, xs=None):
        """Central differences of the outputs along ``direction`` (one entry
        per input, None: not moved), as flat float64 vectors."""
        xs = self.inputs if xs is None else xs
        plus = [x if d is None else x + eps * d.to(x.dtype) for x, d in zip(xs, direction)]
        minus = [x if d is None else x - eps * d.to(x.dtype) for x, d in zip(xs, direction)]
        stage = f"{self.forward_stage} at inputs moved by finite-difference steps"
        fp = self.values(plus, stage)
        fm = self.values(minus, stage)
        return [(flat(p) - flat(m)) / (2 * eps) for p, m in zip(fp, fm)]


class SecondOrder(Problem):
    """(inputs, cotangents) -> the first problem's gradients, with
    ``create_graph=True``: its backward is the double backward."""

    forward_stage = "backward with create_graph=True"

    def __init__(self, first, cotangents):
        super().__init__(list(first.inputs) + list(cotangents), first.seeded)
        self.first = first
        self.n = len(first.inputs)

    def _forward(self, leaves):
        xs, us = leaves[: self.n], leaves[self.n :]
        outs = self.first._forward(xs)
        pairs = [(o, u) for o, u in zip(outs, us) if o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [u for _, u in pairs], create_graph=True)
        grads = []
        for x in xs:
            g = x.grad
            x.grad = None
            grads.append(torch.zeros_like(x) if g is None else g)
        return grads
