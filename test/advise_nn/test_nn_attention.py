"""FusedMultiheadAttention: nn.MultiheadAttention's outputs bit for bit and its
gradients, in every form nn.TransformerEncoderLayer, nn.TransformerDecoderLayer
and nn.Transformer call it; fuse() swaps it in; and a module applied several
times in one step (a shared encoder or decoder layer) allocates exactly what
advise promised less."""
import copy
import itertools
import re

import pytest
import torch

import torch_ctxext
from torch_ctxext.nn import FusedMultiheadAttention, FusedProjectionFunction, fuse

from where_fusing_pays import Workload, report_of

E, HEADS, L, S, N = 8, 2, 5, 6, 3


def pair(**kwargs):
    torch.manual_seed(1)
    stock = torch.nn.MultiheadAttention(E, HEADS, **kwargs)
    fused = copy.deepcopy(stock)
    fuse(fused)
    return stock, fused


def inputs(which, batch_first, batched, kdim=E, vdim=E):
    gen = torch.Generator().manual_seed(2)

    def tensor(n, d):
        shape = ((N, n, d) if batch_first else (n, N, d)) if batched else (n, d)
        return torch.randn(shape, generator=gen, requires_grad=True)

    q = tensor(L, E)
    if which == "self":
        return q, q, q, L
    k = tensor(S, kdim)
    return (q, k, k, S) if which == "key is value" else (q, k, tensor(S, vdim), S)


def run(module, q, k, v, **kwargs):
    leaves = list({id(t): t for t in (q, k, v)}.values())
    for t in leaves:
        t.grad = None
    out, weights = module(q, k, v, **kwargs)
    (out.pow(2).sum() + (weights.sum() if weights is not None else 0)).backward()
    return out, weights, [p.grad for p in module.parameters()] + [t.grad.clone() for t in leaves]


CASES = [c for c in itertools.product(
    ["self", "key is value", "three"], [False, True], [True, False], [None, "bool", "float"], [False, True],
    [True, False]) if not (c[0] == "self" and c[4])]


@pytest.mark.parametrize("which,batch_first,need_weights,mask,separate,batched", CASES)
def test_outputs_are_nn_multihead_attentions_bit_for_bit_and_gradients_agree(
        which, batch_first, need_weights, mask, separate, batched):
    dims = {"kdim": 5, "vdim": 7} if separate else {}
    stock, fused = pair(batch_first=batch_first, **dims)
    assert type(fused) is FusedMultiheadAttention
    q, k, v, source = inputs(which, batch_first, batched, dims.get("kdim", E), dims.get("vdim", E))
    if separate and which == "key is value":
        k = v = inputs("three", batch_first, batched, 5, 5)[1]
        stock, fused = pair(batch_first=batch_first, kdim=5, vdim=5)
    gen = torch.Generator().manual_seed(3)
    attn_mask = {None: None, "bool": torch.rand(L, source, generator=gen) > 0.7,
                 "float": torch.randn(L, source, generator=gen)}[mask]
    if mask == "bool":
        attn_mask[:, 0] = False
    padding = torch.zeros((N, source) if batched else (source,), dtype=torch.bool)
    padding[..., -1] = True
    padding = padding if mask != "float" else padding.float().masked_fill(padding, float("-inf"))
    kwargs = dict(need_weights=need_weights, attn_mask=attn_mask, key_padding_mask=padding)
    out, weights, grads = run(stock, q, k, v, **kwargs)
    fused_out, fused_weights, fused_grads = run(fused, q, k, v, **kwargs)
    assert torch.equal(out, fused_out)
    assert (weights is None and fused_weights is None) or torch.equal(weights, fused_weights)
    for a, b in zip(grads, fused_grads):
        torch.testing.assert_close(b, a)


def test_a_causal_self_attention_as_a_transformer_layer_calls_it_is_nn_multihead_attentions():
    stock, fused = pair()
    q = inputs("self", False, True)[0]
    mask = torch.nn.Transformer.generate_square_subsequent_mask(L)
    kwargs = dict(need_weights=False, attn_mask=mask, is_causal=True)
    out, _, grads = run(stock, q, q, q, **kwargs)
    fused_out, _, fused_grads = run(fused, q, q, q, **kwargs)
    assert torch.equal(out, fused_out)
    for a, b in zip(grads, fused_grads):
        torch.testing.assert_close(b, a)


def test_without_gradients_the_stock_forward_runs_fast_path_included():
    stock, fused = pair(batch_first=True)
    stock.eval()
    fused.eval()
    x = torch.randn(N, L, E)
    with torch.no_grad():
        assert torch.equal(stock(x, x, x)[0], fused(x, x, x)[0])


