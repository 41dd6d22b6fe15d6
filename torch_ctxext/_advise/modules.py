"""Which module made each autograd node, and what each parameter is called.

A node's sequence number is taken from a per-thread counter when the node is
created, so the nodes a module's call creates are exactly those numbered
from the counter's value when the call starts up to (not including) its
value when it ends. The wrapper of ``__call__`` below (placed on the
model's module classes while a block is active) reads the counter at both ends
(``torch._C._autograd._get_sequence_nr()``, which reads it without creating
a node; where a release lacks it, by creating one throwaway node) and keep
the interval; a node is attributed to the innermost call whose interval
holds its number. Node numbers only ever grow, so reading them changes no
order the engine sees.
"""
import bisect
import operator
import threading

import torch

__all__ = ["ModuleCalls", "ParameterNames", "named_modules"]

_probe = threading.local()
_first = operator.itemgetter(0)
_UNKNOWN = object()
KEPT_FORWARDS = 8  # forwards whose module calls a block keeps (ModuleCalls._close_forward)
_peek = getattr(torch._C._autograd, "_get_sequence_nr", None)


def _probe_counter():
    """The next sequence number, by creating a throwaway node: the number
    after the probe's own (which no other node has)."""
    leaf = getattr(_probe, "leaf", None)
    if leaf is None:
        leaf = _probe.leaf = torch.zeros((), requires_grad=True)
    return leaf.view(()).grad_fn._sequence_nr() + 1


def _counter():
    """The next sequence number of this thread, or None when no node would
    be created (grad mode off) or it cannot be read (a tracer, a mode)."""
    if not torch.is_grad_enabled():
        return None
    try:
        return _peek() if _peek is not None else _probe_counter()
    except Exception:  # under torch.compile's tracer, a dispatch mode, ...
        return None


# The model's module calls are timed by a wrapper of ``__call__`` placed, while
# a block is active, on each class the model's modules have (``Linear``,
# ``LSTMCell``, the model's own...), shared by the active blocks. Global
# forward hooks (torch.nn.modules.module.register_module_forward_hook) did the
# same, but they send every module call, in the model or not, down the slow
# path of Module._call_impl: 7 to 9 us a call on the unrolled LSTMCell (34
# calls, 0.3 ms of a 9 ms forward) before the hooks themselves. Wrapping
# torch.nn.Module.__call__ itself instead costs 40 to 80 us at each block's
# entry and exit (setting an attribute of a class invalidates the method
# caches of all its subclasses: hundreds for nn.Module); one of a leaf class
# such as Linear, under 1 us. A class that has a __call__ of its own between
# it and nn.Module (torch.compile's OptimizedModule) is left alone: its
# modules get a pair of forward hooks of their own.
_active = ()  # the ModuleCalls of the active blocks; replaced, never mutated
_patch_lock = threading.Lock()
_wrapped = {}  # class -> how many active blocks time it (under _patch_lock)


def _timed_call(self, *args, **kwargs):
    """``__call__`` of a wrapped class while a block is active: a call of a
    module of a watched model is filed with the counter's value before and
    after it (then torch.nn.Module.__call__ runs as it would have). A call
    that raises is not filed; under torch.compile's tracer nothing is."""
    active = _active
    for calls in active:
        if id(self) in calls.timed:
            break
    else:
        return torch.nn.Module.__call__(self, *args, **kwargs)
    if torch.compiler.is_compiling():
        return torch.nn.Module.__call__(self, *args, **kwargs)
    start = _counter()
    result = torch.nn.Module.__call__(self, *args, **kwargs)
    end = _counter()
    for calls in active:
        if id(self) in calls.timed:
            calls.filed(start, end, self)
    return result


def _wrappable(cls):
    """Whether ``cls`` calls torch.nn.Module.__call__ (no class between them
    has a __call__ of its own, but the wrapper)."""
    for klass in cls.__mro__:
        if klass is torch.nn.Module:
            return True
        own = klass.__dict__.get("__call__")
        if own is not None and own is not _timed_call:
            return False
    return False


def named_modules(model):
    """``model.named_modules(remove_duplicate=False)`` as a list, in its
    order (each module before its children, each path of a shared one),
    read from each module's ``_modules`` without its recursive generators:
    advise() walks the model as each block enters."""
    out = []
    stack = [("", model)]
    while stack:
        path, module = stack.pop()
        out.append((path, module))
        children = module.__dict__.get("_modules")
        if children:
            prefix = f"{path}." if path else ""
            stack.extend(reversed([(prefix + name, child) for name, child in children.items() if child is not None]))
    return out


