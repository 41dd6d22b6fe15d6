"""What ``with torch_ctxext.advise(model) as report`` collected, as a table and as plain data."""
import collections
from dataclasses import dataclass, field

from .._explain import FunctionBufferStats
from .graph import FUSED, GRADIENT, NOTHING
from .table import natural, render

__all__ = ["AdviceReport", "SlotAdvice", "ProducerAdvice", "FunctionAdvice", "DropInAdvice", "RouteAdvice", "account"]


# No __dict__ (one is made per producer of a backward that is described) and
# frozen: the reports of backwards of one structure share them (__init__.py).
@dataclass(slots=True, frozen=True)
class ProducerAdvice:
    """One producer of a slot: the op (autograd node) or custom Function
    whose backward returns a gradient for it, the module that made it
    (``path#call`` when the module ran several times) and its class, the
    drop-in that would fuse it into the slot's buffer (None: none would),
    and what that drop-in's fused path still allocates at each add
    (``residual``: a ``FusedEmbedding``'s padding row, and with
    ``scale_grad_by_freq`` its rows' counts and scale)."""

    op: str
    module: str | None = None
    drop_in: str | None = None
    stock: str | None = None  # the module's class
    residual: int = 0  # bytes the drop-in's fused path still allocates at each add
    # The attribute, relative to the module, of a parameter the module's own
    # forward applies through F.linear (not its own: no drop-in can fuse it,
    # torch_ctxext.nn.functional.linear can), else None.
    route: str | None = None

    def as_dict(self):
        return {"op": self.op, "module": self.module, "stock": self.stock, "drop_in": self.drop_in,
                "residual_bytes": self.residual, "route": self.route}


_ORIGINS_KEPT = 8  # SlotAdvice.origins


@dataclass(slots=True)
class SlotAdvice:
    """A tensor into which one backward accumulated more than one gradient.

    ``temporaries``: gradients its producers returned that the engine then
    added to the buffer; ``summed_out_of_place``: sums the engine allocated
    because the buffer could not be added to in place (the first gradient
    was a view or shared); ``temporary_bytes`` the bytes of both;
    ``avoided_bytes`` what the ``fused`` producers did not allocate, and the
    sum the engine did not make because a drop-in's gradient came first
    where the stock module's would have been a view (so a fused step's
    ``avoided_bytes`` is the stock step's ``avoidable_bytes``);
    ``avoidable_bytes`` what the drop-ins would still save, and
    ``avoidable_peak_bytes`` the most of it alive at one time (at one add).
    """

    name: str
    kind: str  # "parameter", "tensor" (another leaf) or "activation"
    producers: list
    grad_bytes: int
    fused: int = 0
    temporaries: int = 0
    summed_out_of_place: int = 0
    temporary_bytes: int = 0
    avoided_bytes: int = 0
    avoidable_bytes: int = 0
    avoidable_peak_bytes: int = 0
    tied: list = field(default_factory=list)  # other names of a tied parameter
    # The described producers this slot's list was made from, and those of
    # every backward merged in: a block over many steps lists each producer
    # once (compared by identity where a described graph repeats, by value
    # otherwise), so its report stays as long as one step's.
    origins: list = field(default_factory=list, repr=False, compare=False)

    @property
    def drop_in(self):
        names = sorted({p.drop_in for p in self.producers if p.drop_in})
        return ", ".join(names) or None

    def merge(self, other):
        origins = other.origins
        if not origins or not any(o is origins[0] for o in self.origins):
            known = set(self.producers)
            self.producers += [p for p in other.producers if p not in known]
            # the latest few: a graph that changes every step keeps no more
            self.origins = (self.origins + origins)[-_ORIGINS_KEPT:]
        for key in ("fused", "temporaries", "summed_out_of_place", "temporary_bytes",
                    "avoided_bytes", "avoidable_bytes"):
            setattr(self, key, getattr(self, key) + getattr(other, key))
        self.avoidable_peak_bytes = max(self.avoidable_peak_bytes, other.avoidable_peak_bytes)

    def as_dict(self):
        return {
            "name": self.name, "kind": self.kind, "tied": list(self.tied),
            "producers": [p.as_dict() for p in self.producers],
            "grad_bytes": self.grad_bytes, "fused": self.fused, "temporaries": self.temporaries,
            "summed_out_of_place": self.summed_out_of_place,
            "temporary_bytes": self.temporary_bytes, "avoided_bytes": self.avoided_bytes,
            "avoidable_bytes": self.avoidable_bytes,
            "avoidable_peak_bytes": self.avoidable_peak_bytes, "drop_in": self.drop_in,
        }


