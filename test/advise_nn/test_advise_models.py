"""torch_ctxext.advise on the four models of docs/where-fusing-pays.md: what it
reports is what each model's structure implies, the saving it predicts is the
saving fuse(model) makes, and watching changes nothing.

CI runs this file on every release it tests (tools/run.py), native 2.15
included: the same report (names, counts, bytes) everywhere. The expected
reports are derived here from the models' structure, never from advise:

* a parameter used by N calls in one backward has N producers; the engine
  keeps the first gradient and adds the other N - 1 (temporaries);
* the first gradient of an ``nn.Linear``'s weight (``weight.t()``), of its
  bias (the output's gradient reduced to the bias's shape) and of an
  embedding tied to such a projection is a view, which the engine cannot add
  to in place: it allocates one sum, after which the buffer is its own;
* a drop-in (torch_ctxext.nn) returns a gradient of its own where it is
  first, and adds into the buffer wherever it comes later and the buffer is
  exposed; a view left by a functional ``F.linear`` is not.
"""
import importlib.util
import json
import os
import sys
from dataclasses import dataclass

import pytest
import torch

import torch_ctxext
from torch_ctxext import _features
from support import python

from where_fusing_pays import MODELS, report_of

F32 = 4


@dataclass(frozen=True)
class Expected:
    """One tensor's expected line: producers, gradient elements, whether the
    first gradient is a view (one sum out of place), which producers a
    drop-in replaces (the first, the later ones)."""

    producers: int
    numel: int
    first_is_view: bool = False
    first_has_drop_in: bool = False
    later_have_drop_in: bool = False
    kind: str = "parameter"

    @property
    def grad_bytes(self):
        return self.numel * F32

    @property
    def temporary_bytes(self):
        return (self.producers - 1 + self.first_is_view) * self.grad_bytes

    @property
    def avoidable_bytes(self):
        later = self.producers - 1
        if self.first_is_view and not self.first_has_drop_in:
            later -= 1  # the second gradient finds a view: summed out of place as before
        saved = later if self.later_have_drop_in else 0
        saved += self.first_is_view and self.first_has_drop_in  # no sum at all
        return saved * self.grad_bytes


def linear(producers, numel):
    """A stock nn.Linear's weight or bias, used by ``producers`` calls."""
    return Expected(producers, numel, first_is_view=True, first_has_drop_in=True, later_have_drop_in=True)


def albert(vocab=64, dim=32, hidden=64, depth=4, batch=2, seq=8):
    """One block applied ``depth`` times; its input is read by its LayerNorm
    and by the residual add; the head is F.linear(h, embedding.weight)."""
    params = {
        "block.fc1.weight": linear(depth, dim * hidden), "block.fc1.bias": linear(depth, hidden),
        "block.fc2.weight": linear(depth, hidden * dim), "block.fc2.bias": linear(depth, dim),
        "block.norm.weight": Expected(depth, dim), "block.norm.bias": Expected(depth, dim),
        # head (functional, first) and lookup (an nn.Embedding, second)
        "embedding.weight": Expected(2, vocab * dim, first_is_view=True, later_have_drop_in=True),
    }
    return params, [Expected(2, batch * seq * dim, kind="activation")] * depth


def gpt2(vocab=64, context=16, dim=32, heads=2, layers=2, batch=2, seq=8):
    """Every weight used once but the token embedding, which lm_head (an
    nn.Linear, first) shares; each block's input and its attention output
    are each read by a LayerNorm and a residual add."""
    params = {"wte.weight": linear(2, vocab * dim)}
    return params, [Expected(2, batch * seq * dim, kind="activation")] * (2 * layers)


def lstm(features=16, hidden=32, classes=10, steps=16, batch=4):
    """The cell's four parameters at every step; its cell state read by the
    next step and by its own tanh (all but the last step's)."""
    params = {
        "cell.weight_ih": linear(steps, 4 * hidden * features), "cell.weight_hh": linear(steps, 4 * hidden * hidden),
        "cell.bias_ih": linear(steps, 4 * hidden), "cell.bias_hh": linear(steps, 4 * hidden),
    }
    return params, [Expected(2, batch * hidden, kind="activation")] * (steps - 1)


def micro_batches(features=32, hidden=64, classes=10, micro=4, batch=8):
    """Every parameter used once per micro-batch."""
    params = {
        "fc1.weight": linear(micro, features * hidden), "fc1.bias": linear(micro, hidden),
        "fc2.weight": linear(micro, hidden * classes), "fc2.bias": linear(micro, classes),
    }
    return params, []


