"""``FusedEmbedding``: a drop-in ``nn.Embedding`` whose backward adds its rows into the engine's buffer.

A stock embedding's backward returns a dense ``num_embeddings x
embedding_dim`` gradient, mostly zeros, for the engine to add to whatever
the weight's buffer already holds. When the weight is also used elsewhere in
the same backward (an output projection tied to the token embedding, as in
GPT-2 and ALBERT, or one embedding table read by several lookups), the
engine has a buffer for it when the lookup's backward runs, since the lookup
is created first and so runs last: ``FusedEmbedding`` then adds its rows into
that buffer (``index_add_``) and returns ``None``, and no dense temporary is
allocated. Where no buffer is exposed, it returns what ``nn.Embedding``
returns (``aten.embedding_dense_backward``, bit for bit).

``padding_idx``, ``scale_grad_by_freq`` and ``max_norm`` behave as in
``nn.Embedding``. With ``padding_idx`` the fused path adds every row and
then puts the padding row of the buffer back as it was: it allocates that
one row (``embedding_dim`` elements), never a copy of the output gradient.
With ``scale_grad_by_freq`` it counts how often each row is looked up and
scales the buffer's rows around the add, ``(w * count + S) / count`` (rows
not looked up by 1): it allocates the counts (``num_embeddings`` int64) and
the scale made of them (``num_embeddings`` elements of the weight's dtype),
never a copy of the output gradient; the gradient is ``nn.Embedding``'s
within rounding, not bit for bit. ``advise`` takes what the fused path
allocates off the saving it promises, so the promise is the drop in
allocated bytes. A float16 weight (whose range ``w * count`` could
overflow) still divides a copy of the output gradient (``tokens x
embedding_dim``), which ``advise`` does not count. A
``sparse=True`` embedding runs the stock lookup (its
gradient is sparse: there is no dense buffer to add into). Whether the
buffer is exposed depends on what the earlier producer left in it: the
transposed gradient of a functional ``F.linear(h, embedding.weight)`` is a
view sharing its storage, and is not exposed (``torch_ctxext.explain()``
says "shared with another tensor (its storage ...)"); an output projection
that is an ``nn.Linear`` made a ``FusedLinear`` leaves a buffer of its own.
Where torch_ctxext has a build for the running torch (as for
``FusedLinear``: nn/linear.py), a lookup without ``scale_grad_by_freq`` on
plain CPU tensors runs the same Function in C++ (``fused_embedding``,
``csrc/fused_embedding.cpp``): the same bits, the same buffer added into.

    >>> import torch
    >>> from torch_ctxext.nn import FusedEmbedding, FusedLinear
    >>> embedding = FusedEmbedding(10, 4)
    >>> head = FusedLinear(4, 10, bias=False)
    >>> head.weight = embedding.weight                  # tied output projection
    >>> tokens = torch.tensor([[1, 2, 3]])
    >>> head(embedding(tokens)).sum().backward()        # the lookup adds into head's gradient
    >>> embedding.weight.grad.shape
    torch.Size([10, 4])
"""
import torch

from ._buffers import readable_buffers
from ._matmul import ones
from .linear import through_cpp

__all__ = ["FusedEmbedding", "FusedEmbeddingFunction"]


def _counts(rows, num_weights):
    """How many times each of the ``num_weights`` rows is looked up: int64,
    ``num_weights`` elements, and nothing else allocated (a cached one,
    expanded; ``bincount`` would also allocate its input's min and max)."""
    counts = torch.zeros(num_weights, dtype=torch.int64, device=rows.device)
    return counts.index_add_(0, rows, ones(1, counts)[0].expand(rows.shape[0]))


