"""torch_ctxext.nn: each drop-in computes what its stock module computes, fuses
where the engine exposes a buffer, and passes check_function; fuse(model)
swaps them in place without changing the model's parameters or state_dict.
FusedLinear's own tests: test_examples.py (examples/fused_linear.py
re-exports it) and the training stacks (test_training_stacks.py)."""
import contextlib
import copy
import importlib.util
import pickle

import pytest
import torch

import torch_ctxext
from torch_ctxext.nn import (FusedEmbedding, FusedEmbeddingFunction, FusedLinear, FusedLinearFunction,
                             FusedLSTMCell, FusedLSTMGatesFunction, fuse)



def exposed(report, function):
    return report[function].exposed if function in report else 0


# --- FusedEmbedding ---------------------------------------------------------

EMBEDDINGS = [
    ("plain", {}),
    ("padding_idx", {"padding_idx": 1}),
    ("scale_grad_by_freq", {"scale_grad_by_freq": True}),
    ("padding_idx-scale_grad_by_freq", {"padding_idx": 1, "scale_grad_by_freq": True}),
]


@pytest.mark.parametrize("options", [o for _, o in EMBEDDINGS], ids=[n for n, _ in EMBEDDINGS])
def test_fused_embedding_function_passes_check_function(options):
    gen = torch.Generator().manual_seed(0)
    indices = torch.tensor([[1, 2, 1], [0, 3, 1]])
    weight = torch.randn(5, 3, generator=gen, requires_grad=True)
    args = (indices, weight, options.get("padding_idx", -1), options.get("scale_grad_by_freq", False), True)
    intent = {}
    if options:
        # nn.Embedding's gradient is deliberately not the derivative there: no
        # gradient for the padding row, or each row's scaled by 1 / its count.
        intent = {"reference": lambda i, w, p, s, f: torch.embedding(w, i, p, s),
                  "reason": f"nn.Embedding's gradient with {', '.join(options)}"}
    if options.get("scale_grad_by_freq"):
        # The double backward is aten's embedding_dense_backward's, which
        # nn.Embedding has too: its derivative leaves the scaling out.
        intent["double_backward"] = ("torch's derivative of embedding_dense_backward ignores "
                                     "scale_grad_by_freq (nn.Embedding's double backward is the same)")
    report = torch_ctxext.testing.check_function(FusedEmbeddingFunction, *args, **intent)
    assert report.passed, str(report)
    checked = [r for r in report.results if r.name == "input_grad_buffers.fused_matches_fallback"
               and "SKIP" not in str(r)]
    assert len(checked) == 1  # the weight: the only input with a gradient


def tied(embedding_cls, head_cls, **options):
    torch.manual_seed(0)
    embedding = embedding_cls(6, 4, **options)
    head = head_cls(4, 6, bias=False)
    head.weight = embedding.weight
    return embedding, head


@pytest.mark.parametrize("options", [o for _, o in EMBEDDINGS], ids=[n for n, _ in EMBEDDINGS])
def test_a_tied_fused_embedding_adds_its_rows_into_the_heads_gradient_as_nn_embedding_would(options):
    tokens = torch.tensor([[1, 2, 1, 5], [0, 1, 3, 1]])
    grads = {}
    for kind, (e_cls, h_cls) in {"stock": (torch.nn.Embedding, torch.nn.Linear),
                                 "fused": (FusedEmbedding, FusedLinear)}.items():
        embedding, head = tied(e_cls, h_cls, **options)
        with torch_ctxext.explain() as report:
            (head(embedding(tokens)) ** 2).sum().backward()
        grads[kind] = embedding.weight.grad
        if kind == "fused":
            # The head runs first (created last): the lookup finds its gradient.
            assert exposed(report, FusedEmbeddingFunction) == 1
    torch.testing.assert_close(grads["fused"], grads["stock"])


def test_used_once_the_fused_embedding_returns_nn_embeddings_gradient_bit_for_bit():
    tokens = torch.tensor([[1, 2, 1, 5], [0, 1, 3, 1]])
    grads = []
    for cls in (torch.nn.Embedding, FusedEmbedding):
        torch.manual_seed(0)
        embedding = cls(6, 4, padding_idx=1, scale_grad_by_freq=True)
        (embedding(tokens) ** 2).sum().backward()
        grads.append(embedding.weight.grad)
    assert torch.equal(grads[0], grads[1])
    assert torch.equal(grads[1][1], torch.zeros(4))  # the padding row


