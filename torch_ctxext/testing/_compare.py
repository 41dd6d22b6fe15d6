"""Comparisons of Jacobians for the gradient rules, each returning the
places where they disagree (:class:`Mismatch`).

Modes:

``slow``  exact Jacobians: one pair of forwards per real input element, one
          backward per real output element; compared element by element.
``fast``  random projections (as gradcheck's ``fast_mode``): one pair of
          forwards per input and one backward per output, each along a
          random direction; ``u . (J v)`` from finite differences is
          compared with ``(J^T u) . v`` from backward.

The callers pass the tolerances, from the one table in _core.py
(``TOLERANCES``): finite differences with those for the precision, two
computations of the same quantity (the Function against its reference)
with those for rounding only.
"""
import math

import torch

from ._core import close
from ._jacobian import basis, dot, element, flat, real_numel, unflat, zeros_like_or


class Mismatch:
    """Where two ways of computing the Jacobian disagree."""

    def __init__(self, output, input, text):
        self.output = output  # index into the problem's outputs, or None: all
        self.input = input  # index into the problem's inputs
        self.text = text


def _worst(a, b):
    """(index, a value, b value, max abs difference) of the largest gap."""
    diff = (a - b).abs()
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)
    j = int(diff.argmax()) if diff.numel() else 0
    return j, float(a.reshape(-1)[j]), float(b.reshape(-1)[j]), float(diff.reshape(-1)[j])


def _only(what, k, outs):
    """The stage of a backward with a gradient for output k and none for
    the others (they arrive as zeros, or None)."""
    return what if len(outs) == 1 else f"{what} with a gradient for output {k} only"


def _random_directions(likes, gen):
    return [unflat(torch.rand(real_numel(t), generator=gen, dtype=torch.float64) * 2 - 1, t)
            for t in likes]


def exact_vjp_check(problem, eps, atol, rtol, budget, what="backward"):
    """Slow mode: the full Jacobian from finite differences against the one
    from backward, output block by input block."""
    xs = problem.inputs
    outs = problem.outputs if problem.outputs is not None else problem.values()
    numerical = [[torch.zeros(real_numel(o), real_numel(x), dtype=torch.float64) for x in xs]
                 for o in outs]
    for i, x in enumerate(xs):
        for j in range(real_numel(x)):
            budget.check()
            direction = [None] * len(xs)
            direction[i] = basis(x, j)
            for k, column in enumerate(problem.directional(direction, eps)):
                numerical[k][i][:, j] = column
    analytical = [[torch.zeros_like(block) for block in row] for row in numerical]
    for k, o in enumerate(outs):
        for m in range(real_numel(o)):
            budget.check()
            cotangents = [None] * len(outs)
            cotangents[k] = basis(o, m)
            grads = problem.vjp(cotangents, stage=_only(what, k, outs))
            for i, (g, x) in enumerate(zip(grads, xs)):
                if g is not None:
                    analytical[k][i][m, :] = flat(g)
    mismatches = []
    for k, o in enumerate(outs):
        for i, x in enumerate(xs):
            a, n = analytical[k][i], numerical[k][i]
            if close(a, n, atol, rtol):
                continue
            j, va, vn, d = _worst(a, n)
            rows = n.shape[1] or 1
            mismatches.append(Mismatch(k, i, (
                f"max abs difference {d:.3g}, at output element {element(o, j // rows)} "
                f"and input element {element(x, j % rows)}: finite differences {vn:.6g}, "
                f"{what} {va:.6g}")))
    if len(outs) > 1 and not mismatches:
        gen = torch.Generator().manual_seed(7)
        us = _random_directions(outs, gen)
        grads = problem.vjp(us, stage=f"{what} with gradients for all outputs")
        for i, (g, x) in enumerate(zip(grads, xs)):
            expected = sum(numerical[k][i].t() @ flat(u) for k, u in enumerate(us))
            got = flat(zeros_like_or(g, x))
            if not close(got, expected, atol, rtol):
                _, va, vn, d = _worst(got, expected)
                mismatches.append(Mismatch(None, i, (
                    f"with gradients for all outputs at once, max abs difference {d:.3g}: "
                    f"finite differences {vn:.6g}, {what} {va:.6g} (right when one output "
                    "has a gradient, wrong when all have)")))
    return mismatches


