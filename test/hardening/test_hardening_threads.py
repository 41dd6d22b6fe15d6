"""Every feature of the ctx contract from many threads at once.

8 threads each run 500 backward passes through a Function that fuses its
gradient into ``ctx.input_grad_buffers``, declares its output's gradient dtype
with ``ctx.set_output_grad_dtype`` and receives its grads boxed
(``boxed_grads_call = True``), all at the same time. Every gradient must be
exact (the values are small integers, exactly representable), the fused path
must actually have been taken, and no thread may see another's buffer,
declaration or error.

Runs on torch 2.13 + torch_ctxext and on native torch 2.15 alike.
"""
import json
import os
import signal
import sys
import threading
import time

import pytest
import torch
from torch.autograd import Function

import torch_ctxext  # noqa: F401
from doubling_functions import doubling
from torch.autograd.variable import Variable
from support import TESTS, python, reap

HAS_BOXED_GRADS = hasattr(torch.autograd.function.BackwardCFunction, "apply_boxed")

N_THREADS = 8
N_PASSES = 500


class FusedScale(Function):
    """y = x * w (float32 out), gradient received in float64, boxed; the
    gradient of x is accumulated into the engine's buffer when one is exposed."""

    boxed_grads_call = True

    @staticmethod
    def forward(ctx, x, w, tag):
        ctx.save_for_backward(w)
        ctx.tag = tag
        ctx.set_output_grad_dtype(torch.float64)
        return x * w

    @staticmethod
    def backward(ctx, grads):
        assert isinstance(grads, list), type(grads)
        (g,) = grads
        grads.clear()  # boxed: the engine's references are released here
        if g.dtype != torch.float64:
            raise AssertionError(f"declared float64, got {g.dtype}")
        (w,) = ctx.saved_tensors
        x_buffer, w_buffer, tag_buffer = ctx.input_grad_buffers
        assert tag_buffer is None and w_buffer is None
        grad_x = (g * w).float()
        ctx.tag["fused"] += x_buffer is not None
        if x_buffer is not None:
            x_buffer.add_(grad_x)
            grad_x = None
        return grad_x, None, None


class Nested(Function):
    """Declares float64 for its second output and applies FusedScale inside its
    own forward (no graph there, but the per-thread apply state must keep the
    two declarations apart); fuses its own gradient of x as well."""

    @staticmethod
    def forward(ctx, x, w, tag):
        ctx.set_output_grad_dtype(None, torch.float64)
        ctx.save_for_backward(w)
        ctx.tag = tag
        inner = FusedScale.apply(x, w, tag)
        return inner, x * 2

    @staticmethod
    def backward(ctx, g_inner, g_twice):
        if g_inner.dtype != torch.float32 or g_twice.dtype != torch.float64:
            raise AssertionError(f"declared (None, float64), got {g_inner.dtype}, {g_twice.dtype}")
        (w,) = ctx.saved_tensors
        x_buffer, _, _ = ctx.input_grad_buffers
        grad_x = g_inner * w + (g_twice * 2).float()
        ctx.tag["fused"] += x_buffer is not None
        if x_buffer is not None:
            x_buffer.add_(grad_x)
            grad_x = None
        return grad_x, None, None