def test_max_norm_renormalises_the_rows_looked_up_as_nn_embedding_does():
    tokens = torch.tensor([0, 2, 2])
    weights = []
    for cls in (torch.nn.Embedding, FusedEmbedding):
        torch.manual_seed(0)
        embedding = cls(4, 3, max_norm=0.5)
        out = embedding(tokens)
        weights.append((embedding.weight.detach().clone(), out.detach()))
    assert torch.equal(weights[0][0], weights[1][0]) and torch.equal(weights[0][1], weights[1][1])


def test_a_sparse_fused_embedding_gives_nn_embeddings_sparse_gradient():
    torch.manual_seed(0)
    embedding = FusedEmbedding(5, 3, sparse=True)
    embedding(torch.tensor([1, 3])).sum().backward()
    assert embedding.weight.grad.is_sparse


# --- FusedLSTMCell -------------------------------------------------------------


def unrolled(cls, steps=5, batched=True, state=True):
    torch.manual_seed(0)
    cell = cls(3, 4)
    xs = torch.randn(steps, 2, 3) if batched else torch.randn(steps, 3)
    shape = (2, 4) if batched else (4,)
    hx = (torch.zeros(shape), torch.zeros(shape)) if state else None
    outputs = []
    with torch_ctxext.explain() as report:
        for x in xs:
            hx = cell(x, hx)
            outputs.append(hx[0])
        torch.stack(outputs).pow(2).sum().backward()
    return cell, outputs, report


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
@pytest.mark.parametrize("state", [True, False], ids=["given_state", "no_state"])
def test_fused_lstm_cell_computes_nn_lstm_cells_outputs_bit_for_bit_and_its_gradients(batched, state):
    stock, stock_out, _ = unrolled(torch.nn.LSTMCell, batched=batched, state=state)
    fused, fused_out, report = unrolled(FusedLSTMCell, batched=batched, state=state)
    for a, b in zip(stock_out, fused_out):
        assert torch.equal(a, b)
    for (name, a), (_, b) in zip(stock.named_parameters(), fused.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)
    # Four parameters used at each of 5 steps: every step but the first to
    # run backward adds into their buffers.
    assert exposed(report, FusedLSTMGatesFunction) == 4 * (5 - 1)


def test_fused_lstm_gates_function_passes_check_function():
    gen = torch.Generator().manual_seed(0)
    h, x = torch.randn(2, 4, generator=gen, requires_grad=True), torch.randn(2, 3, generator=gen, requires_grad=True)
    w_hh, w_ih = (torch.randn(16, n, generator=gen, requires_grad=True) for n in (4, 3))
    b_hh, b_ih = (torch.randn(16, generator=gen, requires_grad=True) for _ in range(2))
    report = torch_ctxext.testing.check_function(FusedLSTMGatesFunction, h, w_hh, b_hh, x, w_ih, b_ih, True)
    assert report.passed, str(report)


def test_fused_lstm_cell_rejects_input_of_the_wrong_rank():
    cell = FusedLSTMCell(3, 4)
    with pytest.raises(ValueError, match="Expected input to be 1D or 2D, got 3D"):
        cell(torch.randn(1, 2, 3))


# --- fuse(model) ----------------------------------------------------------------


class Custom(torch.nn.Linear):
    """A subclass whose forward replaces the stock one: fuse() leaves it alone."""

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight, self.bias)


class Scaled(torch.nn.Linear):
    """A subclass whose forward calls the stock one: fuse() keeps it, below the drop-in."""

    def forward(self, x):
        return super().forward(x) * 2


def model_with_everything():
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({
        "embedding": torch.nn.Embedding(6, 4),
        "sparse": torch.nn.Embedding(6, 4, sparse=True),
        "cell": torch.nn.LSTMCell(4, 4),
        "head": torch.nn.Linear(4, 6, bias=False),
        "custom": Custom(4, 4),
        "scaled": Scaled(4, 4),
        "norm": torch.nn.LayerNorm(4),
    })
    model["head"].weight = model["embedding"].weight
    return model


def test_fuse_swaps_each_stock_module_in_place_keeping_its_parameters_and_state_dict():
    model = model_with_everything()
    modules = dict(model.named_children())
    parameters = dict(model.named_parameters(remove_duplicate=False))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert fuse(model) is model
    assert {n: type(m) for n, m in model.named_children()} == {
        "embedding": FusedEmbedding, "sparse": torch.nn.Embedding, "cell": FusedLSTMCell,
        "head": FusedLinear, "custom": Custom, "scaled": torch_ctxext.nn.subclass_drop_in(Scaled),
        "norm": torch.nn.LayerNorm}
    assert isinstance(model["scaled"], Scaled) and isinstance(model["scaled"], FusedLinear)
    assert all(modules[n] is m for n, m in model.named_children())
    assert all(parameters[n] is p for n, p in model.named_parameters(remove_duplicate=False))
    assert model["head"].weight is model["embedding"].weight
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    assert fuse(model) is model  # again: nothing changes


