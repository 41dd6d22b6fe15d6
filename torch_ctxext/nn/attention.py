"""``FusedMultiheadAttention``: a drop-in ``nn.MultiheadAttention`` whose projections' gradients accumulate in place.

``nn.MultiheadAttention`` applies its in-projection (``in_proj_weight``, or
``q_proj_weight``, ``k_proj_weight`` and ``v_proj_weight``) and its
out-projection (``out_proj``, a ``Linear`` subclass whose own forward is
never called) through ``F.linear`` inside
``F.multi_head_attention_forward``. Where the module is applied several
times in one backward (a ``TransformerEncoderLayer`` shared across depth,
an attention reused over steps), each application returns its own weight
gradients for the engine to add. ``FusedMultiheadAttention`` computes the
same attention, operation for operation, with those products made by
:class:`FusedProjectionFunction`, so every application after the first to
run backward adds its weights' and biases' gradients into the engine's
buffers (``addmm_``, ``addmv_``).

What is fused: the packed in-projection of self-attention (``query is key
is value``, as ``nn.TransformerEncoderLayer`` and ``nn.Transformer``'s
self-attention call it), the three separate projection weights
(``kdim``/``vdim`` other than ``embed_dim``), and ``out_proj``'s weight and
bias. Not fused: the packed in-projection when query, key and value differ
(a decoder's cross-attention: torch splits ``in_proj_weight`` into views
before each product, so its gradient reaches the weight through the split,
never as a buffer a product could add into) and the biases of separate
projections (chunks of ``in_proj_bias``): they run as in
``nn.MultiheadAttention``. The module's inputs' gradients are returned as
``nn.MultiheadAttention`` returns them. Without gradients (inference, where
torch's fast path may run), with ``bias_k``/``bias_v``, ``add_zero_attn``
or nested tensors, the stock forward runs. Where torch_ctxext has a build
for the running torch, each product on plain CPU tensors is the same
Function in C++ (``fused_projection``, as ``FusedLinear``'s: nn/linear.py).

    >>> import torch
    >>> from torch_ctxext.nn import FusedMultiheadAttention
    >>> attention = FusedMultiheadAttention(8, 2)
    >>> x = torch.randn(5, 3, 8)                          # (L, N, E)
    >>> for _ in range(3):                                # one module, three uses
    ...     x = attention(x, x, x, need_weights=False)[0]
    >>> x.sum().backward()
    >>> attention.in_proj_weight.grad.shape
    torch.Size([24, 8])
"""
import math

import torch
import torch.nn.functional as F

from ._buffers import readable_buffers
from ._matmul import linear_grads
from .linear import FusedLinearFunction, through_cpp

__all__ = ["FusedMultiheadAttention", "FusedProjectionFunction"]


class FusedProjectionFunction(FusedLinearFunction):
    """``FusedLinearFunction`` that fuses the weight's and the bias's
    gradients only: the input's is returned as ``F.linear``'s backward
    returns it (``nn.MultiheadAttention``'s inputs feed several ops of the
    attention, which its drop-in does not replace).

    ``forward(ctx, x, weight, bias, fuse)``.
    """

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        fuse, has_bias, shape, dtype, column_major = ctx.linear  # as FusedLinearFunction.forward stores them
        _, w_buf, b_buf = readable_buffers(ctx, fuse)[:3]
        needs = ctx.needs_input_grad
        return (*linear_grads(grad_out, x, weight, (needs[0], needs[1], has_bias and needs[2]), (None, w_buf, b_buf),
                              True, shape, dtype, column_major), None)


def _linear(x, weight, bias, fuse):
    """A projection: FusedProjectionFunction, or the same Function in C++
    where there is a build for it (``linear.through_cpp``)."""
    out = through_cpp("fused_projection", fuse, x, weight, bias)
    return FusedProjectionFunction.apply(x, weight, bias, fuse) if out is None else out


