"""The training stacks of test_training_stacks.py: how each one trains the model.

Each stack trains ``examples/shared_layers.py``'s model (one block applied
``DEPTH`` times, its two Linear layers ``torch_ctxext.nn.FusedLinear``) for ``STEPS`` SGD
steps, and the same model built from a reference Linear, from the same
initial weights on the same data. What a run returns (:class:`Outcome`):
the loss of every step, the gradients after the last backward and the
parameters after the last step (full tensors, also under FSDP), and what
``torch_ctxext.explain()`` saw: how many entries of ``ctx.input_grad_buffers``
were exposed, and why the others were None.

A distributed stack runs in ``WORLD`` processes started by the test: this
file is also their entry point,

    python training_stacks.py STACK --rank R --world W --store FILE --out FILE

which joins a gloo process group through a file store, runs every
configuration of STACK, and saves ``{config: {variant: Outcome dict}}``.
"""
import argparse
import collections
import contextlib
import datetime
import faulthandler
import os
import re
import sys

import torch

import torch_ctxext
from torch_ctxext.nn import FusedLinear, linear

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
from shared_layers import SharedLayerModel, shifted_token_batch, token_loss  # noqa: E402

VOCAB, DIM, HIDDEN, DEPTH = 32, 16, 32, 3
BATCH, SEQ = 4, 8
STEPS, LR = 2, 0.1
WORLD = 2
# Each distributed process must be done well within this (the test waits
# this long, then kills every process it started).
TIMEOUT_S = 100

# Per backward of the whole model, with all DEPTH uses of the block in one
# engine call: each of fc1 and fc2 has its weight and bias used DEPTH times;
# the first use to run finds no buffer, each later one fuses.
EXPOSED_PER_BACKWARD = 2 * 2 * (DEPTH - 1)

# The variants a stack trains: the model with fusion, and the reference.
VARIANTS = {
    "fused": lambda i, o: FusedLinear(i, o),
    "unfused": lambda i, o: FusedLinear(i, o, fuse=False),
    "nn.Linear": torch.nn.Linear,
}


def batch(step, micro=0, rank=0):
    """The (tokens, targets) of one micro-batch: the same on every run."""
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return shifted_token_batch(BATCH, SEQ, VOCAB, gen)


def build(variant, block_wrapper=None):
    torch.manual_seed(0)
    return SharedLayerModel(VOCAB, DIM, HIDDEN, DEPTH, linear=VARIANTS[variant],
                            block_wrapper=block_wrapper)


class Outcome(dict):
    """losses, grads, params (full tensors) and exposed/reads/reasons."""

    @classmethod
    def start(cls):
        return cls(losses=[], grads={}, params={}, exposed=0, reads=0,
                   reasons=collections.Counter())

    @contextlib.contextmanager
    def watching(self):
        """Count what ctx.input_grad_buffers hands out in the block, and what
        FusedLinear's C++ Function (which FusedLinear runs where torch_ctxext's
        extension has it, and whose forward ran before the block) looked up
        and added into by the same rules."""
        counters = getattr(linear.cpp_function_build(), "_testing", None)
        cpp = (lambda: (counters.fused_linear_lookups(), counters.fused_linear_additions())) if counters else None
        before = cpp() if cpp else (0, 0)
        with torch_ctxext.explain() as report:
            yield
        for stats in report.functions.values():
            self["exposed"] += stats.exposed
            self["reads"] += stats.reads
            self["reasons"].update(stats.reasons)
        if cpp:
            after = cpp()
            self["reads"] += after[0] - before[0]
            self["exposed"] += after[1] - before[1]

    def finish(self, model):
        self["grads"] = {n: full(p.grad) for n, p in model.named_parameters()}
        self["params"] = {n: full(p.detach()) for n, p in model.named_parameters()}
        self["reasons"] = dict(self["reasons"])
        return dict(self)  # plain types: torch.load(weights_only=True) reads it


def full(t):
    """A plain tensor with the whole value (a DTensor's full_tensor())."""
    if t is None:
        return None
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().clone()