def test_a_fused_models_state_dict_loads_into_the_stock_model_and_back():
    fused = fuse(model_with_everything())
    stock = model_with_everything()
    for p in fused.parameters():
        p.data.add_(1)
    stock.load_state_dict(fused.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(stock.state_dict().values(), fused.state_dict().values()))
    copy.deepcopy(fused).load_state_dict(stock.state_dict())


def test_fuse_takes_a_module():
    with pytest.raises(TypeError, match="fuse\\(\\) takes a torch.nn.Module"):
        fuse([torch.nn.Linear(2, 2)])


def test_the_examples_fused_linear_is_the_packages():
    import fused_linear

    assert fused_linear.FusedLinear is FusedLinear
    assert fused_linear.FusedLinearFunction is FusedLinearFunction


# --- every drop-in's gradient is accumulable by the next producer ---------------

def _conv1d_apply(x, layer):
    return torch_ctxext.nn.FusedConv1DFunction.apply(x, layer[0], layer[1], True)


def _linear_apply(x, layer):
    return FusedLinearFunction.apply(x, layer[0], layer[1], True)


# (drop-in Function, its weight's shape for in=4 / out=6, its apply)
READERS = [
    ("FusedLinearFunction", (6, 4), _linear_apply),
    ("FusedConv1DFunction", (4, 6), _conv1d_apply),
]


@pytest.mark.parametrize("first", [0, 1, 2], ids=["q_first", "k_first", "v_first"])
@pytest.mark.parametrize("function, shape, apply", READERS, ids=[r[0] for r in READERS])
def test_three_projections_of_one_hidden_state_fuse_into_each_other_whichever_runs_first(
        function, shape, apply, first):
    """q, k and v read one (batch, seq, features) hidden state: the one that
    runs backward first returns a gradient the engine can add into, and the
    other two add into it."""
    torch.manual_seed(0)
    layers = [(torch.randn(*shape, requires_grad=True), torch.randn(6, requires_grad=True)) for _ in range(3)]
    # Created last, run first: the projection ``first`` is applied last.
    order = [i for i in range(3) if i != first] + [first]
    grads = []
    for fused in (False, True):
        x = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
        with torch_ctxext.explain() as report:
            outs = {i: apply(x, layers[i]) if fused else
                    (x @ (layers[i][0].t() if shape == (6, 4) else layers[i][0]) + layers[i][1]) for i in order}
            sum((outs[i] * (i + 1)).sum() for i in range(3)).backward()
        grads.append(x.grad)
        if fused:
            stats = report[function]
            # Three reads: the first finds nothing, the other two x's buffer
            # (and none of the parameters', each used once).
            assert stats.exposed == 2, str(stats)
    torch.testing.assert_close(grads[1], grads[0])


def backward_allocations(run):
    import bench

    return bench.backward_peak_bytes(run)["allocated_bytes"]


def fused_tied_backward(tokens, **options):
    """The bytes one backward of a tied FusedEmbedding and FusedLinear
    allocates (after two warm-up steps), and the embedding's gradient."""
    embedding, head = tied(FusedEmbedding, FusedLinear, **options)
    for _ in range(2):  # warm up
        embedding.weight.grad = None
        head(embedding(tokens)).sum().backward()
    embedding.weight.grad = None
    loss = head(embedding(tokens)).sum()
    return backward_allocations(loss.backward), embedding.weight.grad


def stock_tied_gradient(tokens, **options):
    embedding, head = tied(torch.nn.Embedding, torch.nn.Linear, **options)
    head(embedding(tokens)).sum().backward()
    return embedding.weight.grad


def advised_residual(tokens, **options):
    """What advise says the lookup's drop-in still allocates at its add."""
    embedding, head = tied(torch.nn.Embedding, torch.nn.Linear, **options)
    with torch_ctxext.advise(torch.nn.ModuleDict({"embedding": embedding, "head": head})) as report:
        head(embedding(tokens)).sum().backward()
    (residual,) = [p.residual for p in report["embedding.weight"].producers if p.drop_in == "FusedEmbedding"]
    return residual


def padded_tokens():
    tokens = torch.randint(0, 6, (64, 64), generator=torch.Generator().manual_seed(0))
    tokens[0, 0] = 0  # one padding token
    return tokens


