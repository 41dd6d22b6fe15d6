"""Which module made each autograd node, and what each parameter is called.

A node's sequence number is taken from a per-thread counter when the node is
created, so the nodes a module's call creates are exactly those numbered
from the counter's value when the call starts up to (not including) its
value when it ends. The wrapper of ``_call_impl`` below (placed on the
model's module classes while a block is active) reads the counter at both ends
(``torch._C._autograd._get_sequence_nr()``, which reads it without creating
a node; where a release lacks it, by creating one throwaway node) and keep
the interval; a node is attributed to the innermost call whose interval
holds its number. Node numbers only ever grow, so reading them changes no
order the engine sees.
"""
import bisect
import functools
import operator
import threading
import weakref

import torch

__all__ = ["ByModel", "ModelView", "ModuleCalls", "ParameterNames", "named_modules", "view_of"]

_probe = threading.local()
_first = operator.itemgetter(0)
_second = operator.itemgetter(1)
_is_number = functools.partial(operator.is_not, None)
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


_grad_enabled = torch.is_grad_enabled


def _probe_read():
    """_probe_counter, or None where it cannot be read (a tracer, a mode)."""
    try:
        return _probe_counter()
    except Exception:  # under torch.compile's tracer, a dispatch mode, ...
        return None


# The next sequence number of this thread, where a node would be created
# (read where every module call of a watched model is, twice a call: the
# reader is torch's own function where there is one).
_read_counter = _peek if _peek is not None else _probe_read


def _counter():
    """The next sequence number of this thread, or None when no node would
    be created (grad mode off) or it cannot be read."""
    return _read_counter() if _grad_enabled() else None


# The model's module calls are timed by a wrapper of ``_call_impl`` (what
# torch.nn.Module.__call__ calls) placed, while a block is active, on each
# class the model's modules have (``Linear``, ``LSTMCell``, the model's
# own...), shared by the active blocks. Global forward hooks
# (torch.nn.modules.module.register_module_forward_hook) did the same, but
# they send every module call, in the model or not, down the slow path of
# Module._call_impl: 7 to 9 us a call on the unrolled LSTMCell (34 calls, 0.3
# ms of a 9 ms forward) before the hooks themselves. Wrapping
# torch.nn.Module's own costs 40 to 80 us at each block's entry and exit
# (setting an attribute of a class invalidates the method caches of all its
# subclasses: hundreds for nn.Module); one of a leaf class such as Linear,
# a few us. ``_call_impl`` rather than ``__call__``: setting a dunder also
# updates the type's slot in each subclass, looking the name up through
# their MROs (3 to 5 times longer: 39 -> 8 us and 8 -> 2 us to wrap and
# unwrap the 4 backwards model's three classes after a step). A module
# that bypasses its class's _call_impl (compiled in place by Module.compile(),
# which calls the compiled function instead, or given a _call_impl of its
# own) is timed by a wrapper of its class's ``__call__``, which times those
# modules alone. A class that has a __call__ or _call_impl of its own
# between it and nn.Module (torch.compile's OptimizedModule) is left alone:
# its modules get a pair of forward hooks of their own.
_active = ()  # the ModuleCalls of the active blocks; replaced, never mutated
_patch_lock = threading.Lock()
_wrapped = {}  # (class, attribute, wrapper) -> how many active blocks time it (under _patch_lock)


_Module = torch.nn.Module
_call_impl = torch.nn.Module._call_impl
# Under torch.compile's tracer the wrappers pass straight through (the
# tracer would break its graph at the counter's C function). Dynamo's own
# test is one frame; torch.compiler.is_compiling() two (it asks TorchScript
# first), at every module call. A non-strict export runs the forward
# eagerly, where reading the counter is harmless.
_is_compiling = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)


