"""Differential scenarios for ``ctx.input_grad_buffers``: which entries are
exposed (and which are None), what they hold, and what fusing into them does,
across argument kinds, engine orders, leaves with a ``.grad``, dtypes and
gradient kinds, identity of repeated reads, hooks and Function styles.
Where reading must refuse: scenarios_refusals.py; with ``boxed_grads_call``:
scenarios_apply_boxed.py.

Names: ``input_grad_buffers.<concern>.<case>``.
"""

import threading

import torch
from torch.autograd import Function
from torch.autograd.function import once_differentiable

from sample_functions import (
    doubling,
    doubling_in_setup_context_style,
    doubling_with_later_consumer,
    fusing_scale,
    producer_returning,
    scale_with_defaults,
    scaled_sum_of_tensor_args,
    two_input_reader,
)
from scenario_helpers import (
    Section,
    backward_with_later_consumer,
    describe_buffers,
    dtype_name,
    error_of,
    fuse_into,
    grad_values,
    leaf,
    outcome_of,
    read_buffers,
    tensor_values,
)

ARGUMENTS = Section("input_grad_buffers.arguments")  # the tuple's length: one entry per forward argument
ENGINE_ORDER = Section("input_grad_buffers.engine_order")  # exposed only where the Function runs last
NONE_ENTRIES = Section("input_grad_buffers.none_entries")  # the graphs in which an entry is None
LEAF_GRAD = Section("input_grad_buffers.leaf_grad")  # leaves that already have a .grad; inputs=/autograd.grad
DTYPES_AND_KINDS = Section("input_grad_buffers.dtypes_and_kinds")  # dtypes, 0-d, subclass/zero/strided grads
IDENTITY = Section("input_grad_buffers.identity")  # repeated reads: the same tuple and tensors?
HOOKS = Section("input_grad_buffers.hooks")  # retain_grad, node pre-hooks, tensor hooks
FUNCTION_STYLES = Section("input_grad_buffers.function_styles")  # once_differentiable, setup_context, vjp
THREADS = Section("input_grad_buffers.threads")
TORCH_FUNC = Section("input_grad_buffers.torch_func")


# ------------------------------------------------------------------ arguments


@ARGUMENTS.scenario
def len_tensor_and_nontensor_args():
    rec = {}
    F = scaled_sum_of_tensor_args(rec)
    x = leaf([1.0, 2.0])
    w = leaf([3.0, 4.0])
    y = F.apply(x, 3, "s", w, None)
    (y.sum() + (x * 3).sum() + (w * 5).sum()).backward()
    return {"rec": rec, **grad_values(x=x, w=w)}


@ARGUMENTS.scenario
def no_args_beyond_one_tensor():
    rec = {}
    F = scaled_sum_of_tensor_args(rec)
    x = leaf([1.0, 2.0])
    y = F.apply(x)
    (y.sum() + (x * 3).sum()).backward()
    return {"rec": rec, **grad_values(x=x)}


def defaults_case(style, args=(), kwargs=None):
    """forward(x, scale=2.0, flag=None) applied to x and ``args``/``kwargs``."""
    rec = {}
    F = scale_with_defaults(style, rec)
    x = leaf([1.0, 2.0])
    out = {}
    try:
        y = F.apply(x, *args, **(kwargs or {}))
        (y.sum() + (x * 3).sum()).backward()
    except Exception as e:  # noqa: BLE001
        out["error"] = error_of(e)
    out.update(rec=rec, xgrad=tensor_values(x.grad))
    return out


ARGUMENTS.table(
    defaults_case,
    {
        "len_default_not_passed_oldstyle": dict(style="old"),
        "len_default_not_passed_setup_context": dict(style="setup"),
        "len_default_passed_positionally_setup_context": dict(style="setup", args=(4.0,)),
        "kwargs_oldstyle": dict(style="old", kwargs={"scale": 4.0}),
        "kwargs_setup_context": dict(style="setup", kwargs={"scale": 4.0}),
    },
)


# --------------------------------------------------------------- engine order