class FusedEmbeddingFunction(torch.autograd.Function):
    """``weight[indices]`` whose backward adds into the weight's buffer.

    ``forward(ctx, indices, weight, padding_idx, scale_grad_by_freq, fuse)``:
    ``padding_idx`` is ``-1`` for none (as ``torch.embedding`` takes it);
    ``fuse`` False gives ``nn.Embedding``'s backward.
    """

    @staticmethod
    def forward(ctx, indices, weight, padding_idx, scale_grad_by_freq, fuse):
        ctx.save_for_backward(indices)
        ctx.num_weights = weight.shape[0]
        ctx.padding_idx = padding_idx
        ctx.scale_grad_by_freq = scale_grad_by_freq
        ctx.fuse = fuse
        return torch.embedding(weight, indices, padding_idx, scale_grad_by_freq, False)

    @staticmethod
    def backward(ctx, grad):
        (indices,) = ctx.saved_tensors
        if not ctx.needs_input_grad[1]:
            return None, None, None, None, None
        _, w_buf, _, _, _ = readable_buffers(ctx, ctx.fuse)
        if w_buf is not None and w_buf.dtype == grad.dtype:
            rows = indices.reshape(-1)
            g = grad.reshape(-1, grad.shape[-1])
            # The padding row gets no gradient: add every row, then put the
            # padding row's buffer back as it was (one row kept aside, not a
            # copy of the output gradient without it).
            kept = w_buf[ctx.padding_idx].clone() if ctx.padding_idx >= 0 else None
            if ctx.scale_grad_by_freq and w_buf.dtype != torch.float16:
                # Row r gets (sum of its rows of g) / count[r]. index_add_
                # takes one scalar alpha, so the buffer's rows are scaled
                # instead: (w * c + S) / c = w + S / c, with c = 1 for rows
                # not looked up (w * 1 / 1 is w exactly). The counts are exact
                # (int64); c is then in the buffer's dtype, which mul_ and
                # div_ need to make no temporary.
                scale = _counts(rows, ctx.num_weights).clamp_(min=1).to(w_buf.dtype).unsqueeze(1)
                w_buf.mul_(scale)
                w_buf.index_add_(0, rows, g)
                w_buf.div_(scale)
            else:
                if ctx.scale_grad_by_freq:
                    # float16: w * c could overflow its range (65504), so
                    # divide a copy of the output gradient instead.
                    counts = torch.bincount(rows, minlength=ctx.num_weights)
                    g = g / counts[rows].unsqueeze(1).to(g.dtype)
                w_buf.index_add_(0, rows, g)
            if kept is not None:
                w_buf[ctx.padding_idx].copy_(kept)
            return None, None, None, None, None
        grad_weight = torch.ops.aten.embedding_dense_backward(
            grad, indices, ctx.num_weights, ctx.padding_idx, ctx.scale_grad_by_freq
        )
        return None, grad_weight, None, None, None


class FusedEmbedding(torch.nn.Embedding):
    """``torch.nn.Embedding`` with :class:`FusedEmbeddingFunction` as its
    lookup, or, without ``scale_grad_by_freq``, the same Function in C++
    where ``FusedLinear`` runs its own (``nn/linear.py``).

    Same ``__init__``, parameters and ``state_dict``; ``fuse=False`` (or
    setting ``.fuse`` later) keeps the Function but never reads the buffers.
    Where the weight receives no gradient (no grad mode, or a frozen weight)
    it is ``nn.Embedding``'s lookup, with no Function.
    """

    def __init__(self, *args, fuse=True, **kwargs):
        super().__init__(*args, **kwargs)
        self.fuse = fuse

    def forward(self, input):
        if self.sparse or not (torch.is_grad_enabled() and self.weight.requires_grad):
            return super().forward(input)  # sparse, or no gradient: nothing to fuse
        if self.max_norm is not None:
            # What F.embedding does first: renormalise the rows looked up,
            # in place, outside autograd.
            input = input.contiguous()
            with torch.no_grad():
                torch.embedding_renorm_(self.weight, input, self.max_norm, self.norm_type)
        padding_idx = -1 if self.padding_idx is None else self.padding_idx
        if not self.scale_grad_by_freq:  # (the Python Function scales the buffer's rows)
            out = through_cpp("fused_embedding", self.fuse, input, self.weight, padding_idx)
            if out is not None:
                return out
        return FusedEmbeddingFunction.apply(
            input, self.weight, padding_idx, self.scale_grad_by_freq, self.fuse
        )

    def extra_repr(self):
        return super().extra_repr() + f", fuse={self.fuse}"