def _timed_call_impl(self, *args, **kwargs):
    """``_call_impl`` of a wrapped class while a block is active: a call of
    a module of a watched model is filed with the counter's value before
    and after it (then torch.nn.Module._call_impl runs as it would have). A
    call that raises is not filed; under torch.compile's tracer nothing is.

    Runs at every call of a watched model's modules (a step of a small
    transformer makes dozens): names are bound once here, and a call is
    filed by appending to the block's list (atomic), without a lock."""
    active = _active
    key = id(self)
    for calls in active:
        if key in calls.timed:
            break
    else:
        return _call_impl(self, *args, **kwargs)
    if _is_compiling():
        return _call_impl(self, *args, **kwargs)
    # Gradients on as the call starts (a forward's usual case): its end is
    # read whatever the mode then (the counter does not move with them off).
    if _grad_enabled():
        start = _read_counter()
        result = _call_impl(self, *args, **kwargs)
        call = (start, _read_counter(), self)
    else:
        result = _call_impl(self, *args, **kwargs)
        call = (None, _read_counter() if _grad_enabled() else None, self)
    calls._new.append(call)
    if len(active) > 1:  # nested blocks: each that times the module
        for other in active:
            if other is not calls and key in other.timed:
                other._new.append(call)
    return result


def _timed_bypassing_call(self, *args, **kwargs):
    """``__call__`` of a wrapped class that has modules bypassing its
    _call_impl (``Module.compile()``'s, whose calls reach the compiled
    function, or an instance's own _call_impl), while a block is active:
    the calls of those modules are filed as _timed_call_impl files the
    others' (which it passes through)."""
    key = id(self)
    if _is_compiling() or not any(key in calls.bypassing for calls in _active):
        return _Module.__call__(self, *args, **kwargs)
    start = _counter()
    result = _Module.__call__(self, *args, **kwargs)
    call = (start, _counter(), self)
    for calls in _active:
        if key in calls.bypassing:
            calls._new.append(call)
    return result


def _bypasses(module):
    """Whether Module.__call__ on ``module`` does not reach its class's
    _call_impl: it was compiled in place, or has a _call_impl of its own."""
    own = module.__dict__
    return own.get("_compiled_call_impl") is not None or "_call_impl" in own


_own_dict = operator.attrgetter("__dict__")
_keys = operator.methodcaller("keys")
_without_call_names = operator.methodcaller("isdisjoint", ("_call_impl", "__call__"))


def _own_call(klass):
    """Whether ``klass`` has a __call__ or _call_impl of its own (not a wrapper)."""
    own = klass.__dict__
    impl, call = own.get("_call_impl"), own.get("__call__")
    return ((impl is not None and impl is not _timed_call_impl)
            or (call is not None and call is not _timed_bypassing_call))


def _wrappable(cls):
    """Whether ``cls`` calls torch.nn.Module.__call__ and _call_impl (no
    class between them has either of its own, but the wrappers)."""
    for klass in cls.__mro__:
        if klass is torch.nn.Module:
            return True
        if _own_call(klass):
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


