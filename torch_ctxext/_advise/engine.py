"""What ``advise()`` places while a block is active, and takes away after.

* ``torch.autograd._engine_run_backward`` (and ``torch.autograd.graph``'s,
  the one entry ``backward()``, ``Tensor.backward()`` and
  ``torch.autograd.grad`` share; torch's own ``make_fx`` patches the same
  two names): each backward is recorded by a :class:`graph.Backward`.
  Placed when the first active block enters, removed when the last exits.
* ``BackwardCFunction.apply`` / ``apply_boxed``, the methods the engine calls
  to run a custom Function's backward: what it returned, and whether it wrote
  into the buffers it was handed; and an observer of
  ``ctx.input_grad_buffers`` (``_explain.observe``): every read, with the
  reasons for ``None``. Placed at the first watched backward whose graph has
  a custom Function (a graph of built-in ops runs no Python in its backward,
  and setting a method of BackwardCFunction or FunctionCtx invalidates the
  method caches of each of their subclasses: one per custom Function class
  the process has), removed when the last block exits.

While a block is active, the drop-ins of :mod:`torch_ctxext.nn` run their
Python Function (``_explain.advising``), whose reads the observer sees. A
block that fails to observe a backward records why in its report instead of
raising into the training step.
"""
import gc
import threading

import torch
from torch.autograd.function import BackwardCFunction, FunctionCtx

from .. import _explain
from .graph import Backward

__all__ = ["enter", "exit"]

_lock = threading.RLock()
_sessions = []  # active sessions; replaced, never mutated: a consistent snapshot
_backwards = []  # backwards running now, likewise
_originals = {}
_observing = None  # the observe() context of the buffer reads
_functions_watched = False  # apply wrappers and observer placed (_watch_functions)
_calls = threading.local()  # .stack: the custom backward running on this thread


def enter(session):
    global _sessions
    with _lock:
        if not _sessions:
            _originals["run"] = torch.autograd.graph._engine_run_backward
            _originals["run_here"] = torch.autograd.__dict__.get("_engine_run_backward")
            torch.autograd.graph._engine_run_backward = _run_backward
            torch.autograd._engine_run_backward = _run_backward
            _explain.advising = True
        _sessions = _sessions + [session]


def _watch_functions():
    """Wrap BackwardCFunction's apply and observe ``ctx.input_grad_buffers``
    until the last block exits (a backward with a custom Function is about
    to run)."""
    global _observing, _functions_watched
    with _lock:
        if _functions_watched or not _sessions:
            return
        for name in ("apply", "apply_boxed"):
            if name in BackwardCFunction.__dict__:
                _originals[name] = BackwardCFunction.__dict__[name]
                setattr(BackwardCFunction, name, _WRAPPERS[name])
        if "input_grad_buffers" in FunctionCtx.__dict__:
            _observing = _explain.observe(_on_read, wants_reasons=True)
            _observing.__enter__()
        _functions_watched = True


def exit(session):
    global _sessions, _observing, _functions_watched
    with _lock:
        remaining = [s for s in _sessions if s is not session]
        _sessions = remaining
        if remaining:
            return
        _explain.advising = False
        if _functions_watched:
            _functions_watched = False
            if _observing is not None:
                observing, _observing = _observing, None
                observing.__exit__(None, None, None)
            for name in ("apply", "apply_boxed"):
                if name in _originals and BackwardCFunction.__dict__.get(name) is _WRAPPERS[name]:
                    setattr(BackwardCFunction, name, _originals.pop(name))
        # Put back only what is still ours (another patch on top stays).
        if torch.autograd.graph._engine_run_backward is _run_backward:
            torch.autograd.graph._engine_run_backward = _originals["run"]
        if torch.autograd.__dict__.get("_engine_run_backward") is _run_backward:
            torch.autograd._engine_run_backward = _originals["run_here"]


class _no_collection:
    """No cyclic collection while advise walks the graph or files a record.

    Its bookkeeping (the graph's edges, per-slot records) is thousands of
    short-lived containers freed by reference counting: collections
    triggered in the middle of it would promote them to the oldest
    generation, whose full collections then come every few steps and cost
    tens of milliseconds in a process that has imported a model library.
    The collector is re-enabled as it was, and only by the block that
    disabled it. (A class, not a generator: it is entered twice a backward.)"""

    __slots__ = ("enabled",)

    def __enter__(self):
        self.enabled = gc.isenabled()
        if self.enabled:
            gc.disable()

    def __exit__(self, *exc):
        if self.enabled:
            gc.enable()
        return False


