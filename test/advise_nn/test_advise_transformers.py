"""advise and torch_ctxext.nn on the architectures people train: GPT-2 (its
``Conv1D`` layers, the head tied to the token embedding; also with two
micro-batches summed), BERT, ALBERT, T5 (one embedding tied across encoder,
decoder and head), Llama (``tie_word_embeddings=True``), from ``transformers``
configs at small sizes with random weights (examples/transformers_models.py),
and an ``nn.LSTMCell`` unrolled over 32 steps.

For each: the report's slots are those of a walk of the step's graph; watching
changes no gradient; ``fuse(model)`` computes the same outputs and gradients;
and there is one accounting: what the stock step's report promises, per slot
and in total, is what the fused step's report calls avoided and what the
backward's allocations really drop (the sum out of place the engine no longer
makes included), and the peak drops by no more than the predicted bound.

``transformers`` is a test-only dependency (tools/run.py installs it into the
venvs CI tests with); where it is missing, the tests that need it are skipped
with that reason.
"""
import importlib.util
import re
import sys

import pytest
import torch

import torch_ctxext
from support import ROOT, python

from transformers_models import MODELS, NEEDS_TRANSFORMERS
from where_fusing_pays import report_of

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
MISSING = "transformers is not installed (a test-only dependency: tools/run.py installs it for CI)"


def models():
    return [pytest.param(name, marks=pytest.mark.skipif(name in NEEDS_TRANSFORMERS and not HAS_TRANSFORMERS,
                                                        reason=MISSING))
            for name in MODELS]


def graph_slots(loss, names):
    """Walk the step's graph from the loss: every (node, input) that two or
    more edges feed, as {parameter name: producers} and the producer counts of
    the other slots."""
    into, seen, stack = {}, {id(loss.grad_fn)}, [loss.grad_fn]
    nodes = {id(loss.grad_fn): loss.grad_fn}
    while stack:
        node = stack.pop()
        for child, nr in node.next_functions:
            if child is None:
                continue
            into[(id(child), nr)] = into.get((id(child), nr), 0) + 1
            if id(child) not in seen:
                seen.add(id(child))
                nodes[id(child)] = child
                stack.append(child)
    parameters, others = {}, []
    for (node_id, _), count in into.items():
        if count < 2:
            continue
        variable = getattr(nodes[node_id], "variable", None)
        if variable is not None and id(variable) in names:
            parameters[names[id(variable)]] = count
        else:
            others.append(count)
    return parameters, sorted(others)


@pytest.mark.parametrize("name", models())
def test_the_reports_slots_are_those_of_a_walk_of_the_steps_graph(name):
    workload = MODELS[name]()
    names = {}
    for n, p in workload.model.named_parameters():
        names.setdefault(id(p), n)
    with torch_ctxext.advise(workload.model) as report:
        loss = workload.loss()
        parameters, others = graph_slots(loss, names)
        loss.backward()
    assert {s.name: len(s.producers) for s in report.slots if s.kind == "parameter"} == parameters
    assert sorted(len(s.producers) for s in report.slots if s.kind != "parameter") == others


def gradients(workload, watch=False):
    workload.model.zero_grad(set_to_none=True)
    if watch:
        with torch_ctxext.advise(workload.model):
            loss = workload.loss()
            loss.backward()
    else:
        loss = workload.loss()
        loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in workload.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("fused", [False, True], ids=["stock", "fused"])
@pytest.mark.parametrize("name", models())
def test_watching_a_step_changes_no_gradient(name, fused):
    workload = MODELS[name]()
    if fused:
        torch_ctxext.nn.fuse(workload.model)
    plain, watched = gradients(workload), gradients(workload, watch=True)
    assert torch.equal(plain[0], watched[0])
    assert plain[1].keys() == watched[1].keys()
    for n in plain[1]:
        assert torch.equal(plain[1][n], watched[1][n]), n


@pytest.mark.parametrize("name", models())
def test_fuse_keeps_the_parameters_ties_and_state_dict_and_computes_the_same_step(name):
    stock, fused = MODELS[name](), MODELS[name]()
    state = fused.model.state_dict()
    tied = {n: id(p) for n, p in fused.model.named_parameters(remove_duplicate=False)}
    torch_ctxext.nn.fuse(fused.model)
    assert {n: id(p) for n, p in fused.model.named_parameters(remove_duplicate=False)} == tied
    assert fused.model.state_dict().keys() == state.keys()
    (stock_loss, stock_grads), (fused_loss, fused_grads) = gradients(stock), gradients(fused)
    torch.testing.assert_close(fused_loss, stock_loss)
    assert fused_grads.keys() == stock_grads.keys()
    for n in stock_grads:
        torch.testing.assert_close(fused_grads[n], stock_grads[n], msg=n)
    # Every stock module that has a drop-in was swapped, Conv1D included.
    left = {type(m).__name__ for m in fused.model.modules()} & {"Linear", "Embedding", "LSTMCell", "Conv1D"}
    assert left == set()