def order_case(leaf_x, after):
    """x (a leaf, or a*1) reaches the fusing Function and x*3, created after
    (``after``) or before it."""
    F, rec = fusing_scale()
    a = leaf([1.0, 2.0, 3.0])
    x = a if leaf_x else a * 1.0
    if after:
        y = F.apply(x)
        z = x * 3.0
    else:
        z = x * 3.0
        y = F.apply(x)
    (y.sum() + z.sum()).backward()
    return {"rec": rec, **grad_values(a=a)}


ENGINE_ORDER.table(
    order_case,
    {
        "leaf_consumer_after": dict(leaf_x=True, after=True),
        "leaf_consumer_before": dict(leaf_x=True, after=False),
        "nonleaf_consumer_after": dict(leaf_x=False, after=True),
        "nonleaf_consumer_before": dict(leaf_x=False, after=False),
    },
)


@ENGINE_ORDER.scenario
def nonleaf_two_consumers_after():
    F, rec = fusing_scale()
    a = leaf([1.0, 2.0])
    x = a * 1.0
    y = F.apply(x)
    z1 = x * 3.0
    z2 = x * 5.0
    (y.sum() + z1.sum() + z2.sum()).backward()
    return {"rec": rec, **grad_values(a=a)}


@ENGINE_ORDER.scenario
def only_consumer_is_fn():
    F, rec = fusing_scale()
    x = leaf([1.0, 2.0])
    F.apply(x).sum().backward()
    return {"rec": rec, **grad_values(x=x)}


@ENGINE_ORDER.scenario
def no_fuse_returns_grad_anyway():
    F, rec = fusing_scale(fuse=False)
    x = backward_with_later_consumer(F)
    return {"rec": rec, **grad_values(x=x)}


@ENGINE_ORDER.scenario
def fuse_and_also_return_grad():
    """Mutate the buffer AND return a grad: both contributions count?"""

    def fuse_100_and_return(ctx, g, rec):
        b = ctx.input_grad_buffers
        rec["bufs"] = describe_buffers(b)
        if b[0] is not None:
            b[0].add_(100.0)
        return g * 2.0

    return doubling_with_later_consumer(fuse_100_and_return)


# --------------------------------------------------------------- None entries


@NONE_ENTRIES.scenario
def add_aliased_with_nonleaf_pending():
    F, rec = fusing_scale()
    x = leaf([1.0, 2.0])
    v = leaf([10.0, 20.0])
    w = v * 1.0  # producer created before F -> runs after F
    y = F.apply(x)
    z = ((x + w) * 3.0).sum()
    (y.sum() + z).backward()
    return {"rec": rec, **grad_values(x=x, v=v)}


def second_consumer_case(consumer, x_values=(1.0, 2.0), other=None):
    """y = fusing_scale(x); z = consumer(x[, other leaf]); (y.sum() + z).backward()."""
    F, rec = fusing_scale()
    x = leaf(list(x_values))
    leaves = {"x": x}
    if other is not None:
        leaves[other[0]] = leaf(list(other[1]))
    y = F.apply(x)
    z = consumer(*leaves.values())
    (y.sum() + z).backward()
    return {"rec": rec, **grad_values(**leaves)}


NONE_ENTRIES.table(
    second_consumer_case,
    {
        "add_aliased_with_leaf": dict(consumer=lambda x, w: ((x + w) * 3.0).sum(), other=("w", (10.0, 20.0))),
        "add_same_tensor_twice": dict(consumer=lambda x: ((x + x) * 3.0).sum()),
        "add_nonrequiring_other": dict(consumer=lambda x: ((x + torch.tensor([10.0, 20.0])) * 3.0).sum()),
        "sum_expanded_grad": dict(consumer=lambda x: x.sum()),
        "stack_view_grad": dict(
            consumer=lambda x, x2: (torch.stack([x, x2]) * 3.0).sum(), other=("x2", (5.0, 6.0))
        ),
        "t_view_grad": dict(
            consumer=lambda x: (x.t() * torch.tensor([[1.0, 2.0], [3.0, 4.0]])).sum(),
            x_values=([1.0, 2.0], [3.0, 4.0]),
        ),
    },
)


def root_grad_case(leaf_x):
    """backward from y and from x itself (a leaf, or a*1), with given grads."""
    F, rec = fusing_scale()
    a = leaf([1.0, 2.0])
    x = a if leaf_x else a * 1.0
    y = F.apply(x)
    torch.autograd.backward([y, x], [torch.tensor([1.0, 1.0]), torch.tensor([7.0, 8.0])])
    return {"rec": rec, **(grad_values(x=a) if leaf_x else grad_values(a=a))}


