"""The custom autograd Functions the CPU differential scenarios are built from.

Each factory returns a fresh Function class (and the dict it records what its
backward saw into), so no scenario shares state with another. Only the public
torch 2.15 API is used, so these run on native 2.15 without torch_ctxext.
"""

import torch
from torch.autograd import Function

from scenario_helpers import backward_with_later_consumer, describe_buffers, dtype_name, error_of, fuse_into
from scenario_helpers import grad_values, leaf, outcome_of, read_buffers, tensor_values


def doubling(backward, in_forward=None, boxed=False):
    """y = 2x whose backward is ``backward(ctx, g)`` (it returns the gradient);
    given ``in_forward``, forward first runs ``in_forward(ctx)``; ``boxed``
    sets boxed_grads_call (backward then gets the list of gradients)."""

    class Doubling(Function):
        boxed_grads_call = boxed

        @staticmethod
        def forward(ctx, x):
            if in_forward is not None:
                in_forward(ctx)
            return x * 2.0

        @staticmethod
        def backward(ctx, g):
            return backward(ctx, g)

    return Doubling


def doubling_in_setup_context_style(setup_context, backward=None, vmap_rule=False):
    """y = 2x in the setup_context style: forward(x), then setup_context runs
    ``setup_context(ctx)``; backward is ``backward(ctx, g)`` (by default the
    gradient 2g); ``vmap_rule`` sets generate_vmap_rule (for torch.func.vmap)."""

    class DoublingInSetupContextStyle(Function):
        generate_vmap_rule = vmap_rule

        @staticmethod
        def forward(x):
            return x * 2.0

        @staticmethod
        def setup_context(ctx, inputs, output):
            setup_context(ctx)

        @staticmethod
        def backward(ctx, g):
            return g * 2.0 if backward is None else backward(ctx, g)

    return DoublingInSetupContextStyle


def doubling_with_later_consumer(backward):
    """backward_with_later_consumer(doubling(...)) whose backward is
    ``backward(ctx, g, rec)``, recording into ``rec``: {"rec": rec, "x.grad": ...}."""
    rec = {}
    x = backward_with_later_consumer(doubling(lambda ctx, g: backward(ctx, g, rec)))
    return {"rec": rec, **grad_values(x=x)}


def fusing_scale(scale=2.0, fuse=True, record=None):
    """y = scale * x whose backward reads ctx.input_grad_buffers and, with
    ``fuse``, adds its gradient into an exposed buffer instead of returning it.
    Records each read ("reads"), read errors ("read_errors") and the dtype of
    the incoming gradient ("grad_dtype")."""
    record = {} if record is None else record

    class FusingScale(Function):
        @staticmethod
        def forward(ctx, x):
            return x * scale

        @staticmethod
        def backward(ctx, g):
            try:
                buffers = ctx.input_grad_buffers
            except Exception as e:  # noqa: BLE001
                record.setdefault("read_errors", []).append(error_of(e))
                return g * scale
            record.setdefault("reads", []).append(describe_buffers(buffers))
            record["grad_dtype"] = dtype_name(g)
            return fuse_into(buffers[0], g * scale) if fuse else g * scale

    return FusingScale, record


def scaled_sum_of_tensor_args(record):
    """forward(*args): 2 * (sum of the tensor arguments); backward records the
    buffers it reads ("bufs", and "err" where reading raises)."""

    class ScaledSum(Function):
        @staticmethod
        def forward(ctx, *args):
            ctx.kinds = [isinstance(a, torch.Tensor) for a in args]
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            out = tensors[0] * 2
            for a in tensors[1:]:
                out = out + a * 2
            return out

        @staticmethod
        def backward(ctx, g):
            buffers, err = read_buffers(ctx)
            record["bufs"] = buffers
            if err:
                record["err"] = err
            return tuple(g * 2 if is_tensor else None for is_tensor in ctx.kinds)

    return ScaledSum