def measured(workload):
    """Bytes the CPU allocator handed out during one backward, and the peak
    of one whole step (benchmarks/bench_advise.py's method)."""
    import bench_advise

    return bench_advise.allocations(workload)


def savings(report, key):
    """Per slot, by its gradient's size (an activation's name follows the op
    that made it, which fuse() changes): the nonzero bytes saved."""
    return sorted((s.grad_bytes, getattr(s, key)) for s in report.slots if getattr(s, key))


@pytest.mark.parametrize("name", models())
def test_what_the_report_promises_is_what_fusing_avoids_and_what_the_allocations_drop(name):
    stock = report_of(MODELS[name]())
    fused = report_of(MODELS[name](), fused=True)
    assert stock.avoidable_bytes > 0
    assert savings(fused, "avoided_bytes") == savings(stock, "avoidable_bytes")
    for slot in stock.slots:
        if slot.kind == "parameter":
            assert fused[slot.name].avoided_bytes == slot.avoidable_bytes, slot.name
    assert fused.avoided_bytes == stock.avoidable_bytes
    assert fused.avoidable_bytes == 0
    workload = MODELS[name]()
    torch_ctxext.nn.fuse(workload.model)
    (stock_allocated, stock_peak), (fused_allocated, fused_peak) = measured(MODELS[name]()), measured(workload)
    # Within a few bytes per slot (the allocator's rounding), not a gradient.
    assert abs(stock_allocated - fused_allocated - stock.avoidable_bytes) <= 16 * len(stock.slots)
    assert 0 <= stock_peak - fused_peak <= stock.avoidable_peak_bytes


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason=MISSING)
def test_gpt2s_conv1d_layers_have_a_drop_in_the_report_names():
    workload = MODELS["gpt2-micro"]()
    report = report_of(workload)
    conv1d = {d.module: d.drop_in for d in report.drop_ins.values() if d.stock == "Conv1D"}
    assert conv1d and set(conv1d.values()) == {"FusedConv1D"}
    assert "torch_ctxext.nn.FusedConv1D" in str(report)
    torch_ctxext.nn.fuse(workload.model)
    assert all(type(workload.model.get_submodule(m)).__name__ == "FusedConv1D" for m in conv1d)
    assert isinstance(workload.model.get_submodule(next(iter(conv1d))),
                      sys.modules["transformers.pytorch_utils"].Conv1D)


def test_fuse_never_imports_transformers():
    script = ("import sys, torch, torch_ctxext.nn as n\n"
              "n.fuse(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Embedding(3, 2)))\n"
              "assert 'transformers' not in sys.modules, 'imported'\n")
    done = python(code=script, timeout=120, path=[ROOT])
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("fused", [False, True], ids=["stock", "fused"])
@pytest.mark.parametrize("name", models())
def test_the_report_reads_at_a_glance(name, fused):
    """At most 100 columns; a "do this" line with the total and the drop-ins
    by kind; the tensors that save most first; the tensors nothing saves
    folded into one line naming the module classes without a drop-in; and
    as_dict() keeps every tensor."""
    report = report_of(MODELS[name](), fused=fused)
    text = str(report)
    assert max(len(line) for line in text.splitlines()) <= 100
    data = report.as_dict()
    assert len(data["slots"]) == len(report.slots)
    # Uncut, the table names every tensor that saves, in full.
    full = report.table(width=None)
    assert all(s.name in full for s in report.slots if s.avoidable_bytes or s.avoided_bytes)
    if not fused:
        kinds = {}
        for d in data["drop_ins"]:
            if d["avoidable_bytes"]:
                kinds[d["drop_in"]] = kinds.get(d["drop_in"], 0) + 1
        do_this = " ".join(text.split("do this: ", 1)[1].split("\n\n")[0].split())
        do_this = "do this: " + do_this
        # The total the header gives (the drop-ins "would save X more").
        total = re.search(r"the drop-ins would save (\S+ \S+) more", " ".join(text.split())).group(1)
        assert do_this.startswith(f"do this: torch_ctxext.nn.fuse(model) saves {total} per step: ")
        assert sorted(do_this.split(": ", 2)[2].split(", ")) == sorted(f"{n} x {k}" for k, n in kinds.items())
    saved = [s.avoidable_bytes + s.avoided_bytes for s in report.slots]
    assert saved == sorted(saved, reverse=True)
    nothing = [s for s in report.slots if not (s.avoidable_bytes or s.avoided_bytes)]
    if nothing:
        folded = " ".join(line.strip() for line in text.split(f"+ {len(nothing)} tensor", 1)[1].split("\n\n")[0]
                          .splitlines())
        classes = {p.stock for s in nothing for p in s.producers if p.stock and not p.drop_in
                   and not p.route and not p.stock.startswith("Fused")}
        for cls in classes:
            assert cls in folded
    # A module that applies another's weight through F.linear is named as a route, with the attribute.
    for route in report.routes.values():
        assert f"{route.module}.forward: F.linear(..., {route.attribute})" in " ".join(text.split())
    # Nothing says "-" for a module without a drop-in: it is named.
    assert "Conv1D" not in " ".join(line for line in text.splitlines() if "no drop-in for" in line)