def _projection_tolerance(u, column, atol, rtol):
    """Tolerance for u . (J v) when each element of J v is known to
    atol + rtol * |value|: the errors, weighted by random u, add up like a
    random walk."""
    return atol * float(u.norm()) + rtol * float((u * column).norm())


def projected_vjp_check(problem, eps, atol, rtol, budget, seed, what="backward"):
    """Fast mode: for each input a random direction v, for each output a
    random cotangent u; ``u . (J v)`` by finite differences against
    ``(J^T u) . v`` by backward, per output and input, and for all outputs
    at once."""
    xs = problem.inputs
    outs = problem.outputs if problem.outputs is not None else problem.values()
    gen = torch.Generator().manual_seed(seed)
    vs = _random_directions(xs, gen)
    us = _random_directions(outs, gen)
    columns = []  # [input][output] flat J_ki v_i
    for i, v in enumerate(vs):
        budget.check()
        direction = [None] * len(xs)
        direction[i] = v
        columns.append(problem.directional(direction, eps))
    mismatches = []
    cases = [(k, [u if kk == k else None for kk, u in enumerate(us)]) for k, u in enumerate(us)]
    if len(outs) > 1:
        cases.append((None, us))
    for k, cotangents in cases:
        budget.check()
        stage = f"{what} with gradients for all outputs" if k is None else _only(what, k, outs)
        grads = problem.vjp(cotangents, stage=stage)
        for i, (g, v, x) in enumerate(zip(grads, vs, xs)):
            got = dot(zeros_like_or(g, x), v)
            ks = range(len(outs)) if k is None else [k]
            expected = sum(float(flat(us[kk]) @ columns[i][kk]) for kk in ks)
            tol = sum(_projection_tolerance(flat(us[kk]), columns[i][kk], atol, rtol) for kk in ks)
            if abs(got - expected) <= tol or (math.isnan(got) and math.isnan(expected)):
                continue
            where = "with gradients for all outputs at once, " if k is None else ""
            mismatches.append(Mismatch(k, i, (
                f"{where}along random directions: finite differences {expected:.6g}, "
                f"{what} {got:.6g} (difference {abs(got - expected):.3g}, tolerance {tol:.3g})")))
        if k is None and any(m.output is not None for m in mismatches):
            break
    return mismatches


def jvp_check(problem, eps, atol, rtol, budget, seed, slow):
    """jvp's output tangents against finite differences along the same
    input direction: every basis direction (slow) or one random direction
    per input (fast)."""
    xs = problem.inputs
    outs = problem.outputs if problem.outputs is not None else problem.values()
    gen = torch.Generator().manual_seed(seed)
    directions = []
    for i, x in enumerate(xs):
        if slow:
            directions += [(i, basis(x, j), element(x, j)) for j in range(real_numel(x))]
        else:
            directions.append((i, _random_directions([x], gen)[0], None))
    mismatches, seen = [], set()
    for i, d, where in directions:
        budget.check()
        tangents = [None] * len(xs)
        tangents[i] = d
        got = problem.jvp(tangents, stage=f"jvp with a tangent for input {i}")
        expected = problem.directional(tangents, eps)
        for k, (t, e, o) in enumerate(zip(got, expected, outs)):
            a = flat(t)
            if (k, i) in seen or close(a, e, atol, rtol):
                continue
            seen.add((k, i))
            j, va, ve, diff = _worst(a, e)
            along = f"along input element {where}" if where else "along a random direction"
            mismatches.append(Mismatch(k, i, (
                f"{along}: max abs difference {diff:.3g} at output element {element(o, j)}: "
                f"finite differences {ve:.6g}, jvp {va:.6g}")))
    return mismatches