@dataclass
class FunctionAdvice(FunctionBufferStats):
    """Reads of ``ctx.input_grad_buffers`` by one custom Function: entries
    exposed, buffers really written in place (``used``), entries that fell
    back to ``None`` and why (``explain()``'s labels)."""

    used: int = 0

    def as_dict(self):
        return {"reads": self.reads, "exposed": self.exposed, "used": self.used,
                "fell_back": self.fell_back, "not_applicable": self.not_applicable,
                "reasons": dict(self.reasons.most_common())}

    def __str__(self):
        return super().__str__().replace(" exposed, ", f" exposed, {self.used} used, ", 1)


@dataclass
class DropInAdvice:
    """A stock module and the drop-in that would fuse its gradients."""

    module: str
    stock: str
    drop_in: str
    avoidable_bytes: int = 0
    slots: list = field(default_factory=list)

    def as_dict(self):
        return {"module": self.module, "stock": self.stock, "drop_in": self.drop_in,
                "avoidable_bytes": self.avoidable_bytes, "slots": list(self.slots)}


def account(slot, arrivals, out_of_place, create_graph):
    """Fill ``slot``'s counts from what reached it, in order (``arrivals``:
    graph.py's (producer index, kind, bytes, stock_view)); returns the
    savings the drop-ins would make, [(producer index, bytes)].

    The engine keeps the first gradient as the buffer and adds each later
    one to it: in place, unless the first could not be (then it allocates
    one sum, after which the buffer is its own). With the drop-ins, a
    producer that has one fuses wherever the buffer is exposed (the same
    rule); the first gradient, if a drop-in returns it, is a fresh tensor,
    so no sum out of place is needed at all. Under ``create_graph=True``
    nothing is exposed. Each fused add saves the gradient less the drop-in's
    ``residual``.

    ``avoided_bytes`` counts the same two things where the drop-ins ran: the
    gradients fused producers did not return, and the sum the engine did not
    make because a drop-in's gradient came first where the stock module's
    would have been a view. So the promise before ``fuse()`` is what the
    fused step reports as avoided.
    """
    # One pass over the arrivals (this runs for every slot of every watched
    # backward): ``k`` numbers the arrivals after the first.
    producers, grad_bytes = slot.producers, slot.grad_bytes
    first = None
    k = -1
    fused = temporaries = temporary_bytes = avoided = 0
    counting = first_drop_in = exposable = False
    savings, events = [], []
    for arrival in arrivals:
        producer, kind, nbytes, _ = arrival
        if kind == NOTHING:
            continue
        if kind == FUSED:
            fused += 1
            avoided += max(grad_bytes - producers[producer].residual, 0)
        if first is None:
            first = arrival
            counting = not create_graph and kind == GRADIENT
            if counting:
                first_drop_in = producers[producer].drop_in is not None
                # Where a later gradient comes, the engine sums out of place
                # exactly when ``out_of_place``.
                exposable = first_drop_in or not out_of_place
            continue
        k += 1
        if kind != GRADIENT:
            continue
        temporaries += 1
        temporary_bytes += nbytes
        if not counting:
            continue
        saved = 0
        if k == 0 and out_of_place and first_drop_in:
            # The sum the engine allocates at the second gradient: a
            # drop-in's first gradient is its own tensor, added to in place.
            savings.append((first[0], grad_bytes))
            saved += grad_bytes
        advice = producers[producer]
        if exposable and advice.drop_in is not None and nbytes > advice.residual:
            # (a fused add that allocates as much as the gradient does not
            # pay: not advised, so fuse(model, report) leaves it stock)
            nbytes -= advice.residual
            savings.append((producer, nbytes))
            saved += nbytes
        events.append(saved)
        exposable = True  # after this add the buffer is the engine's own
    summed = int(bool(out_of_place and temporaries))
    slot.fused = fused
    slot.temporaries = temporaries
    slot.summed_out_of_place = summed
    slot.temporary_bytes = temporary_bytes + summed * grad_bytes
    if k >= 0 and first[3] and not summed:  # the first gradient's stock_view
        avoided += grad_bytes
    slot.avoided_bytes = avoided
    slot.avoidable_bytes = sum(b for _, b in savings)
    slot.avoidable_peak_bytes = max(events, default=0)
    return savings


