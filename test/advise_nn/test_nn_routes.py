"""The reuse no stock drop-in reaches: a stock module's subclass (fuse() keeps
its forward, or the report names the class and why), a weight applied through
F.linear by another module (torch_ctxext.nn.functional.linear, which the
report names with the module and the attribute), a convolution applied twice
(the report says in one line that no drop-in can exist, with its figure);
and at 100 columns each row keeps its own name whole."""
import copy
import pickle

import torch
import torch.nn.functional as F

import torch_ctxext
from torch_ctxext.nn import FusedEmbedding, fuse, why_not
from torch_ctxext.nn.functional import linear as fused_linear

from where_fusing_pays import Workload, report_of

VOCAB, DIM = 64, 32


class ScaledEmbedding(torch.nn.Embedding):
    """An embedding scaled by a constant (T5, Gemma, fairseq)."""

    def __init__(self, *args, scale=2.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.scale = scale

    def forward(self, tokens):
        return super().forward(tokens) * self.scale


class OwnEmbedding(torch.nn.Embedding):
    """A subclass whose forward does not go through nn.Embedding's."""

    def forward(self, tokens):
        return F.embedding(tokens, self.weight) * 2.0


class TiedModel(torch.nn.Module):
    """A token embedding, a layer, and a head tied to the embedding: an
    nn.Linear sharing its weight, or ``F.linear(h, self.embed.weight)``
    (``head="functional"``), or torch_ctxext.nn.functional.linear (``"routed"``)."""

    def __init__(self, embedding=torch.nn.Embedding, head="module"):
        super().__init__()
        self.embed = embedding(VOCAB, DIM)
        self.body = torch.nn.Linear(DIM, DIM)
        self.head_kind = head
        if head == "module":
            self.head = torch.nn.Linear(DIM, VOCAB, bias=False)
            self.head.weight = self.embed.weight

    def forward(self, tokens):
        h = torch.tanh(self.body(self.embed(tokens)))
        if self.head_kind == "module":
            return self.head(h)
        return (fused_linear if self.head_kind == "routed" else F.linear)(h, self.embed.weight)


def tied(embedding=torch.nn.Embedding, head="module"):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    tokens, targets = torch.randint(VOCAB, (2, 8), generator=gen), torch.randint(VOCAB, (2, 8), generator=gen)
    return Workload("tied", TiedModel(embedding, head), (tokens, targets),
                    lambda m, tokens, targets: F.cross_entropy(m(tokens).flatten(0, 1), targets.flatten()))


def allocated(workload):
    import bench_advise

    return bench_advise.allocations(workload)[0]


# --- subclasses -----------------------------------------------------------------


def test_fuse_keeps_a_scaled_embeddings_forward_and_its_class():
    stock = tied(ScaledEmbedding)
    fused = tied(ScaledEmbedding)
    fuse(fused.model)
    embed = fused.model.embed
    assert isinstance(embed, ScaledEmbedding) and isinstance(embed, FusedEmbedding) and embed.scale == 2.0
    assert fused.model.head.weight is embed.weight
    assert torch.equal(stock.loss(), fused.loss())
    for workload in (stock, fused):
        workload.model.zero_grad()
        workload.loss().backward()
    for (name, a), (_, b) in zip(stock.model.named_parameters(), fused.model.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)
    # Saved whole and loaded back, and copied: the made class travels by its subclass.
    for again in (pickle.loads(pickle.dumps(fused.model)), copy.deepcopy(fused.model)):
        assert type(again.embed) is type(embed) and torch.equal(again.embed.weight, embed.weight)


def test_a_scaled_embedding_fused_allocates_exactly_the_promise_less():
    report = report_of(tied(ScaledEmbedding))
    assert report.drop_ins["embed"].stock == "ScaledEmbedding"
    fused = tied(ScaledEmbedding)
    fuse(fused.model)
    assert allocated(tied(ScaledEmbedding)) - allocated(fused) == report.avoidable_bytes > 0
    fused_report = report_of(tied(ScaledEmbedding), fused=True)
    assert fused_report.avoided_bytes == report.avoidable_bytes and fused_report.avoidable_bytes == 0


def test_a_subclass_fuse_cannot_swap_is_named_with_why_not_nothing_more_to_swap():
    model = tied(OwnEmbedding).model
    fuse(model)
    assert type(model.embed) is OwnEmbedding
    assert "OwnEmbedding.forward does not call super().forward()" in why_not(model.embed)
    text = str(report_of(tied(OwnEmbedding), fused=True))
    do_this = text.splitlines()[3]
    assert "nothing more to swap" not in text and "no drop-in for OwnEmbedding" in do_this
    assert "OwnEmbedding.forward does not call super().forward()" in text.replace("\n    ", " ")
    assert report_of(tied(OwnEmbedding)).as_dict()["cannot_swap"]["OwnEmbedding"]


def test_torchs_own_subclasses_are_left_alone():
    attention = torch.nn.MultiheadAttention(8, 2)
    assert torch_ctxext.nn.drop_in_for(attention.out_proj) is None
    assert "torch's own subclass of Linear" in why_not(attention.out_proj)


# --- F.linear in a parent module ---------------------------------------------------


def test_functional_linear_is_f_linear_and_fuses_a_tied_head():
    """torch_ctxext.nn.functional.linear computes F.linear and its gradients;
    a head written with it leaves a buffer of its own, into which the
    (fused) lookup adds."""
    torch.manual_seed(0)
    x, w, b = torch.randn(3, 5, 4), torch.randn(6, 4, requires_grad=True), torch.randn(6, requires_grad=True)
    assert torch.equal(fused_linear(x, w, b), F.linear(x, w, b))
    stock, routed = tied(head="functional"), tied(head="routed")
    fuse(routed.model)
    with torch_ctxext.explain() as explained:
        routed.loss().backward()
    stock.loss().backward()
    torch.testing.assert_close(routed.model.embed.weight.grad, stock.model.embed.weight.grad)
    assert explained[torch_ctxext.nn.FusedEmbeddingFunction].exposed == 1


def test_the_report_names_the_module_and_attribute_of_a_tied_head_through_f_linear():
    """The route: the module whose forward applies the weight, the attribute
    it reads, and what changing it (with fuse) saves: exactly the measured
    drop of fuse(model) with the head written with torch_ctxext.nn.functional.linear."""
    report = report_of(tied(head="functional"))
    (route,) = report.routes.values()
    assert (route.module, route.attribute) == ("TiedModel", "self.embed.weight")
    text = report.table()
    assert "TiedModel.forward: F.linear(..., self.embed.weight) -> torch_ctxext.nn.functional.linear" in (
        text.replace("\n    ", " "))
    routed = tied(head="routed")
    fuse(routed.model)
    measured = allocated(tied(head="functional")) - allocated(routed)
    assert measured == report.avoidable_bytes + report.route_bytes > 0
    assert route.avoidable_bytes == report.route_bytes


class TiedAutoencoder(torch.nn.Module):
    """A decoder that is the encoder's weight transposed: ``F.linear(z, self.encoder.weight.t())``."""

    def __init__(self, routed=False):
        super().__init__()
        self.encoder = torch.nn.Linear(DIM, 8)
        self.routed = routed

    def forward(self, x):
        z = torch.tanh(self.encoder(x))
        return (fused_linear if self.routed else F.linear)(z, self.encoder.weight.t())


def autoencoder(routed=False):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    return Workload("autoencoder", TiedAutoencoder(routed), (torch.randn(16, DIM, generator=gen),),
                    lambda m, x: (m(x) - x).pow(2).mean())


def test_a_tied_autoencoders_transposed_decoder_routed_allocates_exactly_the_promise_less():
    """functional.linear applies a weight passed as ``.t()`` as the weight
    itself (no view between it and its gradient): the same output and
    gradients as F.linear, and the route the report names saves what it says."""
    stock, routed = autoencoder(), autoencoder(routed=True)
    assert torch.equal(stock.loss(), routed.loss())
    stock.loss().backward()
    routed.loss().backward()
    torch.testing.assert_close(routed.model.encoder.weight.grad, stock.model.encoder.weight.grad)
    report = report_of(autoencoder())
    (route,) = report.routes.values()
    assert (route.module, route.attribute) == ("TiedAutoencoder", "self.encoder.weight")
    fused = autoencoder(routed=True)
    fuse(fused.model)
    assert allocated(autoencoder()) - allocated(fused) == report.avoidable_bytes + report.route_bytes > 0


def test_fused_transposed_linear_function_passes_check_function():
    from torch_ctxext.nn.functional import FusedTransposedLinearFunction

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 4, generator=gen, requires_grad=True)
    w = torch.randn(4, 6, generator=gen, requires_grad=True)
    b = torch.randn(6, generator=gen, requires_grad=True)
    report = torch_ctxext.testing.check_function(FusedTransposedLinearFunction, x, w, b, True)
    assert report.passed, str(report)