class ModelView:
    """What advise() reads of a model's structure as a block enters: its
    modules' paths, its parameters' names (:class:`ParameterNames`), what a
    description reads of each module (``module_keys``, filled by
    ``Advise._module_key``) and the last backward a block on the model
    filed (``last``, ``Advise.add``).

    Kept per model (``view_of``) and used again by the next block while the
    structure it was read from is unchanged: each module, its class, its
    children and parameters by name and identity, and for an embedding
    what its drop-in's residual reads (a training loop enters a block per
    step: reading names again is a third of an empty block's cost, and a
    view kept lets a repeated step be recognised by identity). It holds the
    modules weakly (nothing here keeps a model alive): a module gone makes
    the view stale."""

    __slots__ = ("names", "paths", "classes", "module_keys", "last", "calls_signature", "_refs", "_below_module",
                 "_embeddings", "_bypassing", "_timed", "_structure", "_fingerprint")

    def __init__(self, model):
        modules = named_modules(model)
        self.names = ParameterNames(modules)
        self.paths = {}  # id(module) -> its first path
        self._refs = []  # a weak reference to each module, in the order of their first paths
        for path, module in modules:
            if id(module) not in self.paths:
                self.paths[id(module)] = path
                self._refs.append(weakref.ref(module))
        self._embeddings = [ref for ref in self._refs if isinstance(ref(), torch.nn.Embedding)]
        # The modules that bypass their class's _call_impl (their structure
        # holds what they call instead).
        self._bypassing = frozenset(id(module) for _, module in modules if _bypasses(module))
        self.classes = frozenset(type(module) for _, module in modules)
        # Every class between those and torch.nn.Module (their MROs'), which
        # decides whether a class's modules reach Module.__call__ and
        # _call_impl (wrappable).
        below = {}
        for cls in self.classes:
            mro = cls.__mro__
            below.update(dict.fromkeys(mro[:mro.index(torch.nn.Module)] if torch.nn.Module in mro else mro))
        self._below_module = tuple(below)
        self.module_keys = {}  # (id(module), its class) -> (what a description reads of it, why no drop-in)
        self.last = None  # Advise.add's record of the last backward filed on the model
        self._timed = (None, None)  # (the classes wrapped, ``timed``'s answer for them)
        self._structure, self.calls_signature = _build_functions()
        self._fingerprint = self._read()

    def modules(self):
        """{id(module): module} of every module (alive: the view is current)."""
        return {id(module): module for module in map(_call, self._refs)}

    def _read(self):
        """Each module's class, children and parameters (by name and
        identity), and what an embedding's drop-in reads of it; None where a
        module is gone."""
        modules = list(map(_call, self._refs))
        if None in modules:
            return None
        embeddings = []
        for ref in self._embeddings:
            module = ref()
            weight = module.__dict__.get("_parameters", {}).get("weight")
            embeddings.append((module.sparse, module.padding_idx, module.scale_grad_by_freq,
                               getattr(weight, "dtype", None), getattr(weight, "shape", None)))
        return self._structure(modules), embeddings

    def current(self):
        """Whether the model still has the structure this view was read from."""
        return self._read() == self._fingerprint

    def wrappable(self):
        """The classes of the model's modules that call torch.nn.Module.__call__
        and _call_impl (``_wrappable``): all of them, unless a class between
        one of them and nn.Module has either of its own (then each is
        asked). Asked as each block enters: a look into each class's own
        dictionary, at C speed where none has either name (the usual case:
        another block's wrappers are not there, a class's own are)."""
        below = self._below_module
        if all(map(_without_call_names, map(_keys, map(_own_dict, below)))) or not any(map(_own_call, below)):
            return self.classes
        return frozenset(cls for cls in self.classes if _wrappable(cls))

    def timed(self, classes):
        """Of the modules whose class is in ``classes``: {id(module): path} of
        those _timed_call_impl times, the same of those that bypass it
        (_timed_bypassing_call times them), and what to wrap for them:
        (class, attribute, wrapper) of each class's _call_impl, and of the
        __call__ of the classes of the latter."""
        known, timed = self._timed
        if known is not classes and known != classes:
            by_impl, bypassing, bypassing_classes = {}, {}, set()
            for i, module in self.modules().items():
                if type(module) in classes:
                    if i in self._bypassing:
                        bypassing[i] = self.paths[i]
                        bypassing_classes.add(type(module))
                    else:
                        by_impl[i] = self.paths[i]
            wrapped = (*[(cls, "_call_impl", _timed_call_impl) for cls in classes],
                       *[(cls, "__call__", _timed_bypassing_call) for cls in bypassing_classes])
            timed = by_impl, bypassing, wrapped
            self._timed = (classes, timed)
        return timed


_call = operator.call if hasattr(operator, "call") else (lambda ref: ref())  # (3.11+)


def _python_structure(modules):
    """``module_structure`` of the C++ watch's build, in Python (where there
    is none): the same, as one list."""
    out = []
    for module in modules:
        own = module.__dict__
        out += (type(module), id(own.get("_compiled_call_impl")), id(own.get("_call_impl")))
        for name in ("_modules", "_parameters"):
            held = own.get(name)
            if type(held) is not dict:
                out.append(id(held))
                continue
            out.append(len(held))
            out += held
            out += map(id, held.values())
    return out


def _python_calls_signature(calls, low):
    """``calls_signature`` of the C++ watch's build, in Python (where there
    is none): the same, as one list."""
    flat = []
    for start, end, module in calls:
        flat += (None if start is None else start - low, None if end is None else end - low,
                 id(module), type(module))
    return flat


