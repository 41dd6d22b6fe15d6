"""Differential scenarios for the ctx features ``input_grad_buffers`` and
``set_output_grad_dtype``.

Each scenario builds a tiny custom autograd.Function graph on the CPU, runs
it and returns a JSON-serialisable dict of observations.  Only the public
torch 2.15 API is used (``ctx.input_grad_buffers``,
``ctx.set_output_grad_dtype``, ``boxed_grads_call``) so the same file can run
against native torch 2.15 and against torch 2.13 + the torch_ctxext backport.

Scenario names are prefixed with the question number they answer
(``q01_...`` .. ``q15_...``).
"""

import threading

import torch
from torch.autograd import Function
from torch.autograd.function import once_differentiable

SCENARIOS = []


def scenario(fn):
    SCENARIOS.append((fn.__name__, fn))
    return fn


# ---------------------------------------------------------------- helpers


def R(t, nd=4):
    """Tensor -> rounded (nested) list; complex -> [re, im] pairs."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        return repr(t)
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    if t.dtype == torch.bool:
        return t.tolist()
    vals = t.to(torch.float64).tolist()

    def rnd(v):
        if isinstance(v, list):
            return [rnd(i) for i in v]
        return round(v, nd)

    return rnd(vals)


def E(e):
    return {"exc_type": type(e).__name__, "msg": str(e)}


def D(t):
    return None if t is None else str(t.dtype)


def desc_bufs(bufs):
    """Describe a tuple returned by ctx.input_grad_buffers."""
    if not isinstance(bufs, tuple):
        return {"not_tuple": type(bufs).__name__}
    out = []
    for b in bufs:
        if b is None:
            out.append(None)
        else:
            out.append(
                {
                    "type": type(b).__name__,
                    "dtype": str(b.dtype),
                    "shape": list(b.shape),
                    "values": R(b),
                }
            )
    return {"len": len(bufs), "entries": out}


def read_bufs(ctx):
    try:
        return desc_bufs(ctx.input_grad_buffers), None
    except Exception as e:  # noqa: BLE001
        return None, E(e)


def try_(f):
    try:
        return {"ok": f()}
    except Exception as e:  # noqa: BLE001
        return {"error": E(e)}


def make_fuse(scale=2.0, fuse=True, rec=None):
    """Function y = scale * x; backward reads buffers and fuses if exposed."""
    rec = {} if rec is None else rec

    class Fuse(Function):
        @staticmethod
        def forward(ctx, x):
            return x * scale

        @staticmethod
        def backward(ctx, g):
            try:
                bufs = ctx.input_grad_buffers
            except Exception as e:  # noqa: BLE001
                rec.setdefault("read_errors", []).append(E(e))
                return g * scale
            rec.setdefault("reads", []).append(desc_bufs(bufs))
            rec["grad_dtype"] = D(g)
            if fuse and bufs[0] is not None:
                bufs[0].add_(g * scale)
                return None
            return g * scale

    return Fuse, rec


def make_scale_multi(rec):
    """Function over (*args): returns sum of tensor args * 2, shape of 1st."""

    class Multi(Function):
        @staticmethod
        def forward(ctx, *args):
            ctx.kinds = [isinstance(a, torch.Tensor) for a in args]
            t = [a for a in args if isinstance(a, torch.Tensor)]
            out = t[0] * 2
            for a in t[1:]:
                out = out + a * 2
            return out

        @staticmethod
        def backward(ctx, g):
            b, err = read_bufs(ctx)
            rec["bufs"] = b
            if err:
                rec["err"] = err
            return tuple(g * 2 if k else None for k in ctx.kinds)

    return Multi


def leaf(vals, dtype=torch.float32):
    return torch.tensor(vals, dtype=dtype, requires_grad=True)


# ------------------------------------------------ Q1: tuple length / args


@scenario
def q01_len_tensor_and_nontensor_args():
    rec = {}
    F = make_scale_multi(rec)
    x = leaf([1.0, 2.0])
    w = leaf([3.0, 4.0])
    y = F.apply(x, 3, "s", w, None)
    (y.sum() + (x * 3).sum() + (w * 5).sum()).backward()
    return {"rec": rec, "x.grad": R(x.grad), "w.grad": R(w.grad)}


def _default_arg_fn(style, rec):
    if style == "old":

        class DefOld(Function):
            @staticmethod
            def forward(ctx, x, scale=2.0, flag=None):
                ctx.scale = scale
                return x * scale

            @staticmethod
            def backward(ctx, g):
                rec["bufs"], rec["err"] = read_bufs(ctx)
                rec["nargs_return"] = 3
                return g * ctx.scale, None, None

        return DefOld

    class DefSetup(Function):
        @staticmethod
        def forward(x, scale=2.0, flag=None):
            return x * scale

        @staticmethod
        def setup_context(ctx, inputs, output):
            rec["setup_inputs_len"] = len(inputs)
            ctx.scale = inputs[1]

        @staticmethod
        def backward(ctx, g):
            rec["bufs"], rec["err"] = read_bufs(ctx)
            return g * ctx.scale, None, None

    return DefSetup


@scenario
def q01_len_default_not_passed_oldstyle():
    rec = {}
    F = _default_arg_fn("old", rec)
    x = leaf([1.0, 2.0])
    out = {}
    try:
        y = F.apply(x)
        (y.sum() + (x * 3).sum()).backward()
    except Exception as e:  # noqa: BLE001
        out["error"] = E(e)
    out.update(rec=rec, xgrad=R(x.grad))
    return out


@scenario
def q01_len_default_not_passed_setup_context():
    rec = {}
    F = _default_arg_fn("setup", rec)
    x = leaf([1.0, 2.0])
    out = {}
    try:
        y = F.apply(x)
        (y.sum() + (x * 3).sum()).backward()
    except Exception as e:  # noqa: BLE001
        out["error"] = E(e)
    out.update(rec=rec, xgrad=R(x.grad))
    return out


@scenario
def q01_len_default_passed_positionally_setup_context():
    rec = {}
    F = _default_arg_fn("setup", rec)
    x = leaf([1.0, 2.0])
    out = {}
    try:
        y = F.apply(x, 4.0)
        (y.sum() + (x * 3).sum()).backward()
    except Exception as e:  # noqa: BLE001
        out["error"] = E(e)
    out.update(rec=rec, xgrad=R(x.grad))
    return out


@scenario
def q01_kwargs_oldstyle():
    rec = {}
    F = _default_arg_fn("old", rec)
    x = leaf([1.0, 2.0])
    out = {}
    try:
        y = F.apply(x, scale=4.0)
        (y.sum() + (x * 3).sum()).backward()
    except Exception as e:  # noqa: BLE001
        out["error"] = E(e)
    out.update(rec=rec, xgrad=R(x.grad))
    return out


@scenario
def q01_kwargs_setup_context():
    rec = {}
    F = _default_arg_fn("setup", rec)
    x = leaf([1.0, 2.0])
    out = {}
    try:
        y = F.apply(x, scale=4.0)
        (y.sum() + (x * 3).sum()).backward()
    except Exception as e:  # noqa: BLE001
        out["error"] = E(e)
    out.update(rec=rec, xgrad=R(x.grad))
    return out


@scenario
def q01_no_args_beyond_one_tensor():
    rec = {}
    F = make_scale_multi(rec)
    x = leaf([1.0, 2.0])
    y = F.apply(x)
    (y.sum() + (x * 3).sum()).backward()
    return {"rec": rec, "x.grad": R(x.grad)}


# ------------------------------------------------ Q2: engine order


def _order(leaf_x, after):
    F, rec = make_fuse()
    a = leaf([1.0, 2.0, 3.0])
    x = a if leaf_x else a * 1.0
    if after:
        y = F.apply(x)
        z = x * 3.0
    else:
        z = x * 3.0
        y = F.apply(x)
    (y.sum() + z.sum()).backward()
    return {"rec": rec, "a.grad": R(a.grad)}


@scenario
def q02_leaf_consumer_after():
    return _order(True, True)


@scenario
def q02_leaf_consumer_before():
    return _order(True, False)


@scenario
def q02_nonleaf_consumer_after():
    return _order(False, True)


@scenario
def q02_nonleaf_consumer_before():
    return _order(False, False)


@scenario
def q02_nonleaf_two_consumers_after():
    F, rec = make_fuse()
    a = leaf([1.0, 2.0])
    x = a * 1.0
    y = F.apply(x)
    z1 = x * 3.0
    z2 = x * 5.0
    (y.sum() + z1.sum() + z2.sum()).backward()
    return {"rec": rec, "a.grad": R(a.grad)}


@scenario
def q02_only_consumer_is_fn():
    F, rec = make_fuse()
    x = leaf([1.0, 2.0])
    F.apply(x).sum().backward()
    return {"rec": rec, "x.grad": R(x.grad)}


@scenario
def q02_no_fuse_returns_grad_anyway():
    F, rec = make_fuse(fuse=False)
    x = leaf([1.0, 2.0])
    y = F.apply(x)
    (y.sum() + (x * 3.0).sum()).backward()
    return {"rec": rec, "x.grad": R(x.grad)}


@scenario
def q02_fuse_and_also_return_grad():
    """Mutate the buffer AND return a grad: both contributions count?"""
    rec = {}

    class F(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2.0

        @staticmethod
        def backward(ctx, g):
            b = ctx.input_grad_buffers
            rec["bufs"] = desc_bufs(b)
            if b[0] is not None:
                b[0].add_(100.0)
            return g * 2.0

    x = leaf([1.0, 2.0])
    y = F.apply(x)
    (y.sum() + (x * 3.0).sum()).backward()
    return {"rec": rec, "x.grad": R(x.grad)}


# ------------------------------------------------ Q3: None cases


@scenario
def q03_add_aliased_with_nonleaf_pending():
    F, rec = make_fuse()
    x = leaf([1.0, 2.0])
    v = leaf([10.0, 20.0])
    w = v * 1.0  # producer created before F -> runs after F
    y = F.apply(x)
    z = ((x + w) * 3.0).sum()
    (y.sum() + z).backward()
    return {"rec": rec, "x.grad": R(x.grad), "v.grad": R(v.grad)}


@scenario
def q03_add_aliased_with_leaf():
    F, rec = make_fuse()
    x = leaf([1.0, 2.0])
    w = leaf([10.0, 20.0])
    y = F.apply(x)
    z = ((x + w) * 3.0).sum()
    (y.sum() + z).backward()
    return {"rec": rec, "x.grad": R(x.grad), "w.grad": R(w.grad)}


@scenario
def q03_add_same_tensor_twice():
    F, rec = make_fuse()
    x = leaf([1.0, 2.0])
    y = F.apply(x)
    z = ((x + x) * 3.0).sum()
    (y.sum() + z).backward()
    return {"rec": rec, "x.grad": R(x.grad)}


@scenario
def q03_add_nonrequiring_other():
    F, rec = make_fuse()
    x = leaf([1.0, 2.0])
    w = torch.tensor([10.0, 20.0])
    y = F.apply(x)
    z = ((x + w) * 3.0).sum()
    (y.sum() + z).backward()
    return {"rec": rec, "x.grad": R(x.grad)}


@scenario
def q03_sum_expanded_grad():
    F, rec = make_fuse()
    x = leaf([1.0, 2.0])
    y = F.apply(x)
    z = x.sum()
    (y.sum() + z).backward()
    return {"rec": rec, "x.grad": R(x.grad)}


@scenario
def q03_stack_view_grad():
    F, rec = make_fuse()
    x = leaf([1.0, 2.0])
    x2 = leaf([5.0, 6.0])
    y = F.apply(x)
    z = (torch.stack([x, x2]) * 3.0).sum()
    (y.sum() + z).backward()
    return {"rec": rec, "x.grad": R(x.grad), "x2.grad": R(x2.grad)}


@scenario
def q03_t_view_grad():
    F, rec = make_fuse()
    x = leaf([[1.0, 2.0], [3.0, 4.0]])
    y = F.apply(x)
    z = (x.t() * torch.tensor([[1.0, 2.0], [3.0, 4.0]])).sum()
    (y.sum() + z).backward()
    return {"rec": rec, "x.grad": R(x.grad)}


@scenario
def q03_root_grad_nonleaf_x():
    F, rec = make_fuse()
    a = leaf([1.0, 2.0])
    x = a * 1.0
    y = F.apply(x)
    torch.autograd.backward(
        [y, x], [torch.tensor([1.0, 1.0]), torch.tensor([7.0, 8.0])]
    )
    return {"rec": rec, "a.grad": R(a.grad)}


@scenario
def q03_root_grad_leaf_x():
    F, rec = make_fuse()
    x = leaf([1.0, 2.0])
    y = F.apply(x)
    torch.autograd.backward(
        [y, x], [torch.tensor([1.0, 1.0]), torch.tensor([7.0, 8.0])]
    )
    return {"rec": rec, "x.grad": R(x.grad)}


@scenario
def q03_root_is_fn_output_only():
    F, rec = make_fuse()
    x = leaf([1.0, 2.0])
    y = F.apply(x)
    y.backward(torch.tensor([1.0, 3.0]))
    return {"rec": rec, "x.grad": R(x.grad)}


@scenario
def q03_same_input_twice():
    rec = {}

    class F2(Function):
        @staticmethod
        def forward(ctx, a, b):
            return a * b

        @staticmethod
        def backward(ctx, g):
            bufs = ctx.input_grad_buffers
            rec["bufs"] = desc_bufs(bufs)
            rec["same_obj_0_1"] = bufs[0] is bufs[1]
            ga, gb = g * 2.0, g * 2.0
            if bufs[0] is not None:
                bufs[0].add_(ga)
                ga = None
            if bufs[1] is not None:
                bufs[1].add_(gb)
                gb = None
            return ga, gb

    x = leaf([1.0, 2.0])
    y = F2.apply(x, x)
    (y.sum() + (x * 3.0).sum()).backward()
    return {"rec": rec, "x.grad": R(x.grad)}


@scenario
def q03_input_not_requiring_grad():
    rec = {}

    class F2(Function):
        @staticmethod
        def forward(ctx, a, b):
            return a * 2.0 + b * 2.0

        @staticmethod
        def backward(ctx, g):
            rec["bufs"], rec["err"] = read_bufs(ctx)
            rec["needs_input_grad"] = list(ctx.needs_input_grad)
            return g * 2.0, g * 2.0

    x = leaf([1.0, 2.0])
    w = torch.tensor([3.0, 4.0])
    y = F2.apply(w, x)
    (y.sum() + (x * 3.0).sum() + (w * 3.0).sum()).backward()
    return {"rec": rec, "x.grad": R(x.grad)}


@scenario
def q03_other_consumer_keeps_ref():
    """A producer (custom Function) returns a grad tensor it also keeps."""
    rec = {}
    keep = []

    class G(Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            t = g * 3.0
            keep.append(t)
            return t

    F, rec = make_fuse()
    x = leaf([1.0, 2.0])
    y = F.apply(x)
    z = G.apply(x)
    (y.sum() + (z * 1.0).sum()).backward()
    return {"rec": rec, "x.grad": R(x.grad), "kept": R(keep[0])}


@scenario
def q03_expanded_grad_from_custom_producer():
    class G(Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return torch.ones(1).expand(g.shape)

    F, rec = make_fuse()
    x = leaf([1.0, 2.0])
    y = F.apply(x)
    z = G.apply(x)
    (y.sum() + (z * 1.0).sum()).backward()
    return {"rec": rec, "x.grad": R(x.grad)}


# ------------------------------------------------ Q4: leaf with .grad


@scenario
def q04_existing_grad_backward():
    F, rec = make_fuse()
    x = leaf([1.0, 2.0])
    x.grad = torch.full((2,), 100.0)
    gobj = x.grad
    y = F.apply(x)
    (y.sum() + (x * 3.0).sum()).backward()
    return {
        "rec": rec,
        "x.grad": R(x.grad),
        "grad_same_object": x.grad is gobj,
    }


@scenario
def q04_autograd_grad_returns_completed_buffer():
    F, rec = make_fuse()
    x = leaf([1.0, 2.0])
    x.grad = torch.full((2,), 100.0)
    y = F.apply(x)
    (gx,) = torch.autograd.grad(y.sum() + (x * 3.0).sum(), [x])
    return {"rec": rec, "returned": R(gx), "x.grad": R(x.grad)}


@scenario
def q04_autograd_grad_nonleaf():
    F, rec = make_fuse()
    a = leaf([1.0, 2.0])
    x = a * 1.0
    y = F.apply(x)
    (gx,) = torch.autograd.grad(y.sum() + (x * 3.0).sum(), [x])
    return {"rec": rec, "returned": R(gx), "a.grad": R(a.grad)}


@scenario
def q04_backward_inputs_x():
    F, rec = make_fuse()
    x = leaf([1.0, 2.0])
    x.grad = torch.full((2,), 100.0)
    y = F.apply(x)
    (y.sum() + (x * 3.0).sum()).backward(inputs=[x])
    return {"rec": rec, "x.grad": R(x.grad)}


@scenario
def q04_backward_inputs_other():
    rec = {}

    class F2(Function):
        @staticmethod
        def forward(ctx, a, b):
            return a * b

        @staticmethod
        def backward(ctx, g):
            rec["bufs"], rec["err"] = read_bufs(ctx)
            rec["needs_input_grad"] = list(ctx.needs_input_grad)
            return g * 2.0, g * 2.0

    x = leaf([1.0, 2.0])
    w = leaf([3.0, 4.0])
    x.grad = torch.full((2,), 100.0)
    y = F2.apply(x, w)
    (y.sum() + (x * 3.0).sum() + (w * 5.0).sum()).backward(inputs=[w])
    return {"rec": rec, "x.grad": R(x.grad), "w.grad": R(w.grad)}


@scenario
def q04_autograd_grad_other_input():
    rec = {}

    class F2(Function):
        @staticmethod
        def forward(ctx, a, b):
            return a * b

        @staticmethod
        def backward(ctx, g):
            rec["bufs"], rec["err"] = read_bufs(ctx)
            return g * 2.0, g * 2.0

    x = leaf([1.0, 2.0])
    w = leaf([3.0, 4.0])
    y = F2.apply(x, w)
    (gw,) = torch.autograd.grad(
        y.sum() + (x * 3.0).sum() + (w * 5.0).sum(), [w]
    )
    return {"rec": rec, "gw": R(gw), "x.grad": R(x.grad)}


@scenario
def q04_buffer_becomes_grad_object():
    """Retained buffer object: is it the final .grad?"""
    held = {}

    class F(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2.0

        @staticmethod
        def backward(ctx, g):
            b = ctx.input_grad_buffers[0]
            held["b"] = b
            if b is not None:
                b.add_(g * 2.0)
                return None
            return g * 2.0

    x = leaf([1.0, 2.0])
    y = F.apply(x)
    (y.sum() + (x * 3.0).sum()).backward()
    b = held["b"]
    return {
        "exposed": b is not None,
        "buffer_is_grad": (b is x.grad) if b is not None else None,
        "x.grad": R(x.grad),
        "buffer_after": R(b),
    }


# ------------------------------------------------ Q5: errors


def _reader_fn(rec, where="backward", catch=True):
    class Rd(Function):
        @staticmethod
        def forward(ctx, x):
            if where == "forward":
                rec["forward_read"], rec["forward_err"] = read_bufs(ctx)
            rec["ctx"] = ctx
            return x * 2.0

        @staticmethod
        def backward(ctx, g):
            if catch:
                rec["bwd_read"], rec["bwd_err"] = read_bufs(ctx)
            else:
                rec["bwd_read"] = desc_bufs(ctx.input_grad_buffers)
            return g * 2.0

    return Rd


def _clean(rec):
    rec = dict(rec)
    rec.pop("ctx", None)
    return rec


@scenario
def q05_read_in_forward():
    rec = {}
    F = _reader_fn(rec, "forward")
    x = leaf([1.0, 2.0])
    F.apply(x).sum().backward()
    return _clean(rec)


@scenario
def q05_read_in_forward_no_grad_input():
    rec = {}
    F = _reader_fn(rec, "forward")
    x = torch.tensor([1.0, 2.0])
    F.apply(x)
    return _clean(rec)


@scenario
def q05_read_in_setup_context():
    rec = {}

    class S(Function):
        @staticmethod
        def forward(x):
            return x * 2.0

        @staticmethod
        def setup_context(ctx, inputs, output):
            rec["read"], rec["err"] = read_bufs(ctx)

        @staticmethod
        def backward(ctx, g):
            return g * 2.0

    x = leaf([1.0, 2.0])
    S.apply(x).sum().backward()
    return rec


@scenario
def q05_read_after_backward_retained_ctx():
    rec = {}
    F = _reader_fn(rec)
    x = leaf([1.0, 2.0])
    y = F.apply(x)
    (y.sum() + (x * 3.0).sum()).backward(retain_graph=True)
    ctx = rec["ctx"]
    after, err = read_bufs(ctx)
    ctx2, err2 = read_bufs(y.grad_fn)
    return {
        "rec": _clean(rec),
        "after": after,
        "after_err": err,
        "via_grad_fn": ctx2,
        "via_grad_fn_err": err2,
        "grad_fn_is_ctx": y.grad_fn is ctx,
    }


@scenario
def q05_read_before_backward_via_grad_fn():
    rec = {}
    F = _reader_fn(rec)
    x = leaf([1.0, 2.0])
    y = F.apply(x)
    r, err = read_bufs(y.grad_fn)
    return {"read": r, "err": err}


@scenario
def q05_read_other_graph_ctx_inside_backward():
    rec1 = {}
    F1 = _reader_fn(rec1)
    x1 = leaf([1.0, 2.0])
    y1 = F1.apply(x1)
    rec = {}

    class Rd2(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2.0

        @staticmethod
        def backward(ctx, g):
            rec["own"], rec["own_err"] = read_bufs(ctx)
            rec["other"], rec["other_err"] = read_bufs(y1.grad_fn)
            return g * 2.0

    x = leaf([1.0, 2.0])
    y = Rd2.apply(x)
    (y.sum() + (x * 3.0).sum()).backward()
    return rec


@scenario
def q05_direct_grad_fn_apply():
    rec = {}
    F = _reader_fn(rec)
    x = leaf([1.0, 2.0])
    y = F.apply(x)
    out = try_(lambda: R(y.grad_fn.apply(torch.ones(2))))
    return {"rec": _clean(rec), "apply": out}


@scenario
def q05_direct_grad_fn_apply_inside_backward():
    rec = {}
    F = _reader_fn(rec)
    x = leaf([1.0, 2.0])
    yF = F.apply(x)
    rec2 = {}

    class Outer(Function):
        @staticmethod
        def forward(ctx, a):
            return a * 2.0

        @staticmethod
        def backward(ctx, g):
            rec2["inner_apply"] = try_(lambda: R(yF.grad_fn.apply(torch.ones(2))))
            return g * 2.0

    a = leaf([1.0, 2.0])
    Outer.apply(a).sum().backward()
    return {"rec": _clean(rec), "rec2": rec2}


@scenario
def q05_create_graph():
    rec = {}
    F = _reader_fn(rec)
    x = leaf([1.0, 2.0])
    y = F.apply(x)
    (y.sum() + (x * 3.0).sum()).backward(create_graph=True)
    return {"rec": _clean(rec), "x.grad": R(x.grad)}


@scenario
def q05_create_graph_nothing_exposable():
    rec = {}
    F = _reader_fn(rec)
    x = leaf([1.0, 2.0])
    y = F.apply(x)
    y.sum().backward(create_graph=True)
    return {"rec": _clean(rec), "x.grad": R(x.grad)}


@scenario
def q05_create_graph_uncaught():
    rec = {}
    F = _reader_fn(rec, catch=False)
    x = leaf([1.0, 2.0])
    y = F.apply(x)
    out = try_(lambda: (y.sum() + (x * 3.0).sum()).backward(create_graph=True))
    return {"rec": _clean(rec), "outer": out}


@scenario
def q05_autograd_grad_create_graph():
    rec = {}
    F = _reader_fn(rec)
    x = leaf([1.0, 2.0])
    y = F.apply(x)
    (gx,) = torch.autograd.grad(y.sum() + (x * 3.0).sum(), [x], create_graph=True)
    return {"rec": _clean(rec), "gx": R(gx)}


@scenario
def q05_anomaly():
    rec = {}
    F = _reader_fn(rec)
    x = leaf([1.0, 2.0])
    with torch.autograd.set_detect_anomaly(True):
        y = F.apply(x)
        (y.sum() + (x * 3.0).sum()).backward()
    return {"rec": _clean(rec), "x.grad": R(x.grad)}


@scenario
def q05_anomaly_enabled_only_during_backward():
    rec = {}
    F = _reader_fn(rec)
    x = leaf([1.0, 2.0])
    y = F.apply(x)
    with torch.autograd.set_detect_anomaly(True):
        (y.sum() + (x * 3.0).sum()).backward()
    return {"rec": _clean(rec), "x.grad": R(x.grad)}


@scenario
def q05_anomaly_nothing_exposable():
    rec = {}
    F = _reader_fn(rec)
    x = leaf([1.0, 2.0])
    with torch.autograd.set_detect_anomaly(True):
        F.apply(x).sum().backward()
    return {"rec": _clean(rec)}


@scenario
def q05_anomaly_in_forward_read():
    rec = {}
    F = _reader_fn(rec, "forward")
    x = leaf([1.0, 2.0])
    with torch.autograd.set_detect_anomaly(True):
        F.apply(x).sum().backward()
    return _clean(rec)


@scenario
def q05_post_hook_on_node():
    rec = {}
    F = _reader_fn(rec)
    x = leaf([1.0, 2.0])
    y = F.apply(x)
    calls = []
    y.grad_fn.register_hook(lambda gi, go: calls.append(1))
    (y.sum() + (x * 3.0).sum()).backward()
    return {"rec": _clean(rec), "hook_calls": len(calls), "x.grad": R(x.grad)}


@scenario
def q05_post_hook_nothing_exposable():
    rec = {}
    F = _reader_fn(rec)
    x = leaf([1.0, 2.0])
    y = F.apply(x)
    y.grad_fn.register_hook(lambda gi, go: None)
    y.sum().backward()
    return {"rec": _clean(rec)}


@scenario
def q05_post_hook_on_other_node():
    rec = {}
    F = _reader_fn(rec)
    a = leaf([1.0, 2.0])
    x = a * 1.0
    x.grad_fn.register_hook(lambda gi, go: None)
    y = F.apply(x)
    (y.sum() + (x * 3.0).sum()).backward()
    return {"rec": _clean(rec), "a.grad": R(a.grad)}


@scenario
def q05_post_hook_create_graph_anomaly_precedence():
    res = {}
    for combo in [
        ("create_graph", "anomaly"),
        ("create_graph", "posthook"),
        ("anomaly", "posthook"),
        ("create_graph", "anomaly", "posthook"),
    ]:
        rec = {}
        F = _reader_fn(rec)
        x = leaf([1.0, 2.0])
        with torch.autograd.set_detect_anomaly("anomaly" in combo):
            y = F.apply(x)
            if "posthook" in combo:
                y.grad_fn.register_hook(lambda gi, go: None)
            (y.sum() + (x * 3.0).sum()).backward(
                create_graph="create_graph" in combo
            )
        res["+".join(combo)] = _clean(rec)
    return res


def _reentrant(mode):
    rec = {}

    class F(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2.0

        @staticmethod
        def backward(ctx, g):
            b = ctx.input_grad_buffers
            rec["bufs"] = desc_bufs(b)
            if mode == "mutate" and b[0] is not None:
                b[0].add_(g * 2.0)
            with torch.enable_grad():
                p = leaf([1.0, 2.0])
                rec["reentrant_grad"] = try_(
                    lambda: R(torch.autograd.grad((p * 5.0).sum(), [p])[0])
                )
                q = leaf([1.0, 2.0])
                rec["reentrant_backward"] = try_(
                    lambda: (q * 7.0).sum().backward()
                )
                rec["q.grad"] = R(q.grad)
            if mode == "mutate" and b[0] is not None:
                return None
            return g * 2.0

    return F, rec


@scenario
def q05_reentrant_after_nonnone_before_mutation():
    F, rec = _reentrant("read")
    x = leaf([1.0, 2.0])
    y = F.apply(x)
    (y.sum() + (x * 3.0).sum()).backward()
    return {"rec": rec, "x.grad": R(x.grad)}


@scenario
def q05_reentrant_after_nonnone_after_mutation():
    F, rec = _reentrant("mutate")
    x = leaf([1.0, 2.0])
    y = F.apply(x)
    (y.sum() + (x * 3.0).sum()).backward()
    return {"rec": rec, "x.grad": R(x.grad)}


@scenario
def q05_reentrant_all_none():
    F, rec = _reentrant("read")
    x = leaf([1.0, 2.0])
    y = F.apply(x)
    y.sum().backward()
    return {"rec": rec, "x.grad": R(x.grad)}


@scenario
def q05_reentrant_uncaught():
    rec = {}

    class F(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2.0

        @staticmethod
        def backward(ctx, g):
            b = ctx.input_grad_buffers
            rec["bufs"] = desc_bufs(b)
            with torch.enable_grad():
                p = leaf([1.0, 2.0])
                torch.autograd.grad((p * 5.0).sum(), [p])
            return g * 2.0

    x = leaf([1.0, 2.0])
    y = F.apply(x)
    out = try_(lambda: (y.sum() + (x * 3.0).sum()).backward())
    return {"rec": rec, "outer": out}


@scenario
def q05_reentrant_then_read():
    """Reentrant backward first, then read buffers."""
    rec = {}

    class F(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2.0

        @staticmethod
        def backward(ctx, g):
            with torch.enable_grad():
                p = leaf([1.0, 2.0])
                rec["reentrant"] = try_(
                    lambda: R(torch.autograd.grad((p * 5.0).sum(), [p])[0])
                )
            rec["bufs"], rec["err"] = read_bufs(ctx)
            return g * 2.0

    x = leaf([1.0, 2.0])
    y = F.apply(x)
    (y.sum() + (x * 3.0).sum()).backward()
    return {"rec": rec, "x.grad": R(x.grad)}


@scenario
def q05_read_from_thread_inside_backward():
    rec = {}

    class F(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2.0

        @staticmethod
        def backward(ctx, g):
            res = {}

            def t():
                res["bufs"], res["err"] = read_bufs(ctx)

            th = threading.Thread(target=t)
            th.start()
            th.join()
            rec["thread"] = res
            rec["main"], rec["main_err"] = read_bufs(ctx)
            return g * 2.0

    x = leaf([1.0, 2.0])
    y = F.apply(x)
    (y.sum() + (x * 3.0).sum()).backward()
    return {"rec": rec, "x.grad": R(x.grad)}


@scenario
def q05_read_raises_uncaught_in_forward_type():
    class F(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.input_grad_buffers
            return x * 2.0

        @staticmethod
        def backward(ctx, g):
            return g

    x = leaf([1.0])
    return try_(lambda: F.apply(x))


# ------------------------------------------------ Q6: dtypes / kinds


def _dtype_case(dtype, vals):
    F, rec = make_fuse()
    x = leaf(vals, dtype=dtype)
    y = F.apply(x)
    z = x * 3.0
    loss = y.sum() + z.sum()
    if loss.is_complex():
        loss = loss.real
    loss.backward()
    return {"rec": rec, "x.grad": R(x.grad), "x.grad.dtype": D(x.grad)}


@scenario
def q06_float16():
    return _dtype_case(torch.float16, [1.0, 2.0])


@scenario
def q06_bfloat16():
    return _dtype_case(torch.bfloat16, [1.0, 2.0])


@scenario
def q06_float64():
    return _dtype_case(torch.float64, [1.0, 2.0])


@scenario
def q06_complex64():
    return _dtype_case(torch.complex64, [1 + 1j, 2 - 1j])


@scenario
def q06_zero_dim():
    F, rec = make_fuse()
    x = leaf(3.0)
    y = F.apply(x)
    (y + x * 3.0).backward()
    return {"rec": rec, "x.grad": R(x.grad)}


class MySub(torch.Tensor):
    pass


@scenario
def q06_subclass_grad_in_buffer():
    class G(Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return (g * 3.0).as_subclass(MySub)

    F, rec = make_fuse()
    x = leaf([1.0, 2.0])
    y = F.apply(x)
    z = G.apply(x)
    (y.sum() + (z * 1.0).sum()).backward()
    return {"rec": rec, "x.grad": R(x.grad), "x.grad.type": type(x.grad).__name__}


@scenario
def q06_zero_tensor_grad_in_buffer():
    class G(Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return torch._efficientzerotensor(g.shape, dtype=g.dtype)

    F, rec = make_fuse()
    x = leaf([1.0, 2.0])
    y = F.apply(x)
    z = G.apply(x)
    (y.sum() + (z * 1.0).sum()).backward()
    return {"rec": rec, "x.grad": R(x.grad)}


@scenario
def q06_noncontiguous_but_dense_grad():
    """Producer returns a permuted (non-contiguous, dense) fresh tensor."""

    class G(Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return (g * 3.0).t().contiguous().t()

    F, rec = make_fuse()
    x = leaf([[1.0, 2.0], [3.0, 4.0]])
    y = F.apply(x)
    z = G.apply(x)
    (y.sum() + (z * torch.tensor([[1.0, 2.0], [3.0, 4.0]])).sum()).backward()
    return {"rec": rec, "x.grad": R(x.grad)}


@scenario
def q06_requires_grad_buffer_flag():
    rec = {}

    class F(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2.0

        @staticmethod
        def backward(ctx, g):
            b = ctx.input_grad_buffers[0]
            if b is not None:
                rec["requires_grad"] = b.requires_grad
                rec["is_leaf"] = b.is_leaf
                rec["grad_fn"] = None if b.grad_fn is None else type(b.grad_fn).__name__
                rec["is_contiguous"] = b.is_contiguous()
                rec["device"] = str(b.device)
            rec["present"] = b is not None
            return g * 2.0

    x = leaf([1.0, 2.0])
    y = F.apply(x)
    (y.sum() + (x * 3.0).sum()).backward()
    return rec


# ------------------------------------------------ Q7: identity / caching


@scenario
def q07_identity_and_double_read():
    rec = {}

    class F(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2.0

        @staticmethod
        def backward(ctx, g):
            t1 = ctx.input_grad_buffers
            t2 = ctx.input_grad_buffers
            rec["first"] = desc_bufs(t1)
            rec["second"] = desc_bufs(t2)
            rec["tuple_same_object"] = t1 is t2
            rec["tuple_equal_type"] = type(t1).__name__
            if t1[0] is not None and t2[0] is not None:
                rec["entry_same_object"] = t1[0] is t2[0]
                rec["entry_same_storage"] = (
                    t1[0].data_ptr() == t2[0].data_ptr()
                )
            b = t1[0]
            if b is not None:
                b.add_(g * 2.0)
                return None
            return g * 2.0

    x = leaf([1.0, 2.0])
    y = F.apply(x)
    (y.sum() + (x * 3.0).sum()).backward()
    return {"rec": rec, "x.grad": R(x.grad)}


@scenario
def q07_double_read_dropping_first():
    """Read, drop the tuple, read again."""
    rec = {}

    class F(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2.0

        @staticmethod
        def backward(ctx, g):
            rec["first"] = desc_bufs(ctx.input_grad_buffers)
            rec["second"] = desc_bufs(ctx.input_grad_buffers)
            return g * 2.0

    x = leaf([1.0, 2.0])
    y = F.apply(x)
    (y.sum() + (x * 3.0).sum()).backward()
    return {"rec": rec, "x.grad": R(x.grad)}


@scenario
def q07_double_read_holding_entry():
    rec = {}

    class F(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2.0

        @staticmethod
        def backward(ctx, g):
            b = ctx.input_grad_buffers[0]
            rec["first_present"] = b is not None
            t2 = ctx.input_grad_buffers
            rec["second"] = desc_bufs(t2)
            rec["same"] = (b is t2[0]) if b is not None else None
            return g * 2.0

    x = leaf([1.0, 2.0])
    y = F.apply(x)
    (y.sum() + (x * 3.0).sum()).backward()
    return {"rec": rec, "x.grad": R(x.grad)}


@scenario
def q07_tuple_identity_across_backwards():
    """Same ctx (retain_graph) run twice: tuples identical across runs?"""
    rec = {"runs": []}
    held = []

    class F(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2.0

        @staticmethod
        def backward(ctx, g):
            t = ctx.input_grad_buffers
            held.append(t)
            rec["runs"].append(desc_bufs(t))
            return g * 2.0

    x = leaf([1.0, 2.0])
    y = F.apply(x)
    loss = y.sum() + (x * 3.0).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    rec["same_tuple_across_runs"] = held[0] is held[1]
    return {"rec": rec, "x.grad": R(x.grad)}


# ------------------------------------------------ Q8: hooks / retain_grad


@scenario
def q08_retain_grad_nonleaf_input():
    F, rec = make_fuse()
    a = leaf([1.0, 2.0])
    x = a * 1.0
    x.retain_grad()
    y = F.apply(x)
    (y.sum() + (x * 3.0).sum()).backward()
    return {"rec": rec, "x.grad": R(x.grad), "a.grad": R(a.grad)}


@scenario
def q08_prehook_on_node():
    F, rec = make_fuse()
    x = leaf([1.0, 2.0])
    y = F.apply(x)
    seen = []

    def pre(go):
        seen.append(R(go[0]))
        return None

    y.grad_fn.register_prehook(pre)
    (y.sum() + (x * 3.0).sum()).backward()
    return {"rec": rec, "prehook_saw": seen, "x.grad": R(x.grad)}


@scenario
def q08_prehook_on_node_modifying():
    F, rec = make_fuse()
    x = leaf([1.0, 2.0])
    y = F.apply(x)
    y.grad_fn.register_prehook(lambda go: (go[0] * 10.0,))
    (y.sum() + (x * 3.0).sum()).backward()
    return {"rec": rec, "x.grad": R(x.grad)}


@scenario
def q08_tensor_hook_on_leaf_input():
    F, rec = make_fuse()
    x = leaf([1.0, 2.0])
    seen = []
    x.register_hook(lambda g: seen.append(R(g)))
    y = F.apply(x)
    (y.sum() + (x * 3.0).sum()).backward()
    return {"rec": rec, "hook_saw": seen, "x.grad": R(x.grad)}


@scenario
def q08_tensor_hook_on_nonleaf_input():
    F, rec = make_fuse()
    a = leaf([1.0, 2.0])
    x = a * 1.0
    seen = []
    x.register_hook(lambda g: seen.append(R(g)))
    y = F.apply(x)
    (y.sum() + (x * 3.0).sum()).backward()
    return {"rec": rec, "hook_saw": seen, "a.grad": R(a.grad)}


@scenario
def q08_tensor_hook_modifying_nonleaf():
    F, rec = make_fuse()
    a = leaf([1.0, 2.0])
    x = a * 1.0
    x.register_hook(lambda g: g * 10.0)
    y = F.apply(x)
    (y.sum() + (x * 3.0).sum()).backward()
    return {"rec": rec, "a.grad": R(a.grad)}


@scenario
def q08_post_accumulate_grad_hook_leaf():
    F, rec = make_fuse()
    x = leaf([1.0, 2.0])
    seen = []
    x.register_post_accumulate_grad_hook(lambda p: seen.append(R(p.grad)))
    y = F.apply(x)
    (y.sum() + (x * 3.0).sum()).backward()
    return {"rec": rec, "hook_saw": seen, "x.grad": R(x.grad)}


# ------------------------------------------------ Q9: once_differentiable / boxed


@scenario
def q09_once_differentiable():
    rec = {}

    class F(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2.0

        @staticmethod
        @once_differentiable
        def backward(ctx, g):
            b = ctx.input_grad_buffers
            rec["bufs"] = desc_bufs(b)
            if b[0] is not None:
                b[0].add_(g * 2.0)
                return None
            return g * 2.0

    x = leaf([1.0, 2.0])
    y = F.apply(x)
    (y.sum() + (x * 3.0).sum()).backward()
    return {"rec": rec, "x.grad": R(x.grad)}


@scenario
def q09_boxed_grads_call():
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
            rec["bufs"] = desc_bufs(b)
            gx, gw = g * 2.0, g * 2.0
            if b[0] is not None:
                b[0].add_(gx)
                gx = None
            return gx, gw

    x = leaf([1.0, 2.0])
    w = leaf([2.0, 2.0])
    y = F.apply(x, w)
    (y.sum() + (x * 3.0).sum()).backward()
    return {"rec": rec, "x.grad": R(x.grad), "w.grad": R(w.grad)}


@scenario
def q09_boxed_direct_apply():
    rec = {}

    class F(Function):
        boxed_grads_call = True

        @staticmethod
        def forward(ctx, x):
            return x * 2.0

        @staticmethod
        def backward(ctx, grads):
            rec["grads_type"] = type(grads).__name__
            rec["bufs"], rec["err"] = read_bufs(ctx)
            return grads[0] * 2.0

    x = leaf([1.0, 2.0])
    y = F.apply(x)
    out = try_(lambda: R(y.grad_fn.apply(torch.ones(2))))
    return {"rec": rec, "apply": out}


@scenario
def q09_setup_context_style_fuse():
    rec = {}

    class F(Function):
        @staticmethod
        def forward(x, w):
            return x * w

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(*inputs)

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            b = ctx.input_grad_buffers
            rec["bufs"] = desc_bufs(b)
            gx, gw = g * w, g * x
            if b[0] is not None:
                b[0].add_(gx)
                gx = None
            if b[1] is not None:
                b[1].add_(gw)
                gw = None
            return gx, gw

    x = leaf([1.0, 2.0])
    w = leaf([3.0, 4.0])
    y = F.apply(x, w)
    (y.sum() + (x * 3.0).sum() + (w * 5.0).sum()).backward()
    return {"rec": rec, "x.grad": R(x.grad), "w.grad": R(w.grad)}


@scenario
def q09_vjp_instead_of_backward():
    rec = {}

    class F(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2.0

        @staticmethod
        def vjp(ctx, g):
            rec["bufs"], rec["err"] = read_bufs(ctx)
            return g * 2.0

    x = leaf([1.0, 2.0])
    y = F.apply(x)
    (y.sum() + (x * 3.0).sum()).backward()
    return {"rec": rec, "x.grad": R(x.grad)}


@scenario
def q09_multithreaded_backward():
    results = {}

    def work(i):
        F, rec = make_fuse()
        x = leaf([1.0 + i, 2.0])
        for _ in range(20):
            x.grad = None
            y = F.apply(x)
            (y.sum() + (x * 3.0).sum()).backward()
        results[i] = {"last_read": rec["reads"][-1], "x.grad": R(x.grad)}

    ths = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    return {str(k): results[k] for k in sorted(results)}


# ------------------------------------------------ Q10: set_output_grad_dtype errors


def _decl_fn(decls_fn, outputs_fn, rec=None, style="old", mark_nd=None):
    rec = {} if rec is None else rec

    if style == "old":

        class Decl(Function):
            @staticmethod
            def forward(ctx, x):
                outs = outputs_fn(x)
                if mark_nd is not None:
                    ctx.mark_non_differentiable(*[outs[i] for i in mark_nd])
                try:
                    ctx.set_output_grad_dtype(*decls_fn(x))
                    rec["decl"] = "ok"
                except Exception as e:  # noqa: BLE001
                    rec["decl"] = E(e)
                ctx.n = len(outs) if isinstance(outs, tuple) else 1
                return outs

            @staticmethod
            def backward(ctx, *gs):
                rec["bwd_dtypes"] = [D(g) if isinstance(g, torch.Tensor) else repr(g) for g in gs]
                rec["bwd_vals"] = [R(g) if isinstance(g, torch.Tensor) else None for g in gs]
                t = [g for g in gs if isinstance(g, torch.Tensor)]
                return (t[0].float() * 2.0) if t else None

        return Decl, rec

    class DeclS(Function):
        @staticmethod
        def forward(x):
            return outputs_fn(x)

        @staticmethod
        def setup_context(ctx, inputs, output):
            try:
                ctx.set_output_grad_dtype(*decls_fn(inputs[0]))
                rec["decl"] = "ok"
            except Exception as e:  # noqa: BLE001
                rec["decl"] = E(e)

        @staticmethod
        def backward(ctx, *gs):
            rec["bwd_dtypes"] = [D(g) if isinstance(g, torch.Tensor) else repr(g) for g in gs]
            t = [g for g in gs if isinstance(g, torch.Tensor)]
            return (t[0].float() * 2.0) if t else None

    return DeclS, rec


def _apply_run(F, x, rec, loss_fn=None):
    out = {}
    try:
        y = F.apply(x)
        out["apply"] = "ok"
    except Exception as e:  # noqa: BLE001
        out["apply"] = E(e)
        out["rec"] = rec
        return out
    if loss_fn is not None:
        out["backward"] = try_(lambda: loss_fn(y))
    out["rec"] = rec
    return out


@scenario
def q10_called_twice():
    rec = {}

    class F(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.set_output_grad_dtype(torch.float32)
            rec["second"] = try_(lambda: ctx.set_output_grad_dtype(torch.float32))
            rec["third_none"] = try_(lambda: ctx.set_output_grad_dtype(None))
            return x * 2.0

        @staticmethod
        def backward(ctx, g):
            return g * 2.0

    x = leaf([1.0])
    F.apply(x).sum().backward()
    return rec


@scenario
def q10_called_twice_uncaught():
    class F(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.set_output_grad_dtype(torch.float32)
            ctx.set_output_grad_dtype(torch.float32)
            return x * 2.0

        @staticmethod
        def backward(ctx, g):
            return g * 2.0

    x = leaf([1.0])
    return try_(lambda: F.apply(x))


@scenario
def q10_called_twice_forward_and_setup_context():
    rec = {}

    class F(Function):
        @staticmethod
        def forward(x):
            return x * 2.0

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.set_output_grad_dtype(None)
            rec["second"] = try_(lambda: ctx.set_output_grad_dtype(None))

        @staticmethod
        def backward(ctx, g):
            return g * 2.0

    x = leaf([1.0])
    F.apply(x).sum().backward()
    return rec


def _count_case(ndecl, nout, x_requires=True, no_grad=False):
    decls = lambda x: (None,) * ndecl  # noqa: E731
    if nout == 1:
        outs = lambda x: x * 2.0  # noqa: E731
    else:
        outs = lambda x: tuple(x * float(i + 1) for i in range(nout))  # noqa: E731
    F, rec = _decl_fn(decls, outs)
    x = torch.tensor([1.0, 2.0], requires_grad=x_requires)
    if no_grad:
        with torch.no_grad():
            return _apply_run(F, x, rec)
    return _apply_run(F, x, rec)


@scenario
def q10_count_1out_2decl():
    return _count_case(2, 1)


@scenario
def q10_count_1out_0decl():
    return _count_case(0, 1)


@scenario
def q10_count_2out_1decl():
    return _count_case(1, 2)


@scenario
def q10_count_4out_3decl():
    return _count_case(3, 4)


@scenario
def q10_count_mismatch_no_input_requires_grad():
    return _count_case(2, 1, x_requires=False)


@scenario
def q10_count_mismatch_under_no_grad():
    return _count_case(2, 1, no_grad=True)


@scenario
def q10_count_mismatch_setup_context():
    F, rec = _decl_fn(lambda x: (None, None), lambda x: x * 2.0, style="setup")
    return _apply_run(F, leaf([1.0]), rec)


@scenario
def q10_count_tuple_of_one_output():
    F, rec = _decl_fn(lambda x: (None, None), lambda x: (x * 2.0,))
    return _apply_run(F, leaf([1.0]), rec)


def _type_case(decl, x_requires=True):
    F, rec = _decl_fn(lambda x: (decl,), lambda x: x * 2.0)
    return _apply_run(F, torch.tensor([1.0], requires_grad=x_requires), rec)


@scenario
def q10_nondtype_str():
    return _type_case("float32")


@scenario
def q10_nondtype_int():
    return _type_case(3)


@scenario
def q10_nondtype_tensor():
    return _type_case(torch.tensor(1.0))


@scenario
def q10_nondtype_python_float_type():
    return _type_case(float)


@scenario
def q10_nondtype_str_no_input_requires_grad():
    return _type_case("float32", x_requires=False)


@scenario
def q10_nondtype_and_count_mismatch_precedence():
    F, rec = _decl_fn(lambda x: ("a", "b"), lambda x: x * 2.0)
    return _apply_run(F, leaf([1.0]), rec)


@scenario
def q10_concrete_for_nontensor_output():
    F, rec = _decl_fn(
        lambda x: (None, None, torch.float32),
        lambda x: (x * 2.0, x * 3.0, "s"),
    )
    return _apply_run(F, leaf([1.0]), rec)


@scenario
def q10_concrete_for_nontensor_output_index0():
    F, rec = _decl_fn(
        lambda x: (torch.float32, None),
        lambda x: (5, x * 3.0),
    )
    return _apply_run(F, leaf([1.0]), rec)


@scenario
def q10_concrete_for_mark_non_differentiable():
    F, rec = _decl_fn(
        lambda x: (None, torch.float32),
        lambda x: (x * 2.0, x * 3.0),
        mark_nd=[1],
    )
    return _apply_run(F, leaf([1.0]), rec)


@scenario
def q10_concrete_for_integer_output():
    F, rec = _decl_fn(
        lambda x: (None, torch.float32),
        lambda x: (x * 2.0, (x * 3.0).long()),
    )
    return _apply_run(F, leaf([1.0]), rec)


@scenario
def q10_concrete_for_integer_output_own_dtype():
    F, rec = _decl_fn(
        lambda x: (None, torch.int64),
        lambda x: (x * 2.0, (x * 3.0).long()),
    )
    return _apply_run(F, leaf([1.0]), rec)


@scenario
def q10_concrete_output_no_input_requires_grad():
    F, rec = _decl_fn(lambda x: (torch.float32,), lambda x: x * 2.0)
    return _apply_run(F, torch.tensor([1.0]), rec)


@scenario
def q10_concrete_for_nontensor_no_input_requires_grad():
    F, rec = _decl_fn(
        lambda x: (None, torch.float32), lambda x: (x * 2.0, "s")
    )
    return _apply_run(F, torch.tensor([1.0]), rec)


@scenario
def q10_concrete_for_nontensor_under_no_grad():
    F, rec = _decl_fn(
        lambda x: (None, torch.float32), lambda x: (x * 2.0, "s")
    )
    with torch.no_grad():
        return _apply_run(F, leaf([1.0]), rec)


@scenario
def q10_concrete_for_nontensor_setup_context():
    F, rec = _decl_fn(
        lambda x: (None, torch.float32),
        lambda x: (x * 2.0, "s"),
        style="setup",
    )
    return _apply_run(F, leaf([1.0]), rec)


@scenario
def q10_all_none_valid_for_nontensors():
    F, rec = _decl_fn(
        lambda x: (None, None, None),
        lambda x: (x * 2.0, "s", 3),
    )
    return _apply_run(F, leaf([1.0]), rec, lambda y: y[0].sum().backward())


# ------------------------------------------------ Q11: dtype seen in backward


def _grad_dtype_fn(decl, out_dtype=torch.float32, rec=None):
    """decl: 'omit' | None | dtype."""
    rec = {} if rec is None else rec

    class F(Function):
        @staticmethod
        def forward(ctx, x):
            if decl != "omit":
                ctx.set_output_grad_dtype(decl)
            return (x * 2.0).to(out_dtype)

        @staticmethod
        def backward(ctx, g):
            rec.setdefault("bwd_dtype", []).append(D(g))
            rec["bwd_vals"] = R(g)
            return (g * 2.0).to(torch.float32)

    return F, rec


class ToDtype(Function):
    """Identity whose backward returns the grad cast to a chosen dtype."""

    @staticmethod
    def forward(ctx, y, dt):
        ctx.dt = dt
        return y.clone()

    @staticmethod
    def backward(ctx, g):
        return g.to(ctx.dt), None


DECLS = {"omit": "omit", "None": None, "float32": torch.float32, "float64": torch.float64, "float16": torch.float16}


@scenario
def q11_root_grad_other_dtype():
    res = {}
    for k, decl in DECLS.items():
        F, rec = _grad_dtype_fn(decl)
        x = leaf([1.0, 2.0])
        y = F.apply(x)
        r = try_(lambda: y.backward(torch.tensor([1.0, 3.0], dtype=torch.float64)))
        res[k] = {"rec": rec, "backward": r, "x.grad": R(x.grad), "x.grad.dtype": D(x.grad)}
    return res


@scenario
def q11_root_grad_via_autograd_grad():
    res = {}
    for k, decl in DECLS.items():
        F, rec = _grad_dtype_fn(decl)
        x = leaf([1.0, 2.0])
        y = F.apply(x)
        r = try_(
            lambda: [
                D(t)
                for t in torch.autograd.grad(
                    y, x, torch.tensor([1.0, 3.0], dtype=torch.float64)
                )
            ]
        )
        res[k] = {"rec": rec, "grad": r}
    return res


@scenario
def q11_one_consumer_returning_float64():
    res = {}
    for k, decl in DECLS.items():
        F, rec = _grad_dtype_fn(decl)
        x = leaf([1.0, 2.0])
        y = F.apply(x)
        z = ToDtype.apply(y, torch.float64)
        r = try_(lambda: z.sum().backward())
        res[k] = {"rec": rec, "backward": r, "x.grad": R(x.grad), "x.grad.dtype": D(x.grad)}
    return res


@scenario
def q11_two_consumers_float64_and_float16():
    res = {}
    for k, decl in DECLS.items():
        F, rec = _grad_dtype_fn(decl)
        x = leaf([1.0, 2.0])
        y = F.apply(x)
        z1 = ToDtype.apply(y, torch.float64)
        z2 = ToDtype.apply(y, torch.float16)
        r = try_(lambda: (z1.sum() + z2.sum()).backward())
        res[k] = {"rec": rec, "backward": r, "x.grad": R(x.grad)}
    return res


@scenario
def q11_two_consumers_float16_then_float64():
    res = {}
    for k, decl in DECLS.items():
        F, rec = _grad_dtype_fn(decl)
        x = leaf([1.0, 2.0])
        y = F.apply(x)
        z2 = ToDtype.apply(y, torch.float16)
        z1 = ToDtype.apply(y, torch.float64)
        r = try_(lambda: (z1.sum() + z2.sum()).backward())
        res[k] = {"rec": rec, "backward": r, "x.grad": R(x.grad)}
    return res


@scenario
def q11_float16_output_consumed_by_float():
    res = {}
    for k, decl in DECLS.items():
        F, rec = _grad_dtype_fn(decl, out_dtype=torch.float16)
        x = leaf([1.0, 2.0])
        y = F.apply(x)
        r = try_(lambda: y.float().sum().backward())
        res[k] = {"rec": rec, "backward": r, "x.grad": R(x.grad)}
    return res


@scenario
def q11_float16_output_root_float32_grad():
    res = {}
    for k, decl in DECLS.items():
        F, rec = _grad_dtype_fn(decl, out_dtype=torch.float16)
        x = leaf([1.0, 2.0])
        y = F.apply(x)
        r = try_(lambda: y.backward(torch.tensor([1.0, 3.0])))
        res[k] = {"rec": rec, "backward": r, "x.grad": R(x.grad)}
    return res


@scenario
def q11_own_dtype_and_plain_sum():
    res = {}
    for k, decl in DECLS.items():
        F, rec = _grad_dtype_fn(decl)
        x = leaf([1.0, 2.0])
        r = try_(lambda: F.apply(x).sum().backward())
        res[k] = {"rec": rec, "backward": r, "x.grad": R(x.grad), "x.grad.dtype": D(x.grad)}
    return res


@scenario
def q11_create_graph():
    res = {}
    for k, decl in DECLS.items():
        F, rec = _grad_dtype_fn(decl)
        x = leaf([1.0, 2.0])
        y = F.apply(x)
        z = ToDtype.apply(y, torch.float64)
        r = try_(lambda: z.sum().backward(create_graph=True))
        res[k] = {"rec": rec, "backward": r, "x.grad": R(x.grad)}
    return res


@scenario
def q11_from_setup_context():
    res = {}
    for k, decl in DECLS.items():
        rec = {}

        class F(Function):
            @staticmethod
            def forward(x):
                return x * 2.0

            @staticmethod
            def setup_context(ctx, inputs, output, decl=decl):
                if decl != "omit":
                    ctx.set_output_grad_dtype(decl)

            @staticmethod
            def backward(ctx, g, rec=rec):
                rec["bwd_dtype"] = D(g)
                return g.float() * 2.0

        x = leaf([1.0, 2.0])
        y = F.apply(x)
        z = ToDtype.apply(y, torch.float64)
        r = try_(lambda: z.sum().backward())
        res[k] = {"rec": rec, "backward": r, "x.grad": R(x.grad)}
    return res


@scenario
def q11_multi_output_mixed():
    rec = {}

    class F(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.set_output_grad_dtype(torch.float64, None, torch.float16, None)
            return x * 1.0, x * 2.0, x * 3.0, "s"

        @staticmethod
        def backward(ctx, g1, g2, g3, g4):
            rec["dtypes"] = [D(g1), D(g2), D(g3), repr(g4)]
            return g1.float() + g2.float() + g3.float()

    x = leaf([1.0, 2.0])
    a, b, c, _ = F.apply(x)
    (
        ToDtype.apply(a, torch.float16).sum()
        + ToDtype.apply(b, torch.float64).sum()
        + ToDtype.apply(c, torch.float64).sum()
    ).backward()
    return {"rec": rec, "x.grad": R(x.grad)}


@scenario
def q11_declared_dtype_no_input_requires_grad():
    F, rec = _grad_dtype_fn(torch.float64)
    x = torch.tensor([1.0, 2.0])
    y = F.apply(x)
    return {"rec": rec, "requires_grad": y.requires_grad, "grad_fn": y.grad_fn is None}


@scenario
def q11_declared_dtype_under_no_grad():
    F, rec = _grad_dtype_fn(torch.float64)
    x = leaf([1.0, 2.0])
    with torch.no_grad():
        y = F.apply(x)
    return {"rec": rec, "requires_grad": y.requires_grad}


# ------------------------------------------------ Q12: deviations


@scenario
def q12_declare_int64():
    F, rec = _decl_fn(lambda x: (torch.int64,), lambda x: x * 2.0)
    return _apply_run(F, leaf([1.0, 2.0]), rec, lambda y: y.sum().backward())


@scenario
def q12_declare_bool():
    F, rec = _decl_fn(lambda x: (torch.bool,), lambda x: x * 2.0)
    return _apply_run(F, leaf([1.0, 2.0]), rec, lambda y: y.sum().backward())


@scenario
def q12_declare_complex_for_real():
    F, rec = _decl_fn(lambda x: (torch.complex64,), lambda x: x * 2.0)
    return _apply_run(F, leaf([1.0, 2.0]), rec, lambda y: y.sum().backward())


@scenario
def q12_declare_real_for_complex():
    F, rec = _decl_fn(
        lambda x: (torch.float32,), lambda x: (x * 2.0).to(torch.complex64)
    )
    return _apply_run(
        F, leaf([1.0, 2.0]), rec, lambda y: y.real.sum().backward()
    )


@scenario
def q12_declare_complex128_for_complex64():
    F, rec = _decl_fn(
        lambda x: (torch.complex128,), lambda x: (x * 2.0).to(torch.complex64)
    )
    return _apply_run(
        F, leaf([1.0, 2.0]), rec, lambda y: y.real.sum().backward()
    )


@scenario
def q12_materialized_zeros_unused_output():
    res = {}
    for mat in (True, False):
        rec = {}

        class F(Function):
            @staticmethod
            def forward(ctx, x, mat=mat):
                ctx.set_materialize_grads(mat)
                ctx.set_output_grad_dtype(torch.float64, torch.float64)
                return x * 2.0, x * 3.0

            @staticmethod
            def backward(ctx, g1, g2, rec=rec):
                rec["dtypes"] = [D(g1), D(g2)]
                rec["vals"] = [R(g1), R(g2)]
                return g1.float() * 2.0

        x = leaf([1.0, 2.0])
        a, b = F.apply(x)
        r = try_(lambda: a.sum().backward())
        res["materialize=%s" % mat] = {"rec": rec, "backward": r, "x.grad": R(x.grad)}
    return res


@scenario
def q12_materialized_zeros_unused_output_none_decl():
    rec = {}

    class F(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.set_output_grad_dtype(None, None)
            return x * 2.0, (x * 3.0).half()

        @staticmethod
        def backward(ctx, g1, g2):
            rec["dtypes"] = [D(g1), D(g2)]
            return g1.float() * 2.0

    x = leaf([1.0, 2.0])
    a, b = F.apply(x)
    r = try_(lambda: a.sum().backward())
    return {"rec": rec, "backward": r}


@scenario
def q12_call_from_backward():
    rec = {}

    class F(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2.0

        @staticmethod
        def backward(ctx, g):
            rec["bwd_dtype"] = D(g)
            rec["call"] = try_(lambda: ctx.set_output_grad_dtype(torch.float64))
            rec["call_again"] = try_(lambda: ctx.set_output_grad_dtype(torch.float64))
            return g * 2.0

    x = leaf([1.0, 2.0])
    y = F.apply(x)
    z = ToDtype.apply(y, torch.float64)
    z.sum().backward(retain_graph=True)
    rec_first = dict(rec)
    rec.clear()
    z.sum().backward()
    return {"first": rec_first, "second_backward": rec}


@scenario
def q12_call_from_backward_after_forward_decl():
    rec = {}

    class F(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.set_output_grad_dtype(None)
            return x * 2.0

        @staticmethod
        def backward(ctx, g):
            rec["bwd_dtype"] = D(g)
            rec["call"] = try_(lambda: ctx.set_output_grad_dtype(torch.float64))
            return g.float() * 2.0

    x = leaf([1.0, 2.0])
    y = F.apply(x)
    z = ToDtype.apply(y, torch.float64)
    z.sum().backward()
    return rec


@scenario
def q12_call_after_forward_on_grad_fn():
    F, rec = _grad_dtype_fn("omit")
    x = leaf([1.0, 2.0])
    y = F.apply(x)
    r = try_(lambda: y.grad_fn.set_output_grad_dtype(torch.float64))
    z = ToDtype.apply(y, torch.float64)
    z.sum().backward()
    return {"call": r, "rec": rec}


# ------------------------------------------------ Q13: mark_dirty


@scenario
def q13_mark_dirty_view_output():
    res = {}
    for k, decl in DECLS.items():
        rec = {}

        class F(Function):
            @staticmethod
            def forward(ctx, x, decl=decl):
                x.mul_(2.0)
                ctx.mark_dirty(x)
                if decl != "omit":
                    ctx.set_output_grad_dtype(decl)
                return x

            @staticmethod
            def backward(ctx, g, rec=rec):
                rec["bwd_dtype"] = D(g)
                return g.float() * 2.0

        a = leaf([1.0, 2.0, 3.0])
        base = a * 1.0
        v = base[:2]
        r = {}
        try:
            out = F.apply(v)
            r["out_grad_fn"] = type(out.grad_fn).__name__
            z = ToDtype.apply(out, torch.float64)
            (z.sum() + base.sum()).backward()
        except Exception as e:  # noqa: BLE001
            r["error"] = E(e)
        res[k] = {"rec": rec, "r": r, "a.grad": R(a.grad)}
    return res


@scenario
def q13_mark_dirty_nonview_output():
    res = {}
    for k, decl in DECLS.items():
        rec = {}

        class F(Function):
            @staticmethod
            def forward(ctx, x, decl=decl):
                x.mul_(2.0)
                ctx.mark_dirty(x)
                if decl != "omit":
                    ctx.set_output_grad_dtype(decl)
                return x

            @staticmethod
            def backward(ctx, g, rec=rec):
                rec["bwd_dtype"] = D(g)
                return g.float() * 2.0

        a = leaf([1.0, 2.0])
        x = a * 1.0
        r = {}
        try:
            out = F.apply(x)
            z = ToDtype.apply(out, torch.float64)
            z.sum().backward()
        except Exception as e:  # noqa: BLE001
            r["error"] = E(e)
        res[k] = {"rec": rec, "r": r, "a.grad": R(a.grad)}
    return res


@scenario
def q13_view_output_not_dirty():
    """forward returns a view of its input (not dirty)."""
    res = {}
    for k, decl in DECLS.items():
        rec = {}

        class F(Function):
            @staticmethod
            def forward(ctx, x, decl=decl):
                if decl != "omit":
                    ctx.set_output_grad_dtype(decl)
                return x.view_as(x)

            @staticmethod
            def backward(ctx, g, rec=rec):
                rec["bwd_dtype"] = D(g)
                return g.float()

        a = leaf([1.0, 2.0])
        x = a * 1.0
        r = {}
        try:
            out = F.apply(x)
            z = ToDtype.apply(out, torch.float64)
            z.sum().backward()
        except Exception as e:  # noqa: BLE001
            r["error"] = E(e)
        res[k] = {"rec": rec, "r": r, "a.grad": R(a.grad)}
    return res


# ------------------------------------------------ Q14: torch.func


def _func_fn(decl, rec):
    class F(Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(x):
            return x * 2.0

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.set_output_grad_dtype(decl)

        @staticmethod
        def backward(ctx, g):
            rec.setdefault("bwd_dtype", []).append(D(g))
            return g * 2.0

    return F


@scenario
def q14_func_grad():
    res = {}
    for k, decl in [("None", None), ("float32", torch.float32), ("float64", torch.float64)]:
        rec = {}
        F = _func_fn(decl, rec)
        r = try_(lambda: R(torch.func.grad(lambda x: F.apply(x).sum())(torch.tensor([1.0, 2.0]))))
        res[k] = {"rec": rec, "result": r}
    return res


@scenario
def q14_func_vjp():
    res = {}
    for k, decl in [("None", None), ("float32", torch.float32), ("float64", torch.float64)]:
        rec = {}
        F = _func_fn(decl, rec)

        def go():
            out, fn = torch.func.vjp(F.apply, torch.tensor([1.0, 2.0]))
            return R(fn(torch.tensor([1.0, 3.0]))[0])

        res[k] = {"rec": rec, "result": try_(go)}
    return res


@scenario
def q14_func_vmap():
    res = {}
    for k, decl in [("None", None), ("float32", torch.float32), ("float64", torch.float64)]:
        rec = {}
        F = _func_fn(decl, rec)
        r = try_(lambda: R(torch.func.vmap(F.apply)(torch.ones(2, 3))))
        res[k] = {"rec": rec, "result": r}
    return res


@scenario
def q14_func_vmap_grad():
    res = {}
    for k, decl in [("None", None), ("float64", torch.float64)]:
        rec = {}
        F = _func_fn(decl, rec)
        r = try_(
            lambda: R(
                torch.func.vmap(torch.func.grad(lambda x: F.apply(x).sum()))(
                    torch.ones(2, 3)
                )
            )
        )
        res[k] = {"rec": rec, "result": r}
    return res


@scenario
def q14_func_grad_input_grad_buffers():
    rec = {}

    class F(Function):
        @staticmethod
        def forward(x):
            return x * 2.0

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, g):
            rec["bufs"], rec["err"] = read_bufs(ctx)
            return g * 2.0

    r = try_(
        lambda: R(
            torch.func.grad(lambda x: F.apply(x).sum() + (x * 3.0).sum())(
                torch.tensor([1.0, 2.0])
            )
        )
    )
    return {"rec": rec, "result": r}


@scenario
def q14_func_grad_oldstyle_declaring():
    rec = {}
    F, rec = _grad_dtype_fn(torch.float64, rec=rec)
    r = try_(lambda: R(torch.func.grad(lambda x: F.apply(x).sum())(torch.tensor([1.0, 2.0]))))
    return {"rec": rec, "result": r}


# ------------------------------------------------ Q15: boxed + dtype


@scenario
def q15_boxed_declared_dtype():
    res = {}
    for k, decl in DECLS.items():
        rec = {}

        class F(Function):
            boxed_grads_call = True

            @staticmethod
            def forward(ctx, x, decl=decl):
                if decl != "omit":
                    ctx.set_output_grad_dtype(decl, None)
                return x * 2.0, x * 3.0

            @staticmethod
            def backward(ctx, grads, rec=rec):
                rec["grads_type"] = type(grads).__name__
                rec["dtypes"] = [D(g) for g in grads]
                g = grads[0]
                grads.clear()
                return g.float() * 2.0

        x = leaf([1.0, 2.0])
        a, b = F.apply(x)
        z = ToDtype.apply(a, torch.float64)
        r = try_(lambda: (z.sum() + b.sum()).backward())
        res[k] = {"rec": rec, "backward": r, "x.grad": R(x.grad)}
    return res


@scenario
def q15_boxed_declared_dtype_root_grad():
    rec = {}

    class F(Function):
        boxed_grads_call = True

        @staticmethod
        def forward(ctx, x):
            ctx.set_output_grad_dtype(torch.float16)
            return x * 2.0

        @staticmethod
        def backward(ctx, grads):
            rec["dtypes"] = [D(g) for g in grads]
            return grads[0].float() * 2.0

    x = leaf([1.0, 2.0])
    y = F.apply(x)
    r = try_(lambda: y.backward(torch.tensor([1.0, 3.0], dtype=torch.float64)))
    return {"rec": rec, "backward": r, "x.grad": R(x.grad)}


@scenario
def q15_boxed_direct_apply_declared():
    rec = {}

    class F(Function):
        boxed_grads_call = True

        @staticmethod
        def forward(ctx, x):
            ctx.set_output_grad_dtype(torch.float64)
            return x * 2.0

        @staticmethod
        def backward(ctx, grads):
            rec["dtypes"] = [D(g) for g in grads]
            return grads[0] * 2.0

    x = leaf([1.0, 2.0])
    y = F.apply(x)
    r = try_(lambda: D(y.grad_fn.apply(torch.ones(2))))
    return {"rec": rec, "apply": r}


# ------------------------------------------------ additions


@scenario
def q04_buffer_storage_becomes_grad():
    """Buffer not retained past backward: does x.grad reuse its storage?"""
    held = {}

    class F(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2.0

        @staticmethod
        def backward(ctx, g):
            b = ctx.input_grad_buffers[0]
            held["ptr"] = None if b is None else b.data_ptr()
            if b is not None:
                b.add_(g * 2.0)
                return None
            return g * 2.0

    x = leaf([1.0, 2.0])
    y = F.apply(x)
    (y.sum() + (x * 3.0).sum()).backward()
    return {
        "exposed": held["ptr"] is not None,
        "grad_reuses_buffer_storage": held["ptr"] == x.grad.data_ptr(),
        "x.grad": R(x.grad),
    }


@scenario
def q06_fresh_dense_noncontiguous_grad():
    class G(Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            t = torch.empty_strided((2, 2), (1, 2))
            t.copy_(g * 3.0)
            return t

    F, rec = make_fuse()
    x = leaf([[1.0, 2.0], [3.0, 4.0]])
    y = F.apply(x)
    z = G.apply(x)
    (y.sum() + (z * torch.tensor([[1.0, 2.0], [3.0, 4.0]])).sum()).backward()
    return {"rec": rec, "x.grad": R(x.grad)}


def _other_ctx_in_mode(mode):
    rec1 = {}
    F1 = _reader_fn(rec1)
    x1 = leaf([1.0, 2.0])
    y1 = F1.apply(x1)
    rec = {}

    class Rd2(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2.0

        @staticmethod
        def backward(ctx, g):
            rec["own"], rec["own_err"] = read_bufs(ctx)
            rec["other"], rec["other_err"] = read_bufs(y1.grad_fn)
            return g * 2.0

    x = leaf([1.0, 2.0])
    with torch.autograd.set_detect_anomaly(mode == "anomaly"):
        y = Rd2.apply(x)
        if mode == "posthook":
            y.grad_fn.register_hook(lambda gi, go: None)
        (y.sum() + (x * 3.0).sum()).backward(create_graph=(mode == "create_graph"))
    return rec


@scenario
def q05_precedence_other_ctx_under_create_graph():
    return _other_ctx_in_mode("create_graph")


@scenario
def q05_precedence_other_ctx_under_anomaly():
    return _other_ctx_in_mode("anomaly")


@scenario
def q05_precedence_other_ctx_under_posthook():
    return _other_ctx_in_mode("posthook")


@scenario
def q05_precedence_forward_read_under_create_graph_backward():
    """Forward of an inner Function run (with grad) inside a create_graph backward."""
    rec_in = {}
    Inner = _reader_fn(rec_in, "forward")

    class Outer(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2.0

        @staticmethod
        def backward(ctx, g):
            Inner.apply(g)
            return g * 2.0

    x = leaf([1.0, 2.0])
    Outer.apply(x).sum().backward(create_graph=True)
    return _clean(rec_in)


@scenario
def q12_declare_complex_for_real_return_complex():
    rec = {}

    class F(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.set_output_grad_dtype(torch.complex64)
            return x * 2.0

        @staticmethod
        def backward(ctx, g):
            rec["bwd_dtype"] = D(g)
            return g * 2.0

    x = leaf([1.0, 2.0])
    y = F.apply(x)
    r = try_(lambda: y.sum().backward())
    return {"rec": rec, "backward": r, "x.grad": R(x.grad), "x.grad.dtype": D(x.grad)}


@scenario
def q12_declare_int64_create_graph():
    F, rec = _decl_fn(lambda x: (torch.int64,), lambda x: x * 2.0)
    return _apply_run(
        F, leaf([1.0, 2.0]), rec, lambda y: y.sum().backward(create_graph=True)
    )


@scenario
def q12_declare_int64_under_no_grad():
    F, rec = _decl_fn(lambda x: (torch.int64,), lambda x: x * 2.0)
    with torch.no_grad():
        return _apply_run(F, leaf([1.0, 2.0]), rec)


@scenario
def q12_declare_int64_no_input_requires_grad():
    F, rec = _decl_fn(lambda x: (torch.int64,), lambda x: x * 2.0)
    return _apply_run(F, torch.tensor([1.0, 2.0]), rec)


@scenario
def q10_concrete_for_integer_output_no_input_requires_grad():
    F, rec = _decl_fn(
        lambda x: (None, torch.float32),
        lambda x: (x * 2.0, (x * 3.0).long()),
    )
    return _apply_run(F, torch.tensor([1.0]), rec)


@scenario
def q10_concrete_for_tensor_output_under_no_grad():
    F, rec = _decl_fn(lambda x: (torch.float64,), lambda x: x * 2.0)
    with torch.no_grad():
        return _apply_run(F, leaf([1.0]), rec)


@scenario
def q10_concrete_for_nondiff_output_of_nonrequiring_input():
    """Two inputs; output 1 depends only on the non-requiring input."""

    class F(Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.set_output_grad_dtype(torch.float32, torch.float32)
            return x * 2.0, w * 2.0

        @staticmethod
        def backward(ctx, g1, g2):
            return g1 * 2.0, None

    x = leaf([1.0])
    w = torch.tensor([1.0])
    r = try_(lambda: [o.requires_grad for o in F.apply(x, w)])
    return r