def test_fused_projection_function_passes_check_function():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 4, generator=gen, requires_grad=True)
    w = torch.randn(6, 4, generator=gen, requires_grad=True)
    b = torch.randn(6, generator=gen, requires_grad=True)
    report = torch_ctxext.testing.check_function(FusedProjectionFunction, x, w, b, True)
    assert report.passed, str(report)


def test_fuse_swaps_nn_transformers_attention_keeping_out_proj_its_parameters_and_state_dict():
    torch.manual_seed(0)
    model = torch.nn.Transformer(16, 2, 1, 1, 32, dropout=0.0)
    before = {name: p for name, p in model.named_parameters()}
    state = copy.deepcopy(model.state_dict())
    fuse(model)
    attentions = [m for m in model.modules() if isinstance(m, torch.nn.MultiheadAttention)]
    assert len(attentions) == 3 and all(type(m) is FusedMultiheadAttention for m in attentions)
    # out_proj is never called: it keeps its class (quantization tools look for it).
    assert all(type(m.out_proj) is torch.nn.modules.linear.NonDynamicallyQuantizableLinear for m in attentions)
    assert {name: p for name, p in model.named_parameters()} == before
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items()) and state.keys() == model.state_dict().keys()


class SharedEncoder(torch.nn.Module):
    """One nn.TransformerEncoderLayer applied ``depth`` times."""

    def __init__(self, dim=32, heads=4, depth=4, batch_first=False):
        super().__init__()
        self.layer = torch.nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=batch_first)
        self.depth = depth

    def forward(self, x):
        for _ in range(self.depth):
            x = self.layer(x)
        return x


class SharedDecoder(torch.nn.Module):
    """One nn.TransformerDecoderLayer (causal self-attention, cross-attention
    over a memory) applied ``depth`` times."""

    def __init__(self, dim=32, heads=4, depth=3):
        super().__init__()
        self.layer = torch.nn.TransformerDecoderLayer(dim, heads, 2 * dim, dropout=0.0)
        self.depth = depth

    def forward(self, x, memory):
        mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[0])
        for _ in range(self.depth):
            x = self.layer(x, memory, tgt_mask=mask)
        return x


def shared_encoder():
    torch.manual_seed(0)
    return Workload("shared-encoder", SharedEncoder(), (torch.randn(8, 2, 32),), lambda m, x: m(x).pow(2).sum())


def shared_decoder():
    torch.manual_seed(0)
    return Workload("shared-decoder", SharedDecoder(), (torch.randn(8, 2, 32), torch.randn(6, 2, 32)),
                    lambda m, x, memory: m(x, memory).pow(2).sum())


def transformer():
    torch.manual_seed(0)
    return Workload("transformer", torch.nn.Transformer(32, 4, 2, 2, 64, dropout=0.0),
                    (torch.randn(6, 2, 32), torch.randn(8, 2, 32)), lambda m, src, tgt: m(src, tgt).pow(2).sum())


WORKLOADS = {"shared-encoder": shared_encoder, "shared-decoder": shared_decoder, "transformer": transformer}


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_fuse_lowers_allocations_by_exactly_the_promise(name):
    """The measured drop equals advise's promise, to the byte, and the fused
    step's report calls it avoided with nothing left; on the shared encoder
    layer the attention's drop-in is named with its saving."""
    import bench_advise

    make = WORKLOADS[name]
    report = report_of(make())
    fused = make()
    fuse(fused.model)
    stock_allocated, _ = bench_advise.allocations(make())
    fused_allocated, _ = bench_advise.allocations(fused)
    fused_report = report_of(make(), fused=True)
    assert stock_allocated - fused_allocated == report.avoidable_bytes > 0
    assert fused_report.avoided_bytes == report.avoidable_bytes
    assert fused_report.avoidable_bytes == 0
    if name == "shared-encoder":
        attention = report.drop_ins["layer.self_attn"]
        assert attention.drop_in == "FusedMultiheadAttention"
        # in_proj_weight, in_proj_bias, out_proj.weight, out_proj.bias: 3 later uses each
        assert attention.avoidable_bytes >= 3 * 4 * (3 * 32 * 32 + 3 * 32 + 32 * 32 + 32)
        left = " ".join(line.split("no drop-in for", 1)[1] for line in fused_report.table(width=None).splitlines()
                        if "no drop-in for" in line)
        assert "TransformerEncoderLayer" in left and not re.search(r"\bMultiheadAttention\b", left)