def _build_functions():
    """(module_structure, calls_signature) of the C++ watch's build where
    this torch has one, else their Python versions (a view keeps the ones
    it was read with: its fingerprints and signatures are compared only
    with their own kind)."""
    from . import graph

    build = graph._extension_now() or graph._advise_only_build()
    return (getattr(build, "module_structure", None) or _python_structure,
            getattr(build, "calls_signature", None) or _python_calls_signature)


class ByModel(dict):
    """id(model) -> (a weak reference to it, a value): one value per model,
    by the model's identity (whatever its class's __eq__ and __hash__),
    keeping no model alive; the entries of models gone are dropped as
    another is set (their ids may be reused). Its users hold their own lock."""

    def of(self, model):
        """The value set for ``model``, or None."""
        entry = self.get(id(model))
        return entry[1] if entry is not None and entry[0]() is model else None

    def put(self, model, value):
        """Set ``model``'s value (and return it)."""
        entry = self.get(id(model))
        if entry is not None and entry[0]() is model:  # (a block per step: the same model again)
            self[id(model)] = (entry[0], value)
            return value
        for i in [i for i, (ref, _) in self.items() if ref() is None]:
            del self[i]
        self[id(model)] = (weakref.ref(model), value)
        return value


_views = ByModel()  # each model's ModelView
_views_lock = threading.Lock()


