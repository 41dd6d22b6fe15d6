"""Fusion in the stacks people train with: DDP, FSDP2, checkpointing, autocast, torch.compile.

Each case trains examples/shared_layers.py's model (one block applied DEPTH
times; its Linear layers are ``torch_ctxext.nn.FusedLinear``, a drop-in
``nn.Linear`` whose Function fuses through ``ctx.input_grad_buffers`` and declares
``ctx.set_output_grad_dtype`` when autocast lowers its output) inside one
stack, and the same model without fusion from the same initial weights, and
checks:

* losses, gradients and the parameters after the optimizer steps equal the
  reference's;
* ``ctx.input_grad_buffers`` exposed as many buffers as the table says
  (counted with ``torch_ctxext.explain()``): where the engine can expose one
  and where it cannot is part of the contract this file pins, on torch 2.13
  + torch_ctxext and on native torch 2.15 alike (docs/training-stacks.md).

The distributed stacks run in WORLD processes (gloo, CPU) that the test
starts and always stops, with a time bound. The helpers and the workers'
entry point are in training_stacks.py.
"""
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest
import torch

import torch_ctxext
import training_stacks as stacks
from torch_ctxext import _releases
from support import child_env, reap, wait_until

HARNESS = os.path.abspath(stacks.__file__)
# Who provides set_output_grad_dtype decides how Dynamo fails to trace it
# (test_what_torch_compile_traces): torch itself from 2.14, torch_ctxext before.
NATIVE_GRAD_DTYPE = torch_ctxext.features()["set_output_grad_dtype"] == "native"
# Backward passes in a run: STEPS steps of 2 micro-batches (DDP) or 1.
BACKWARDS = {"ddp": 2 * stacks.STEPS}
FULL = stacks.EXPOSED_PER_BACKWARD


@dataclass(frozen=True)
class Case:
    stack: str
    config: str
    reference: str  # the variant the fused model must equal
    exposed_per_backward: int
    why: str

    @property
    def id(self):
        return f"{self.stack}-{self.config}".replace(" ", "_").replace(",", "")


CASES = [
    Case("ddp", "gradient_as_bucket_view", "nn.Linear", FULL,
         "DDP's hooks sit on the parameters' AccumulateGrad nodes, after the buffer is complete"),
    Case("ddp", "gradients copied to buckets", "nn.Linear", FULL,
         "the buffer is the engine's, not .grad: how .grad maps to buckets does not matter"),
    Case("fsdp2", "root only", "nn.Linear", FULL,
         "the unsharded parameter is a leaf used DEPTH times within one backward"),
    Case("fsdp2", "block and root", "nn.Linear", FULL,
         "as above, with the block an FSDP unit called DEPTH times in forward"),
    Case("fsdp2", "each Linear, block and root", "nn.Linear", FULL,
         "FSDP's pre-backward hooks on FusedLinear's outputs are tensor hooks "
         "(pre-hooks on the node), which the contract allows; no post-hook"),
    Case("checkpoint", "non-reentrant, each use", "nn.Linear", FULL,
         "recomputation only refills saved tensors; the backward is the original graph's"),
    Case("checkpoint", "non-reentrant, all uses", "nn.Linear", FULL, "as above"),
    Case("checkpoint", "reentrant, each use", "nn.Linear", 0,
         "each segment's backward is a separate engine call (graph task) with a single use "
         "of each weight; earlier segments' gradients are already in .grad, not in a buffer"),
    Case("checkpoint", "reentrant, all uses", "nn.Linear", FULL,
         "all DEPTH uses are inside the one recomputed segment, one engine call"),
    # nn.Linear under autocast computes its gradients in bfloat16; the
    # reference is the same Function without fusion.
    Case("autocast", "bfloat16", "unfused", FULL,
         "buffers of the float32 parameters; the gradient arrives in float32 as declared"),
    Case("compile", "float32", "unfused", 0,
         "the Function is traced into the graph with the out-of-place fallback "
         "(torch.compiler.is_compiling()); the compiled backward reads no buffer"),
    Case("compile", "autocast bfloat16", "unfused", FULL,
         "set_output_grad_dtype cannot be traced: the graph breaks at each FusedLinear, "
         "which runs eagerly and fuses"),
]


STACKS = list(dict.fromkeys(c.stack for c in CASES))

# ------------------------------------------------------------------ running


def worker_env():
    """A clean environment in which the workers import the same torch_ctxext
    as this process, one intra-op thread each."""
    return child_env(OMP_NUM_THREADS=1)


