"""The forward and backward of ``y = x @ W + b`` shared by FusedLinear, FusedConv1D and FusedLSTMCell.

The forward multiplies and saves what ``nn.Linear`` does, whatever the
input's strides (:func:`fold`): an input of more than two dimensions is
folded into a matrix, a view where its strides allow one and otherwise the
contiguous copy ``aten::matmul`` makes and saves, so the backward never
copies the input again, and an input the weight's gradient does not need is
not saved at all. What a drop-in allocates is then what the stock layer
allocates, less the gradients it adds into the engine's buffers.

Every gradient returned here is a tensor of its own, never a view: the engine
keeps the first gradient that reaches a slot as its buffer and exposes it to
the next producer only when nothing else shares its storage, so a view (of
the matrix product, reshaped) would leave the buffer "shared" and no later
producer could add into it (q/k/v reading one hidden state, gate/up, a
cross-attention's k/v). And every fused path adds without a temporary: the
bias's row sum is a matrix-vector product with a cached vector of ones,
accumulated in place (``addmv_``).
"""
import threading

import torch

__all__ = ["fold", "is_column_major", "input_grad", "weight_grad", "bias_grad", "backward", "linear_grads"]

_ones = {}  # (device, dtype) -> a vector of ones, grown as needed, never shrunk
_ones_rows = {}  # (device, dtype, rows) -> that vector's first rows (a view, made once: a slice costs ~1 us)
_ONES_ROWS_KEPT = 64  # distinct row counts remembered before the views are dropped and made again
_ones_lock = threading.Lock()
_unsafe_view = torch.ops.aten._unsafe_view


def fold(x, weight_needs_grad):
    """What of ``x`` ``aten::linear`` multiplies and saves: ``x`` itself
    where it is a matrix or folds into one as a view, the folded copy,
    else None.

    ``aten::linear`` (``aten::matmul``) folds an input of more than two
    dimensions into a matrix when that is a view, and also, as a contiguous
    copy that its backward then reads, when the weight requires grad; an
    input it does not fold (strided, with a frozen weight) it multiplies as
    a batch, and so does the drop-in (None: ``F.linear`` on ``x`` itself)."""
    if x.dim() <= 2 or _viewable(x):
        return x  # the backward folds it, a view
    if weight_needs_grad:
        # The copy, made with grad mode on as aten::matmul makes it: a
        # double backward differentiates the weight's gradient through it.
        with torch.enable_grad():
            return x.flatten(0, -2)
    return None


def _viewable(x):
    """Whether ``x``'s leading dimensions fold into one without a copy."""
    if x.is_contiguous():
        return True
    sizes, strides = x.shape, x.stride()
    return all(strides[i] == strides[i + 1] * sizes[i + 1] for i in range(x.dim() - 2)) and x.numel() > 0


def is_column_major(x):
    """Whether the matrix ``x`` is stored column by column: ``aten::mm``'s
    backward then returns its gradient transposed, a view (FunctionsManual's
    ``is_column_major``)."""
    strides = x.stride()
    return x.dim() == 2 and strides[0] == 1 and (x.shape[1] == 1 or strides[1] >= max(1, x.shape[0]))


def as_matrix(t):
    """(..., features) -> (rows, features), a view where possible."""
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def ones(rows, like):
    """``rows`` ones of ``like``'s dtype and device, from a cache: the bias's
    fused sum allocates nothing at each add."""
    device, dtype = like.device, like.dtype
    view = _ones_rows.get((device, dtype, rows))
    if view is not None:
        return view
    key = (device, dtype)
    with _ones_lock:
        vector = _ones.get(key)
        if vector is None or vector.numel() < rows:
            vector = _ones[key] = torch.ones(max(rows, 1024), dtype=dtype, device=device)
            _ones_rows.clear()  # the views of a smaller vector would keep its storage alive
        elif len(_ones_rows) >= _ONES_ROWS_KEPT:
            _ones_rows.clear()
        view = _ones_rows[(device, dtype, rows)] = vector[:rows]
    return view