NONE_ENTRIES.table(
    root_grad_case,
    {"root_grad_nonleaf_x": dict(leaf_x=False), "root_grad_leaf_x": dict(leaf_x=True)},
)


@NONE_ENTRIES.scenario
def root_is_fn_output_only():
    F, rec = fusing_scale()
    x = leaf([1.0, 2.0])
    y = F.apply(x)
    y.backward(torch.tensor([1.0, 3.0]))
    return {"rec": rec, **grad_values(x=x)}


@NONE_ENTRIES.scenario
def same_input_twice():
    rec = {}

    class F2(Function):
        @staticmethod
        def forward(ctx, a, b):
            return a * b

        @staticmethod
        def backward(ctx, g):
            bufs = ctx.input_grad_buffers
            rec["bufs"] = describe_buffers(bufs)
            rec["same_obj_0_1"] = bufs[0] is bufs[1]
            return fuse_into(bufs[0], g * 2.0), fuse_into(bufs[1], g * 2.0)

    x = leaf([1.0, 2.0])
    y = F2.apply(x, x)
    (y.sum() + (x * 3.0).sum()).backward()
    return {"rec": rec, **grad_values(x=x)}


@NONE_ENTRIES.scenario
def input_not_requiring_grad():
    rec = {}
    F2 = two_input_reader(rec, lambda a, b: a * 2.0 + b * 2.0, note_needs_input_grad=True)
    x = leaf([1.0, 2.0])
    w = torch.tensor([3.0, 4.0])
    y = F2.apply(w, x)
    (y.sum() + (x * 3.0).sum() + (w * 3.0).sum()).backward()
    return {"rec": rec, **grad_values(x=x)}


@NONE_ENTRIES.scenario
def other_consumer_keeps_ref():
    """A producer (custom Function) returns a grad tensor it also keeps."""
    keep = []

    def kept(g):
        keep.append(g * 3.0)
        return keep[-1]

    G = producer_returning(kept)
    F, rec = fusing_scale()
    x = leaf([1.0, 2.0])
    y = F.apply(x)
    z = G.apply(x)
    (y.sum() + (z * 1.0).sum()).backward()
    return {"rec": rec, **grad_values(x=x), "kept": tensor_values(keep[0])}


class MySub(torch.Tensor):
    pass


def custom_producer_case(make_grad, x_values=(1.0, 2.0), weight=None, observe_grad_type=False):
    """x reaches the fusing Function and a custom producer whose backward
    returns ``make_grad(g)`` (an expanded, subclass, zero or strided tensor)."""
    G = producer_returning(make_grad)
    F, rec = fusing_scale()
    x = leaf(list(x_values))
    y = F.apply(x)
    z = G.apply(x)
    other = z * 1.0 if weight is None else z * torch.tensor(weight)
    (y.sum() + other.sum()).backward()
    out = {"rec": rec, **grad_values(x=x)}
    if observe_grad_type:
        out["x.grad.type"] = type(x.grad).__name__
    return out


def _fresh_strided(g):
    t = torch.empty_strided((2, 2), (1, 2))
    t.copy_(g * 3.0)
    return t


SQUARE = ([1.0, 2.0], [3.0, 4.0])

NONE_ENTRIES.table(
    custom_producer_case,
    {"expanded_grad_from_custom_producer": dict(make_grad=lambda g: torch.ones(1).expand(g.shape))},
)
DTYPES_AND_KINDS.table(
    custom_producer_case,
    {
        "subclass_grad_in_buffer": dict(make_grad=lambda g: (g * 3.0).as_subclass(MySub), observe_grad_type=True),
        "zero_tensor_grad_in_buffer": dict(make_grad=lambda g: torch._efficientzerotensor(g.shape, dtype=g.dtype)),
        "noncontiguous_but_dense_grad": dict(  # permuted (non-contiguous, dense), fresh
            make_grad=lambda g: (g * 3.0).t().contiguous().t(), x_values=SQUARE, weight=SQUARE
        ),
        "fresh_dense_noncontiguous_grad": dict(make_grad=_fresh_strided, x_values=SQUARE, weight=SQUARE),
    },
)