# --- no drop-in can exist -------------------------------------------------------------


class TwiceConv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        return self.conv(torch.relu(self.conv(x)))


def test_a_convolution_applied_twice_is_said_unfusable_in_one_line_with_its_figure():
    torch.manual_seed(0)
    workload = Workload("conv", TwiceConv(), (torch.randn(2, 4, 8, 8),), lambda m, x: m(x).pow(2).sum())
    report = report_of(workload)
    lines = report.table().splitlines()
    (line,) = [line for line in lines if line.lstrip().startswith("Conv2d:")]
    figure = torch_ctxext._advise.table.fmt_bytes(report.temporary_bytes)
    assert f"Conv2d: {figure} of temporaries; no drop-in can exist" in line and len(line) <= 100


# --- names at 100 columns ---------------------------------------------------------------


class Deep(torch.nn.Module):
    """A long-named embedding tied to several long-named heads."""

    def __init__(self):
        super().__init__()
        names = ["decoder_stack_with_a_long_name_for_the_language_model_head_projection",
                 "auxiliary_prediction_head_with_an_equally_long_name_for_the_tied_output"]
        self.token_embedding_table_of_the_encoder_with_a_long_name = torch.nn.Embedding(VOCAB, DIM)
        self.heads = torch.nn.ModuleDict({n: torch.nn.Linear(DIM, VOCAB, bias=False) for n in names})
        for head in self.heads.values():
            head.weight = self.token_embedding_table_of_the_encoder_with_a_long_name.weight

    def forward(self, tokens):
        h = self.token_embedding_table_of_the_encoder_with_a_long_name(tokens)
        return sum(head(h) for head in self.heads.values())


def test_at_100_columns_a_rows_own_name_is_whole_and_tied_names_are_shortened():
    model = Deep()
    with torch_ctxext.advise(model) as report:
        model(torch.randint(VOCAB, (2, 8))).sum().backward()
    (slot,) = [s for s in report.slots if s.kind == "parameter"]
    lines = report.table().splitlines()
    assert all(len(line) <= 100 for line in lines)
    (row,) = [line for line in lines if slot.name in line]
    assert "(tied: " in row
    assert slot.name == "token_embedding_table_of_the_encoder_with_a_long_name.weight"
    for path in report.drop_ins:
        assert any(f" {path}:" in line for line in lines), path