def input_grad(g, w_x, shape, x_buf, column_major=False):
    """The input's gradient ``g @ w_x`` (``w_x``: ``out x in``) added into
    ``x_buf`` (returns None) or returned as a tensor of its own of ``shape``
    (``_unsafe_view``: a reshape that is not a view to autograd); for a
    ``column_major`` input matrix, stored column by column as ``aten::mm``'s
    backward returns it (its transpose is then contiguous, as the input's
    own transpose is: ``AccumulateGrad`` keeps it without a copy)."""
    if x_buf is not None and x_buf.dtype == g.dtype:
        if x_buf.is_contiguous():
            x_buf.view(-1, shape[-1]).addmm_(g, w_x)
            return None
        if x_buf.dim() == 2 and x_buf.t().is_contiguous():
            x_buf.t().addmm_(w_x.t(), g.t())
            return None
    if column_major and not torch.is_grad_enabled():  # (out= is not differentiable: create_graph=True)
        product = torch.empty_strided(shape, (1, shape[0]), dtype=g.dtype, device=g.device)
        return torch.mm(g, w_x, out=product)
    product = g.mm(w_x)
    if len(shape) == 2:
        return product
    return _unsafe_view(product, shape)


def weight_grad(a, b, w_buf, dtype):
    """``a @ b`` (the weight's gradient in its layout) added into ``w_buf``
    (returns None), or returned in ``dtype``."""
    if w_buf is not None and w_buf.dtype == a.dtype:
        w_buf.addmm_(a, b)
        return None
    product = a.mm(b)
    return product if product.dtype == dtype else product.to(dtype)


def bias_grad(g, b_buf):
    """The output gradient summed over its rows: added into ``b_buf`` with no
    temporary (``addmv_`` with cached ones; returns None), or returned."""
    if b_buf is not None and b_buf.dtype == g.dtype:
        b_buf.addmv_(g.t(), ones(g.shape[0], g))
        return None
    return g.sum(0)


def backward(ctx, grad_out, buffers, stored_out_in):
    """The three gradients of ``y = x @ W (+ b)`` from the saved (folded)
    ``x`` and ``weight``: ``stored_out_in`` for a weight stored ``out x in``
    (``nn.Linear``), else ``in x out`` (``Conv1D``). ``buffers``: the
    entries of ``ctx.input_grad_buffers`` for x, weight and bias."""
    x, weight = ctx.saved_tensors
    needs = ctx.needs_input_grad
    return (*linear_grads(grad_out, x, weight, (needs[0], needs[1], ctx.has_bias and needs[2]), buffers,
                          stored_out_in, ctx.x_shape, ctx.x_dtype, ctx.x_column_major), None)


def linear_grads(grad_out, x, weight, needs, buffers, stored_out_in=True, x_shape=None, x_dtype=None,
                 x_column_major=False):
    """``(grad_x, grad_w, grad_b)`` of ``y = x @ W (+ b)``, each only where
    ``needs`` says (None otherwise, and None where it was added into its
    entry of ``buffers``). ``x``: the input as the forward saved it (a
    matrix, or None where the weight's gradient is not needed); ``x_shape``
    and ``x_dtype``: the input's own (default: ``x``'s); ``x_column_major``:
    the input was a matrix stored column by column (:func:`input_grad`)."""
    x_buf, w_buf, b_buf = buffers
    g = grad_out if grad_out.dim() == 2 else grad_out.reshape(-1, grad_out.shape[-1])
    grad_x = grad_w = grad_b = None
    if needs[0]:
        dtype = x.dtype if x_dtype is None else x_dtype
        w_x = weight if weight.dtype == dtype else weight.to(dtype)
        g_x = g if g.dtype == dtype else g.to(dtype)
        grad_x = input_grad(g_x, w_x if stored_out_in else w_x.t(), x.shape if x_shape is None else x_shape, x_buf,
                            x_column_major)
    if needs[1]:
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if x2.dtype != g.dtype:
            x2 = x2.to(g.dtype)
        a, b = (g.t(), x2) if stored_out_in else (x2.t(), g)
        grad_w = weight_grad(a, b, w_buf, weight.dtype)
    if needs[2]:
        grad_b = bias_grad(g, b_buf)
    return grad_x, grad_w, grad_b