def _run_backward(t_outputs, *args, **kwargs):
    global _backwards
    sessions = _sessions
    run = _originals["run"]
    record = None
    if sessions:
        try:
            grad_tensors = args[0] if args else kwargs.get("grad_tensors")
            create_graph = args[2] if len(args) > 2 else kwargs.get("create_graph", False)
            inputs = args[3] if len(args) > 3 else kwargs.get("inputs", ())
            with _no_collection():
                record = Backward(t_outputs, grad_tensors, inputs, create_graph,
                                  shaped=any(session.model is not None for session in sessions))
        except Exception as error:  # never into the training step
            for session in sessions:
                session.failed(error)
            record = None
        if not _functions_watched and (record is None or record.custom_functions):
            _watch_functions()
    if record is None:
        return run(t_outputs, *args, **kwargs)
    if record.slotless:
        # No slot and no custom Function (a plain model's backward, each of
        # a gradient accumulation's): no hook was placed and nothing will
        # reach it, so there is nothing to read back, list or release; the
        # blocks count it and close its forward.
        try:
            return run(t_outputs, *args, **kwargs)
        finally:
            for session in sessions:
                try:
                    session.add(record)
                except Exception as error:  # never into the training step
                    session.failed(error)
    # Listed for the apply wrapper and the buffer reads' observer, which ask
    # only a backward with a custom Function.
    listed = record.custom_functions
    if listed:
        with _lock:
            _backwards = _backwards + [record]
    try:
        return run(t_outputs, *args, **kwargs)
    finally:
        with _no_collection():
            try:
                record.finish()
                for session in sessions:
                    try:
                        session.add(record)
                    except Exception as error:  # never into the training step
                        session.failed(error)
            finally:
                if listed:
                    with _lock:
                        _backwards = [b for b in _backwards if b is not record]
                record.release()
            # Its slots, producers and arrivals freed before the collector is
            # back: a collection triggered as it comes back would otherwise
            # move them, dead a moment later, into an older generation.
            record = None


class _Call:
    """One custom backward running: the buffers it was handed (held only
    until it returns) and their versions when handed out."""

    __slots__ = ("ctx", "exposed")

    def __init__(self, ctx):
        self.ctx = ctx
        self.exposed = {}

    def written(self):
        """argument index -> whether the buffer handed out was written."""
        written = {i: buffer._version != version for i, (buffer, version) in self.exposed.items()}
        self.exposed = {}
        return written


def _call_backward(original, ctx, args):
    if not _sessions:
        return original(ctx, *args)
    stack = getattr(_calls, "stack", None)
    if stack is None:
        stack = _calls.stack = []
    call = _Call(ctx)
    stack.append(call)
    try:
        returned = original(ctx, *args)
    finally:
        stack.pop()
        written = call.written()
    grads = returned if isinstance(returned, tuple) else (
        tuple(returned) if isinstance(returned, list) else (returned,)
    )
    try:
        name = _explain.function_name(ctx)
        for session in _sessions:
            session.function_returned(name, grads, written)
        for record in _backwards:
            record.function_returned(ctx, grads, written)
    except Exception as error:  # never into the training step
        for session in _sessions:
            session.failed(error)
    return returned


def _apply(self, *args):
    return _call_backward(_originals["apply"], self, args)


def _apply_boxed(self, *args):
    return _call_backward(_originals["apply_boxed"], self, args)


_WRAPPERS = {"apply": _apply, "apply_boxed": _apply_boxed}


def _on_read(ctx, result, raw):
    """Every read of ctx.input_grad_buffers while a block is active."""
    try:
        # Without the extension (native 2.15), what the watch saw tells more.
        reasons = _explain.build_reasons(ctx, result, raw, slot_empty=lambda edge: _slot_empty(ctx, edge))
        stack = getattr(_calls, "stack", None)
        if stack and stack[-1].ctx is ctx:
            for i, buffer in enumerate(result):
                if buffer is not None and i not in stack[-1].exposed:
                    stack[-1].exposed[i] = (buffer, buffer._version)
        for session in _sessions:
            session.function_read(reasons.function, reasons)
    except Exception as error:
        for session in _sessions:
            session.failed(error)


def _slot_empty(ctx, edge):
    """Whether nothing has reached the slot ``edge`` (node, input_nr) of the
    custom Function ``ctx`` yet, in the watched backward ``ctx`` belongs to
    (its buffer is then empty: "no earlier producer"); False where no
    watched backward holds ``ctx``."""
    for record in _backwards:
        empty = record.nothing_arrived(ctx, edge)
        if empty is not None:
            return empty
    return False
