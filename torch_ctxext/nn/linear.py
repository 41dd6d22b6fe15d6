"""``FusedLinear``: a drop-in ``nn.Linear`` whose backward accumulates into the engine's buffers.

``FusedLinear`` is an ``nn.Linear`` (same parameters, same ``state_dict``,
same ``__init__``): where a weight is used several times inside one backward
(a layer shared across depth as in ALBERT, an unrolled recurrent cell,
micro-batches applied to one weight), each use after the first adds its
weight gradient straight into the buffer the engine already holds
(``addmm_``, one kernel, no temporary) instead of returning a new
``D_out x D_in`` tensor for the engine to add. ``torch_ctxext.nn.fuse(model)``
swaps it in for every ``nn.Linear`` of a model; ``torch_ctxext.advise``
says where that pays.

On torch 2.15 ``ctx.input_grad_buffers`` and ``ctx.set_output_grad_dtype``
are native; on torch 2.6 to 2.14 ``import torch_ctxext`` provides them.

Two Functions compute it, alike to the bit. Where torch_ctxext has a build
for the running torch (its extension on torch 2.6 to 2.14; on 2.15, the
build advise() loads too), FusedLinear runs on plain CPU tensors the Function
written in C++ (``csrc/fused_linear.cpp``, a ``torch::autograd::Function``
whose backward adds into the engine's buffers by the rules of
``ctx.input_grad_buffers``): a Python ``autograd.Function`` costs about 15 us
a call more than ``nn.Linear`` on the CPU, the C++ one about as much as
``nn.Linear`` (docs/benchmarks.md, "FusedLinear's cost per call"). Elsewhere
it runs :class:`FusedLinearFunction`, the Python one: torch 2.15 without that
build, another device, a tensor subclass, a torch function or dispatch mode,
autocast, forward AD, a column-major matrix, under a tracer, and while ``advise()`` or
``explain()`` observe (they see the Python Function's reads of
``ctx.input_grad_buffers``).

Three rules it follows (``docs/input_grad_buffers.md``):

* every fused path has an out-of-place fallback, since whether a buffer is
  there depends on the engine's order (the first use to run backward finds
  none);
* an input accumulated into gets ``None`` as its returned gradient;
* under a tracer (``torch.compile``, compiled autograd) and under
  ``create_graph=True`` the buffers are not read (the property would raise):
  the Function is traced, or differentiated twice, with the fallback, and
  eager first-order backward still fuses.

Under ``torch.autocast`` the output is in the autocast dtype (bfloat16, say)
while the parameters stay float32: the Function then declares
``ctx.set_output_grad_dtype(weight.dtype)``, so backward receives a float32
gradient, computes the weight and bias gradients in float32 and accumulates
them into the float32 buffers without a cast.

No fused path allocates: the bias's row sum is accumulated in place
(``addmv_`` with a cached vector of ones), and the input's gradient, where
this layer runs first and returns it, is a tensor of its own (not a view),
so the next layer that reads the same input adds into it (q, k and v
reading one hidden state fuse whichever runs first).

    >>> import torch
    >>> from torch_ctxext.nn import FusedLinear
    >>> layer = FusedLinear(8, 8)
    >>> x = torch.randn(4, 8)
    >>> loss = sum(layer(x * k).sum() for k in range(3))  # one weight, three uses
    >>> loss.backward()
    >>> layer.weight.grad.shape
    torch.Size([8, 8])
"""
import torch
import torch.nn.functional as F

from .. import _explain, _features
from ._matmul import fold, linear_grads

_unsafe_view = torch.ops.aten._unsafe_view
_grad_enabled = torch.is_grad_enabled
_compiling = torch.compiler.is_compiling
_routes = {}  # C++ Function name -> the build's function, or None; found at the first call

__all__ = ["FusedLinear", "FusedLinearFunction", "fused_linear"]


