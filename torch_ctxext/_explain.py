"""``torch_ctxext.explain``: why an entry of ``ctx.input_grad_buffers`` is None.

Two uses:

* inside a custom ``backward``, ``torch_ctxext.explain(ctx)`` returns one
  :class:`Reason` per argument passed to ``Function.apply``;
* around a backward, ``with torch_ctxext.explain() as report: loss.backward()``
  counts, per Function class, how many entries were exposed and how many fell
  back, and why.

The reasons come from the C++ extension (where torch_ctxext provides
input_grad_buffers: _releases.NATIVE_FROM), which walks the
engine's buffer slots with the same rule as the getter. On a torch that
provides ``input_grad_buffers`` natively (2.15) the extension is not loaded:
the reasons Python can see (not a tensor, does not require grad, not needed by
this backward, the same slot as another argument) are still given, the others
are reported as ``unknown`` with a sentence saying so.

While a ``with explain()`` block (or ``torch_ctxext.testing.check_function``)
is active, ``FunctionCtx.input_grad_buffers`` is replaced by a property that
wraps the original one; the original is put back when the last user exits.
"""
import collections
import contextlib
import os
import threading
import weakref
from dataclasses import dataclass, field

import torch
from torch.autograd.function import FunctionCtx

from . import _features, _releases

# The releases on which torch_ctxext provides input_grad_buffers: '2.6 to 2.14'.
_PROVIDED_ON = (
    f"{_releases.RELEASES[0].rsplit('.', 1)[0]} to "
    + max((r for r in _releases.RELEASES if not _releases.native("input_grad_buffers", r)),
          key=_releases.release).rsplit(".", 1)[0]
)

__all__ = ["explain", "Reason", "Explanation", "BufferReport", "FunctionBufferStats"]

# code -> (short label, sentence): every sentence explain() says. A code and
# its detail come from the extension (csrc/input_grad_buffers.cpp,
# explain_input_grad_buffers) or from Python (_python_reason, build_reasons);
# the placeholders are the detail's fields: {owners} (other owners of the
# gradient or its storage; {s} pluralizes), {argument} (the argument given the
# buffer), {refusal} (the error a read raises: the refusal's "message", the extension's
# own text), {version}.
_TEXT = {
    "exposed": (
        "exposed",
        "exposed: earlier producers' gradient is in the buffer; accumulate into "
        "it in place and return None for this input",
    ),
    "not_a_tensor": ("not a tensor argument", "None: not a tensor argument"),
    "no_gradient": ("does not require grad", "None: the input does not require grad"),
    "no_gradient_or_not_a_tensor": (
        "not a tensor argument or does not require grad",
        "None: not a tensor argument, or a tensor that does not require grad",
    ),
    "not_needed": (
        "not needed by this backward",
        "None: this backward does not compute the input's gradient (it is not "
        "among backward(inputs=...) / autograd.grad's inputs)",
    ),
    "no_earlier_producer": (
        "no earlier producer",
        "None: no earlier producer has contributed to the input's gradient yet "
        "(only consumers of the input created after this Function run before it)",
    ),
    "shared": (
        "shared with another tensor ({owners} other owner{s})",
        "None: the gradient is shared with another tensor ({owners} other owner{s}: "
        "add hands one gradient to both its inputs, a root gradient the caller "
        "still holds, or a buffer still held from an earlier read)",
    ),
    "storage_shared": (
        "shared with another tensor (its storage has {owners} other owner{s})",
        "None: the gradient's storage is shared with another tensor ({owners} other "
        "owner{s}: a view of one storage, e.g. the gradients stack or unbind produce)",
    ),
    "not_dense": (
        "not dense (expanded, overlapping)",
        "None: the gradient is not dense (expanded or overlapping, e.g. the "
        "expanded gradient of x.sum())",
    ),
    "subclass": ("a subclass", "None: the gradient is a tensor subclass"),
    "zero_tensor": ("a zero tensor", "None: the gradient is a zero tensor"),
    "nested": ("a nested tensor", "None: the gradient is a nested tensor"),
    "refused": (
        "refused (thread or stream)",
        "refused: reading ctx.input_grad_buffers raises here, because direct "
        "accumulation into this buffer would cross an engine thread or stream "
        "({refusal})",
    ),
    "later_producers_unvalidated": (
        "later producers cannot be validated",
        "None: producers that run later may use another engine thread or stream, "
        "and torch_ctxext could not place the engine hook that validates them on "
        "this torch build (it needs torch 2.10 or later)",
    ),
    "streams_unrecorded": (
        "accelerator buffer, streams not recorded (torch < 2.8)",
        "None: the gradient is on an accelerator, and before torch 2.8 the engine "
        "records no accumulation stream per buffer slot, so direct accumulation "
        "into it cannot be validated",
    ),
    "same_slot": (
        "same slot as argument {argument}",
        "None: the same gradient slot as argument {argument} (the same tensor passed "
        "twice, f(x, x)): only the first argument gets the buffer",
    ),
    "unknown": (
        "None (reason needs torch_ctxext's extension)",
        "None: no earlier producer, or the buffer is shared, not dense, a "
        "subclass, zero or nested tensor. torch_ctxext "
        f"tells which only with its C++ extension (torch {_PROVIDED_ON}); this torch "
        "({version}) provides input_grad_buffers natively and the extension is "
        "not loaded",
    ),
}