def jvp_vs_vjp_check(problem, atol, rtol, budget, seed):
    """``u . jvp(v)`` against ``vjp(u) . v``: forward and reverse mode must
    be the same linear map."""
    xs = problem.inputs
    outs = problem.outputs if problem.outputs is not None else problem.values()
    gen = torch.Generator().manual_seed(seed)
    vs = _random_directions(xs, gen)
    us = _random_directions(outs, gen)
    forward = []
    for i, v in enumerate(vs):
        budget.check()
        tangents = [None] * len(xs)
        tangents[i] = v
        forward.append(problem.jvp(tangents, stage=f"jvp with a tangent for input {i}"))
    mismatches = []
    for k, u in enumerate(us):
        budget.check()
        cotangents = [None] * len(outs)
        cotangents[k] = u
        grads = problem.vjp(cotangents, stage=_only("backward", k, outs))
        for i, (g, v, x) in enumerate(zip(grads, vs, xs)):
            by_backward = dot(zeros_like_or(g, x), v)
            by_jvp = float(flat(u) @ flat(forward[i][k]))
            tol = _projection_tolerance(flat(u), flat(forward[i][k]), atol, rtol)
            if abs(by_backward - by_jvp) <= tol:
                continue
            mismatches.append(Mismatch(k, i, (
                f"along random directions: jvp gives {by_jvp:.6g}, backward {by_backward:.6g} "
                f"(difference {abs(by_backward - by_jvp):.3g})")))
    return mismatches


def reference_values_check(problem, reference, atol, rtol):
    mismatches = []
    got = problem.values()
    expected = reference.values(stage="the reference")
    for k, (a, e) in enumerate(zip(got, expected)):
        if a.shape != e.shape:
            mismatches.append(Mismatch(k, None, f"shape {list(a.shape)}, the reference's "
                                                f"{list(e.shape)}"))
            continue
        if not close(flat(a), flat(e), atol, rtol):
            j, va, ve, d = _worst(flat(a), flat(e))
            mismatches.append(Mismatch(k, None, (
                f"max abs difference {d:.3g} at element {element(a, j)}: the Function "
                f"{va:.6g}, the reference {ve:.6g}")))
    return mismatches


def reference_vjp_check(problem, reference, atol, rtol, budget, seed, what="backward"):
    """backward's gradients against the reference's, for random cotangents
    on each output alone and on all outputs at once."""
    outs = problem.outputs if problem.outputs is not None else problem.values()
    gen = torch.Generator().manual_seed(seed)
    us = _random_directions(outs, gen)
    cases = [(k, [u if kk == k else None for kk, u in enumerate(us)]) for k, u in enumerate(us)]
    if len(outs) > 1:
        cases.append((None, us))
    mismatches = []
    for k, cotangents in cases:
        budget.check()
        stage = f"{what} with gradients for all outputs" if k is None else _only(what, k, outs)
        got = problem.vjp(cotangents, stage=stage)
        expected = reference.vjp(cotangents, stage=f"the reference's {stage}")
        for i, (g, e, x) in enumerate(zip(got, expected, problem.inputs)):
            a, b = flat(zeros_like_or(g, x)), flat(zeros_like_or(e, x))
            if close(a, b, atol, rtol):
                continue
            j, va, vb, d = _worst(a, b)
            where = "with gradients for all outputs at once, " if k is None else ""
            mismatches.append(Mismatch(k, i, (
                f"{where}max abs difference {d:.3g} at input element {element(x, j)}: "
                f"{what} {va:.6g}, the reference's gradient {vb:.6g}")))
        if mismatches:
            break
    return mismatches


def reference_jvp_check(problem, reference, atol, rtol, budget, seed):
    gen = torch.Generator().manual_seed(seed)
    vs = _random_directions(problem.inputs, gen)
    outs = problem.outputs if problem.outputs is not None else problem.values()
    mismatches = []
    for i, v in enumerate(vs):
        budget.check()
        tangents = [None] * len(vs)
        tangents[i] = v
        got = problem.jvp(tangents, stage=f"jvp with a tangent for input {i}")
        expected = reference.jvp(tangents, stage="the reference under forward-mode AD")
        for k, (a, e, o) in enumerate(zip(got, expected, outs)):
            if close(flat(a), flat(e), atol, rtol):
                continue
            j, va, ve, d = _worst(flat(a), flat(e))
            mismatches.append(Mismatch(k, i, (
                f"along a random direction: max abs difference {d:.3g} at output element "
                f"{element(o, j)}: jvp {va:.6g}, the reference {ve:.6g}")))
    return mismatches