class FusedLinearFunction(torch.autograd.Function):
    """``y = x @ weight.t() + bias`` whose backward fuses gradient accumulation.

    ``forward(ctx, x, weight, bias, fuse)``: ``bias`` may be ``None``; ``fuse``
    False gives the plain out-of-place backward (for comparisons). It
    multiplies and saves what ``nn.Linear`` does, whatever ``x``'s strides
    (``_matmul.fold``): a transposed, expanded, sliced or channels-last input
    is copied once, in the forward, where ``nn.Linear`` copies it, and not
    again in the backward.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, fuse):
        # Runs at every call: the checks are what the common case needs
        # (a matrix, or a contiguous batch), in that order.
        needs_weight = ctx.needs_input_grad[1]
        shape = x.shape
        column_major = False
        if len(shape) == 2:
            saved = x
            out = F.linear(x, weight, bias)
            rows, columns = x.stride()
            column_major = rows == 1 and (shape[1] == 1 or columns >= max(1, shape[0]))
        else:
            saved = fold(x, needs_weight)
            if saved is x or saved is None:
                out = F.linear(x, weight, bias)
            else:
                out = _unsafe_view(F.linear(saved, weight, bias), shape[:-1] + weight.shape[:1])
        # What the backward reads, as aten::linear saves it: the (folded)
        # input only where the weight's gradient needs it.
        ctx.save_for_backward(saved if needs_weight else None, weight)
        ctx.linear = (fuse, bias is not None, shape, x.dtype, column_major)
        dtype = weight.dtype
        if out.dtype != dtype:
            # autocast computed the output in lower precision: take its
            # gradient in the parameters' precision.
            ctx.set_output_grad_dtype(dtype)
        return out

    @staticmethod
    def stock_gradient_is_view(ctx, index):
        """Whether ``nn.Linear``'s own backward returns argument ``index``'s
        gradient as a view, which the engine cannot add into (it sums out of
        place instead): the weight's (``weight.t()``), the bias's (reduced to
        its shape), a batched input's (reshaped back) and a column-major
        matrix's (transposed back). ``advise`` counts that sum as avoided
        where this Function's gradient came first."""
        return index in (1, 2) or (index == 0 and (len(ctx.linear[2]) != 2 or ctx.linear[4]))

    @staticmethod
    def backward(ctx, grad_out):
        # Runs at every call: readable_buffers inlined, and where there is
        # nothing to add into (a layer used once, the first use to run
        # backward, double backward) the three products of nn.Linear's own
        # backward, without linear_grads' generality.
        x, weight = ctx.saved_tensors
        fuse, has_bias, shape, dtype, column_major = ctx.linear
        needs = ctx.needs_input_grad
        if fuse and not _grad_enabled() and not _compiling():
            try:
                x_buf, w_buf, b_buf, _ = ctx.input_grad_buffers
            except RuntimeError:  # refused: out of place (_buffers.readable_buffers)
                x_buf = w_buf = b_buf = None
            plain = x_buf is None and w_buf is None and b_buf is None
        else:
            x_buf = w_buf = b_buf = None
            plain = True
        if plain and not column_major and grad_out.dim() == 2 and grad_out.dtype == dtype == weight.dtype:
            # What linear_grads computes here, op for op (the same bits).
            return (grad_out.mm(weight) if needs[0] else None,
                    grad_out.t().mm(x) if needs[1] else None,
                    grad_out.sum(0) if has_bias and needs[2] else None,
                    None)
        return (*linear_grads(grad_out, x, weight, (needs[0], needs[1], has_bias and needs[2]), (x_buf, w_buf, b_buf),
                              True, shape, dtype, column_major), None)


class FusedLinear(torch.nn.Linear):
    """``torch.nn.Linear`` with :class:`FusedLinearFunction` (or the same
    Function in C++: see the module's docstring) as its forward.

    ``fuse=False`` (or setting ``.fuse`` later) keeps the Python Function but
    never reads the buffers: the same computation, unfused. Where nothing can
    receive a gradient (no grad mode, or neither the input nor a parameter
    requires grad) it is ``nn.Linear``'s ``F.linear``, with no Function.
    """

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, fuse=True):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.fuse = fuse

    def forward(self, x):
        weight, bias = self.weight, self.bias
        if not _grad_enabled():
            return F.linear(x, weight, bias)  # no gradient: nothing to fuse
        return fused_linear(x, weight, bias, self.fuse)

    def extra_repr(self):
        return super().extra_repr() + f", fuse={self.fuse}"


def fused_linear(x, weight, bias, fuse):
    """``FusedLinearFunction.apply(x, weight, bias, fuse)``, or the same
    Function in C++ where there is a build for it and the call is one it
    computes alike (see the module's docstring); ``F.linear`` where nothing
    requires grad."""
    out = through_cpp("fused_linear", fuse, x, weight, bias)
    if out is not None:
        return out
    if not (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        return F.linear(x, weight, bias)  # no gradient: nothing to fuse
    return FusedLinearFunction.apply(x, weight, bias, fuse)


# The build's C++ Functions (through_cpp's names), each looked up once.
CPP_FUNCTIONS = ("fused_linear", "fused_projection", "fused_conv1d", "fused_gru_cell", "fused_lstm_cell",
                 "fused_embedding")


def through_cpp(name, fuse, *args):
    """The output of the build's C++ Function ``name`` (``fused_linear``,
    ``fused_projection``, ``fused_conv1d`` of ``(x, weight, bias)``; the
    cells' steps ``fused_gru_cell``, ``fused_lstm_cell``: csrc/fused_linear.cpp;
    ``fused_embedding`` of ``(indices, weight, padding_idx)``:
    csrc/fused_embedding.cpp) for ``args``, or
    None where the drop-in's Python Function must run: no such build, a call
    the C++ Function would not compute alike, ``fuse=False``, while
    ``advise()`` or ``explain()`` observe (they see the Python Function's
    reads) or a tracer runs (it traces the Python Function)."""
    if fuse and not _explain._observers and not _explain.advising and not _compiling():
        route = _routes[name] if name in _routes else _find_route(name)
        if route is not None:
            return route(*args)
    return None


def cpp_function_build():
    """The loaded build that carries the drop-ins' C++ Functions
    (csrc/fused_linear.cpp), or None: the extension behind
    ``ctx.input_grad_buffers`` (torch 2.6 to 2.14), or on a torch that
    provides the whole contract (2.15) the build advise() loads too, where one
    was made for it (``_ext/advise_module.py``: it never compiles). Its
    ``_testing`` counts what the Functions' backward looked up and added
    into."""
    from .._ext import advise_module

    extension = _features.extension_behind("input_grad_buffers") or advise_module.load()
    return extension if hasattr(extension, "fused_linear") else None


def _find_route(name):
    """``cpp_function_build()``'s function ``name``, looked up once; None
    where there is no such build."""
    route = _routes[name] = getattr(cpp_function_build(), name, None)
    return route