def run_processes(commands, logs, timeout):
    """Start one process per command, wait until all exit 0, within timeout
    seconds in all. Raises with the logs' tails if one fails or time runs
    out. Every process started is stopped before this returns or raises."""
    procs = []
    try:
        for command, log in zip(commands, logs):
            with open(log, "w") as out:
                procs.append(subprocess.Popen(
                    command, stdout=out, stderr=subprocess.STDOUT, env=worker_env(),
                    cwd=os.path.dirname(log), start_new_session=True,
                ))
        def settled():  # every process exited, or one failed
            codes = [p.poll() for p in procs]
            return None not in codes or any(c not in (None, 0) for c in codes)

        with contextlib.suppress(AssertionError):  # time ran out: said below, with the logs
            wait_until(settled, timeout, "the worker processes finished")
        codes = [p.poll() for p in procs]
        if codes != [0] * len(procs):
            tails = "\n".join(f"--- {log} (exit code {code}):\n{_tail(log)}"
                              for log, code in zip(logs, codes))
            what = "failed" if any(c not in (None, 0) for c in codes) else f"did not finish within {timeout} s"
            raise AssertionError(f"worker processes {what}; exit codes {codes}\n{tails}")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # its own session: the worker and anything it started
            reap(p)


def _tail(path, n=4000):
    with open(path) as f:
        return f.read()[-n:]


_DISTRIBUTED = {}


def distributed_results(stack, tmp_path_factory):
    """{config: {variant: outcome}} per rank, for every config of the stack
    (one pair of processes per stack, shared by its cases)."""
    if stack not in _DISTRIBUTED:
        tmp = tmp_path_factory.mktemp(stack)
        outs = [str(tmp / f"rank{r}.pt") for r in range(stacks.WORLD)]
        commands = [
            [sys.executable, HARNESS, stack, "--rank", str(r), "--world", str(stacks.WORLD),
             "--store", str(tmp / "store"), "--out", outs[r]]
            for r in range(stacks.WORLD)
        ]
        run_processes(commands, [str(tmp / f"rank{r}.log") for r in range(stacks.WORLD)],
                      stacks.TIMEOUT_S)
        _DISTRIBUTED[stack] = [torch.load(o, weights_only=True) for o in outs]
    return _DISTRIBUTED[stack]


_LOCAL = {}


@pytest.fixture
def results(request, tmp_path_factory):
    """The outcomes of a case's run, one per process (computed once per case)."""
    case = request.param
    if case.stack in stacks.DISTRIBUTED:
        return [r[case.config] for r in distributed_results(case.stack, tmp_path_factory)]
    if case not in _LOCAL:
        run, _ = stacks.LOCAL[case.stack]
        _LOCAL[case] = [run(case.config)]
    return _LOCAL[case]


def why_torch_cannot_run(stack):
    """Why the running torch cannot run a stack on CPU at all (None if it can):
    a limit of torch, not of fusion, so its cases skip saying so."""
    if stack == "fsdp2" and not hasattr(torch.cpu.Stream, "record_event"):
        return (f"torch {torch.__version__}'s fully_shard cannot run on CPU: its all-gather "
                "records an event on a torch.cpu.Stream, which has no record_event before torch 2.7")
    return None


def by_stack(*names):
    chosen = [c for c in CASES if c.stack in names]
    params = []
    for c in chosen:
        why = why_torch_cannot_run(c.stack)
        marks = [pytest.mark.skip(reason=why)] if why else []
        params.append(pytest.param(c, c, id=c.id, marks=marks))
    return pytest.mark.parametrize("case, results", params, indirect=["results"])


def assert_same_training(got, expected):
    torch.testing.assert_close(got["losses"], expected["losses"])
    for kind in ("grads", "params"):
        assert got[kind].keys() == expected[kind].keys()
        for name in got[kind]:
            torch.testing.assert_close(got[kind][name], expected[kind][name], msg=lambda m: f"{kind} {name}: {m}")


# -------------------------------------------------------------------- tests


@by_stack(*STACKS)
def test_fused_model_trains_exactly_as_the_model_without_fusion(case, results):
    for rank in results:
        assert_same_training(rank["fused"], rank[case.reference])


@by_stack(*STACKS)
def test_engine_exposes_the_buffers_the_table_says(case, results):
    backwards = BACKWARDS.get(case.stack, stacks.STEPS)
    for rank in results:
        fused = rank["fused"]
        assert fused["exposed"] == case.exposed_per_backward * backwards, (case.why, fused["reasons"])
        if case.stack != "compile" or fused["exposed"]:
            # Each of the 2 FusedLinear layers, each use, read the buffers once.
            assert fused["reads"] == 2 * stacks.DEPTH * backwards