STRUCTURE = {"albert": albert, "gpt2": gpt2, "lstm": lstm, "micro-batches": micro_batches}
# The drop-in of each stock module whose gradients it would fuse.
DROP_INS = {
    "albert": {"block.fc1": "FusedLinear", "block.fc2": "FusedLinear"},
    "gpt2": {"lm_head": "FusedLinear", "wte": "FusedEmbedding"},
    "lstm": {"cell": "FusedLSTMCell"},
    "micro-batches": {"fc1": "FusedLinear", "fc2": "FusedLinear"},
}
NAMES = list(MODELS)


def advised(name, fused=False):
    workload = MODELS[name]()
    if fused:
        torch_ctxext.nn.fuse(workload.model)
    return workload, report_of(workload)


def by_kind(report, kind):
    return [s for s in report.slots if s.kind == kind]


@pytest.mark.parametrize("name", NAMES)
def test_each_tensor_that_receives_several_gradients_is_named_with_as_many_producers_as_the_structure_implies(name):
    params, activations = STRUCTURE[name]()
    _, report = advised(name)
    got = {s.name: (len(s.producers), s.grad_bytes) for s in by_kind(report, "parameter")}
    assert got == {n: (e.producers, e.grad_bytes) for n, e in params.items()}
    assert sorted((len(s.producers), s.grad_bytes) for s in by_kind(report, "activation")) == sorted(
        (e.producers, e.grad_bytes) for e in activations)
    assert by_kind(report, "tensor") == []
    assert report.backwards == 1
    # Every producer is named by its op and the module that ran it.
    assert all(p.op and p.module for s in report.slots for p in s.producers)


