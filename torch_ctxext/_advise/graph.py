"""One backward under ``advise()``: the slots that collect several gradients, and what reached them.

Before the engine runs, the graph is walked from the backward's roots: a
slot is an input of a node (a consumer: an ``AccumulateGrad`` for a leaf,
the node that made an activation otherwise) and its producers are the edges
into it from nodes that will run. Slots with two or more producers are
watched while the engine runs:

* each producer that is a built-in node gets a post-hook, which sees the
  gradient it returns for the slot (or None);
* each custom Function producer is seen by the ``apply`` wrapper of
  ``engine.py``: what its backward returned, and whether it wrote into an
  exposed buffer;
* each consumer gets a pre-hook, which sees the finished buffer: when its
  storage is not the first gradient's, the engine summed out of place.

Nothing here keeps a gradient: hooks read sizes, storage addresses and
identities, and the nodes are dropped when the backward ends.

With torch_ctxext's extension (torch 2.6 to 2.14) the walk and the hooks on
built-in nodes are C++ ones (``_C.advise_watch``, csrc/advise_watch.cpp): the
engine then calls no Python for them and wraps no gradient as a Python
tensor. On a torch that provides every member itself (2.15), where nothing
is loaded at import, the same C++ watch comes from the build made for it
alone (``_ext/advise_module.py``), if there is one. Where there is none, or
compiled autograd is on (which calls Python hooks only), they are Python's.
"""
import sys
import threading
from typing import NamedTuple

import torch
from torch.autograd.function import BackwardCFunction, FunctionCtx
from torch.autograd.graph import get_gradient_edge

from .._explain import _argument_slots, _extension, function_name

__all__ = ["Backward", "Slot", "Arrival", "Producer", "Found", "Outcome", "CROSSING",
           "NOTHING", "GRADIENT", "FUSED"]


# What one producer left in a slot (Arrival.kind): nothing, a gradient the
# engine adds, or a write into the exposed buffer (None returned). Numbered
# here only: the C++ watch is handed these (CROSSING) and uses them by name.
NOTHING, GRADIENT, FUSED = 0, 1, 2


class Arrival(NamedTuple):
    """What one producer left in a slot, in the order they came."""

    producer: int  # its index in the slot's producers
    kind: int  # NOTHING, GRADIENT or FUSED
    bytes: int  # the extent a gradient's strides span (storage_bytes); 0 without one
    # A drop-in's gradient where the stock module's would have been a view
    # (the engine would have summed out of place had it come first).
    stock_view: bool


class Producer(NamedTuple):
    """One producer of a slot."""

    op: str | None  # its node's op (None from the C++ watch for a custom Function: Slot names it)
    seq: int | None  # its node's sequence number; None for a root gradient
    node: object  # a custom Function's ctx (Python's walk: every node); None otherwise
    position: int  # the node's output that feeds the slot, or the root's index


class Found(NamedTuple):
    """A slot as the C++ watch's walk finds it (``AdviseWatch.slots``)."""

    consumer: object  # its node (a leaf's AccumulateGrad, or the node that made the activation)
    nr: int  # the consumer's input
    producers: list  # [Producer], in the order their edges were found
    op: str  # the consumer's op
    seq: int | None  # the consumer's sequence number; None for a leaf's
    grad_bytes: int | None  # the gradient's bytes by the consumer's metadata, where it says
    functions: int  # how many producers are custom Functions


class Outcome(NamedTuple):
    """What reached a slot in a backward (``AdviseWatch.results()``)."""

    arrivals: list  # [Arrival]
    given: bool  # a gradient arrived
    first_address: int | None  # the first gradient's data
    final_address: int | None  # the finished buffer's
    first_bytes: int  # numel x element size of the first gradient


class CROSSING:
    """What the C++ watch's fields cross as, and the kinds, read by name
    (csrc/advise_watch.cpp's Crossing)."""

    Arrival, Producer, Found, Outcome = Arrival, Producer, Found, Outcome
    NOTHING, GRADIENT, FUSED = NOTHING, GRADIENT, FUSED


