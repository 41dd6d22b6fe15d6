"""The drop-ins' cost per call against their stock modules, side by side.

    python benchmarks/run_all.py --from-json docs/benchmarks.json --remeasure per_call

For each drop-in other than FusedLinear (bench_fused.py measures that one):
``FusedGRUCell``, ``FusedLSTMCell`` (unrolled over steps), a self-attention
``FusedMultiheadAttention`` applied several times, and ``FusedEmbedding``
used several times. Three variants of one model, the same weights: the
stock module, the drop-in as it runs (its products through the C++ Function
where torch_ctxext has a build for the running torch), and the drop-in with
the C++ Functions hidden (its Python Functions, as while ``advise()``
observes or on native 2.15 without that build). Each round times ``steps``
steps of each variant, alternating the order; a step is ``calls`` calls of
the module summed into one backward. The figure is the median over rounds of
(variant - stock) per call, in the measuring thread's CPU time and in wall
time.
"""
import contextlib
import statistics
import time

# (name, the model's kind, its size, rows per call, calls per step)
DROP_IN_CASES = [
    ("GRUCell 32 -> 32, 8 rows, unrolled over 4 steps", "gru", 32, 8, 4),
    ("LSTMCell 32 -> 32, 8 rows, unrolled over 4 steps", "lstm", 32, 8, 4),
    ("MultiheadAttention 32, 4 heads, 8 tokens x 2, applied 3 times", "attention", 32, 8, 3),
    ("Embedding 1000 x 32, 16 ids, used 4 times", "embedding", 32, 16, 4),
]


def _models(kind, size, rows, calls, gen):
    """The stock module, its drop-in with the same weights, and a step of
    either (``calls`` calls summed into one backward)."""
    import torch

    from torch_ctxext.nn import FusedEmbedding, FusedGRUCell, FusedLSTMCell, FusedMultiheadAttention

    if kind in ("gru", "lstm"):
        stock = (torch.nn.GRUCell if kind == "gru" else torch.nn.LSTMCell)(size, size)
        fused = (FusedGRUCell if kind == "gru" else FusedLSTMCell)(size, size)
        xs = [torch.randn(rows, size, generator=gen) for _ in range(calls)]

        def step(cell):
            h = c = torch.zeros(rows, size)
            for x in xs:
                if kind == "lstm":
                    h, c = cell(x, (h, c))
                else:
                    h = cell(x, h)
            h.sum().backward()
    elif kind == "attention":
        stock = torch.nn.MultiheadAttention(size, 4)
        fused = FusedMultiheadAttention(size, 4)
        x = torch.randn(rows, 2, size, generator=gen).requires_grad_()

        def step(attention):
            y = x
            for _ in range(calls):
                y = attention(y, y, y, need_weights=False)[0]
            y.sum().backward()
    else:
        stock = torch.nn.Embedding(1000, size)
        fused = FusedEmbedding(1000, size)
        ids = [torch.randint(0, 1000, (rows,), generator=gen) for _ in range(calls)]

        def step(embedding):
            sum(embedding(i).sum() for i in ids).backward()
    fused.load_state_dict(stock.state_dict())
    return stock, fused, step


@contextlib.contextmanager
def _python_functions():
    """The drop-ins find no C++ Function: they run their Python Functions."""
    from torch_ctxext.nn import linear

    saved = dict(linear._routes)
    for name in linear.CPP_FUNCTIONS:
        linear._routes[name] = None
    try:
        yield
    finally:
        linear._routes.clear()
        linear._routes.update(saved)


def measure_drop_ins(cases=None, rounds=15, steps=10, seed=0):
    """Rows of microseconds per call: the stock module's, and each variant's
    difference to it (``fused``: as it runs; ``python``: its Python
    Functions), in CPU time and wall time."""
    import torch

    results = []
    for name, kind, size, rows, calls in cases or DROP_IN_CASES:
        stock, fused, step = _models(kind, size, rows, calls, torch.Generator().manual_seed(seed))
        variants = {"stock": (stock, contextlib.nullcontext),
                    "fused": (fused, contextlib.nullcontext),
                    "python": (fused, _python_functions)}

        def timed(variant):
            module, context = variants[variant]
            with context():
                wall, cpu = time.perf_counter(), time.thread_time()
                for _ in range(steps):
                    module.zero_grad(set_to_none=True)
                    step(module)
                return ((time.perf_counter() - wall) / (steps * calls),
                        (time.thread_time() - cpu) / (steps * calls))

        for variant in variants:  # warm up
            timed(variant)
        for a, b in zip(stock.parameters(), fused.parameters()):
            torch.testing.assert_close(a.grad, b.grad)
        got = {variant: [] for variant in variants}
        order = list(variants)
        for _ in range(rounds):
            for variant in order:
                got[variant].append(timed(variant))
            order.reverse()
        row = {"case": name, "calls": calls}
        for i, clock in enumerate(("wall", "cpu")):
            stock_s = [t[i] for t in got["stock"]]
            row[f"{clock}_stock_us"] = statistics.median(stock_s) * 1e6
            for variant in ("fused", "python"):
                row[f"{clock}_{variant}_us"] = statistics.median(
                    [v[i] - s for v, s in zip(got[variant], stock_s)]) * 1e6
        results.append(row)
    return results


def drop_ins_table(rows):
    """``measure_drop_ins``'s rows as a Markdown table."""
    out = ["| model, step | stock module us per call (CPU / wall) | drop-in - stock us per call (CPU / wall) "
           "| drop-in with its Python Functions - stock (CPU / wall) |",
           "|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['case']} | {r['cpu_stock_us']:.1f} / {r['wall_stock_us']:.1f} "
                   f"| **{r['cpu_fused_us']:+.1f}** / {r['wall_fused_us']:+.1f} "
                   f"| {r['cpu_python_us']:+.1f} / {r['wall_python_us']:+.1f} |")
    return "\n".join(out)


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    print(drop_ins_table(measure_drop_ins(rounds=7)))