# ------------------------------------------------------------------ leaf_grad


def leaf_grad_case(run, leaf_x=True):
    """The fusing Function applied to x, a leaf that already holds
    .grad = 100 (or, without ``leaf_x``, x = a * 1 of a leaf a), with x * 3
    consumed later: what ``run(loss, x)`` observes while it asks the engine
    for the gradients, and then the leaf's .grad."""
    F, rec = fusing_scale()
    a = leaf([1.0, 2.0])
    x = a if leaf_x else a * 1.0
    if leaf_x:
        x.grad = torch.full((2,), 100.0)
    y = F.apply(x)
    seen = run(y.sum() + (x * 3.0).sum(), x)
    return {"rec": rec, **seen, **grad_values(**{"x" if leaf_x else "a": a})}


def _backward_keeping_grad_object(loss, x):
    gobj = x.grad
    loss.backward()
    return {"grad_same_object": x.grad is gobj}


def _autograd_grad(loss, x):
    (gx,) = torch.autograd.grad(loss, [x])
    return {"returned": tensor_values(gx)}


def _backward_inputs_x(loss, x):
    loss.backward(inputs=[x])
    return {}


LEAF_GRAD.table(
    leaf_grad_case,
    {
        "existing_grad_backward": dict(run=_backward_keeping_grad_object),
        "autograd_grad_returns_completed_buffer": dict(run=_autograd_grad),
        "autograd_grad_nonleaf": dict(run=_autograd_grad, leaf_x=False),
        "backward_inputs_x": dict(run=_backward_inputs_x),
    },
)


@LEAF_GRAD.scenario
def backward_inputs_other():
    rec = {}
    F2 = two_input_reader(rec, lambda a, b: a * b, note_needs_input_grad=True)
    x = leaf([1.0, 2.0])
    w = leaf([3.0, 4.0])
    x.grad = torch.full((2,), 100.0)
    y = F2.apply(x, w)
    (y.sum() + (x * 3.0).sum() + (w * 5.0).sum()).backward(inputs=[w])
    return {"rec": rec, **grad_values(x=x, w=w)}


@LEAF_GRAD.scenario
def autograd_grad_other_input():
    rec = {}
    F2 = two_input_reader(rec, lambda a, b: a * b)
    x = leaf([1.0, 2.0])
    w = leaf([3.0, 4.0])
    y = F2.apply(x, w)
    (gw,) = torch.autograd.grad(y.sum() + (x * 3.0).sum() + (w * 5.0).sum(), [w])
    return {"rec": rec, "gw": tensor_values(gw), **grad_values(x=x)}


def _fuse_keeping_buffer(held, keep):
    """y = 2x whose backward fuses into an exposed buffer and gives
    ``keep(buffer)`` to ``held``."""

    def fuse(ctx, g):
        b = ctx.input_grad_buffers[0]
        held.update(keep(b))
        return fuse_into(b, g * 2.0)

    return doubling(fuse)


@LEAF_GRAD.scenario
def buffer_becomes_grad_object():
    """Retained buffer object: is it the final .grad?"""
    held = {}
    F = _fuse_keeping_buffer(held, lambda b: {"b": b})
    x = backward_with_later_consumer(F)
    b = held["b"]
    return {
        "exposed": b is not None,
        "buffer_is_grad": (b is x.grad) if b is not None else None,
        **grad_values(x=x),
        "buffer_after": tensor_values(b),
    }


@LEAF_GRAD.scenario
def buffer_storage_becomes_grad():
    """Buffer not retained past backward: does x.grad reuse its storage?"""
    held = {}
    F = _fuse_keeping_buffer(held, lambda b: {"ptr": None if b is None else b.data_ptr()})
    x = backward_with_later_consumer(F)
    return {
        "exposed": held["ptr"] is not None,
        "grad_reuses_buffer_storage": held["ptr"] == x.grad.data_ptr(),
        **grad_values(x=x),
    }


# ------------------------------------------------------------ dtypes and kinds


def dtype_case(dtype, vals):
    F, rec = fusing_scale()
    x = leaf(vals, dtype=dtype)
    y = F.apply(x)
    z = x * 3.0
    loss = y.sum() + z.sum()
    if loss.is_complex():
        loss = loss.real
    loss.backward()
    return {"rec": rec, **grad_values(x=x), "x.grad.dtype": dtype_name(x.grad)}