def storage_bytes(t):
    """Bytes a gradient occupies: the extent its strides span (less than its
    elements for an expanded gradient). Computed from sizes and strides:
    touching ``untyped_storage()`` would give the storage a Python owner,
    and the engine would then see the buffer as shared."""
    if t.numel() == 0:
        return 0
    try:
        if t.is_contiguous():  # the common case, without a loop in Python
            return t.numel() * t.element_size()
    except Exception:
        pass
    try:
        span = 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
    except Exception:  # a subclass or layout without strides
        span = t.numel()
    return min(span, t.numel()) * t.element_size()


def _address(t):
    try:
        return t.data_ptr()
    except Exception:
        return None


def _edge(t):
    """The (node, input_nr) a gradient for ``t`` goes to, or None."""
    if isinstance(t, torch.autograd.graph.GradientEdge):
        return t.node, t.output_nr
    if t.grad_fn is not None:
        return t.grad_fn, t.output_nr
    if t.requires_grad:
        edge = get_gradient_edge(t)
        return edge.node, edge.output_nr
    return None


def _metadata_bytes(node, nr):
    """csrc/advise_watch.cpp's metadata_bytes, for Python's walk."""
    try:
        meta = node._input_metadata[nr]
        numel = 1
        for size in meta.shape:
            numel *= int(size)
        return numel * meta.dtype.itemsize
    except Exception:
        return None


class Slot:
    """A slot with two or more producers in one backward (nodes held only
    while it runs); ``index``: its place in the backward's list.

    ``producers``: [Producer]; ``arrivals``: [Arrival]; ``op`` and ``seq`` its consumer's (``seq`` None for a leaf's,
    whose tensor is ``leaf``); ``grad_bytes`` its gradient's size, where
    the consumer's metadata says (else the first gradient's)."""

    __slots__ = ("index", "consumer", "nr", "op", "seq", "leaf", "grad_bytes", "producers", "holds_nodes",
                 "arrivals", "first_address", "final_address", "_given")

    def __init__(self, index, consumer, nr, producers, op, seq, grad_bytes, holds_nodes=True, leaf=None):
        self.index = index
        self.consumer = consumer
        self.nr = nr
        self.op = op
        self.seq = seq
        self.leaf = None
        if seq is None:
            self.leaf = leaf = consumer.variable if leaf is None else leaf
            grad_bytes = leaf.numel() * leaf.element_size()
        self.grad_bytes = grad_bytes
        self.producers = producers
        # Whether a producer is a node (the extension's walk names only custom
        # Functions' ctx; Python's every node), which release() drops.
        self.holds_nodes = holds_nodes
        self.arrivals = []
        self.first_address = None
        self.final_address = None
        self._given = False  # a gradient has arrived

    @classmethod
    def native(cls, index, found):
        """From the C++ watch's walk: ``found``, a :class:`Found`, its
        producers named but for custom Functions (op None)."""
        producers = found.producers
        if found.functions:
            producers = [p if p.node is None else p._replace(op=function_name(p.node)) for p in producers]
        return cls(index, found.consumer, found.nr, producers, found.op, found.seq, found.grad_bytes,
                   holds_nodes=bool(found.functions))

    @classmethod
    def walked(cls, index, consumer, nr, edges):
        """From Python's walk: ``edges`` [(producer node or None, output index)]."""
        producers = []
        for node, position in edges:
            if node is None:
                producers.append(Producer("root gradient", None, None, position))
            elif isinstance(node, BackwardCFunction):
                producers.append(Producer(function_name(node), node._sequence_nr(), node, position))
            else:
                producers.append(Producer(node.name(), node._sequence_nr(), node, position))
        leaf = getattr(consumer, "variable", None)  # read once: an AccumulateGrad's tensor
        seq = None if leaf is not None else consumer._sequence_nr()
        return cls(index, consumer, nr, producers, consumer.name(), seq,
                   None if leaf is not None else _metadata_bytes(consumer, nr), leaf=leaf)

    def arrive(self, producer, gradient, kind=None, stock_view=False):
        if gradient is None:
            self.arrivals.append(Arrival(producer, kind or NOTHING, 0, False))
            return
        if not self._given:
            self._given = True
            self.first_address = _address(gradient)
        if self.grad_bytes is None:
            self.grad_bytes = gradient.numel() * gradient.element_size()
        self.arrivals.append(Arrival(producer, GRADIENT, storage_bytes(gradient), stock_view))

    @property
    def out_of_place(self):
        """The engine replaced the first gradient by a sum (its storage was
        shared, a view's, or not dense, or grad mode was on)."""
        return (self.first_address is not None and self.final_address is not None
                and self.final_address != self.first_address)