class FusedMultiheadAttention(torch.nn.MultiheadAttention):
    """``torch.nn.MultiheadAttention`` whose projections are computed by
    :class:`FusedProjectionFunction`.

    Same ``__init__``, parameters (``out_proj`` stays the stock
    ``NonDynamicallyQuantizableLinear``), ``state_dict`` and call signature;
    ``fuse=False`` keeps the Functions but never reads the buffers.
    """

    # advise: the parameters this drop-in fuses include its out_proj's, and
    # of the nodes nn.MultiheadAttention makes it replaces the products'.
    fuses_submodules = True
    stock_ops = ("TBackward0", "AddmmBackward0", "MmBackward0", "AddBackward0")

    def __init__(self, *args, fuse=True, **kwargs):
        super().__init__(*args, **kwargs)
        self.fuse = fuse

    def _stock_path(self, query, key, value):
        """Whether nn.MultiheadAttention's own forward runs: no gradient to
        fuse (its fast path may apply), or a feature the fused path leaves
        to it."""
        return (not torch.is_grad_enabled() or self.bias_k is not None or self.bias_v is not None
                or self.add_zero_attn or query.dim() not in (2, 3)
                or any(t.is_nested for t in (query, key, value))
                or torch.overrides.has_torch_function((query, key, value)))

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        if self._stock_path(query, key, value):
            return super().forward(query, key, value, key_padding_mask=key_padding_mask,
                                   need_weights=need_weights, attn_mask=attn_mask,
                                   average_attn_weights=average_attn_weights, is_causal=is_causal)
        is_batched = query.dim() == 3
        key_padding_mask = F._canonical_mask(
            mask=key_padding_mask, mask_name="key_padding_mask", other_type=F._none_or_dtype(attn_mask),
            other_name="attn_mask", target_type=query.dtype)
        attn_mask = F._canonical_mask(
            mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="",
            target_type=query.dtype, check_other=False)
        if self.batch_first and is_batched:
            # as nn.MultiheadAttention: the transposes keep the "is" relations
            if key is value:
                if query is key:
                    query = key = value = query.transpose(1, 0)
                else:
                    query, key = (x.transpose(1, 0) for x in (query, key))
                    value = key
            else:
                query, key, value = (x.transpose(1, 0) for x in (query, key, value))
        attn_output, attn_output_weights = self._attention(
            query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal)
        if self.batch_first and is_batched:
            return attn_output.transpose(1, 0), attn_output_weights
        return attn_output, attn_output_weights

    def _in_projection(self, query, key, value):
        """q, k and v, as F.multi_head_attention_forward projects them."""
        fuse = self.fuse
        if self._qkv_same_embed_dim:
            if query is key and key is value:
                embed_dim = query.size(-1)
                proj = _linear(query, self.in_proj_weight, self.in_proj_bias, fuse)
                proj = proj.unflatten(-1, (3, embed_dim)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
                return proj[0], proj[1], proj[2]
            # Cross-attention: torch splits the weight into views first.
            return F._in_projection_packed(query, key, value, self.in_proj_weight, self.in_proj_bias)
        if self.in_proj_bias is None:
            b_q = b_k = b_v = None
        else:
            b_q, b_k, b_v = self.in_proj_bias.chunk(3)
        return (_linear(query, self.q_proj_weight, b_q, fuse), _linear(key, self.k_proj_weight, b_k, fuse),
                _linear(value, self.v_proj_weight, b_v, fuse))

    def _attention(self, query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
                   is_causal):
        """F.multi_head_attention_forward without bias_k, bias_v,
        add_zero_attn and static k/v, its projections fused."""
        num_heads = self.num_heads
        is_batched = F._mha_shape_check(query, key, value, key_padding_mask, attn_mask, num_heads)
        if not is_batched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        tgt_len, bsz, embed_dim = query.shape
        src_len = key.shape[0]
        key_padding_mask = F._canonical_mask(
            mask=key_padding_mask, mask_name="key_padding_mask", other_type=F._none_or_dtype(attn_mask),
            other_name="attn_mask", target_type=query.dtype)
        if is_causal and attn_mask is None:
            raise RuntimeError(
                "Need attn_mask if specifying the is_causal hint. You may use the Transformer module method "
                "`generate_square_subsequent_mask` to create this mask.")
        if is_causal and key_padding_mask is None and not need_weights:
            # scaled_dot_product_attention takes is_causal without a mask
            attn_mask = None
        else:
            attn_mask = F._canonical_mask(
                mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="",
                target_type=query.dtype, check_other=False)
            if key_padding_mask is not None:
                is_causal = False
        if embed_dim != self.embed_dim:
            raise AssertionError(f"was expecting embedding dimension of {self.embed_dim}, but got {embed_dim}")
        head_dim = embed_dim // num_heads
        if self._qkv_same_embed_dim:
            if key.shape != value.shape:
                raise AssertionError(f"key shape {key.shape} does not match value shape {value.shape}")
        elif key.shape[:2] != value.shape[:2]:
            raise AssertionError(
                f"key's sequence and batch dims {key.shape[:2]} do not match value's {value.shape[:2]}")
        q, k, v = self._in_projection(query, key, value)
        if attn_mask is not None:
            if attn_mask.dim() == 2:
                if attn_mask.shape != (tgt_len, src_len):
                    raise RuntimeError(f"The shape of the 2D attn_mask is {attn_mask.shape}, but should be "
                                       f"{(tgt_len, src_len)}.")
                attn_mask = attn_mask.unsqueeze(0)
            elif attn_mask.dim() == 3:
                if attn_mask.shape != (bsz * num_heads, tgt_len, src_len):
                    raise RuntimeError(f"The shape of the 3D attn_mask is {attn_mask.shape}, but should be "
                                       f"{(bsz * num_heads, tgt_len, src_len)}.")
            else:
                raise RuntimeError(f"attn_mask's dimension {attn_mask.dim()} is not supported")
        q = q.view(tgt_len, bsz * num_heads, head_dim).transpose(0, 1)
        k = k.view(k.shape[0], bsz * num_heads, head_dim).transpose(0, 1)
        v = v.view(v.shape[0], bsz * num_heads, head_dim).transpose(0, 1)
        src_len = k.size(1)
        if key_padding_mask is not None:
            if tuple(key_padding_mask.shape) != (bsz, src_len):
                raise AssertionError(f"expecting key_padding_mask shape of {(bsz, src_len)}, but got "
                                     f"{tuple(key_padding_mask.shape)}")
            key_padding_mask = (key_padding_mask.view(bsz, 1, 1, src_len).expand(-1, num_heads, -1, -1)
                                .reshape(bsz * num_heads, 1, src_len))
            attn_mask = key_padding_mask if attn_mask is None else attn_mask + key_padding_mask
        dropout_p = self.dropout if self.training else 0.0
        out_weight, out_bias = self.out_proj.weight, self.out_proj.bias
        if need_weights:
            _, _, head = q.shape
            q_scaled = q * math.sqrt(1.0 / float(head))
            if is_causal and attn_mask is None:
                raise AssertionError("FIXME: is_causal not implemented for need_weights")
            if attn_mask is not None:
                weights = torch.baddbmm(attn_mask, q_scaled, k.transpose(-2, -1))
            else:
                weights = torch.bmm(q_scaled, k.transpose(-2, -1))
            del q_scaled, k
            weights = F.softmax(weights, dim=-1)
            if dropout_p > 0.0:
                weights = F.dropout(weights, p=dropout_p)
            attn_output = torch.bmm(weights, v)
            del v
            attn_output = attn_output.transpose(0, 1).reshape(tgt_len * bsz, embed_dim)
            attn_output = _linear(attn_output, out_weight, out_bias, self.fuse)
            attn_output = attn_output.view(tgt_len, bsz, attn_output.size(1))
            weights = weights.view(bsz, num_heads, tgt_len, src_len)
            if average_attn_weights:
                weights = weights.mean(dim=1)
            if not is_batched:
                attn_output, weights = attn_output.squeeze(1), weights.squeeze(0)
            return attn_output, weights
        if attn_mask is not None:
            if attn_mask.size(0) == 1 and attn_mask.dim() == 3:
                attn_mask = attn_mask.unsqueeze(0)
            else:
                attn_mask = attn_mask.view(bsz, num_heads, -1, src_len)
        q = q.view(bsz, num_heads, tgt_len, head_dim)
        k = k.view(bsz, num_heads, src_len, head_dim)
        v = v.view(bsz, num_heads, src_len, head_dim)
        attn_output = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal)
        attn_output = attn_output.permute(2, 0, 1, 3).reshape(bsz * tgt_len, embed_dim)
        attn_output = _linear(attn_output, out_weight, out_bias, self.fuse)
        attn_output = attn_output.view(tgt_len, bsz, attn_output.size(1))
        if not is_batched:
            attn_output = attn_output.squeeze(1)
        return attn_output, None

    def extra_repr(self):
        return f"fuse={self.fuse}"