DTYPES_AND_KINDS.table(
    dtype_case,
    {
        "float16": dict(dtype=torch.float16, vals=[1.0, 2.0]),
        "bfloat16": dict(dtype=torch.bfloat16, vals=[1.0, 2.0]),
        "float64": dict(dtype=torch.float64, vals=[1.0, 2.0]),
        "complex64": dict(dtype=torch.complex64, vals=[1 + 1j, 2 - 1j]),
    },
)


@DTYPES_AND_KINDS.scenario
def zero_dim():
    F, rec = fusing_scale()
    x = leaf(3.0)
    y = F.apply(x)
    (y + x * 3.0).backward()
    return {"rec": rec, **grad_values(x=x)}


@DTYPES_AND_KINDS.scenario
def requires_grad_buffer_flag():
    rec = {}

    def note_flags(ctx, g):
        b = ctx.input_grad_buffers[0]
        if b is not None:
            rec["requires_grad"] = b.requires_grad
            rec["is_leaf"] = b.is_leaf
            rec["grad_fn"] = None if b.grad_fn is None else type(b.grad_fn).__name__
            rec["is_contiguous"] = b.is_contiguous()
            rec["device"] = str(b.device)
        rec["present"] = b is not None
        return g * 2.0

    backward_with_later_consumer(doubling(note_flags))
    return rec


# -------------------------------------------------------------------- identity


@IDENTITY.scenario
def identity_and_double_read():
    def read(ctx, g, rec):
        t1 = ctx.input_grad_buffers
        t2 = ctx.input_grad_buffers
        rec["first"] = describe_buffers(t1)
        rec["second"] = describe_buffers(t2)
        rec["tuple_same_object"] = t1 is t2
        rec["tuple_equal_type"] = type(t1).__name__
        if t1[0] is not None and t2[0] is not None:
            rec["entry_same_object"] = t1[0] is t2[0]
            rec["entry_same_storage"] = t1[0].data_ptr() == t2[0].data_ptr()
        b = t1[0]
        return fuse_into(b, g * 2.0)

    return doubling_with_later_consumer(read)


@IDENTITY.scenario
def double_read_dropping_first():
    """Read, drop the tuple, read again."""

    def read(ctx, g, rec):
        rec["first"] = describe_buffers(ctx.input_grad_buffers)
        rec["second"] = describe_buffers(ctx.input_grad_buffers)
        return g * 2.0

    return doubling_with_later_consumer(read)


@IDENTITY.scenario
def double_read_holding_entry():
    def read(ctx, g, rec):
        b = ctx.input_grad_buffers[0]
        rec["first_present"] = b is not None
        t2 = ctx.input_grad_buffers
        rec["second"] = describe_buffers(t2)
        rec["same"] = (b is t2[0]) if b is not None else None
        return g * 2.0

    return doubling_with_later_consumer(read)


@IDENTITY.scenario
def tuple_identity_across_backwards():
    """Same ctx (retain_graph) run twice: tuples identical across runs?"""
    rec = {"runs": []}
    held = []

    def read(ctx, g):
        t = ctx.input_grad_buffers
        held.append(t)
        rec["runs"].append(describe_buffers(t))
        return g * 2.0

    F = doubling(read)
    x = leaf([1.0, 2.0])
    y = F.apply(x)
    loss = y.sum() + (x * 3.0).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    rec["same_tuple_across_runs"] = held[0] is held[1]
    return {"rec": rec, **grad_values(x=x)}


# ----------------------------------------------------------------------- hooks


def hooked_case(leaf_x, hook, observe_x_grad=False, records=False):
    """x (a leaf, or a*1 for a leaf a) with ``hook(x, seen)`` installed
    reaches the fusing Function and x*3; with ``records``, what the hook saw
    ("hook_saw")."""
    F, rec = fusing_scale()
    a = leaf([1.0, 2.0])
    x = a if leaf_x else a * 1.0
    seen = []
    hook(x, seen)
    y = F.apply(x)
    (y.sum() + (x * 3.0).sum()).backward()
    out = {"rec": rec}
    if records:
        out["hook_saw"] = seen
    out.update(grad_values(x=x) if leaf_x or observe_x_grad else {})
    if not leaf_x:
        out.update(grad_values(a=a))
    return out