def train(model, forward_loss, micro_batches=1, rank=0, world=1, micro_batch_context=None):
    """STEPS SGD steps; each step accumulates ``micro_batches`` backward passes.

    ``forward_loss(model, tokens, targets)`` returns the loss;
    ``micro_batch_context(micro, last)`` returns a context manager the
    micro-batch's forward and backward run in (e.g. DDP's no_sync), or None."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    outcome = Outcome.start()
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for micro in range(micro_batches):
            tokens, targets = batch(step, micro, rank)
            context = None
            if micro_batch_context is not None:
                context = micro_batch_context(micro, micro == micro_batches - 1)
            with context or contextlib.nullcontext():
                loss = forward_loss(model, tokens, targets) / micro_batches
                with outcome.watching():
                    loss.backward()
            total += loss.item()
        outcome["losses"].append(total)
        optimizer.step()
    return outcome.finish(model)


def plain_loss(model, tokens, targets):
    return model.loss(tokens, targets)


def train_local_reference(world, micro_batches):
    """The reference model without any wrapper, on every rank's data: the
    gradients a data-parallel run must produce (the mean over ranks, summed
    over micro-batches)."""
    model = build("nn.Linear")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    outcome = Outcome.start()
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for micro in range(micro_batches):
            losses = [model.loss(*batch(step, micro, r)) for r in range(world)]
            loss = sum(losses) / (world * micro_batches)
            loss.backward()
            total += loss.item()
        outcome["losses"].append(total)
        optimizer.step()
    return outcome.finish(model)


# ------------------------------------------------------------ one process


def run_checkpoint(config):
    """torch.utils.checkpoint.checkpoint, reentrant or not, around each use
    of the block (``"... each use"``) or around all DEPTH uses at once
    (``"... all uses"``)."""
    from torch.utils.checkpoint import checkpoint

    reentrant = config.startswith("reentrant")
    results = {}
    for variant in ("fused", "nn.Linear"):
        if config.endswith("each use"):
            def each_use(block, h):
                return checkpoint(block, h, use_reentrant=reentrant)

            model = build(variant, block_wrapper=each_use)
            forward_loss = plain_loss
        else:
            model = build(variant)

            def forward_loss(m, tokens, targets):
                h = checkpoint(m.encode, m.embedding(tokens), use_reentrant=reentrant)
                return token_loss(m.head(h), targets)

        results[variant] = train(model, forward_loss)
    return results


def autocast_bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def run_autocast(config):
    """torch.autocast("cpu", dtype=torch.bfloat16): FusedLinear's outputs are
    bfloat16, the parameters float32; the Function declares
    set_output_grad_dtype(torch.float32). Also records the dtype of every
    gradient that reaches a Linear output (grad_dtypes)."""
    results = {}
    for variant in ("fused", "unfused", "nn.Linear"):
        model = build(variant)
        seen = collections.Counter()

        def record(module, args, out):
            out.register_hook(lambda g: seen.update([(str(out.dtype), str(g.dtype))]))

        for layer in (model.block.fc1, model.block.fc2):
            layer.register_forward_hook(record)

        outcome = train(model, _autocast_loss)
        outcome["grad_dtypes"] = {f"{o} output, {g} gradient": n for (o, g), n in seen.items()}
        results[variant] = outcome
    return results


def run_compile(config):
    """torch.compile(model, backend="aot_eager") (cheap: no code generation),
    in float32 or under autocast, fused and unfused; also records what Dynamo
    compiled: graphs, frames ({"total": .., "ok": ..}) and what it could not
    trace (graph_break, unimplemented: {reason: count})."""
    import torch._dynamo
    from torch._dynamo.backends.debugging import aot_eager
    from torch._dynamo.utils import counters

    results = {}
    for variant in ("fused", "unfused"):
        torch._dynamo.reset()
        counters.clear()
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm)
            return aot_eager(gm, example_inputs)

        model = build(variant)
        compiled = torch.compile(model, backend=backend)

        def forward_loss(m, tokens, targets):
            with autocast_bf16() if config == "autocast bfloat16" else contextlib.nullcontext():
                logits = compiled(tokens)
            return token_loss(logits.float(), targets)

        outcome = train(model, forward_loss)
        outcome["graphs"] = len(graphs)
        # What Dynamo could not trace: graph breaks (the backport), or a frame
        # given up on ("unimplemented": torch 2.15's Observed exception).
        for kind in ("graph_break", "unimplemented"):
            reasons = collections.Counter()
            for reason, n in counters[kind].items():
                reasons[short_reason(reason)] += n
            outcome[kind] = dict(reasons)
        outcome["frames"] = dict(counters["frames"])
        results[variant] = outcome
        torch._dynamo.reset()
    # Eager, the same Function without fusion (under autocast the compiled
    # graphs round differently: equal only to bfloat16 precision).
    results["eager unfused"] = train(
        build("unfused"), _autocast_loss if config == "autocast bfloat16" else plain_loss
    )
    return results


def short_reason(reason):
    """Dynamo's graph-break reason in a line: the untraceable function's name
    when it names one, else its first sentence."""
    text = " ".join(str(reason).split())
    named = re.search(r"trace the builtin `([^`]+)`", text)
    if named:
        return f"untraceable builtin {named.group(1).rstrip('.').rsplit('.', 1)[-1]}"
    return text.split(" Explanation:")[0].split(". ")[0][:160]


def _autocast_loss(model, tokens, targets):
    with autocast_bf16():
        logits = model(tokens)
    return token_loss(logits.float(), targets)


LOCAL = {
    "checkpoint": (run_checkpoint, [
        "non-reentrant, each use", "non-reentrant, all uses",
        "reentrant, each use", "reentrant, all uses",
    ]),
    "autocast": (run_autocast, ["bfloat16"]),
    "compile": (run_compile, ["float32", "autocast bfloat16"]),
}


# --------------------------------------------------------------- distributed


def run_ddp(config, rank, world):
    """DistributedDataParallel with gradient_as_bucket_view=config, two
    micro-batches per step: the first under no_sync() (accumulated locally),
    the second synchronised."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    results = {}
    for variant in ("fused", "nn.Linear"):
        model = DDP(build(variant), gradient_as_bucket_view=config == "gradient_as_bucket_view")

        def no_sync_but_last(micro, last, model=model):
            return None if last else model.no_sync()

        # Through DDP's forward (it prepares the reducer for the backward).
        outcome = train(model, lambda m, t, y: token_loss(m(t), y), micro_batches=2,
                        rank=rank, world=world, micro_batch_context=no_sync_but_last)
        # Names without DDP's "module." prefix.
        for key in ("grads", "params"):
            outcome[key] = {n.removeprefix("module."): v for n, v in outcome[key].items()}
        results[variant] = outcome
    results["local"] = train_local_reference(world, micro_batches=2)
    return results


