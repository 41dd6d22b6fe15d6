"""Four models in which one backward accumulates several gradients into one tensor, and their advice.

    python examples/where_fusing_pays.py [--fused] [MODEL ...]

prints, for each model, what ``torch_ctxext.advise(model)`` reports over one
training step with the stock modules (``--fused``: after
``torch_ctxext.nn.fuse(model)``): the page docs/where-fusing-pays.md shows
this output. The models, all built in code (no downloads):

* ``albert``: examples/shared_layers.py's model, one block (LayerNorm,
  Linear, GELU, Linear, residual) applied ``depth`` times, the output
  projection tied to the token embedding (a functional ``F.linear``);
* ``gpt2``: a GPT-2-style language model: token and position embeddings,
  ``layers`` pre-norm blocks (causal self-attention, MLP), and an ``lm_head``
  ``nn.Linear`` whose weight is the token embedding's;
* ``lstm``: an ``nn.LSTMCell`` unrolled over ``steps`` steps, then a linear
  readout of the last hidden state;
* ``micro-batches``: a two-layer MLP whose losses on four micro-batches are
  summed into one backward.

``MODELS[name](**sizes)`` returns a :class:`Workload`: the model (stock
``torch.nn`` modules, from a fixed seed), a batch, and ``loss(model)``, the
loss of one step, whose ``backward()`` is the step's backward.
"""
import argparse
import math
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shared_layers import SharedLayerModel, shifted_token_batch, token_loss  # noqa: E402

__all__ = ["MODELS", "Workload", "TiedLanguageModel", "UnrolledLSTM", "MicroBatchMLP", "main"]


@dataclass
class Workload:
    """A model, its batch, and the loss of one training step."""

    name: str
    model: torch.nn.Module
    batch: tuple
    loss_of: object  # loss_of(model, *batch) -> scalar

    def loss(self, model=None):
        return self.loss_of(self.model if model is None else model, *self.batch)

    def to(self, device):
        """The model and the batch moved to ``device``; returns self."""
        def move(x):
            if isinstance(x, torch.Tensor):
                return x.to(device)
            return type(x)(move(v) for v in x) if isinstance(x, (list, tuple)) else x

        self.model.to(device)
        self.batch = move(self.batch)
        return self