def _retain_grad(x, seen):
    x.retain_grad()


HOOKS.table(
    hooked_case,
    {
        "retain_grad_nonleaf_input": dict(leaf_x=False, hook=_retain_grad, observe_x_grad=True),
        "tensor_hook_on_leaf_input": dict(
            leaf_x=True, hook=lambda x, seen: x.register_hook(lambda g: seen.append(tensor_values(g))), records=True
        ),
        "tensor_hook_on_nonleaf_input": dict(
            leaf_x=False, hook=lambda x, seen: x.register_hook(lambda g: seen.append(tensor_values(g))), records=True
        ),
        "tensor_hook_modifying_nonleaf": dict(leaf_x=False, hook=lambda x, seen: x.register_hook(lambda g: g * 10.0)),
        "post_accumulate_grad_hook_leaf": dict(
            leaf_x=True,
            hook=lambda x, seen: x.register_post_accumulate_grad_hook(lambda p: seen.append(tensor_values(p.grad))),
            records=True,
        ),
    },
)


def node_prehook_case(prehook, records=False):
    """The fusing Function's node with ``prehook(seen)`` as a pre-hook; with
    ``records``, what it saw ("prehook_saw")."""
    F, rec = fusing_scale()
    x = leaf([1.0, 2.0])
    y = F.apply(x)
    seen = []
    y.grad_fn.register_prehook(prehook(seen))
    (y.sum() + (x * 3.0).sum()).backward()
    out = {"rec": rec, **grad_values(x=x)}
    if records:
        out["prehook_saw"] = seen
    return out


HOOKS.table(
    node_prehook_case,
    {
        "prehook_on_node": dict(prehook=lambda seen: lambda go: seen.append(tensor_values(go[0])), records=True),
        "prehook_on_node_modifying": dict(prehook=lambda seen: lambda go: (go[0] * 10.0,)),
    },
)


# ------------------------------------------------------------- function styles


@FUNCTION_STYLES.scenario
def once_differentiable_fuse():
    @once_differentiable
    def backward(ctx, g, rec):
        b = ctx.input_grad_buffers
        rec["bufs"] = describe_buffers(b)
        return fuse_into(b[0], g * 2.0)

    return doubling_with_later_consumer(backward)


@FUNCTION_STYLES.scenario
def setup_context_style_fuse():
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
            rec["bufs"] = describe_buffers(b)
            return fuse_into(b[0], g * w), fuse_into(b[1], g * x)

    x = leaf([1.0, 2.0])
    w = leaf([3.0, 4.0])
    y = F.apply(x, w)
    (y.sum() + (x * 3.0).sum() + (w * 5.0).sum()).backward()
    return {"rec": rec, **grad_values(x=x, w=w)}


@FUNCTION_STYLES.scenario
def vjp_instead_of_backward():
    rec = {}

    class F(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2.0

        @staticmethod
        def vjp(ctx, g):
            rec["bufs"], rec["err"] = read_buffers(ctx)
            return g * 2.0

    x = backward_with_later_consumer(F)
    return {"rec": rec, **grad_values(x=x)}


# --------------------------------------------------------------------- threads


@THREADS.scenario
def multithreaded_backward():
    results = {}

    def work(i):
        F, rec = fusing_scale()
        x = leaf([1.0 + i, 2.0])
        for _ in range(20):
            x.grad = None
            y = F.apply(x)
            (y.sum() + (x * 3.0).sum()).backward()
        results[i] = {"last_read": rec["reads"][-1], **grad_values(x=x)}

    ths = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    return {str(k): results[k] for k in sorted(results)}


# ------------------------------------------------------------------ torch.func


@TORCH_FUNC.scenario
def func_grad():
    rec = {}

    def backward(ctx, g):
        rec["bufs"], rec["err"] = read_buffers(ctx)
        return g * 2.0

    F = doubling_in_setup_context_style(lambda ctx: None, backward)
    r = outcome_of(
        lambda: tensor_values(torch.func.grad(lambda x: F.apply(x).sum() + (x * 3.0).sum())(torch.tensor([1.0, 2.0])))
    )
    return {"rec": rec, "result": r}
