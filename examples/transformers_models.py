"""The architectures people train, from ``transformers`` configs at small sizes, and their advice.

    python examples/transformers_models.py [--fused] [MODEL ...]

prints what ``torch_ctxext.advise(model)`` reports over one training step
of each model (``--fused``: after ``torch_ctxext.nn.fuse(model)``); the page
docs/where-fusing-pays.md shows Llama's and GPT-2's. Every model is built
from its config with random weights (nothing is downloaded), dropout off so
that two steps are the same computation:

* ``gpt2``: ``GPT2LMHeadModel``, its layers ``transformers``' ``Conv1D``,
  the head tied to the token embedding; ``gpt2-micro``: the same with the
  losses of two micro-batches summed into one backward;
* ``bert``: ``BertForMaskedLM`` (the decoder tied to the word embedding,
  ``padding_idx=0``);
* ``albert``: ``AlbertForMaskedLM`` (one layer shared across depth);
* ``t5``: ``T5ForConditionalGeneration``, one embedding tied across the
  encoder, the decoder and the head;
* ``llama``: ``LlamaForCausalLM`` with ``tie_word_embeddings=True``;
* ``lstm-cell``: an ``nn.LSTMCell`` unrolled over 32 steps (no
  ``transformers`` needed).

``MODELS[name](**sizes)`` returns a ``Workload`` (examples/where_fusing_pays.py).
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from where_fusing_pays import Workload, _generator, lstm  # noqa: E402

__all__ = ["MODELS", "NEEDS_TRANSFORMERS", "main"]

NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


def _transformers():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def _lm(name, model, vocab, batch, seq, seed, micro=1):
    """A workload whose loss is the model's own (``labels=``), summed over
    ``micro`` micro-batches in one backward."""
    model.train()
    gen = _generator(seed)
    batches = [torch.randint(1, vocab, (batch, seq), generator=gen) for _ in range(micro)]

    def loss_of(m, *batches):
        return sum(m(input_ids=ids, labels=ids).loss for ids in batches)

    return Workload(name, model, tuple(batches), loss_of)


def gpt2(vocab=64, dim=32, layers=2, heads=2, batch=2, seq=8, micro=1, seed=0):
    t = _transformers()
    torch.manual_seed(seed)
    config = t.GPT2Config(vocab_size=vocab, n_positions=max(seq, 16), n_embd=dim, n_layer=layers,
                          n_head=heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                          bos_token_id=0, eos_token_id=0)
    return _lm("gpt2" if micro == 1 else "gpt2-micro", t.GPT2LMHeadModel(config), vocab, batch, seq, seed, micro)


def gpt2_micro(**sizes):
    return gpt2(**{"micro": 2, **sizes})


def bert(vocab=64, dim=32, layers=2, heads=2, batch=2, seq=8, seed=0):
    t = _transformers()
    torch.manual_seed(seed)
    config = t.BertConfig(vocab_size=vocab, hidden_size=dim, num_hidden_layers=layers,
                          num_attention_heads=heads, intermediate_size=2 * dim,
                          max_position_embeddings=max(seq, 16), **NO_DROPOUT)
    return _lm("bert", t.BertForMaskedLM(config), vocab, batch, seq, seed)


def albert(vocab=64, dim=32, layers=2, heads=2, batch=2, seq=8, seed=0):
    t = _transformers()
    torch.manual_seed(seed)
    config = t.AlbertConfig(vocab_size=vocab, embedding_size=dim // 2, hidden_size=dim,
                            num_hidden_layers=layers, num_attention_heads=heads,
                            intermediate_size=2 * dim, max_position_embeddings=max(seq, 16),
                            classifier_dropout_prob=0.0, **NO_DROPOUT)
    return _lm("albert", t.AlbertForMaskedLM(config), vocab, batch, seq, seed)


def t5(vocab=64, dim=32, layers=2, heads=2, batch=2, seq=8, seed=0):
    t = _transformers()
    torch.manual_seed(seed)
    config = t.T5Config(vocab_size=vocab, d_model=dim, d_kv=dim // heads, d_ff=2 * dim, num_layers=layers,
                        num_heads=heads, dropout_rate=0.0, tie_word_embeddings=True,
                        decoder_start_token_id=0, pad_token_id=0)
    return _lm("t5", t.T5ForConditionalGeneration(config), vocab, batch, seq, seed)


def llama(vocab=64, dim=32, layers=2, heads=2, batch=2, seq=8, seed=0):
    t = _transformers()
    torch.manual_seed(seed)
    config = t.LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=2 * dim,
                           num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                           max_position_embeddings=max(seq, 16), tie_word_embeddings=True,
                           bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return _lm("llama", t.LlamaForCausalLM(config), vocab, batch, seq, seed)


def lstm_cell(features=16, hidden=64, classes=10, steps=32, batch=4, seed=0):
    """where_fusing_pays.py's unrolled cell, twice as wide and twice as long."""
    workload = lstm(features, hidden, classes, steps, batch, seed)
    workload.name = "lstm-cell"
    return workload


MODELS = {"gpt2": gpt2, "gpt2-micro": gpt2_micro, "bert": bert, "albert": albert, "t5": t5,
          "llama": llama, "lstm-cell": lstm_cell}
NEEDS_TRANSFORMERS = {"gpt2", "gpt2-micro", "bert", "albert", "t5", "llama"}


def main(argv=None):
    import where_fusing_pays

    return where_fusing_pays.main(argv, MODELS, "examples/transformers_models.py", __doc__.split("\n\n")[0])


if __name__ == "__main__":
    sys.exit(main())
