"""A small ALBERT-style model: one block shared across depth, with FusedLinear.

    python examples/shared_layers.py [--steps 20] [--unfused]

The encoder applies the same block (LayerNorm, Linear, GELU, Linear,
residual) ``depth`` times, so each of the block's weights and biases is used
``depth`` times inside one backward. The engine runs the last use first; its
weight gradient becomes the buffer, and each of the ``depth - 1`` earlier uses
adds into it in place (``FusedLinear``) instead of returning a fresh
gradient for the engine to add. The output projection is tied to the token
embedding (``logits = h @ embedding.weight.t()``).

Run it to train on a synthetic task (predict token + 1), fused and unfused from the same
initial weights, and print both loss curves and what
``torch_ctxext.explain()`` saw during one fused backward.
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fused_linear import FusedLinear  # noqa: E402

__all__ = ["SharedBlock", "SharedLayerModel", "set_fusion", "token_loss", "shifted_token_batch", "train"]


class SharedBlock(torch.nn.Module):
    """Pre-norm MLP block with a residual: ``h + fc2(gelu(fc1(norm(h))))``."""

    def __init__(self, dim, hidden, linear):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.fc1 = linear(dim, hidden)
        self.fc2 = linear(hidden, dim)

    def forward(self, h):
        return h + self.fc2(F.gelu(self.fc1(self.norm(h))))


class SharedLayerModel(torch.nn.Module):
    """Token embedding, one :class:`SharedBlock` applied ``depth`` times, and
    an output projection tied to the embedding.

    ``linear`` builds the block's layers: :class:`FusedLinear` (default) or
    ``torch.nn.Linear`` (the same model without the custom Function); both
    have the same parameters and draw the same initial values from the same
    seed. ``block_wrapper(block, h)`` (optional) runs the block, e.g. under
    activation checkpointing.
    """

    def __init__(self, vocab=64, dim=32, hidden=64, depth=4, linear=FusedLinear, block_wrapper=None):
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab, dim)
        # Scaled so that the tied output projection starts with logits of
        # about unit size (N(0, 1) would give logits of about sqrt(dim)).
        torch.nn.init.normal_(self.embedding.weight, std=dim ** -0.5)
        self.block = SharedBlock(dim, hidden, linear)
        self.norm = torch.nn.LayerNorm(dim)
        self.depth = depth
        self.block_wrapper = block_wrapper

    def forward(self, tokens):
        return self.head(self.encode(self.embedding(tokens)))

    def encode(self, h):
        """The shared block, applied ``depth`` times."""
        for _ in range(self.depth):
            h = self.block(h) if self.block_wrapper is None else self.block_wrapper(self.block, h)
        return h

    def head(self, h):
        return F.linear(self.norm(h), self.embedding.weight)  # tied output embedding

    def loss(self, tokens, targets):
        return token_loss(self(tokens), targets)


def token_loss(logits, targets):
    """Cross-entropy over every position."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def set_fusion(model, fuse):
    """Turn fusion on or off in every FusedLinear of ``model``."""
    for module in model.modules():
        if isinstance(module, FusedLinear):
            module.fuse = fuse
    return model


def shifted_token_batch(batch, seq, vocab, generator):
    """Random tokens; the target of each is the next token id (mod vocab), a
    per-position map the blocks must learn (the tied embedding alone would
    predict the input token itself)."""
    tokens = torch.randint(vocab, (batch, seq), generator=generator)
    return tokens, (tokens + 1) % vocab


def train(model, steps, batch=8, seq=16, lr=0.05, seed=0):
    """Plain SGD on the task of shifted_token_batch; returns the loss of every step."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    vocab = model.embedding.num_embeddings
    losses = []
    for _ in range(steps):
        tokens, targets = shifted_token_batch(batch, seq, vocab, generator)
        optimizer.zero_grad(set_to_none=True)
        loss = model.loss(tokens, targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--depth", type=int, default=6)
    args = parser.parse_args(argv)
    curves = {}
    for fuse in (False, True):
        torch.manual_seed(0)
        model = set_fusion(SharedLayerModel(depth=args.depth), fuse)
        curves[fuse] = train(model, args.steps)
    print("step  unfused loss  fused loss")
    for i, (a, b) in enumerate(zip(curves[False], curves[True])):
        print(f"{i:4d}  {a:12.6f}  {b:10.6f}")
    try:
        import torch_ctxext
    except ImportError:
        return 0
    torch.manual_seed(0)
    model = SharedLayerModel(depth=args.depth)
    tokens, targets = shifted_token_batch(8, 16, 64, torch.Generator().manual_seed(0))
    with torch_ctxext.explain() as report:
        model.loss(tokens, targets).backward()
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