def scale_with_defaults(style, record):
    """forward(x, scale=2.0, flag=None) -> x * scale, in the ``"old"`` style
    (ctx in forward) or the ``"setup"`` style (setup_context)."""
    if style == "old":

        class DefaultsOldStyle(Function):
            @staticmethod
            def forward(ctx, x, scale=2.0, flag=None):
                ctx.scale = scale
                return x * scale

            @staticmethod
            def backward(ctx, g):
                record["bufs"], record["err"] = read_buffers(ctx)
                record["nargs_return"] = 3
                return g * ctx.scale, None, None

        return DefaultsOldStyle

    class DefaultsSetupContext(Function):
        @staticmethod
        def forward(x, scale=2.0, flag=None):
            return x * scale

        @staticmethod
        def setup_context(ctx, inputs, output):
            record["setup_inputs_len"] = len(inputs)
            ctx.scale = inputs[1]

        @staticmethod
        def backward(ctx, g):
            record["bufs"], record["err"] = read_buffers(ctx)
            return g * ctx.scale, None, None

    return DefaultsSetupContext


def buffer_reader(record, where="backward", catch=True):
    """y = 2x that reads ctx.input_grad_buffers in backward (and, with
    ``where="forward"``, in forward too); keeps its ctx in record["ctx"].
    With ``catch=False`` a read that raises in backward propagates."""

    class BufferReader(Function):
        @staticmethod
        def forward(ctx, x):
            if where == "forward":
                record["forward_read"], record["forward_err"] = read_buffers(ctx)
            record["ctx"] = ctx
            return x * 2.0

        @staticmethod
        def backward(ctx, g):
            if catch:
                record["bwd_read"], record["bwd_err"] = read_buffers(ctx)
            else:
                record["bwd_read"] = describe_buffers(ctx.input_grad_buffers)
            return g * 2.0

    return BufferReader


def applied_reader(**options):
    """buffer_reader(rec, **options) applied to x = leaf([1, 2]): (rec, x, y)."""
    rec = {}
    F = buffer_reader(rec, **options)
    x = leaf([1.0, 2.0])
    return rec, x, F.apply(x)


def without_ctx(record):
    """A buffer_reader record without the ctx it keeps."""
    record = dict(record)
    record.pop("ctx", None)
    return record