def run_interleaved(target, n, timeout):
    """Run ``target(i)`` for i < n in n threads, switching between them often
    so that their passes really interleave; assert that none hung."""
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        threads = [threading.Thread(target=target, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=timeout)
        assert not any(t.is_alive() for t in threads), "a thread hung"
    finally:
        sys.setswitchinterval(old_interval)


def one_thread(index, errors, fused_counts, barrier, passes=N_PASSES):
    try:
        tag = {"fused": 0}
        # Values that differ per thread: a gradient from the wrong thread's
        # graph shows up as a wrong number.
        base = float(index + 1)
        w = torch.tensor([base, base + 1.0], requires_grad=True)
        barrier.wait()
        for step in range(passes):
            x = torch.tensor([1.0, 2.0], requires_grad=True)
            k = float(step % 7 + 1)
            # x * k is created after FusedScale, so its backward runs first and
            # its gradient waits in x's buffer when FusedScale.backward runs.
            if step % 2 == 0:
                y = FusedScale.apply(x, w.detach(), tag)
                loss = y.sum() + (x * k).sum()
                expected = w.detach() + k
            else:
                y, twice = Nested.apply(x, w.detach(), tag)
                loss = y.sum() + twice.sum() + (x * k).sum()
                expected = w.detach() + 2.0 + k
            if step % 3 == 0:
                (grad_x,) = torch.autograd.grad(loss, (x,))
            else:
                loss.backward()
                grad_x = x.grad
            if not torch.equal(grad_x, expected):
                raise AssertionError(
                    f"thread {index} step {step}: {grad_x.tolist()} != {expected.tolist()}"
                )
        fused_counts[index] = tag["fused"]
    except BaseException as e:  # reported by the main thread
        errors.append((index, e))
        barrier.abort()


@pytest.mark.skipif(not HAS_BOXED_GRADS, reason="this torch has no boxed_grads_call")
def test_eight_threads_fuse_declare_and_box_at_once():
    errors, fused_counts = [], [None] * N_THREADS
    barrier = threading.Barrier(N_THREADS)
    start = time.perf_counter()
    run_interleaved(lambda i: one_thread(i, errors, fused_counts, barrier), N_THREADS, timeout=120)
    elapsed = time.perf_counter() - start
    assert not errors, errors[0]
    # The fused path was taken in every pass of every thread.
    assert fused_counts == [N_PASSES] * N_THREADS, fused_counts
    print(f"{N_THREADS} x {N_PASSES} passes in {elapsed:.2f} s")


N_FORKS = 15
CHILD_BOUND_S = 20


@pytest.mark.skipif(not HAS_BOXED_GRADS, reason="this torch has no boxed_grads_call")
def fork_while_threads_train():
    """The main thread forks N_FORKS children while 4 threads train; each
    child runs passes of the same workload. Returns (the threads' errors,
    each child's exit code or "hung")."""
    # torch's first backward initialises process-wide state (on a CUDA
    # build, the device count: a function-local static); a fork while a
    # thread is inside that first initialisation would leave its guard held
    # in the child (test_hardening_fork.py): settled before the threads start.
    warm = torch.ones(1, requires_grad=True)
    (warm * 2).sum().backward()
    n_threads = 4
    errors, fused_counts = [], [None] * n_threads
    barrier = threading.Barrier(n_threads + 1)
    threads = [
        threading.Thread(target=one_thread, args=(i, errors, fused_counts, barrier))
        for i in range(n_threads)
    ]
    for t in threads:
        t.start()
    barrier.wait()
    outcomes = []
    for _ in range(N_FORKS):
        time.sleep(0.02)
        pid = os.fork()
        if pid == 0:
            child_errors, child_counts = [], [None]
            try:
                one_thread(0, child_errors, child_counts, threading.Barrier(1), passes=6)
                for _, e in child_errors:
                    print(f"child: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            finally:
                os._exit(0 if not child_errors and child_counts == [6] else 1)
        code = reap(pid, timeout=CHILD_BOUND_S)
        outcomes.append("hung" if code == -signal.SIGKILL else code)
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return [repr(e) for _, e in errors], outcomes


def test_children_forked_while_threads_train_run_every_feature():
    # A fork() while other threads are inside the engine (the main thread
    # starting fork-based workers while threads train) must leave no lock of
    # torch_ctxext held in the child (csrc/fork_safety.h): each child runs
    # passes of the same workload and must finish within the bound.
    # test_hardening_fork.py forks inside each lock deterministically; this
    # forks wherever the threads happen to be.
    #
    # In a process of its own: whether a forked child may run backward at
    # all is torch's state, not ours. On torch 2.14 and 2.15 (PyPI's CUDA
    # builds, no GPU), a torch.compile before the process's first backward
    # makes the engine refuse backward in every child forked afterwards
    # ("Unable to handle autograd's threading in combination with fork-based
    # multiprocessing"), torch_ctxext imported or not; test/ runs
    # test_hardening_compile.py first in the same process.
    code = (
        "import json, test_hardening_threads as t\n"
        "print(json.dumps(t.fork_while_threads_train()))\n"
    )
    here = os.path.dirname(os.path.abspath(__file__))
    done = python(code=code, path=[here, TESTS], cwd=here, timeout=N_FORKS * CHILD_BOUND_S + 300)
    assert done.returncode == 0, done.stderr[-3000:]
    errors, outcomes = json.loads(done.stdout.splitlines()[-1])
    assert not errors, errors[0]
    assert outcomes == [0] * N_FORKS, (outcomes, done.stderr[-3000:])


def test_buffers_are_per_thread_and_per_graph_task():
    """Two threads blocked inside their own backward at the same moment each
    see their own buffer (never the other thread's)."""
    both_inside = threading.Barrier(2, timeout=30)
    seen = {}

    class Probe(Function):
        @staticmethod
        def forward(ctx, x, name):
            ctx.name = name
            return x * 1

        @staticmethod
        def backward(ctx, g):
            (buffer, _) = ctx.input_grad_buffers
            both_inside.wait()  # the other thread is inside its backward too
            seen[ctx.name] = buffer.clone()
            buffer.add_(g)
            both_inside.wait()
            return None, None

    def run(name, value, out):
        x = torch.full((3,), value, requires_grad=True)
        (Probe.apply(x, name).sum() + (x * value).sum()).backward()
        out[name] = x.grad

    grads = {}
    threads = [
        threading.Thread(target=run, args=(n, v, grads)) for n, v in (("a", 2.0), ("b", 5.0))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert torch.equal(seen["a"], torch.full((3,), 2.0))
    assert torch.equal(seen["b"], torch.full((3,), 5.0))
    assert torch.equal(grads["a"], torch.full((3,), 3.0))
    assert torch.equal(grads["b"], torch.full((3,), 6.0))


def test_declaration_in_one_thread_does_not_leak_into_anothers_apply():
    """While thread A is inside forward (after declaring), thread B applies a
    Function that declares nothing: B's gradient keeps its own dtype and A's
    declaration still applies to A."""
    a_declared = threading.Event()
    b_done = threading.Event()
    dtypes = {}

    def declare_then_wait_for_b(ctx):
        ctx.set_output_grad_dtype(torch.float64)
        a_declared.set()
        assert b_done.wait(30)

    def backward_a(ctx, g):
        dtypes["a"] = g.dtype
        return g.float() * 2

    A = doubling(backward_a, in_forward=declare_then_wait_for_b)

    class B(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 3

        @staticmethod
        def backward(ctx, g):
            dtypes["b"] = g.dtype
            return g * 3

    def thread_b():
        assert a_declared.wait(30)
        B.apply(torch.ones(2, requires_grad=True)).sum().backward()
        b_done.set()

    t = threading.Thread(target=thread_b)
    t.start()
    A.apply(torch.ones(2, requires_grad=True)).sum().backward()
    t.join(30)
    assert dtypes == {"a": torch.float64, "b": torch.float32}


class Refusals(Function):
    """y = 2x whose backward, depending on ``mode``, exercises one refusal of
    ctx.input_grad_buffers and records what happened in ``log``."""

    @staticmethod
    def forward(ctx, x, mode, log):
        ctx.mode, ctx.log = mode, log
        return x * 2

    @staticmethod
    def backward(ctx, g):
        mode, log = ctx.mode, ctx.log
        if mode == "reentrant":
            exposed = ctx.input_grad_buffers[0] is not None
            q = torch.ones(1, requires_grad=True)
            try:
                with torch.enable_grad():
                    torch.autograd.grad((q * 2).sum(), [q])
                log.append(("reentrant", exposed, "no error"))
            except RuntimeError as e:
                log.append(("reentrant", exposed, str(e)[:30]))
        elif mode == "no_grad_under_create_graph":
            with torch.no_grad():
                try:
                    ctx.input_grad_buffers
                    log.append((mode, "no error"))
                except RuntimeError as e:
                    log.append((mode, str(e)))
        elif mode == "post_processing":
            outer = ctx

            def read_outer():
                try:
                    outer.input_grad_buffers
                    log.append((mode, "no error"))
                except RuntimeError as e:
                    log.append((mode, str(e)))

            class Inner(Function):
                @staticmethod
                def forward(ictx, q):
                    return q * 2

                @staticmethod
                def backward(ictx, h):
                    Variable._execution_engine.queue_callback(read_outer)
                    return h * 2

            q = torch.ones(2, requires_grad=True)
            with torch.enable_grad():
                Inner.apply(q).sum().backward()
        return g * 2, None, None


def test_the_refusals_hold_from_several_threads_at_once():
    """8 threads each run, 60 times, a backward that reads a buffer and calls
    grad() (refused), one that reads it under no_grad with create_graph
    (refused), and one whose inner backward's final callback reads the outer
    ctx (refused, not a hang)."""
    logs = [[] for _ in range(N_THREADS)]
    errors = []
    barrier = threading.Barrier(N_THREADS)

    def run(index):
        try:
            barrier.wait()
            for _ in range(60):
                x = torch.ones(2, requires_grad=True)
                (Refusals.apply(x, "reentrant", logs[index]).sum() + (x * 3).sum()).backward()
                x = torch.ones(2, requires_grad=True)
                loss = Refusals.apply(x, "no_grad_under_create_graph", logs[index]).sum() + (x * 3).sum()
                torch.autograd.grad(loss, [x], create_graph=True)
                x = torch.ones(2, requires_grad=True)
                Refusals.apply(x, "post_processing", logs[index]).sum().backward()
        except BaseException as e:  # reported below
            errors.append((index, e))

    run_interleaved(run, N_THREADS, timeout=240)
    assert not errors, errors[0]
    expected = [
        ("reentrant", True, "Calling backward or grad reent"),
        ("no_grad_under_create_graph", "input_grad_buffers does not support create_graph=True"),
        ("post_processing", "input_grad_buffers cannot be accessed during backward post-processing"),
    ] * 60
    assert logs == [expected] * N_THREADS