def _compiled_autograd_on():
    """Whether compiled autograd is on: it calls a node's Python hooks but no
    C++ one (torch._dynamo.compiled_autograd sets this flag in ``_enable``
    and torch.compile's ``config.compiled_autograd``; never imported here)."""
    module = sys.modules.get("torch._dynamo.compiled_autograd")
    return module is not None and bool(getattr(module, "compiled_autograd_enabled", False))


_known_extension = (None, None)  # (the getter it was found for, _extension()'s answer)


def _extension_now():
    """``_extension()``, asked again only where ``ctx.input_grad_buffers``'s
    getter (seen through an observer's wrapper, which each advise() block
    places anew) is not the one it was asked for: its answer follows the
    getter installed, and finding that out takes longer than a small
    backward's walk."""
    global _known_extension
    member = FunctionCtx.__dict__.get("input_grad_buffers")
    getter = getattr(member, "fget", member)
    getter = getattr(getter, "__wrapped__", getter)
    known = _known_extension
    if getter is None or known[0] is not getter:
        known = _known_extension = (getter, _extension())
    return known[1]


_advise_module = None  # torch_ctxext._ext.advise_module, once imported


def _advise_only_build():
    """``_ext.advise_module.load()``: the build made for a torch that
    provides every member itself, or None. The module is imported at the
    first backward that asks (an import statement run at each backward costs
    3 to 4 us), and ``load`` looks once per process."""
    global _advise_module
    if _advise_module is None:
        from .._ext import advise_module

        _advise_module = advise_module
    return _advise_module.load()


def _native_watch(roots, inputs, grad_tensors):
    """The C++ watch of the backward from ``roots`` (tensors or gradient
    edges; ``inputs``: its inputs= ones, or empty): its walk, its hooks on
    the built-in nodes, and whether it is the advise-only build's (a torch
    that provides every member itself, whose explain() needs the nodes: it
    keeps them), or (None, False) where Python's must do. The root
    gradients (``grad_tensors``) have arrived in its slots."""
    if _compiled_autograd_on():
        return None, False
    ext = _extension_now()
    watch = getattr(ext, "advise_watch", None)
    alone = False
    if watch is None and ext is None:
        watch = getattr(_advise_only_build(), "advise_watch", None)
        alone = True
    if watch is None:
        return None, False
    try:
        return watch(roots, inputs, CROSSING, alone, grad_tensors), alone
    except (TypeError, ValueError):  # an edge it cannot read: Python's walk reads any
        return None, False