# Entries that are None because there is nothing to fuse, not a fallback.
NOT_APPLICABLE = frozenset(
    {"not_a_tensor", "no_gradient", "no_gradient_or_not_a_tensor", "not_needed"}
)

_HELD_NOTE = (
    " If you still hold a buffer you read from ctx.input_grad_buffers in this "
    "backward, that is one of the owners: call torch_ctxext.explain(ctx) before "
    "reading ctx.input_grad_buffers, or pass what you read as buffers=."
)


@dataclass(frozen=True)
class Reason:
    """Why entry ``index`` of ``ctx.input_grad_buffers`` is what it is."""

    index: int
    code: str
    text: str
    label: str
    owners: int | None = None  # other owners, for "shared" / "storage_shared"
    # What the text was phrased from: "owners", "argument" (same_slot), the
    # refusal's "kind" and what it compared (refused); {} for most codes.
    detail: dict = field(default_factory=dict, compare=False)

    @property
    def exposed(self):
        return self.code == "exposed"

    def __str__(self):
        return f"argument {self.index}: {self.text}"


class Explanation(tuple):
    """A tuple of :class:`Reason`, one per argument passed to ``apply``."""

    function = ""

    @property
    def codes(self):
        return tuple(r.code for r in self)

    def __str__(self):
        head = f"ctx.input_grad_buffers of {self.function}:" if self.function else (
            "ctx.input_grad_buffers:"
        )
        return "\n".join([head] + [f"  [{r.index}] {r.text}" for r in self])


def _reason(index, code, detail=None, note=""):
    """The Reason for argument ``index``: ``code``'s sentence, phrased from
    ``detail`` (see _TEXT)."""
    detail = dict(detail or {})
    label, text = _TEXT[code]
    owners = detail.get("owners")
    fmt = {
        **detail,
        "s": "" if owners == 1 else "s",
        "version": torch.__version__,
        "refusal": detail.get("message"),
    }
    return Reason(index, code, text.format(**fmt) + note, label.format(**fmt), owners, detail)


def _extension():
    """The C++ extension behind ``ctx.input_grad_buffers`` as installed now
    (this copy's, or that of the copy of torch_ctxext that installed it),
    else None. Never loads or builds one: explain(ctx) runs inside a user's
    backward, on an engine thread (_features.extension_behind)."""
    ext = _features.extension_behind("input_grad_buffers")
    if (ext is None and "input_grad_buffers" not in _features.UNAVAILABLE
            and _features.features()["input_grad_buffers"] == "torch_ctxext"):
        # Replaced by a wrapper that does not say what it wraps
        # (``__wrapped__``): the extension loaded for this copy, if any.
        ext = _features.loaded_extension()
    return ext


def function_name(ctx):
    cls = getattr(type(ctx), "_forward_cls", None)
    return (cls or type(ctx)).__qualname__


def _argument_slots(ctx, count):
    """For each argument, the (node, input_nr) its gradient goes to, or None.

    Tensors that require grad are the arguments whose ``needs_input_grad`` is
    True; they map, in order, onto the entries of ``next_functions`` that have
    a node (a tensor that does not require grad has an entry without one)."""
    needs = tuple(ctx.needs_input_grad)
    edges = [(node, nr) for node, nr in ctx.next_functions if node is not None]
    positions = [i for i in range(min(count, len(needs))) if needs[i]]
    slots = [None] * count
    if len(positions) == len(edges):
        for i, edge in zip(positions, edges):
            slots[i] = edge
    return slots