def view_of(model):
    """The model's :class:`ModelView`: the one the last block read where the
    model's structure is unchanged since, else read now."""
    with _views_lock:
        view = _views.of(model)
    if view is not None and view.current():
        return view
    view = ModelView(model)
    with _views_lock:
        _views.put(model, view)
    return view


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

    def __init__(self, model, view):
        self.model = model
        self.paths = view.paths  # id(module) -> its first path (a module's first path is its name)
        self._view = view
        self._new = []  # (start, end, module) of the calls filed since the last forward was closed
        # The last forwards' calls, oldest first: [calls as filed, the
        # highest end among them, the calls numbered (_numbered) or None].
        self._kept = []
        self._intervals = None  # all kept calls numbered and sorted (_sorted), or None: not yet
        self._start_values = []  # their starts
        self.forward = []  # the calls of the last forward closed, as filed: (start, end, module)
        self._forward_start = None  # the lowest start among them (forward_start), or _UNKNOWN: not read yet
        self.before_forward = None  # the highest end of the kept calls before them
        self._lock = threading.Lock()
        self.timed = {}  # id(module) -> path, of the modules _timed_call_impl times (hooks time the others)
        self.bypassing = {}  # the same, of those that bypass it, which _timed_bypassing_call times
        self._wrapped = ()  # the (class, attribute, wrapper) this block wrapped (or joined)
        self._handles = []  # the hooks of modules whose class it could not wrap
        self._open = threading.local()  # their calls under way, per thread

    def install(self):
        """Time this model's calls: wrap the _call_impl of its modules'
        classes, and the __call__ of those with modules that bypass it
        (joining the blocks that wrap them already); hooks on the modules
        whose class cannot be."""
        global _active
        timed, bypassing, wrapped = self._view.timed(self._view.wrappable())
        with _patch_lock:
            for key in wrapped:  # (class, attribute, wrapper): wrapped once, however many blocks time it
                count = _wrapped.get(key, 0)
                if not count:
                    cls, attribute, wrapper = key
                    if cls.__dict__.get(attribute) is not wrapper:
                        setattr(cls, attribute, wrapper)
                _wrapped[key] = count + 1
            self._wrapped = wrapped
            self.timed, self.bypassing = timed, bypassing
            _active = _active + (self,)
        if len(timed) + len(bypassing) < len(self.paths):
            for i, module in self._view.modules().items():
                # (its own __call__ may reach a wrapped one: not timed twice)
                if i not in timed and i not in bypassing:
                    self._handles.append(module.register_forward_pre_hook(self._pre))
                    self._handles.append(module.register_forward_hook(self._post))

    def remove(self):
        """Stop timing; the last block that wraps a class unwraps it, unless
        another patch of the same attribute went on top (it then stays)."""
        global _active
        with _patch_lock:
            _active = tuple(calls for calls in _active if calls is not self)
            for key in self._wrapped:
                count = _wrapped.pop(key) - 1
                if count:
                    _wrapped[key] = count
                    continue
                cls, attribute, wrapper = key
                if cls.__dict__.get(attribute) is wrapper:
                    delattr(cls, attribute)
            self._wrapped = ()
            self.timed, self.bypassing = {}, {}
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def filed(self, start, end, module):
        # Numbered where a backward is described (after the forwards), and
        # sorted only then: not per call, nor per repeated step. (An append
        # is atomic; _close_forward takes the list under the lock.)
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
        """Keep the calls filed since the last forward was closed as this
        forward's; a block keeps its last KEPT_FORWARDS forwards only (a
        graph older than that is named by its ops alone), so what it holds
        stays bounded however long it runs. The highest end of its calls is
        read at C speed (what ``before_forward`` of the next is made of);
        numbering them per module, their lowest start and sorting them for
        attribution wait until a backward is described (``sorted_forward``,
        ``attribute_all``): a repeated step needs none of it."""
        forward = self._new
        self._new = []
        self.before_forward = max(map(_second, self._kept), default=None)
        self.forward = forward
        self._forward_start = _UNKNOWN
        # An end read with gradients on, of a call whose start was not, only
        # raises it: the check it serves (Advise._signature) is then stricter.
        end = max(filter(_is_number, map(_second, forward)), default=None)
        if end is not None:
            self._kept.append([forward, end, None])
            del self._kept[:-KEPT_FORWARDS]
            self._intervals = None

    @property
    def forward_start(self):
        """The lowest start among the last forward's calls that have both
        numbers, or None: it has none."""
        start = self._forward_start
        if start is _UNKNOWN:
            start = self._forward_start = min(
                (start for start, end, _ in self.forward if start is not None and end is not None), default=None)
        return start

    def _numbered(self, forward):
        """A forward's calls as (start, end, path, module, call, counts),
        those with both numbers, in the order filed: ``call`` counts the
        module's calls in the order they returned, ``counts`` (id(module)
        -> calls of it in that forward) is shared by them."""
        counts = {}
        numbered = []
        for start, end, module in forward:
            call = counts[id(module)] = counts.get(id(module), 0) + 1
            if start is not None and end is not None:
                numbered.append((start, end, self.paths.get(id(module), "?"), module, call, counts))
        return tuple(numbered)

    def _kept_numbered(self, entry):
        if entry[2] is None:
            entry[2] = self._numbered(entry[0])
        return entry[2]

    def _sorted(self):
        """The kept calls sorted by (start, -end, -order): an outer call of
        the same interval sorts before the inner one, which returned first;
        and their starts, as plain ints for bisect."""
        if self._intervals is None:
            keyed = []
            for entry in self._kept:
                for interval in self._kept_numbered(entry):
                    keyed.append(((interval[0], -interval[1], -len(keyed)), interval))
            keyed.sort(key=_first)
            self._intervals = [interval for _, interval in keyed]
            self._start_values = [interval[0] for interval in self._intervals]
        return self._start_values, self._intervals

    def last_forward(self):
        """The calls of the last forward as filed (start, end, module) and
        the highest end of the calls kept before it (None: none); the
        forward is closed now."""
        with self._lock:
            if self._new:
                self._close_forward()
            return self.forward, self.before_forward

    def sorted_forward(self):
        """The module calls of the last forward (those filed since the
        previous one was closed; it is closed now), as
        (start, end, path, module, call, counts), the lowest start among
        them, and the highest end of the calls before it (None: there were
        none)."""
        with self._lock:
            if self._new:
                self._close_forward()
            forward = self.forward
            kept = self._kept[-1] if self._kept else None
            numbered = self._kept_numbered(kept) if kept is not None and kept[0] is forward else ()
            return numbered, self.forward_start, self.before_forward

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
    other names a tied one has, and the modules that hold them directly (by
    identity too: kept in a model's view, nothing here keeps a module
    alive)."""

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
                    owners[id(p)] = {id(module)}
                    continue
                if full not in found:
                    found.append(full)
                owners[id(p)].add(id(module))

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
        owners = self.owners.get(id(tensor), ())
        if id(module) in owners:
            return True
        return below and any(id(sub) in owners for sub in module.modules())