class ModuleCalls:
    """The calls of every module of a model, timed while a block is active
    (``install``/``remove``): the interval of sequence numbers of each call,
    and ``attribute_all(seqs)``: (path, module, call) of the innermost call
    that created each node numbered in ``seqs``, or None.

    ``call`` counts from 1, per module, within one forward: the calls filed
    since the last backward was attributed (None where the module ran once
    in it). A block kept open over many steps so names each step's calls as
    the first step's, and its report has one row per tensor, not one per
    tensor per step."""

    def __init__(self, model, modules):
        self.model = model
        self.paths = {}
        self._modules = {}
        # ``modules``: model.named_modules(remove_duplicate=False), which
        # ParameterNames reads too; a module's first path is its name.
        for path, module in modules:
            self.paths.setdefault(id(module), path)
            self._modules[id(module)] = module
        self._new = []  # (start, end, module) of the calls filed since the last forward was closed
        # The last forwards' calls, oldest first, each (start, end, path,
        # module, call, counts) in the order filed (counts: id(module) ->
        # calls of it in that forward), with the highest end among them.
        self._kept = []
        self._intervals = None  # all kept calls, sorted (_sorted), or None: not yet
        self._start_values = []  # their starts
        self.forward = ()  # the calls of the last forward closed, as filed
        self.forward_start = None  # the lowest start among them
        self.before_forward = None  # the highest end of the kept calls before them
        self._lock = threading.Lock()
        self.timed = {}  # id(module) -> path, of the modules the wrapper times (hooks time the others)
        self._classes = ()  # the classes this block wrapped (or joined)
        self._handles = []  # the hooks of modules whose class it could not wrap
        self._open = threading.local()  # their calls under way, per thread

    def install(self):
        """Time this model's calls: wrap the __call__ of its modules' classes
        (joining the blocks that wrap them already); hooks on the modules
        whose class cannot be."""
        global _active
        classes = {type(module) for module in self._modules.values()}
        wrappable = {cls for cls in classes if _wrappable(cls)}
        with _patch_lock:
            for cls in wrappable:
                if not _wrapped.get(cls) and cls.__dict__.get("__call__") is not _timed_call:
                    cls.__call__ = _timed_call
                _wrapped[cls] = _wrapped.get(cls, 0) + 1
            self._classes = tuple(wrappable)
            self.timed = {i: self.paths[i] for i, module in self._modules.items() if type(module) in wrappable}
            _active = _active + (self,)
        for i, module in self._modules.items():
            if i not in self.timed:  # (its own __call__ may reach a wrapped one: not timed twice)
                self._handles.append(module.register_forward_pre_hook(self._pre))
                self._handles.append(module.register_forward_hook(self._post))

    def remove(self):
        """Stop timing; the last block that wraps a class unwraps it, unless
        another patch of its __call__ went on top (it then stays)."""
        global _active
        with _patch_lock:
            _active = tuple(calls for calls in _active if calls is not self)
            for cls in self._classes:
                _wrapped[cls] -= 1
                if not _wrapped[cls]:
                    del _wrapped[cls]
                    if cls.__dict__.get("__call__") is _timed_call:
                        del cls.__call__
            self._classes = ()
            self.timed = {}
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def filed(self, start, end, module):
        with self._lock:
            # Numbered when the next backward is observed (after the
            # forwards), sorted only if it is described: not per call.
            self._new.append((start, end, module))

    def _pre(self, module, args):
        stack = getattr(self._open, "stack", None)
        if stack is None:
            stack = self._open.stack = []
        stack.append((module, _counter()))

    def _post(self, module, args, output):
        stack = getattr(self._open, "stack", [])
        while stack and stack[-1][0] is not module:  # a forward that raised
            stack.pop()
        if stack:
            self.filed(stack.pop()[1], _counter(), module)

    def seen(self):
        """(module calls filed since the last backward was attributed, how
        many of them ran with gradients on): what a block that observed
        no backward tells its user it saw (Advise._why_no_backward)."""
        with self._lock:
            calls = list(self._new)
        return len(calls), sum(1 for start, _, _ in calls if start is not None)

    def _close_forward(self):
        """Number the calls filed since the last forward was closed (per
        module, in the order they returned) and keep them as this forward's;
        a block keeps its last KEPT_FORWARDS forwards only (a graph older
        than that is named by its ops alone), so what it holds stays bounded
        however long it runs. Sorting them for attribution waits until a
        backward is described (``attribute_all``): a described graph that
        repeats needs none."""
        counts = {}  # this forward's calls per module, read at attribution
        forward = []
        for start, end, module in self._new:
            call = counts[id(module)] = counts.get(id(module), 0) + 1
            if start is not None and end is not None:
                forward.append((start, end, self.paths.get(id(module), "?"), module, call, counts))
        self._new = []
        self.before_forward = max((end for _, end in self._kept), default=None)
        self.forward = tuple(forward)
        self.forward_start = min((interval[0] for interval in forward), default=None)
        if forward:
            self._kept.append((self.forward, max(interval[1] for interval in forward)))
            del self._kept[:-KEPT_FORWARDS]
            self._intervals = None

    def _sorted(self):
        """The kept calls sorted by (start, -end, -order): an outer call of
        the same interval sorts before the inner one, which returned first;
        and their starts, as plain ints for bisect."""
        if self._intervals is None:
            keyed = []
            for forward, _ in self._kept:
                for interval in forward:
                    keyed.append(((interval[0], -interval[1], -len(keyed)), interval))
            keyed.sort(key=_first)
            self._intervals = [interval for _, interval in keyed]
            self._start_values = [interval[0] for interval in self._intervals]
        return self._start_values, self._intervals

    def sorted_forward(self):
        """The module calls of the last forward (those filed since the
        previous one was closed; it is closed now), as
        (start, end, path, module, call, counts), the lowest start among
        them, and the highest end of the calls before it (None: there were
        none)."""
        with self._lock:
            if self._new:
                self._close_forward()
            return self.forward, self.forward_start, self.before_forward

    def attribute_all(self, seqs):
        """(path, module, call) of the innermost call that created the node
        numbered ``seq``, for each sequence number (None for a number no
        call holds, and for None)."""
        found = []
        with self._lock:
            if self._new:
                self._close_forward()
            starts, intervals = self._sorted()
            # A node that produces for several slots is asked once (the
            # number None, of a root or a leaf, belongs to no call).
            known = {None: None}
            for seq in seqs:
                where = known.get(seq, _UNKNOWN)
                if where is _UNKNOWN:
                    where = None
                    i = bisect.bisect_right(starts, seq)
                    # Intervals nest: going back from the last one that starts at or
                    # before seq, the first that has not ended yet is the innermost.
                    while i > 0:
                        i -= 1
                        start, end, path, module, call, counts = intervals[i]
                        if seq < end:
                            where = (path, module, call if counts[id(module)] > 1 else None)
                            break
                    known[seq] = where
                found.append(where)
        return found

    def path_name(self, path):
        """A module path as the report shows it: the model itself by its class."""
        return path or type(self.model).__name__