def _first_with_same_slot(slots, i):
    if slots[i] is None:
        return None
    node, nr = slots[i]
    for j in range(i):
        if slots[j] is not None and slots[j][0] is node and slots[j][1] == nr:
            return j
    return None


def _tensor_arguments(ctx):
    """For each argument passed to ``apply``: True (a tensor), False (not a
    tensor) or None (cannot be told), from ``needs_input_grad`` and
    ``next_functions`` alone.

    ``next_functions`` has one entry per tensor argument, in order, without a
    node for a tensor that does not require grad. The arguments that need a
    gradient (tensors with a node) split both sequences into runs: the
    arguments between two of them are all tensors where the entries between
    the two nodes are as many, none where there are none; in between, which
    are tensors cannot be told (``f(x, C, 3)``)."""
    needs = tuple(ctx.needs_input_grad)
    entries = [node is not None for node, _ in ctx.next_functions]
    result = [True if need else None for need in needs]
    argument_runs, entry_runs = [[]], [0]
    for i, need in enumerate(needs):
        if need:
            argument_runs.append([])
        else:
            argument_runs[-1].append(i)
    for has_node in entries:
        if has_node:
            entry_runs.append(0)
        else:
            entry_runs[-1] += 1
    if len(argument_runs) != len(entry_runs):  # not the layout described above
        return result
    for arguments, tensors in zip(argument_runs, entry_runs):
        if tensors == 0 or tensors == len(arguments):
            for i in arguments:
                result[i] = tensors > 0
    return result


def _python_reason(ctx, i, slots, tensor_arguments, slot_empty=None):
    """What Python alone can tell about a None entry (no extension).
    ``tensor_arguments``: :func:`_tensor_arguments`'s answer; ``slot_empty``
    (optional): for an argument's (node, input_nr), True where the caller saw
    that nothing has reached that slot yet in the running backward (then
    "no earlier producer"; ``advise`` watches the slots)."""
    needs = tuple(ctx.needs_input_grad)
    if i < len(needs) and not needs[i]:
        is_tensor = tensor_arguments[i]
        if is_tensor is None:
            return _reason(i, "no_gradient_or_not_a_tensor")
        return _reason(i, "no_gradient" if is_tensor else "not_a_tensor")
    if slots[i] is not None:
        try:
            will_run = torch._C._will_engine_execute_node(slots[i][0])
        except RuntimeError:  # a leaf during autograd.grad: cannot tell
            will_run = True
        if not will_run:
            return _reason(i, "not_needed")
        if slot_empty is not None and slot_empty(slots[i]):
            return _reason(i, "no_earlier_producer")
    return _reason(i, "unknown")


def _from_raw(i, raw, note=""):
    """The Reason for the extension's (code, detail) of argument ``i``."""
    code, detail = raw
    if code not in _TEXT:  # a code this module does not know
        text = f"None: {code} {detail}" if detail else f"None: {code}"
        return Reason(i, code, text, code, detail=dict(detail))
    return _reason(i, code, detail, note)


def build_reasons(ctx, buffers, raw, held_note=False, slot_empty=None):
    """Combine what was read (``buffers``, may be None), the extension's
    reasons taken before the read (``raw``, may be None) and what Python can
    see into one Explanation (``slot_empty``: see :func:`_python_reason`)."""
    count = len(buffers) if buffers is not None else len(raw)
    slots = _argument_slots(ctx, count)
    tensor_arguments = _tensor_arguments(ctx) if raw is None else None
    reasons = []
    for i in range(count):
        j = _first_with_same_slot(slots, i)
        if j is None:
            first_exposed = False
        elif buffers is not None:
            first_exposed = buffers[j] is not None
        else:  # before the read; or after it, the reader holding the buffer
            first_exposed = raw[j][0] == "exposed" or (held_note and raw[j][0] == "shared")
        if buffers is not None and buffers[i] is not None:
            reasons.append(_reason(i, "exposed"))
        elif first_exposed:
            reasons.append(_reason(i, "same_slot", {"argument": j}))
        elif raw is not None:
            note = _HELD_NOTE if held_note and raw[i][0] == "shared" else ""
            reasons.append(_from_raw(i, raw[i], note))
        else:
            reasons.append(_python_reason(ctx, i, slots, tensor_arguments, slot_empty))
    result = Explanation(reasons)
    result.function = function_name(ctx)
    return result


