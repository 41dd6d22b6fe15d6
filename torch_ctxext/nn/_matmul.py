"""The backward of ``y = x @ W + b`` shared by FusedLinear and FusedConv1D.

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

__all__ = ["as_matrix", "input_grad", "weight_grad", "bias_grad", "backward", "linear_grads"]

_ones = {}  # (device, dtype) -> a vector of ones, grown as needed, never shrunk
_ones_lock = threading.Lock()


def as_matrix(t):
    """(..., features) -> (rows, features), a view where possible."""
    return t.reshape(-1, t.shape[-1])


def ones(rows, like):
    """``rows`` ones of ``like``'s dtype and device, from a cache: the bias's
    fused sum allocates nothing at each add."""
    key = (like.device, like.dtype)
    with _ones_lock:
        vector = _ones.get(key)
        if vector is None or vector.numel() < rows:
            vector = _ones[key] = torch.ones(max(rows, 1024), dtype=like.dtype, device=like.device)
    return vector[:rows]


def input_grad(g, w_x, x, x_buf):
    """The input's gradient ``g @ w_x`` (``w_x``: ``out x in``) added into
    ``x_buf`` (returns None) or returned as a tensor of its own in ``x``'s
    shape (``_unsafe_view``: a reshape that is not a view to autograd)."""
    if x_buf is not None and x_buf.is_contiguous() and x_buf.dtype == x.dtype:
        x_buf.view(-1, x.shape[-1]).addmm_(g, w_x)
        return None
    product = g @ w_x
    if product.shape == x.shape:
        return product
    return torch.ops.aten._unsafe_view(product, x.shape)


def weight_grad(a, b, w_buf, dtype):
    """``a @ b`` (the weight's gradient in its layout) added into ``w_buf``
    (returns None), or returned in ``dtype``."""
    if w_buf is not None and w_buf.dtype == a.dtype:
        w_buf.addmm_(a, b)
        return None
    return (a @ b).to(dtype)


def bias_grad(g, b_buf):
    """The output gradient summed over its rows: added into ``b_buf`` with no
    temporary (``addmv_`` with cached ones; returns None), or returned."""
    if b_buf is not None and b_buf.dtype == g.dtype:
        b_buf.addmv_(g.t(), ones(g.shape[0], g))
        return None
    return g.sum(0)


def backward(ctx, grad_out, buffers, stored_out_in):
    """The three gradients of ``y = x @ W (+ b)`` from the saved ``x`` and
    ``weight``: ``stored_out_in`` for a weight stored ``out x in``
    (``nn.Linear``), else ``in x out`` (``Conv1D``). ``buffers``: the
    entries of ``ctx.input_grad_buffers`` for x, weight and bias."""
    x, weight = ctx.saved_tensors
    needs = ctx.needs_input_grad[:2] + ((ctx.has_bias and ctx.needs_input_grad[2]),)
    return (*linear_grads(grad_out, x, weight, needs, buffers, stored_out_in), None)


def linear_grads(grad_out, x, weight, needs, buffers, stored_out_in=True):
    """``(grad_x, grad_w, grad_b)`` of ``y = x @ W (+ b)``, each only where
    ``needs`` says (None otherwise, and None where it was added into its
    entry of ``buffers``)."""
    x_buf, w_buf, b_buf = buffers
    g = as_matrix(grad_out)
    grad_x = grad_w = grad_b = None
    if needs[0]:
        w_x = weight.to(x.dtype)
        grad_x = input_grad(g.to(x.dtype), w_x if stored_out_in else w_x.t(), x, x_buf)
    if needs[1]:
        x2 = as_matrix(x).to(g.dtype)
        a, b = (g.t(), x2) if stored_out_in else (x2.t(), g)
        grad_w = weight_grad(a, b, w_buf, weight.dtype)
    if needs[2]:
        grad_b = bias_grad(g, b_buf)
    return grad_x, grad_w, grad_b