@dataclass
class RouteAdvice:
    """A module whose forward applies another module's parameter through
    ``F.linear``: the line of code to change (``attribute``: the parameter
    as that forward reads it, ``self.embed.weight``), and what
    ``torch_ctxext.nn.functional.linear`` there would save, with
    ``fuse(model)`` (the two together, beyond what ``fuse`` alone saves)."""

    module: str
    stock: str
    attribute: str
    avoidable_bytes: int = 0
    slots: list = field(default_factory=list)

    def as_dict(self):
        return {"module": self.module, "stock": self.stock, "attribute": self.attribute,
                "route": "torch_ctxext.nn.functional.linear", "avoidable_bytes": self.avoidable_bytes,
                "slots": list(self.slots)}


class AdviceReport:
    """What ``with torch_ctxext.advise(model) as report:`` saw.

    ``print(report)`` is a table of at most 100 columns, largest saving
    first, with a "do this" line and the tensors nothing saves folded into
    one line (``report.table(width=None)``: uncut);
    ``report.as_dict()`` the same as plain, JSON-serialisable data;
    ``report[name]`` a slot by its name (``"encoder.fc1.weight"``).

    A report of no backward (``backwards == 0``: the backward ran after the
    block, or not at all, or the forward ran under ``torch.no_grad()``)
    says that it measured nothing and how a block is used, not that there
    is nothing to do; a note says what the block saw instead.
    """

    def __init__(self, model_name=None):
        self.model = model_name
        self.backwards = 0
        self.closed = False  # the block has ended: it will observe no more backwards
        self.failures = 0  # observations that failed (each noted), a backward's or a custom Function's
        self._filed_slots = {}  # name -> SlotAdvice
        self.functions = {}
        self._drop_ins = {}  # module path -> DropInAdvice
        self._routes = {}  # (module path, attribute) -> RouteAdvice
        # What backwards that repeat one already filed would file (replay),
        # filed when the report is next read or added to: a training loop's
        # step adds one entry here, not its slots and savings again.
        self._replayed = collections.deque()
        # Class name -> why fuse() leaves its modules as they are (a subclass
        # whose forward replaces the stock one, ...), for those that made a
        # gradient of a tensor that received several.
        self.cannot_swap = {}
        self.notes = []

    @property
    def _slots(self):
        if self._replayed:
            self._file_replayed()
        return self._filed_slots

    @property
    def drop_ins(self):
        """Module path -> DropInAdvice: what fuse(model) would swap in, and save."""
        if self._replayed:
            self._file_replayed()
        return self._drop_ins

    @property
    def routes(self):
        """(module path, attribute) -> RouteAdvice: F.linear calls to route
        through torch_ctxext.nn.functional.linear."""
        if self._replayed:
            self._file_replayed()
        return self._routes

    def replay(self, filed):
        """File again what a backward filed (``filed``: Advise._file's
        record of it: (0, savings), (1, route), (2, slot) entries), for a
        backward that repeats it; done when the report is next read."""
        self._replayed.append(filed)

    def _file_replayed(self):
        replayed = self._replayed
        while replayed:
            filed = replayed.popleft()  # atomic: a backward on another thread may append meanwhile
            self._file_again(filed)

    def _file_again(self, filed):
        slots = self._filed_slots
        for what, args in filed:
            if what == 0:
                for path, stock, drop_in, nbytes, names in args:
                    self._add_savings(path, stock, drop_in, names, nbytes)
            elif what == 1:
                self._add_route(*args)
            else:
                name, kind, producers, tied, grad_bytes, counters, peak, nonzero = args
                slot = slots.get(name)
                if slot is not None and any(o is producers for o in slot.origins):
                    # SlotAdvice.merge of a slot of these producers: its counts added
                    for counter, value in nonzero:
                        setattr(slot, counter, getattr(slot, counter) + value)
                    if peak > slot.avoidable_peak_bytes:
                        slot.avoidable_peak_bytes = peak
                    continue
                self._add_slot(SlotAdvice(name, kind, list(producers), grad_bytes, *counters, peak,
                                          tied=list(tied), origins=[producers]))

    @property
    def slots(self):
        return sorted(self._slots.values(),
                      key=lambda s: (-s.avoidable_bytes - s.avoided_bytes, -s.temporary_bytes, natural(s.name)))

    def __getitem__(self, name):
        return self._slots[name]

    def __contains__(self, name):
        return name in self._slots

    @property
    def temporary_bytes(self):
        return sum(s.temporary_bytes for s in self._slots.values())

    @property
    def avoided_bytes(self):
        return sum(s.avoided_bytes for s in self._slots.values())

    @property
    def avoidable_bytes(self):
        return sum(s.avoidable_bytes for s in self._slots.values())

    @property
    def avoidable_peak_bytes(self):
        """The most the drop-ins would take off the backward's peak: the
        temporaries of one add are all that is alive of them at a time, and
        the peak drops by that only where it falls on that add."""
        return max((s.avoidable_peak_bytes for s in self._slots.values()), default=0)

    # Each add_ files what is waiting first (replay), so that the report is
    # what filing each backward as it ran would have made; its _add_ twin,
    # which _file_again calls too, writes the filed dictionaries.
    def add_slot(self, slot):
        if self._replayed:
            self._file_replayed()
        self._add_slot(slot)

    def add_saving(self, path, stock, drop_in, slot_name, nbytes):
        self.add_savings(path, stock, drop_in, (slot_name,), nbytes)

    def add_savings(self, path, stock, drop_in, slot_names, nbytes):
        """``add_saving`` for several slots at once: ``nbytes`` in all."""
        if self._replayed:
            self._file_replayed()
        self._add_savings(path, stock, drop_in, slot_names, nbytes)

    def add_route(self, path, stock, attribute, slot_name, nbytes):
        if self._replayed:
            self._file_replayed()
        self._add_route(path, stock, attribute, slot_name, nbytes)

    def _add_slot(self, slot):
        found = self._filed_slots.get(slot.name)
        if found is not None:
            found.merge(slot)
        else:
            self._filed_slots[slot.name] = slot

    def _add_savings(self, path, stock, drop_in, slot_names, nbytes):
        advice = self._drop_ins.get(path)
        if advice is None:
            advice = self._drop_ins[path] = DropInAdvice(path, stock, drop_in)
        advice.avoidable_bytes += nbytes
        slots = advice.slots
        for slot_name in slot_names:
            if slot_name not in slots:
                slots.append(slot_name)

    def _add_route(self, path, stock, attribute, slot_name, nbytes):
        advice = self._routes.get((path, attribute))
        if advice is None:
            advice = self._routes[path, attribute] = RouteAdvice(path, stock, attribute)
        advice.avoidable_bytes += nbytes
        if slot_name not in advice.slots:
            advice.slots.append(slot_name)

    @property
    def route_bytes(self):
        """What the routes (torch_ctxext.nn.functional.linear in the code)
        would save beyond ``fuse(model)``."""
        return sum(r.avoidable_bytes for r in self.routes.values())

    def function(self, name):
        if name not in self.functions:
            self.functions[name] = FunctionAdvice(name)
        return self.functions[name]

    def note(self, text):
        if text not in self.notes:
            self.notes.append(text)

    def as_dict(self):
        return {
            "model": self.model,
            "backwards": self.backwards,
            "slots": [s.as_dict() for s in self.slots],
            "temporary_bytes": self.temporary_bytes,
            "avoided_bytes": self.avoided_bytes,
            "avoidable_bytes": self.avoidable_bytes,
            "avoidable_peak_bytes": self.avoidable_peak_bytes,
            "drop_ins": [d.as_dict() for d in self._drop_ins_sorted()],
            "routes": [r.as_dict() for r in self._routes_sorted()],
            "route_bytes": self.route_bytes,
            "cannot_swap": dict(self.cannot_swap),
            "functions": {name: f.as_dict() for name, f in sorted(self.functions.items())},
            "notes": list(self.notes),
        }

    def _drop_ins_sorted(self):
        return sorted(self.drop_ins.values(), key=lambda d: (-d.avoidable_bytes, d.module))

    def _routes_sorted(self):
        return sorted(self.routes.values(), key=lambda r: (-r.avoidable_bytes, r.module, r.attribute))

    def table(self, width=100):
        """The report as text, lines cut at ``width`` columns (None: not cut)."""
        return render(self, width)

    def __str__(self):
        return self.table()

    __repr__ = __str__