def run_fsdp(config, rank, world):
    """FSDP2 (``fully_shard``) on the root only; or on the shared block, then
    the root; or on each Linear of the block (their outputs are then FSDP
    module outputs, on which FSDP registers its pre-backward hooks), the
    block and the root."""
    from torch.distributed.fsdp import fully_shard

    results = {}
    for variant in ("fused", "nn.Linear"):
        model = build(variant)
        if config == "each Linear, block and root":
            fully_shard(model.block.fc1)
            fully_shard(model.block.fc2)
        if config != "root only":
            fully_shard(model.block)
        fully_shard(model)
        results[variant] = train(model, plain_loss, rank=rank, world=world)
    results["local"] = train_local_reference(world, micro_batches=1)
    return results


DISTRIBUTED = {
    "ddp": (run_ddp, ["gradient_as_bucket_view", "gradients copied to buckets"]),
    "fsdp2": (run_fsdp, ["root only", "block and root", "each Linear, block and root"]),
}


def worker_main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("stack", choices=sorted(DISTRIBUTED))
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    import torch.distributed as dist

    # A crash in native code prints each thread's Python stack to the log the
    # test shows.
    faulthandler.enable()
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{args.store}", rank=args.rank, world_size=args.world,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    try:
        run, configs = DISTRIBUTED[args.stack]
        results = {config: run(config, args.rank, args.world) for config in configs}
        torch.save(results, args.out + ".part")
        os.replace(args.out + ".part", args.out)
        print(f"rank {args.rank}: results written", flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Gloo's worker threads can abort the interpreter's teardown ("terminate
    # called without an active exception", pytorch/pytorch#190489 and
    # #179291); everything this process owes is written and the group is
    # destroyed, so it ends here, without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    worker_main()