def test_a_tied_fused_embedding_with_padding_idx_allocates_one_row_not_a_copy_of_the_output_gradient():
    tokens = padded_tokens()
    allocated, grads = {}, {}
    for padding in (None, 0):
        allocated[padding], grads[padding] = fused_tied_backward(tokens, padding_idx=padding)
    assert allocated[0] - allocated[None] == 4 * 4  # the padding row (embedding_dim floats) kept aside
    stock = stock_tied_gradient(tokens, padding_idx=0)
    # 4096 rows summed in another order: float32 sums of that many terms.
    torch.testing.assert_close(grads[0], stock, rtol=1e-4, atol=1e-3)
    assert torch.equal(grads[0][0], stock[0])  # the padding row: the head's alone


SCALED = [
    ("scale_grad_by_freq", {"scale_grad_by_freq": True}),
    ("padding_idx-scale_grad_by_freq", {"padding_idx": 0, "scale_grad_by_freq": True}),
]


@pytest.mark.parametrize("options", [o for _, o in SCALED], ids=[n for n, _ in SCALED])
def test_a_tied_fused_embedding_with_scale_grad_by_freq_allocates_no_copy_of_the_output_gradient_only_what_advise_names(
        options):
    """The fused path scales the buffer's rows by their counts around the
    add: it allocates each row's count (int64) and scale (float32), and the
    padding row, never the 4096 x 4 output gradient again."""
    tokens = padded_tokens()
    plain, _ = fused_tied_backward(tokens)  # the lookup's add allocates nothing
    allocated, _ = fused_tied_backward(tokens, **options)
    residual, copy = allocated - plain, tokens.numel() * 4 * 4  # tokens x embedding_dim floats
    assert residual < copy  # 6 rows x 12 bytes (and 4 floats) is far below
    assert residual == advised_residual(tokens, **options) == 6 * (8 + 4) + 4 * 4 * ("padding_idx" in options)


@pytest.mark.parametrize("options", [o for _, o in SCALED], ids=[n for n, _ in SCALED])
def test_a_tied_fused_embedding_with_scale_grad_by_freq_has_nn_embeddings_gradient_and_the_padding_row_the_heads_alone(
        options):
    tokens = padded_tokens()
    _, fused = fused_tied_backward(tokens, **options)
    stock = stock_tied_gradient(tokens, **options)
    # Not bit for bit: the buffer's rows are scaled by their counts around
    # the add, (w * c + S) / c, where nn.Embedding adds S / c to w (at 8
    # tokens the EMBEDDINGS table's test holds it to float32's default
    # tolerances). Here the head's 4096 rows summed in another order set the
    # tolerance, as for the plain tied embedding: float32 sums of that many terms.
    torch.testing.assert_close(fused, stock, rtol=1e-4, atol=1e-3)
    if "padding_idx" in options:
        assert torch.equal(fused[0], stock[0])  # the padding row: the head's alone, put back as it was


def test_fused_conv1d_function_passes_check_function():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 4, generator=gen, requires_grad=True)
    w = torch.randn(4, 5, generator=gen, requires_grad=True)
    b = torch.randn(5, generator=gen, requires_grad=True)
    report = torch_ctxext.testing.check_function(torch_ctxext.nn.FusedConv1DFunction, x, w, b, True)
    assert report.passed, str(report)


transformers_missing = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed (a test-only dependency: tools/run.py installs it for CI)")


@transformers_missing
def test_fused_conv1d_is_a_conv1d_with_its_forward_bit_for_bit_and_its_gradients():
    from transformers.pytorch_utils import Conv1D

    from torch_ctxext.nn import FusedConv1D

    torch.manual_seed(0)
    stock = Conv1D(6, 4)
    fused = copy.deepcopy(stock)
    fuse(fused)
    assert type(fused) is FusedConv1D and isinstance(fused, Conv1D)
    assert FusedConv1D(6, 4, fuse=False).fuse is False
    x = torch.randn(2, 5, 4)
    outs = [m(x * k) for m in (stock, fused) for k in (1, 2)]
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])
    (outs[0] + outs[1]).sum().backward()
    (outs[2] + outs[3]).sum().backward()
    for (name, a), (_, b) in zip(stock.named_parameters(), fused.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)
    fused.load_state_dict(stock.state_dict())
    # Saved whole (torch.save pickles the class by its name) and loaded back.
    again = pickle.loads(pickle.dumps(fused))
    assert type(again) is FusedConv1D and torch.equal(again.weight, fused.weight)