@pytest.mark.parametrize("name", NAMES)
def test_temporaries_sums_and_the_avoidable_bytes_are_what_the_engines_rule_implies(name):
    params, activations = STRUCTURE[name]()
    _, report = advised(name)
    for slot in report.slots:
        expected = params.get(slot.name) or Expected(2, slot.grad_bytes // F32, kind="activation")
        assert (slot.fused, slot.temporaries, slot.summed_out_of_place) == (
            0, expected.producers - 1, int(expected.first_is_view)), slot.name
        assert slot.temporary_bytes == expected.temporary_bytes, slot.name
        assert slot.avoidable_bytes == expected.avoidable_bytes, slot.name
    assert report.avoidable_bytes == sum(e.avoidable_bytes for e in params.values())
    assert report.temporary_bytes == sum(e.temporary_bytes for e in [*params.values(), *activations])
    assert report.avoided_bytes == 0
    # Largest saving first.
    savings = [s.avoidable_bytes for s in report.slots]
    assert savings == sorted(savings, reverse=True)


@pytest.mark.parametrize("name", NAMES)
def test_the_drop_in_of_each_stock_module_is_named_with_the_bytes_it_saves(name):
    _, report = advised(name)
    assert {d.module: d.drop_in for d in report.drop_ins.values()} == DROP_INS[name]
    assert sum(d.avoidable_bytes for d in report.drop_ins.values()) == report.avoidable_bytes
    text = str(report)
    for module, drop_in in DROP_INS[name].items():
        assert f"{module}: " in text and f"torch_ctxext.nn.{drop_in}" in text


@pytest.mark.parametrize("name", NAMES)
def test_after_fuse_each_later_producer_adds_into_the_buffer_and_nothing_is_left_to_avoid(name):
    params, _ = STRUCTURE[name]()
    _, report = advised(name, fused=True)
    assert report.avoidable_bytes == 0
    expected_fused = {}
    for slot_name, e in params.items():
        fusing = e.producers - 1 if e.later_have_drop_in else 0
        if e.first_is_view and not e.first_has_drop_in:
            fusing = 0  # the lookup finds the functional head's view: not exposed
        expected_fused[slot_name] = fusing
        slot = report[slot_name]
        assert slot.fused == fusing, slot_name
        # One accounting: what the stock step's report promised for this
        # slot (the sum out of place included) is what the fused one avoided.
        assert slot.avoided_bytes == e.avoidable_bytes, slot_name
    # What the Functions say agrees: every buffer exposed was written in place.
    exposed = sum(f.exposed for f in report.functions.values())
    assert exposed == sum(f.used for f in report.functions.values()) == sum(expected_fused.values())


def measured(workload):
    """Bytes the CPU allocator handed out during one backward, and the peak
    of one whole step (benchmarks/bench_advise.py's method)."""
    import bench_advise

    return bench_advise.allocations(workload)


@pytest.mark.parametrize("name", NAMES)
def test_fuse_lowers_allocations_by_the_predicted_bytes_and_the_peak_by_at_most_the_predicted_peak(name):
    """The saving advise predicts is the saving fuse(model) makes: the
    backward allocates avoidable_bytes less, within a few bytes per slot (no
    fused path allocates: not even the bias's row sum). Temporaries
    are freed after each add, so only one add's are alive together: the
    step's peak drops by at most avoidable_peak_bytes, and by that only where
    the peak falls on that add (at these small sizes the activations' peak
    is elsewhere; at benchmarks/bench_advise.py's sizes it drops by
    avoidable_peak_bytes within one gradient)."""
    _, report = advised(name)
    fused = MODELS[name]()
    torch_ctxext.nn.fuse(fused.model)
    (stock_allocated, stock_peak), (fused_allocated, fused_peak) = measured(MODELS[name]()), measured(fused)
    assert abs(stock_allocated - fused_allocated - report.avoidable_bytes) <= 16 * len(report.slots)
    assert 0 <= stock_peak - fused_peak <= report.avoidable_peak_bytes


SCALED_EMBEDDINGS = [
    ("scale_grad_by_freq", {"scale_grad_by_freq": True}),
    ("padding_idx-scale_grad_by_freq", {"padding_idx": 0, "scale_grad_by_freq": True}),
]


@pytest.mark.parametrize("options", [o for _, o in SCALED_EMBEDDINGS], ids=[n for n, _ in SCALED_EMBEDDINGS])
def test_with_scale_grad_by_freq_fuse_lowers_allocations_by_the_predicted_bytes_to_the_byte(options):
    """gpt2 with its tied token embedding scaling each row's gradient by
    its frequency (and a padding row): the fused lookup still allocates each
    row's count (int64) and scale (float32), and the padding row kept aside,
    and advise takes exactly that off the saving it promises."""
    def gpt2():
        workload = MODELS["gpt2"]()
        for option, value in options.items():
            setattr(workload.model.wte, option, value)
        return workload

    report = report_of(gpt2())
    wte = gpt2().model.wte
    residual = wte.num_embeddings * (8 + F32) + wte.embedding_dim * F32 * ("padding_idx" in options)
    assert report["wte.weight"].avoidable_bytes == STRUCTURE["gpt2"]()[0]["wte.weight"].avoidable_bytes - residual
    fused = gpt2()
    torch_ctxext.nn.fuse(fused.model)
    (stock_allocated, _), (fused_allocated, _) = measured(gpt2()), measured(fused)
    assert stock_allocated - fused_allocated == report.avoidable_bytes


def gradients_and_exposures(workload, watch):
    workload.model.zero_grad(set_to_none=True)
    with torch_ctxext.explain() as exposures:
        if watch:
            with torch_ctxext.advise(workload.model):
                workload.loss().backward()
        else:
            workload.loss().backward()
    grads = {n: p.grad.clone() for n, p in workload.model.named_parameters()}
    return grads, {n: (s.reads, s.exposed, dict(s.reasons)) for n, s in exposures.functions.items()}


@pytest.mark.parametrize("fused", [False, True], ids=["stock", "fused"])
@pytest.mark.parametrize("name", NAMES)
def test_watching_changes_no_gradient_and_no_buffer_the_engine_exposes(name, fused):
    workload = MODELS[name]()
    if fused:
        torch_ctxext.nn.fuse(workload.model)
    plain_grads, plain_exposed = gradients_and_exposures(workload, watch=False)
    watched_grads, watched_exposed = gradients_and_exposures(workload, watch=True)
    assert plain_grads.keys() == watched_grads.keys()
    for n in plain_grads:
        assert torch.equal(plain_grads[n], watched_grads[n]), n
    assert watched_exposed == plain_exposed


def summary(report):
    """What must be the same wherever the step runs: names, counts, bytes."""
    d = report.as_dict()
    slots = {s["name"]: [s["kind"], len(s["producers"]), s["grad_bytes"], s["fused"], s["temporaries"],
                         s["summed_out_of_place"], s["temporary_bytes"], s["avoidable_bytes"]]
             for s in d["slots"]}
    functions = {n: [f["exposed"], f["used"]] for n, f in d["functions"].items()}
    return {"slots": slots, "functions": functions, "avoidable_bytes": d["avoidable_bytes"],
            "drop_ins": sorted((x["module"], x["drop_in"], x["avoidable_bytes"]) for x in d["drop_ins"])}


# Stock nn.LSTMCell does not run on a PrivateUse1 device: torch's cell
# calls _thnn_fused_lstm_cell there, which only CUDA implements.
ON_THE_TEST_DEVICE = [(n, f) for n in NAMES for f in (False, True) if (n, f) != ("lstm", False)]

DEVICE_SCRIPT = """
import json, os, sys
import torch, torch_ctxext_testdevice
import torch_ctxext
sys.path.insert(0, {examples!r})
from where_fusing_pays import MODELS, report_of
out = {{}}
for name, fused in {cases!r}:
    workload = MODELS[name]().to("testdevice")
    if fused:
        torch_ctxext.nn.fuse(workload.model)
    out[f"{{name}} {{fused}}"] = report_of(workload).as_dict()
print(json.dumps(out))
sys.stdout.flush()
os._exit(0)
"""


@pytest.mark.skipif(importlib.util.find_spec("torch_ctxext_testdevice") is None,
                    reason="the test device is not installed (tools/run.py installs it)")
def test_the_report_on_the_test_device_is_the_cpus():
    # Looked up, not imported: the device must be registered before a
    # process's first backward, so it runs in a fresh interpreter.
    examples = os.path.dirname(sys.modules["where_fusing_pays"].__file__)
    script = DEVICE_SCRIPT.format(examples=examples, cases=ON_THE_TEST_DEVICE)
    done = python(code=script)
    assert done.returncode == 0, done.stderr[-3000:]
    on_device = json.loads(done.stdout.strip().splitlines()[-1])
    # Where this release's route leaves accelerator buffers None (torch_ctxext
    # on torch 2.6 to 2.9: docs/input_grad_buffers.md), the drop-ins fuse less
    # on the device, and the report says so; every producer is still counted.
    exposes_everything = all(_features.buffer_exposure().values())
    for name, fused in ON_THE_TEST_DEVICE:
        _, cpu = advised(name, fused)
        device = on_device[f"{name} {fused}"]
        if not fused or exposes_everything:
            assert _summary_of_dict(cpu.as_dict()) == _summary_of_dict(device), (name, fused)
            continue
        for slot in device["slots"]:
            assert slot["fused"] + slot["temporaries"] == len(slot["producers"]) - 1, (name, slot)
        assert sum(s["fused"] for s in device["slots"]) == sum(f["used"] for f in device["functions"].values())


def _summary_of_dict(d):
    """summary() of an as_dict(), through JSON (as it crosses processes)."""
    class _Report:
        def as_dict(self):
            return d

    return json.loads(json.dumps(summary(_Report())))


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("fused", [False, True], ids=["stock", "fused"])
def test_a_step_that_repeats_a_described_graph_is_reported_as_a_fresh_description_would(name, fused, monkeypatch):
    from torch_ctxext import _advise

    workload = MODELS[name]()
    if fused:
        torch_ctxext.nn.fuse(workload.model)
    described = []
    describe_all = _advise.Advise._describe_all
    monkeypatch.setattr(_advise.Advise, "_describe_all",
                        lambda self, ordered: described.append(1) or describe_all(self, ordered))
    reports = [report_of(workload).as_dict() for _ in range(3)]  # a block per step
    assert len(described) == 1  # the steps after the first reuse it
    with torch_ctxext.advise(workload.model) as kept_open:  # one block over the steps
        for _ in range(3):
            workload.model.zero_grad(set_to_none=True)
            workload.loss().backward()
    assert len(described) == 1
    monkeypatch.setattr(_advise, "_DESCRIBED_PER_MODEL", 0)  # nothing kept: each described afresh
    _advise._DESCRIBED.clear()
    fresh = report_of(workload).as_dict()
    assert len(described) == 2
    assert reports == [fresh] * 3
    scaled = kept_open.as_dict()
    assert scaled["backwards"] == 3 and [s["name"] for s in scaled["slots"]] == [s["name"] for s in fresh["slots"]]
    assert scaled["avoidable_bytes"] == 3 * fresh["avoidable_bytes"]
    assert scaled["temporary_bytes"] == 3 * fresh["temporary_bytes"]