class ParameterNames:
    """Parameter (and buffer) tensors of a model by identity: their name, the
    other names a tied one has, and the modules that hold them directly."""

    def __init__(self, modules):
        """``modules``: the model's named_modules(remove_duplicate=False)."""
        # A module's own parameters are its ``_parameters`` (what
        # named_parameters(recurse=False, remove_duplicate=False) yields,
        # without its generators: this runs as each block enters).
        self.names = names = {}
        self.owners = owners = {}
        for module_path, module in modules:
            parameters = module.__dict__.get("_parameters")
            if not parameters:
                continue
            prefix = f"{module_path}." if module_path else ""
            for name, p in parameters.items():
                if p is None:
                    continue
                full = prefix + name
                found = names.get(id(p))
                if found is None:
                    names[id(p)] = [full]
                    owners[id(p)] = [module]
                    continue
                if full not in found:
                    found.append(full)
                held = owners[id(p)]
                if all(m is not module for m in held):
                    held.append(module)

    def name(self, tensor):
        names = self.names.get(id(tensor))
        return names[0] if names else None

    def attribute(self, tensor, module_path):
        """``tensor`` as the forward of the module at ``module_path`` reads
        it: ``self.embed.weight`` (its first name under that module)."""
        names = self.names.get(id(tensor), [])
        prefix = f"{module_path}." if module_path else ""
        name = next((n for n in names if n.startswith(prefix)), names[0] if names else "?")
        return "self." + (name[len(prefix):] if name.startswith(prefix) else name)

    def tied(self, tensor):
        return self.names.get(id(tensor), [])[1:]

    def owned_by(self, tensor, module, below=False):
        """Whether ``module`` holds ``tensor`` directly (``below``: or one
        of its submodules does)."""
        owners = self.owners.get(id(tensor), [])
        if any(m is module for m in owners):
            return True
        return below and any(m is sub for sub in module.modules() for m in owners)