def explain(ctx=None, *, buffers=None):
    """Say why each entry of ``ctx.input_grad_buffers`` is None (or exposed).

    ``explain(ctx)``, inside a custom ``backward``: an :class:`Explanation`,
    one :class:`Reason` per argument passed to ``apply`` (``.code``,
    ``.text``, ``.exposed``; ``str()`` lists them). Call it before reading
    ``ctx.input_grad_buffers``, or pass the tuple you read as ``buffers=``: a
    buffer you still hold is an owner of the slot, and the slot then counts
    as shared. On a torch without torch_ctxext's extension (native 2.15),
    ``explain(ctx)`` reads ``ctx.input_grad_buffers`` itself (unless
    ``buffers`` is given; like any read that returns a buffer, that forbids a
    reentrant backward/grad call until this backward returns) and reports
    the reasons it cannot see as ``unknown``.

    ``explain()`` without a ctx: a context manager; every read of
    ``ctx.input_grad_buffers`` while it is active (any thread) is counted per
    Function class::

        with torch_ctxext.explain() as report:
            loss.backward()
        print(report)          # per Function: reads, exposed, fell back (why)
    """
    if ctx is None:
        if buffers is not None:
            raise TypeError("explain(): buffers= needs a ctx")
        return ExplainSession()
    if not issubclass(type(ctx), torch._C._FunctionBase):
        raise TypeError(
            "explain() expects the ctx of a custom autograd.Function (the object "
            f"its backward receives as ctx), but got {type(ctx).__qualname__}"
        )
    ext = _extension()
    if ext is not None:
        raw = ext.explain_input_grad_buffers(ctx)
        held = buffers is None and ext.exposed_in_running_task(ctx)
        return build_reasons(ctx, buffers, raw, held_note=held)
    if buffers is None:
        # See which entries are None: our read is not counted by observers.
        _internal.reading = True
        try:
            buffers = ctx.input_grad_buffers
        finally:
            _internal.reading = False
    return build_reasons(ctx, tuple(buffers), None)


# --- observing reads of ctx.input_grad_buffers --------------------------------

_lock = threading.RLock()
_internal = threading.local()  # .reading: explain(ctx) reads for itself
_reports = weakref.WeakSet()  # every BufferReport, for _renew_locks_after_fork


def _renew_locks_after_fork():
    """A fork() made while another thread held one of these locks (inside
    observe() or a report's record()) copies it held into the child, where
    no thread will release it: the child starts with fresh ones (as
    docs/reliability.md says of every lock torch_ctxext takes)."""
    global _lock
    _lock = threading.RLock()
    for report in list(_reports):
        report._lock = threading.Lock()


os.register_at_fork(after_in_child=_renew_locks_after_fork)
_observers = []  # [(callback, wants_reasons)]
# An advise() block is active (its engine.py sets it): the drop-ins run their
# Python Function, as while an observer is active, so that the reads of the
# backward it watches are seen (its observer is placed at that backward).
advising = False
# While observers are active: the property replaced, and the extension behind
# it (found when the first observer entered, on its thread), as one tuple.
_wrapped = None
_wrapper = None


def _observing(original):
    """The property that replaces ``original`` while observers are active.
    Its getter names the getter it wraps (``__wrapped__``), so that what
    provides the member is still found through it (_features.extension_behind),
    by this copy of torch_ctxext or another one."""

    def observed_get(ctx):
        return _observed_get(ctx)

    observed_get.__wrapped__ = original.fget
    return property(observed_get, doc=original.__doc__)


def _observed_get(ctx):
    observers = _observers  # replaced, never mutated: a consistent snapshot
    # A reader racing the last observer's exit finds the original restored.
    original, ext = _wrapped or (FunctionCtx.__dict__["input_grad_buffers"], None)
    raw = None
    if any(wants for _, wants in observers):
        if ext is not None:
            try:
                # Before the read: the tuple the getter returns will own the
                # exposed slots, and an explanation taken after would call
                # them shared.
                raw = ext.explain_input_grad_buffers(ctx)
            except RuntimeError:
                raw = None  # the getter below raises the same error
    result = original.fget(ctx)
    if getattr(_internal, "reading", False):
        return result
    for callback, _ in observers:
        callback(ctx, result, raw)
    return result


_known_extension = (None, None)  # (a member, the extension found behind it)


