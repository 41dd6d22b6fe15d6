"""The sizes the transformers models of ``examples/transformers_models.py``
are measured at: by bench_advise_models.py (promise, drop, fused/stock) and by
bench_advise.py (advise's cost at the benchmark sizes). Apart from both, so
that neither imports the other for them."""


# Sizes at which the step's work is a real job's shape (hundreds of tokens
# per step, 256-wide), on one CPU thread.
def _sizes(vocab, dim, heads, batch, seq, steps_batch):
    """The transformers models at one size (ALBERT twice as deep: its layer is
    shared; GPT-2's micro-batches each half the batch), and the LSTMCell."""
    lm = {"vocab": vocab, "dim": dim, "layers": 2, "heads": heads, "batch": batch, "seq": seq}
    sizes = {m: dict(lm) for m in ("gpt2", "gpt2-micro", "bert", "albert", "t5", "llama")}
    sizes["albert"]["layers"] = 4
    sizes["gpt2-micro"]["batch"] = max(batch // 2, 1)
    sizes["lstm-cell"] = {"features": dim // 2, "hidden": dim, "steps": 32, "batch": steps_batch}
    return sizes


SIZES = _sizes(vocab=4000, dim=256, heads=4, batch=4, seq=128, steps_batch=32)
SIZES_QUICK = _sizes(vocab=256, dim=64, heads=2, batch=2, seq=16, steps_batch=4)