def test_the_conv1d_modules_docstring_example_runs_as_written():
    import doctest

    from torch_ctxext.nn import conv1d

    result = doctest.testmod(conv1d, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_the_cached_vector_of_ones_has_each_length_asked_for_across_its_growth_and_is_made_once():
    """The fused bias sum's ones (``_matmul.ones``): a view per row count,
    made once, still ones of that length after the vector grew."""
    from torch_ctxext.nn._matmul import ones

    like = torch.zeros(1, dtype=torch.float64)
    for rows in (3, 5000, 3, 7, 5000, 20000, 3, 1):
        vector = ones(rows, like)
        assert vector.dtype == torch.float64 and torch.equal(vector, torch.ones(rows, dtype=torch.float64))
    assert ones(3, like) is ones(3, like)


# ------------------------------------------- where ctx.input_grad_buffers refuses

def _used_thrice(make, run):
    """A stock module and what one step of it (three uses) computes."""
    def build():
        torch.manual_seed(0)
        module = make()
        return module, lambda m: sum(run(m, k) for k in range(1, 4))
    return build


_TOKENS = torch.tensor([[1, 2], [2, 3]])
_HIDDEN = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
_SEQUENCE = torch.randn(3, 2, 4, generator=torch.Generator().manual_seed(2))

USED_THRICE = {
    "Linear": _used_thrice(lambda: torch.nn.Linear(4, 4), lambda m, k: (m(_HIDDEN * k) * k).sum()),
    "Embedding": _used_thrice(lambda: torch.nn.Embedding(6, 4), lambda m, k: (m(_TOKENS) * k).sum()),
    "LSTMCell": _used_thrice(lambda: torch.nn.LSTMCell(4, 4), lambda m, k: (m(_HIDDEN * k)[0] * k).sum()),
    "GRUCell": _used_thrice(lambda: torch.nn.GRUCell(4, 4), lambda m, k: (m(_HIDDEN * k) * k).sum()),
    "MultiheadAttention": _used_thrice(lambda: torch.nn.MultiheadAttention(4, 2),
                                       lambda m, k: (m(_SEQUENCE * k, _SEQUENCE, _SEQUENCE)[0] * k).sum()),
}


def _post_hooks_on_every_node(loss):
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        node.register_hook(lambda grad_inputs, grad_outputs: None)
        stack.extend(next_node for next_node, _ in node.next_functions)


@pytest.mark.parametrize("refusal", ["anomaly detection", "post-hooks on the nodes"])
@pytest.mark.parametrize("module", USED_THRICE)
def test_where_input_grad_buffers_refuses_every_drop_in_runs_the_step_with_its_stock_modules_gradients(module, refusal):
    """The property raises under anomaly detection and for a node with
    post-hooks; each drop-in then computes out of place, as its stock module
    does, instead of failing a step the stock module runs."""
    def gradients(fused):
        model, step = USED_THRICE[module]()
        if fused:
            fuse(model, everything=True)
            assert type(model).__module__.startswith("torch_ctxext.nn"), type(model)
        with torch.autograd.detect_anomaly(check_nan=False) if refusal == "anomaly detection" else contextlib.nullcontext():
            loss = step(model)
            if refusal == "post-hooks on the nodes":
                _post_hooks_on_every_node(loss)
            loss.backward()
        return {name: p.grad for name, p in model.named_parameters()}

    stock, fused = gradients(False), gradients(True)
    assert stock.keys() == fused.keys()
    for name in stock:
        torch.testing.assert_close(fused[name], stock[name], msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("module", USED_THRICE)
def test_under_cpu_autocast_every_drop_in_runs_the_step_with_its_stock_modules_gradients_in_their_dtype(module):
    """Under ``torch.autocast`` the products run in bfloat16 and the
    parameters stay float32: each drop-in's step runs where its stock
    module's does, with float32 gradients equal to the stock module's within
    bfloat16's precision (the drop-ins compute the weights' gradients from a
    float32 output gradient, ``ctx.set_output_grad_dtype``)."""
    def gradients(fused):
        model, step = USED_THRICE[module]()
        if fused:
            fuse(model, everything=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = step(model)
        loss.float().backward()
        return {name: p.grad for name, p in model.named_parameters()}

    stock, fused = gradients(False), gradients(True)
    assert stock.keys() == fused.keys()
    for name in stock:
        assert fused[name].dtype == stock[name].dtype == torch.float32
        torch.testing.assert_close(fused[name], stock[name], rtol=0.05, atol=0.05, msg=lambda m: f"{name}: {m}")