def _extension_of(member):
    """``_extension()`` while ``member`` is installed: an extension found
    behind a member stays behind it, so it is looked up once per member
    (advise() observes each block anew); None is asked again (an
    extension may be loaded since)."""
    global _known_extension
    known = _known_extension
    if known[0] is member and known[1] is not None:
        return known[1]
    ext = _extension()
    _known_extension = (member, ext)
    return ext


@contextlib.contextmanager
def observe(callback, wants_reasons=False):
    """Call ``callback(ctx, result, raw_reasons)`` after every read of
    ``ctx.input_grad_buffers`` while the block runs. ``result`` is the tuple
    handed to the reader: the callback must not keep it or its tensors."""
    global _observers, _wrapped, _wrapper
    entry = (callback, wants_reasons)
    with _lock:
        current = FunctionCtx.__dict__.get("input_grad_buffers")
        if current is None:
            raise RuntimeError(
                f"torch {torch.__version__} has no ctx.input_grad_buffers: import "
                f"torch_ctxext first (it provides it on torch {_PROVIDED_ON})"
            )
        if not _observers:
            _wrapped = (current, _extension_of(current))
            _wrapper = _observing(current)
            FunctionCtx.input_grad_buffers = _wrapper
        _observers = _observers + [entry]
    try:
        yield
    finally:
        with _lock:
            remaining = list(_observers)
            remaining.remove(entry)
            _observers = remaining
            if not remaining:
                if FunctionCtx.__dict__.get("input_grad_buffers") is _wrapper:
                    FunctionCtx.input_grad_buffers = _wrapped[0]
                _wrapped = _wrapper = None


# --- the context-manager report -----------------------------------------------


@dataclass
class FunctionBufferStats:
    """Reads of ``ctx.input_grad_buffers`` by one Function class."""

    function: str
    reads: int = 0
    exposed: int = 0
    fell_back: int = 0  # None for an input whose gradient is computed
    not_applicable: int = 0  # None: not a tensor, no grad, not needed
    reasons: collections.Counter = field(default_factory=collections.Counter)

    def add_read(self, reasons):
        """Count one read of ``ctx.input_grad_buffers`` and its reasons."""
        self.reads += 1
        for r in reasons:
            if r.exposed:
                self.exposed += 1
                continue
            if r.code in NOT_APPLICABLE:
                self.not_applicable += 1
            else:
                self.fell_back += 1
            self.reasons[r.label] += 1

    def __str__(self):
        line = (
            f"{self.function}: {self.reads} read(s), {self.exposed} exposed, "
            f"{self.fell_back} fell back"
        )
        if self.not_applicable:
            line += f", {self.not_applicable} not applicable"
        if self.reasons:
            why = "; ".join(f"{n} x {label}" for label, n in self.reasons.most_common())
            line += f" ({why})"
        return line


class BufferReport:
    """What ``with torch_ctxext.explain() as report`` collected."""

    def __init__(self):
        self._lock = threading.Lock()
        self.functions = {}  # qualname -> FunctionBufferStats
        _reports.add(self)

    def __getitem__(self, function):
        """Stats of a Function class (or its qualified name)."""
        key = function if isinstance(function, str) else function.__qualname__
        return self.functions[key]

    def __contains__(self, function):
        key = function if isinstance(function, str) else function.__qualname__
        return key in self.functions

    @property
    def exposed(self):
        return sum(s.exposed for s in self.functions.values())

    @property
    def fell_back(self):
        return sum(s.fell_back for s in self.functions.values())

    def record(self, name, reasons):
        with self._lock:
            stats = self.functions.get(name)
            if stats is None:
                stats = self.functions[name] = FunctionBufferStats(name)
            stats.add_read(reasons)

    def __str__(self):
        if not self.functions:
            return "input_grad_buffers: no Function read ctx.input_grad_buffers"
        lines = ["input_grad_buffers, per Function:"]
        lines += [f"  {s}" for s in self.functions.values()]
        return "\n".join(lines)

    __repr__ = __str__


class ExplainSession:
    """``with torch_ctxext.explain() as report:``; nested use is fine."""

    def __init__(self):
        self.report = BufferReport()
        self._cm = None

    def _record(self, ctx, result, raw):
        self.report.record(function_name(ctx), build_reasons(ctx, result, raw))

    def __enter__(self):
        if self._cm is not None:
            raise RuntimeError("this explain() block is already active")
        self._cm = observe(self._record, wants_reasons=True)
        self._cm.__enter__()
        return self.report

    def __exit__(self, *exc):
        cm, self._cm = self._cm, None
        return cm.__exit__(*exc)