class Backward:
    """The slots of one backward call and the hooks that watch them."""

    def __init__(self, t_outputs, grad_tensors, inputs, create_graph, shaped=False):
        self.create_graph = bool(create_graph)
        self.lock = threading.Lock()
        self.handles = []
        self.problems = []  # what kept this backward from being fully seen
        # The C++ watch reads each tensor's edge itself (Python's _edge makes
        # a node object per root: as long as a small graph's walk).
        self.native, self.native_keeps_nodes = _native_watch(t_outputs, inputs or (), grad_tensors)
        self._slots = None  # [Slot], made where they are read (the C++ watch's: not for a repeated graph)
        self._finished = False  # the backward is over: the C++ watch's record is final
        # Whether a node of the graph is a custom Function's (a producer of
        # a slot or not): engine.py wraps their apply only then.
        if self.native is not None:
            self.node_ids = set()
            count, python_nodes, functions, shape = self.native.walked()
            self.custom_functions = python_nodes > 0
            if not count:  # no slot: nothing to make, fill or read back (accumulation's backwards)
                self._slots = []
            # A custom Function producer is named by Python (Slot.native) and
            # seen by the apply wrapper (_watch): its slots are made now, and
            # Python shapes them; else the watch's walk shaped them.
            shaped_by = self.slots if functions else shape
        else:
            roots = [_edge(t) for t in t_outputs]
            found, nodes = _python_slots(roots, [_edge(t) for t in inputs] if inputs else [])
            self.custom_functions = any(isinstance(node, BackwardCFunction) for node in nodes.values())
            # Every node this backward may run: for nothing_arrived, which
            # only a torch without the extension asks (the extension tells
            # it itself).
            self.node_ids = set(nodes) if _extension_now() is None else set()
            self._slots = shaped_by = [Slot.walked(i, *slot) for i, slot in enumerate(found)]
        # With ``shaped``: the graph's shape, by which advise() knows a
        # backward it has described (taken now, while the slots are fresh
        # in the caches: after the engine's backward it costs five times more).
        if not shaped:
            self.lowest, self.shape = None, None
        elif type(shaped_by) is tuple:
            self.lowest, self.shape = shaped_by
        else:
            self.lowest, self.shape = _shape(shaped_by)
        self.functions = {}  # id(ctx) -> [(slot, producer index)]
        self.slot_of = None  # (id(consumer), nr) -> slot, made where nothing_arrived is asked
        self._watch(grad_tensors)
        # No slot and no custom Function: no hook placed, nothing to see
        # (engine.py neither finishes nor releases it).
        self.slotless = self._slots == [] and not self.custom_functions

    @property
    def slots(self):
        """[Slot], in the order the walk found them; what reached them
        filled in once the backward is over (``finish``). From the C++
        watch, made where they are read: a repeated graph's backward reads
        its ``shape``, ``leaves()`` and ``outcome()`` alone."""
        if self._slots is None:
            native = self.native
            if native is None:  # released
                return []
            self._slots = [Slot.native(i, slot) for i, slot in enumerate(native.slots)]
            if self._finished:
                self._fill(native.results())
        return self._slots

    def leaves(self):
        """The tensor of each slot that is a leaf's, in the slots' order."""
        if self._slots is not None:
            return [slot.leaf for slot in self._slots if slot.leaf is not None]
        return self.native.leaves() if self.native is not None else []

    def outcome(self):
        """What reached the slots, per slot in the walk's order: its
        arrivals, whether the engine summed out of place, the gradient's
        bytes (as the slot says them): equal for two backwards of one shape
        that saw the same (hashable). Read from the C++ watch's record
        without making the slots where they are not made yet."""
        if self._slots is None and self._finished and self.native is not None:
            return self.native.outcome()
        return tuple([(tuple(slot.arrivals), slot.out_of_place, slot.grad_bytes) for slot in self.slots])

    def _arrive(self, slot, index, gradient, kind=None, stock_view=False):
        if self.native is not None:
            self.native.arrive(slot.index, index, gradient, kind == FUSED, stock_view)
        else:
            slot.arrive(index, gradient, kind, stock_view)

    def _watch(self, grad_tensors):
        posts, pres = {}, {}
        native = self.native is not None  # its hooks are placed, the root gradients arrived
        if native and not self._slots:  # no custom Function producer: nothing left to place
            return
        for slot in self.slots:
            if native:
                if slot.holds_nodes:  # a custom Function producer: the apply wrapper sees it
                    for index, producer in enumerate(slot.producers):
                        if producer.node is not None:
                            self.functions.setdefault(id(producer.node), []).append((slot, index))
                continue
            pres.setdefault(id(slot.consumer), (slot.consumer, []))[1].append(slot)
            for index, (_, seq, node, position) in enumerate(slot.producers):
                if node is None:  # a root: its gradient is in the slot before any node runs
                    root = grad_tensors[position] if grad_tensors and position < len(grad_tensors) else None
                    slot.arrive(index, root if isinstance(root, torch.Tensor) else None)
                elif isinstance(node, BackwardCFunction):
                    self.functions.setdefault(id(node), []).append((slot, index))
                else:
                    posts.setdefault(id(node), (node, []))[1].append((slot, index, position))
        for node, entries in posts.values():
            self.handles.append(node.register_hook(self._post_hook(entries)))
        for consumer, slots in pres.values():
            self.handles.append(consumer.register_prehook(self._pre_hook(slots)))

    def _post_hook(self, entries):
        def post(grad_inputs, grad_outputs):
            with self.lock:
                for slot, index, position in entries:
                    slot.arrive(index, grad_inputs[position])

        return post

    def _pre_hook(self, slots):
        def pre(grad_outputs):
            with self.lock:
                for slot in slots:
                    g = grad_outputs[slot.nr]
                    slot.final_address = None if g is None else _address(g)

        return pre

    def function_returned(self, ctx, returned, written):
        """A custom Function producer's backward returned ``returned``;
        ``written``: argument index -> whether it wrote into the exposed buffer."""
        entries = self.functions.get(id(ctx))
        if not entries:
            return
        argument_slots = _argument_slots(ctx, len(returned))
        stock_view = getattr(getattr(ctx, "_forward_cls", None), "stock_gradient_is_view", None)
        with self.lock:
            used = set()
            for j, edge in enumerate(argument_slots):
                if edge is None:
                    continue
                for k, (slot, index) in enumerate(entries):
                    if k in used or slot.consumer is not edge[0] or slot.nr != edge[1]:
                        continue
                    used.add(k)
                    gradient = returned[j]
                    if gradient is None and written.get(j):
                        self._arrive(slot, index, None, kind=FUSED)
                    else:
                        self._arrive(slot, index, gradient,
                                     stock_view=bool(stock_view and gradient is not None and stock_view(ctx, j)))
                    break

    def nothing_arrived(self, ctx, edge):
        """Whether the slot that ``edge`` (node, input_nr) of the custom
        Function ``ctx`` feeds has received nothing yet in this backward
        (then its buffer is empty: "no earlier producer"); None where ``ctx``
        is not a node of this backward (or torch_ctxext's extension, which
        tells that reason itself, is loaded: no node is kept then). An edge
        that is no slot has one producer, ``ctx`` itself."""
        node, nr = edge
        native = self.native
        if native is not None:  # the C++ watch knows the nodes where it kept them
            if not self.native_keeps_nodes or not native.contains(ctx) or not native.contains(node):
                return None
        elif id(ctx) not in self.node_ids or id(node) not in self.node_ids:
            return None
        if self.slot_of is None:
            self.slot_of = {(id(slot.consumer), slot.nr): slot for slot in self.slots}
        slot = self.slot_of.get((id(node), nr))
        if slot is None:
            return True
        if native is not None:
            return not native.given(slot.index)
        with self.lock:
            return not slot._given

    def finish(self):
        """Remove the hooks (the backward is over, or failed); with the
        extension's watch, read what reached each slot from it."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        native = self.native
        if native is None:
            return
        compiled, error = native.close()
        self._finished = True
        if self._slots:
            self._fill(native.results())
        if compiled:
            self.problems.append("it ran under compiled autograd, which calls no C++ hook: "
                                 "what reached its slots was not seen")
        if error is not None:
            self.problems.append(f"a gradient could not be read: {error}")

    def _fill(self, outcomes):
        for slot, outcome in zip(self._slots, outcomes):
            slot.arrivals = outcome.arrivals
            slot._given = outcome.given
            slot.first_address = outcome.first_address
            slot.final_address = outcome.final_address
            if slot.grad_bytes is None and outcome.given:
                slot.grad_bytes = outcome.first_bytes

    def release(self):
        """Drop every node and tensor this record held."""
        for slot in self._slots or ():
            slot.consumer = None
            slot.leaf = None
            if slot.holds_nodes:
                slot.producers = [p._replace(node=None) for p in slot.producers]
                slot.holds_nodes = False
        self.functions = {}
        self.slot_of = None
        self.node_ids = set()
        self.native = None


def _shape(slots):
    """The lowest node number of the slots and their producers (None where
    none has one), and per slot (in order) its op, input number, node
    number and number of producers, then each producer's op and node number,
    numbers less the lowest, in one flat tuple: equal for two backwards of
    graphs built alike. (Flat: hashing and comparing it after the engine's
    backward touches a few contiguous lines, not a tuple per producer.)"""
    seqs = [seq for slot in slots for _, seq, _, _ in slot.producers if seq is not None]
    seqs += [slot.seq for slot in slots if slot.seq is not None]
    if not seqs:
        return None, None
    low = min(seqs)
    flat = []
    add = flat.append
    for slot in slots:
        flat += (slot.op, slot.nr, None if slot.seq is None else slot.seq - low, len(slot.producers))
        for op, seq, _, _ in slot.producers:
            add(op)
            add(None if seq is None else seq - low)
    return low, tuple(flat)


def _python_slots(roots, input_edges):
    """Python's walk: [(consumer, nr, [(producer or None, output index)])]
    for every slot two or more producers feed (of the nodes the engine will
    run), in the order its first edge was found; and the nodes by id."""
    into, nodes = _walk(roots)
    running = _leading_to(into, nodes, input_edges) if input_edges else None
    found = []
    for (consumer_id, nr), edges in into.items():
        if type(edges) is tuple:  # one producer: not a slot
            continue
        if running is not None:
            if consumer_id not in running:
                continue
            edges = [e for e in edges if e[0] is None or id(e[0]) in running]
        if len(edges) >= 2:
            found.append((nodes[consumer_id], nr, edges))
    return found, nodes


def _walk(roots):
    """Every edge reachable from the roots: {(id(consumer), nr): (producer or
    None for a root, output index)} where one producer feeds the slot, a
    list of them where several do; and the nodes by id.

    The hot loop of a watched backward (one pass over every node): an edge
    is kept as a tuple, and only a slot with a second producer gets a list."""
    into, nodes = {}, {}
    stack = []
    for k, edge in enumerate(roots):
        if edge is None:
            continue
        node, nr = edge
        _add_edge(into, (id(node), nr), (None, k))
        if id(node) not in nodes:
            nodes[id(node)] = node
            stack.append(node)
    get = into.get
    while stack:
        node = stack.pop()
        i = -1
        for child, nr in node.next_functions:
            i += 1
            if child is None:
                continue
            child_id = id(child)
            key = (child_id, nr)
            edges = get(key)
            if edges is None:
                into[key] = (node, i)
            elif type(edges) is tuple:
                into[key] = [edges, (node, i)]
            else:
                edges.append((node, i))
            if child_id not in nodes:
                nodes[child_id] = child
                stack.append(child)
    return into, nodes


def _add_edge(into, key, edge):
    edges = into.get(key)
    if edges is None:
        into[key] = edge
    elif type(edges) is tuple:
        into[key] = [edges, edge]
    else:
        edges.append(edge)


def _edges(entry):
    """The producers of one ``_walk`` entry, as a list."""
    return [entry] if type(entry) is tuple else entry


def _leading_to(into, nodes, input_edges):
    """With ``inputs=`` the engine runs only the nodes on a path to an
    input: the ids of those nodes (the inputs' own included)."""
    parents = {}
    for (consumer_id, _), entry in into.items():
        for producer, _ in _edges(entry):
            if producer is not None:
                parents.setdefault(consumer_id, []).append(producer)
    running = {id(edge[0]) for edge in input_edges if edge is not None}
    queue = list(running)
    while queue:
        for producer in parents.get(queue.pop(), ()):
            if id(producer) not in running:
                running.add(id(producer))
                queue.append(id(producer))
    return running