class CausalSelfAttention(torch.nn.Module):
    """GPT-2's attention, written out (the same graph on every device)."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.c_attn = torch.nn.Linear(dim, 3 * dim)
        self.c_proj = torch.nn.Linear(dim, dim)

    def forward(self, x):
        batch, seq, dim = x.shape
        q, k, v = self.c_attn(x).split(dim, dim=2)
        q, k, v = (t.reshape(batch, seq, self.heads, dim // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(dim // self.heads)
        mask = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
        attention = scores.masked_fill(mask, float("-inf")).softmax(dim=-1)
        y = (attention @ v).transpose(1, 2).reshape(batch, seq, dim)
        return self.c_proj(y)


class Block(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln_1 = torch.nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln_2 = torch.nn.LayerNorm(dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(),
                                       torch.nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TiedLanguageModel(torch.nn.Module):
    """GPT-2 in miniature; ``lm_head.weight`` is ``wte.weight``."""

    def __init__(self, vocab=64, context=16, dim=32, heads=2, layers=2):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, dim)
        self.wpe = torch.nn.Embedding(context, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(dim)
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def _apply(self, fn, *args, **kwargs):
        # Moving to a device whose tensors cannot take the CPU ones' place
        # (a PrivateUse1 backend, XLA) makes new Parameters: tie them again,
        # as transformers' tie_weights() does.
        super()._apply(fn, *args, **kwargs)
        self.lm_head.weight = self.wte.weight
        return self

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class UnrolledLSTM(torch.nn.Module):
    """An ``nn.LSTMCell`` applied at every step of the sequence, then a readout."""

    def __init__(self, features=16, hidden=32, classes=10):
        super().__init__()
        self.cell = torch.nn.LSTMCell(features, hidden)
        self.readout = torch.nn.Linear(hidden, classes)

    def forward(self, sequence):
        h = c = torch.zeros(sequence.shape[1], self.cell.hidden_size, device=sequence.device)
        for x in sequence:
            h, c = self.cell(x, (h, c))
        return self.readout(h)


class MicroBatchMLP(torch.nn.Module):
    def __init__(self, features=32, hidden=64, classes=10):
        super().__init__()
        self.fc1 = torch.nn.Linear(features, hidden)
        self.fc2 = torch.nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def _generator(seed):
    return torch.Generator().manual_seed(seed)


def albert(vocab=64, dim=32, hidden=64, depth=4, batch=2, seq=8, seed=0):
    torch.manual_seed(seed)
    model = SharedLayerModel(vocab, dim, hidden, depth, linear=torch.nn.Linear)
    return Workload("albert", model, shifted_token_batch(batch, seq, vocab, _generator(seed)),
                    lambda m, tokens, targets: m.loss(tokens, targets))


def gpt2(vocab=64, context=16, dim=32, heads=2, layers=2, batch=2, seq=8, seed=0):
    torch.manual_seed(seed)
    model = TiedLanguageModel(vocab, context, dim, heads, layers)
    return Workload("gpt2", model, shifted_token_batch(batch, seq, vocab, _generator(seed)),
                    lambda m, tokens, targets: token_loss(m(tokens), targets))


def lstm(features=16, hidden=32, classes=10, steps=16, batch=4, seed=0):
    torch.manual_seed(seed)
    model = UnrolledLSTM(features, hidden, classes)
    gen = _generator(seed)
    sequence = torch.randn(steps, batch, features, generator=gen)
    targets = torch.randint(classes, (batch,), generator=gen)
    return Workload("lstm", model, (sequence, targets),
                    lambda m, sequence, targets: F.cross_entropy(m(sequence), targets))


def micro_batches(features=32, hidden=64, classes=10, micro=4, batch=8, seed=0):
    torch.manual_seed(seed)
    model = MicroBatchMLP(features, hidden, classes)
    gen = _generator(seed)
    xs = [torch.randn(batch, features, generator=gen) for _ in range(micro)]
    ys = [torch.randint(classes, (batch,), generator=gen) for _ in range(micro)]

    def loss_of(m, xs, ys):
        return sum(F.cross_entropy(m(x), y) for x, y in zip(xs, ys))

    return Workload("micro-batches", model, (xs, ys), loss_of)


MODELS = {"albert": albert, "gpt2": gpt2, "lstm": lstm, "micro-batches": micro_batches}


def report_of(workload, fused=False):
    """The advice over one step of the workload (forward and backward), with
    its stock modules or, ``fused``, the drop-ins swapped in."""
    import torch_ctxext

    if fused:
        torch_ctxext.nn.fuse(workload.model)

    with torch_ctxext.advise(workload.model) as report:
        workload.loss().backward()
    return report


def main(argv=None, models=None, script="examples/where_fusing_pays.py", description=None):
    """Print each model's report (``models``: another registry of models,
    as examples/transformers_models.py passes its own)."""
    models = MODELS if models is None else models
    parser = argparse.ArgumentParser(description=description or __doc__.split("\n\n")[0])
    parser.add_argument("--fused", action="store_true", help="swap the drop-ins in first (torch_ctxext.nn.fuse)")
    parser.add_argument("models", nargs="*", metavar="MODEL", help=f"any of {', '.join(models)} (default: all)")
    args = parser.parse_args(argv)
    unknown = [m for m in args.models if m not in models]
    if unknown:
        parser.error(f"unknown model {unknown[0]!r}: choose from {', '.join(models)}")
    for i, name in enumerate(args.models or models):
        if i:
            print()
        print(f"$ python {script} {'--fused ' if args.fused else ''}{name}")
        print(report_of(models[name](), fused=args.fused))
    return 0


if __name__ == "__main__":
    sys.exit(main())