def producer_returning(make_grad):
    """An identity (clone) whose backward returns ``make_grad(g)``: a custom
    producer of the gradient that reaches its input."""

    class Producer(Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return make_grad(g)

    return Producer


def declaring_function(declarations, outputs, record=None, style="old", non_differentiable=None):
    """forward(x) returns ``outputs(x)`` and calls
    ``ctx.set_output_grad_dtype(*declarations(x))``, recording "ok" or the error
    as record["decl"]; in the ``"old"`` style (ctx in forward) or ``"setup"``
    (setup_context). Backward records the dtypes (and, old style, values) of
    the gradients it gets. ``non_differentiable``: indices of outputs marked
    non-differentiable (old style)."""
    record = {} if record is None else record

    if style == "old":

        class Declaring(Function):
            @staticmethod
            def forward(ctx, x):
                outs = outputs(x)
                if non_differentiable is not None:
                    ctx.mark_non_differentiable(*[outs[i] for i in non_differentiable])
                try:
                    ctx.set_output_grad_dtype(*declarations(x))
                    record["decl"] = "ok"
                except Exception as e:  # noqa: BLE001
                    record["decl"] = error_of(e)
                ctx.n = len(outs) if isinstance(outs, tuple) else 1
                return outs

            @staticmethod
            def backward(ctx, *gs):
                record["bwd_dtypes"] = [dtype_name(g) if isinstance(g, torch.Tensor) else repr(g) for g in gs]
                record["bwd_vals"] = [tensor_values(g) if isinstance(g, torch.Tensor) else None for g in gs]
                tensors = [g for g in gs if isinstance(g, torch.Tensor)]
                return (tensors[0].float() * 2.0) if tensors else None

        return Declaring, record

    class DeclaringSetupContext(Function):
        @staticmethod
        def forward(x):
            return outputs(x)

        @staticmethod
        def setup_context(ctx, inputs, output):
            try:
                ctx.set_output_grad_dtype(*declarations(inputs[0]))
                record["decl"] = "ok"
            except Exception as e:  # noqa: BLE001
                record["decl"] = error_of(e)

        @staticmethod
        def backward(ctx, *gs):
            record["bwd_dtypes"] = [dtype_name(g) if isinstance(g, torch.Tensor) else repr(g) for g in gs]
            tensors = [g for g in gs if isinstance(g, torch.Tensor)]
            return (tensors[0].float() * 2.0) if tensors else None

    return DeclaringSetupContext, record


def apply_and_backward(F, x, record, loss=None):
    """Apply F to x ("apply": "ok" or the error), then, given ``loss``, run
    ``loss(y)`` ("backward": its outcome); with F's record as "rec"."""
    out = {}
    try:
        y = F.apply(x)
        out["apply"] = "ok"
    except Exception as e:  # noqa: BLE001
        out["apply"] = error_of(e)
        out["rec"] = record
        return out
    if loss is not None:
        out["backward"] = outcome_of(lambda: loss(y))
    out["rec"] = record
    return out


OMIT = "omit"  # a declaration left out: set_output_grad_dtype is not called

# The declarations the dtype scenarios try, by the key their observation is under.
DECLARATIONS = {
    "omit": OMIT,
    "None": None,
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
}


def declaring_scale(declaration, out_dtype=torch.float32, record=None):
    """y = (2x).to(out_dtype) that declares ``declaration`` for its output
    (``OMIT``: no call); backward records the dtypes ("bwd_dtype", a list) and
    values ("bwd_vals") of the gradient it gets and returns a float32 one."""
    record = {} if record is None else record

    class DeclaringScale(Function):
        @staticmethod
        def forward(ctx, x):
            if declaration != OMIT:
                ctx.set_output_grad_dtype(declaration)
            return (x * 2.0).to(out_dtype)

        @staticmethod
        def backward(ctx, g):
            record.setdefault("bwd_dtype", []).append(dtype_name(g))
            record["bwd_vals"] = tensor_values(g)
            return (g * 2.0).to(torch.float32)

    return DeclaringScale, record


class CastGradTo(Function):
    """Identity whose backward returns the gradient cast to a chosen dtype:
    ``CastGradTo.apply(y, torch.float64)`` sends a float64 gradient to y."""

    @staticmethod
    def forward(ctx, y, dt):
        ctx.dt = dt
        return y.clone()

    @staticmethod
    def backward(ctx, g):
        return g.to(ctx.dt), None


def two_input_reader(record, forward, note_needs_input_grad=False):
    """forward(a, b) -> ``forward(a, b)``; backward records the buffers it
    reads ("bufs", "err") and, with ``note_needs_input_grad``, the ctx's
    needs_input_grad; it returns 2g for both inputs."""

    class TwoInputReader(Function):
        @staticmethod
        def forward(ctx, a, b):
            return forward(a, b)

        @staticmethod
        def backward(ctx, g):
            record["bufs"], record["err"] = read_buffers(ctx)
            if note_needs_input_grad:
                record["needs_input_grad"] = list(ctx.needs_input_grad)
            return g * 2.0, g * 2.0

    return TwoInputReader


def func_declaring_scale(declaration, record):
    """y = 2x in the setup_context style (generate_vmap_rule, for torch.func)
    that declares ``declaration``; backward records the gradient dtypes it gets."""

    def backward(ctx, g):
        record.setdefault("bwd_dtype", []).append(dtype_name(g))
        return g * 2.0

    return doubling_in_setup_context_style(
        lambda ctx: ctx.set_output_grad_dtype(declaration), backward, vmap_rule=True
    )