# Releases whose own FSDP2 on the CPU trains nn.Linear otherwise than one
# process does (measured without torch_ctxext: a torch matter, not a route).
NATIVE_FSDP2_INEXACT_ON_CPU = {(2, 7), (2, 8)}


@by_stack("ddp", "fsdp2")
def test_data_parallel_ranks_agree_and_match_one_process_on_all_data(case, results):
    first, *others = results
    for other in others:
        for name, grad in first["fused"]["grads"].items():
            torch.testing.assert_close(other["fused"]["grads"][name], grad)
    # The reference itself is right: the mean over ranks, summed over micro-batches.
    if case.stack == "fsdp2" and _releases.release(torch.__version__) in NATIVE_FSDP2_INEXACT_ON_CPU:
        pytest.xfail(
            f"torch {torch.__version__}'s FSDP2 on the CPU (gloo) does not reproduce one process's "
            "training, nn.Linear alone and without torch_ctxext imported (max gradient difference "
            "0.59; torch 2.9 on: 9e-8); the fused model equals that reference (checked above and by "
            "test_fused_model_trains_exactly_as_the_model_without_fusion)"
        )
    local = first["local"]
    for kind in ("grads", "params"):
        for name, value in first[case.reference][kind].items():
            torch.testing.assert_close(value, local[kind][name])


@by_stack("autocast")
def test_under_autocast_backward_receives_the_declared_float32_gradient(case, results):
    (rank,) = results
    uses = 2 * stacks.DEPTH * stacks.STEPS
    for variant in ("fused", "unfused"):
        assert rank[variant]["grad_dtypes"] == {"torch.bfloat16 output, torch.float32 gradient": uses}
    # Without the declaration (nn.Linear) the gradient stays in bfloat16.
    assert rank["nn.Linear"]["grad_dtypes"] == {"torch.bfloat16 output, torch.bfloat16 gradient": uses}
    torch.testing.assert_close(
        rank["fused"]["grads"], rank["nn.Linear"]["grads"], atol=0.05, rtol=0.05
    )


@by_stack("compile")
def test_what_torch_compile_traces(case, results):
    (rank,) = results
    fused, eager = rank["fused"], rank["eager unfused"]
    untraced = {**fused["graph_break"], **fused["unimplemented"]}
    if case.config == "float32":
        # The whole model, FusedLinear included, is one graph, and computes
        # what eager computes.
        assert fused["graphs"] == 1 and untraced == {}, fused
        assert_same_training(fused, eager)
    else:
        # set_output_grad_dtype cannot be traced, and how Dynamo says so
        # depends on who provides it. torch's own (2.14 on): the method reads
        # ``self.output_grad_dtypes``, an attribute of a real ctx that
        # Dynamo's stand-in FunctionCtx lacks; the AttributeError makes Dynamo
        # give up on the frame ("Observed exception"), which runs eagerly, and
        # compile the frames it calls. torch_ctxext's (before 2.14): the graph
        # breaks at its C calls and no frame is given up on. Either way
        # FusedLinear runs eagerly (and fuses: the exposed count is checked by
        # test_engine_exposes_the_buffers_the_table_says).
        assert fused["graphs"] > 1 and untraced, fused
        if NATIVE_GRAD_DTYPE:
            assert list(fused["unimplemented"]) == ["Observed exception"], fused
        else:
            assert fused["graph_break"] and "Observed exception" not in fused["unimplemented"], fused
        torch.testing.assert_close(fused["grads"], eager["grads"], atol=0.05, rtol=0.05)


SLEEPER = [sys.executable, "-c",
           "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(120)"]


def assert_gone(pid_file):
    with open(pid_file) as f:
        pid = int(f.read())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_every_worker_process_is_stopped_when_time_runs_out(tmp_path):
    pids = [str(tmp_path / "a.pid"), str(tmp_path / "b.pid")]
    logs = [str(tmp_path / "a.log"), str(tmp_path / "b.log")]
    started = time.monotonic()
    with pytest.raises(AssertionError, match="did not finish within 3 s"):
        run_processes([SLEEPER + [p] for p in pids], logs, timeout=3)
    assert time.monotonic() - started < 30
    for p in pids:
        assert_gone(p)


def test_a_failing_worker_stops_the_others_at_once(tmp_path):
    pid = str(tmp_path / "a.pid")
    commands = [SLEEPER + [pid], [sys.executable, "-c", "raise SystemExit('rank 1 failed')"]]
    logs = [str(tmp_path / "a.log"), str(tmp_path / "b.log")]
    started = time.monotonic()
    with pytest.raises(AssertionError, match="rank 1 failed"):
        run_processes(commands, logs, timeout=100)
    assert time.monotonic() - started < 30
    assert_gone(pid)
