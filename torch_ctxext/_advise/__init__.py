"""``torch_ctxext.advise``: where a training step accumulates several gradients into one tensor, what that costs, and the drop-in that saves it.

``ctx.input_grad_buffers`` saves memory and time only where one backward
adds several gradients into one tensor: a weight used several times (shared
or tied layers, an unrolled recurrent cell, micro-batch losses summed into
one backward) or an activation read by several ops. ``advise`` finds those
tensors in a real step, from the graph the engine runs and what reaches it,
and prices them::

    with torch_ctxext.advise(model) as report:
        loss = model(x).sum()
        loss.backward()
    print(report)            # a table, largest saving first
    report.as_dict()         # the same, as plain (JSON-serialisable) data

Works on torch 2.6 to 2.14 with torch_ctxext and on native 2.15, on the CPU
and on any device; the observation changes no result (the gradients are
bitwise those of the step without it) and no buffer the engine exposes.
"""
import dataclasses
import threading

import torch

from . import engine
from .graph import Backward
from .modules import ByModel, ModuleCalls, view_of
from .report import AdviceReport, DropInAdvice, FunctionAdvice, ProducerAdvice, SlotAdvice, account
from .table import USAGE

__all__ = ["advise", "Advise", "AdviceReport", "SlotAdvice", "ProducerAdvice", "FunctionAdvice",
           "DropInAdvice"]


def advise(model=None):
    """Watch one training step (forward and backward) and say where fusing pays.

    A context manager: ``with torch_ctxext.advise(model) as report:`` returns
    an :class:`AdviceReport`, filled as each backward inside the block ends.
    For every tensor into which a backward accumulates more than one
    gradient (a "slot" of the engine) it gives:

    * its name: a parameter by its module path (``encoder.fc1.weight``; a
      tied one with its other names), an activation by the op that made it
      and the module call that ran it (``AddBackward0 in block#2``);
    * its producers: the op or custom Function whose backward returns a
      gradient for it, and the module it belongs to;
    * ``grad_bytes``, the gradient's size; ``fused``, producers that wrote
      into the buffer in place; ``temporaries``, gradients the engine added
      to the buffer instead, and ``summed_out_of_place``, sums it allocated
      because it could not add in place;
    * ``temporary_bytes``, ``avoided_bytes`` (what fused producers did not
      allocate, the engine's sum out of place that a drop-in's own first
      gradient spared included) and ``avoidable_bytes`` (what the drop-ins of
      :mod:`torch_ctxext.nn` would save: ``torch_ctxext.nn.fuse(model)``);
      after ``fuse(model)``, the step's ``avoided_bytes`` is what the stock
      step's report promised, and what its allocations drop by.

    ``print(report)`` fits 100 columns: a "do this" line, the tensors that
    save most first with their producers' module classes, the tensors no
    drop-in saves folded into one line naming the module classes without
    one; ``report.table(width=None)`` uncut, ``report.as_dict()`` all.

    For each custom Function that read ``ctx.input_grad_buffers``: reads,
    entries exposed, buffers really written in place (``used``), and why the
    others were ``None`` (``torch_ctxext.explain()``'s reasons).

    ``model`` (a ``torch.nn.Module``, optional) gives names, modules and
    drop-ins; without it tensors are named by their ops and shapes and no
    drop-in is suggested. Blocks nest. A block may stay open over a training
    loop: each forward's module calls are numbered from 1, so the report
    keeps one step's rows (each producer once) while its bytes add up over
    the backwards, and what the block holds stays bounded; a graph that
    repeats one already described is named without describing it again.
    A backward the block cannot observe
    (an error in the observation itself) is noted in the report, never
    raised into the step.

    Only backwards that run inside the block are observed. A report of
    none (the backward after the block, a forward only, a forward under
    ``torch.no_grad()``) says it measured nothing and shows how a block is
    used, with a note on what it saw instead; ``advise(model)`` printed
    without being entered says how to use it.
    """
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(
            "advise(model): model must be the torch.nn.Module the step trains (for names, "
            f"modules and drop-ins) or None, got {type(model).__qualname__}"
        )
    return Advise(model)


# The node that hands a parameter its gradient where a forward applies it
# through F.linear (or a product with its transpose): weight.t()'s.
_ROUTED_OPS = ("TBackward0",)
_FUSE_INPUT = ("FusedLinear", "FusedConv1D", "FusedGRUCell")  # they also add into their inputs' buffers

# What a backward's slots are called, per model: a training loop repeats one
# graph, and naming its slots (where each producer was made, its module's
# drop-in, the tensor's name) is most of what advise() adds to a step after
# the engine's backward. Kept by the key of everything the naming reads, by
# value (Advise._key); a few per model, dropped with it. By the model's
# identity (a weak reference), whatever its class's __eq__ and __hash__.
_DESCRIBED = ByModel()  # each model's {key: Advise._describe_all's answer}
_DESCRIBED_PER_MODEL = 8
_described_lock = threading.Lock()
# SlotAdvice's counts, in its fields' order (after grad_bytes), less avoidable_peak_bytes
_COUNTERS = ("fused", "temporaries", "summed_out_of_place", "temporary_bytes", "avoided_bytes", "avoidable_bytes")


_drop_ins_module = None


def _drop_ins():
    """torch_ctxext.nn.drop_ins (which imports this package: not at import
    time), looked up once: an import statement run per module call and
    block cost 3 to 4 us each, a tenth of a small step's watch."""
    global _drop_ins_module
    if _drop_ins_module is None:
        from ..nn import drop_ins

        _drop_ins_module = drop_ins
    return _drop_ins_module


def _known_descriptions(model):
    """The descriptions kept for ``model`` (under _described_lock)."""
    known = _DESCRIBED.of(model)
    return known if known is not None else _DESCRIBED.put(model, {})


# The report of the latest block on each model that observed a backward:
# what torch_ctxext.nn.fuse(model) swaps in when given nothing else (the
# report whose "do this" line names it). By the model's identity, dropped with it.
_LATEST = ByModel()  # each model's latest report


def _remember(model, report):
    with _described_lock:
        _LATEST.put(model, report)


def latest_report(model):
    """The report of the latest ``advise(model)`` block on ``model`` that
    observed a backward, or None."""
    with _described_lock:
        return _LATEST.of(model)


def _ordered(record):
    """A backward's slots in the order their tensors were made (a leaf's
    last): activations of one name are numbered in that order."""
    return sorted(record.slots, key=lambda slot: (slot.seq is None, slot.seq or 0))


def _residual(module):
    """Bytes a drop-in's fused path still allocates at each add into its
    weight: for an embedding, one row where it has a ``padding_idx`` and,
    with ``scale_grad_by_freq``, each row's count (int64) and the scale
    made of them (the weight's dtype), ``num_embeddings`` elements each
    (torch_ctxext/nn/embedding.py). A float16 weight's fused path divides
    a copy of the output gradient instead, which is not counted."""
    if not isinstance(module, torch.nn.Embedding):
        return 0
    element = module.weight.element_size()
    nbytes = 0
    if module.padding_idx is not None:
        nbytes += module.embedding_dim * element
    if module.scale_grad_by_freq and module.weight.dtype != torch.float16:
        nbytes += module.num_embeddings * (8 + element)  # int64 counts, the scale
    return nbytes


class Advise:
    """The context manager :func:`advise` returns."""

    def __init__(self, model):
        self.model = model
        self.report = None
        self._calls = None
        self._names = None
        self._view = None  # the model's ModelView (modules.view_of)
        self._fusing = {}  # (id(module), its class, id(parameter) or None) -> Advise._drop_in's answer
        self._labels = {}  # (module path, call) -> the producer's module as the report shows it

    def __enter__(self):
        if self.report is not None:
            raise RuntimeError("this advise() block is already active; call advise() again for a new one")
        self.report = AdviceReport(type(self.model).__name__ if self.model is not None else None)
        if self.model is not None:
            self._view = view_of(self.model)
            self._names = self._view.names
            self._calls = ModuleCalls(self.model, self._view)
            self._calls.install()
        else:
            self.report.note("no model given: advise(model) names parameters and modules "
                             "and says which drop-in would fuse each tensor")
        engine.enter(self)
        return self.report

    def __exit__(self, *exc):
        engine.exit(self)
        if self._calls is not None:
            self._calls.remove()
        report = self.report
        report.closed = True
        if not report.backwards and not report.failures:
            report.note(self._why_no_backward())
        elif self.model is not None:
            _remember(self.model, report)
        return False

    def _why_no_backward(self):
        """What a block that observed no backward saw instead, as a note:
        the usual mistakes are a backward after the block and a forward
        under torch.no_grad() (no graph, so no backward to watch)."""
        advice = "call loss.backward() inside the `with` block"
        if self._calls is None:
            return f"no backward ran inside the block: {advice}"
        ran, with_grad = self._calls.seen()
        name = type(self.model).__name__
        if not ran:
            return f"neither {name} nor a backward ran inside the block: run the training step, {advice}"
        if not with_grad:
            return (f"{name} ran inside the block with gradients off (torch.no_grad() or "
                    "torch.inference_mode()): it made no graph, so there was no backward to watch; "
                    "advise a training step, with gradients on")
        return (f"{name} ran inside the block but no backward did: a backward after the block "
                f"is not watched; {advice}")

    def __repr__(self):
        # advise(model) printed instead of entered (or before): it watches
        # nothing until used as a context manager, so its repr says how.
        # Entered, it shows what it collected, as its report does.
        if self.report is not None:
            return repr(self.report)
        name = type(self.model).__name__ if self.model is not None else ""
        return "\n".join([f"torch_ctxext.advise({name}) watches nothing until used as a `with` block",
                          "around a training step, its backward included:", *USAGE])

    __str__ = __repr__

    # --- what the engine patches report (engine.py) -----------------------

    def failed(self, error):
        self.report.failures += 1
        self.report.note(f"a backward could not be fully observed: {type(error).__name__}: {error}")

    def function_read(self, name, reasons):
        self.report.function(name).add_read(reasons)

    def function_returned(self, name, grads, written):
        if name in self.report.functions:
            stats = self.report.functions[name]
            stats.used += sum(1 for j, w in written.items() if w and j < len(grads) and grads[j] is None)

    def add(self, record: Backward):
        self.report.backwards += 1
        for problem in record.problems:
            self.report.note(f"a backward was not fully observed: {problem}")
        if record.create_graph:
            self.report.note("a backward ran with create_graph=True: the engine sums out of place "
                             "and exposes no buffer there, so no drop-in saves anything in it")
        # A training loop's backwards repeat one graph and what reached it:
        # what this one files in the report is then what the first filed
        # (kept by the description's key and what reached every slot),
        # replayed. The last one filed on this model (by this block or an
        # earlier one: a block per step) is recognised by its signature and
        # outcome alone; another, by the description's key.
        signature = self._signature(record)
        if signature is not None:
            outcome = record.outcome()
            with _described_lock:
                known = _known_descriptions(self.model)
            last = self._view.last
            if last is not None and last[0] is known and last[1] == signature:
                if last[2] == outcome:
                    self._cannot_swap(last[5])
                    self.report.replay(last[4])
                    return
                key, cannot = last[3], last[5]
            else:
                key, cannot = self._key(record)
        if signature is None or key is None:
            ordered = _ordered(record)
            if ordered:
                self._file(record, ordered, self._describe_all(ordered))
            elif self._calls is not None:
                # No slot (each tensor got one gradient: nothing to name,
                # nor to attribute): its forward is closed all the same.
                self._calls.last_forward()
            return
        self._cannot_swap(cannot)
        described = (key, record.create_graph, outcome)
        with _described_lock:
            filed = known.get(described)
        if filed is None:
            filed = []
            ordered = _ordered(record)
            self._file(record, ordered, self._described(key, ordered), filed)
            with _described_lock:
                known = _known_descriptions(self.model)
                if len(known) >= 2 * _DESCRIBED_PER_MODEL:
                    known.clear()  # graphs that change every step: keep the latest
                known[described] = filed
        else:
            self.report.replay(filed)
        # Valid while the model's descriptions are kept (the dict they are in).
        self._view.last = (known, signature, outcome, key, filed, cannot)

    def _cannot_swap(self, cannot):
        for name, reason in cannot:
            self.report.cannot_swap.setdefault(name, reason)

    def _file(self, record, ordered, described, filed=None):
        """Account each slot and file it, its savings and routes in the
        report; ``filed`` (a list): what was filed is appended to it, for
        ``AdviceReport.replay``."""
        path_name = self._calls.path_name if self._calls is not None else None
        savings_by_path = {}  # for ``filed``: path -> [stock, drop-in, bytes, [slot names]], as filed
        for (name, kind, producers, tied, modules), slot in zip(described, ordered):
            advice = SlotAdvice(name, kind, list(producers), slot.grad_bytes or 0, tied=list(tied),
                                origins=[producers])
            savings = account(advice, slot.arrivals, slot.out_of_place, record.create_graph)
            # Summed per module and drop-in first: an unrolled cell's slot
            # has a saving per step, all of them the same module's.
            by_module = {}
            for index, nbytes in savings:
                key = modules[index]
                if key is not None:
                    by_module[key] = by_module.get(key, 0) + nbytes
            for (path, stock, drop_in), nbytes in by_module.items():
                shown = path_name(path)
                self.report.add_saving(shown, stock, drop_in, name, nbytes)
                if filed is not None:
                    group = savings_by_path.setdefault(shown, [stock, drop_in, 0, []])
                    group[2] += nbytes
                    group[3].append(name)
            if any(p.route for p in producers):
                route = self._add_routes(advice, slot, modules, record.create_graph)
                if filed is not None and route is not None:
                    filed.append((1, route))
            if filed is not None:
                counts = tuple(getattr(advice, counter) for counter in _COUNTERS)
                filed.append((2, (name, kind, producers, tied, advice.grad_bytes, counts,
                                  advice.avoidable_peak_bytes,
                                  tuple((c, n) for c, n in zip(_COUNTERS, counts) if n))))
            self.report.add_slot(advice)
        if filed is not None and savings_by_path:
            # The savings of the backward per drop-in, summed (add_saving, in bulk)
            filed.append((0, tuple((path, stock, drop_in, nbytes, tuple(names))
                                   for path, (stock, drop_in, nbytes, names) in savings_by_path.items())))

    def _add_routes(self, advice, slot, modules, create_graph):
        """What the slot would save beyond fuse(model) with its producers
        that apply a parameter through F.linear routed through
        torch_ctxext.nn.functional.linear (a drop-in of their own), filed
        under the first of them."""
        # A module fused already adds into the buffer the route exposes.
        routed = [dataclasses.replace(p, drop_in=p.stock if p.stock.startswith("Fused") else "linear")
                  if not p.drop_in and (p.route or (p.stock or "").startswith("Fused")) else p
                  for p in advice.producers]
        scratch = SlotAdvice(advice.name, advice.kind, routed, advice.grad_bytes)
        extra = sum(b for _, b in account(scratch, slot.arrivals, slot.out_of_place, create_graph))
        extra -= advice.avoidable_bytes
        index = next(i for i, p in enumerate(advice.producers) if p.route)
        where = modules[index]
        if where is not None:
            path, stock, _ = where
            args = (self._calls.path_name(path), stock, advice.producers[index].route, advice.name, max(extra, 0))
            self.report.add_route(*args)
            return args
        return None

    def _described(self, key, ordered):
        """``_describe_all``'s answer for these slots: the one made for a
        backward of the same structure, same module calls and same names
        (``key``, ``_key``'s answer) where there is one (a training loop's
        every step after the first, in one block or one block per step),
        else made now."""
        with _described_lock:
            found = _known_descriptions(self.model).get(key)
        if found is not None:
            return found
        found = self._describe_all(ordered)
        with _described_lock:
            known = _known_descriptions(self.model)
            if len(known) >= _DESCRIBED_PER_MODEL:
                known.clear()  # graphs that change every step: keep the latest
            known[key] = found
        return found

    def _describe_all(self, ordered):
        """Per slot (sorted as the tensors were made): its name (activations
        of one name numbered), kind, producers (ProducerAdvice), tied names,
        and per producer the (module path, class, drop-in) its saving is
        filed under, or None."""
        described = []
        counts = {}
        for slot, wheres in zip(ordered, self._attribute(ordered)):
            advice, wheres = self._describe(slot, wheres)
            modules = tuple(None if where is None else (where[0], type(where[1]).__name__, producer.drop_in)
                            for where, producer in zip(wheres, advice.producers))
            described.append([advice.name, advice.kind, tuple(advice.producers), tuple(advice.tied), modules])
            counts[advice.name] = counts.get(advice.name, 0) + 1
        seen = {}
        for entry in described:
            name = entry[0]
            if counts[name] > 1 and entry[1] == "activation":
                seen[name] = seen.get(name, 0) + 1
                entry[0] = f"{name} ({seen[name]})"
        return [tuple(entry) for entry in described]

    def _signature(self, record):
        """What ``_key`` reads, in a form as cheap to make and compare as
        this model's view allows (it names the modules and parameters: the
        same view, the same names): the last forward's module calls (their
        numbers less the lowest number of the backward's nodes, each
        module's identity and class: ``ModelView.calls_signature``), the
        backward's ``shape``, its leaves (a parameter by identity, another
        tensor by its shape), and whether it made a graph. Equal signatures
        on one view have equal keys. None where a key cannot be made: no
        model, no shape, no module call filed in the block (its forward ran
        before it), or a node numbered before the end of an earlier
        forward's call (it may be that call's); ``_key`` says None too
        where no module call has both numbers."""
        calls = self._calls
        if calls is None or record.shape is None:
            return None
        forward, before = calls.last_forward()
        low = record.lowest
        if not forward or (before is not None and low < before):
            return None
        names = self._names.names
        leaves = [id(leaf) if id(leaf) in names else tuple(leaf.shape) for leaf in record.leaves()]
        return self._view.calls_signature(forward, low), record.shape, leaves, record.create_graph

    def _key(self, record):
        """Everything ``_describe_all`` reads, by value: the backward's
        ``shape`` (per slot its op, input number, node number and its
        producers' ops and numbers, numbers relative to its lowest), where
        that lies from this forward's first module call, the slots' tensor
        names; this forward's module calls (numbers, path, call, class,
        drop-in, what its fused path still allocates); the model's class.
        And the classes of the modules called that have no drop-in, with
        why (the report's ``cannot_swap``). (None, ()) where no module call
        of the forward has both numbers. Asked only where ``_signature`` is
        not None."""
        forward, start, _ = self._calls.sorted_forward()
        if start is None:
            return None, ()
        names = self._names.names
        tensors = []
        for leaf in record.leaves():
            found = names.get(id(leaf))
            tensors.append(tuple(found) if found is not None else tuple(leaf.shape))
        made = []
        cannot = {}
        for begin, end, path, m, call, counts in forward:
            key, reason = self._module_key(m)
            if reason:
                cannot.setdefault(type(m).__name__, reason)
            made.append((begin - start, end - start, path, call, counts[id(m)], key))
        key = type(self.model), tuple(made), record.lowest - start, record.shape, tuple(tensors)
        return key, tuple(cannot.items())

    def _module_key(self, module):
        """What a description reads of a module (its class, drop-in, and what
        the drop-in's fused path still allocates), and why it has no drop-in
        (or None): once per module while the model's view lasts."""
        keys = self._view.module_keys
        key = (id(module), type(module))
        found = keys.get(key)
        if found is None:
            drop_ins = _drop_ins()
            drop_in = drop_ins.drop_in_for(module)
            reason = drop_ins.why_not(module) if drop_in is None else None
            found = keys[key] = ((type(module), drop_in, _residual(module)), reason or None)
        return found

    def _attribute(self, slots):
        """For each slot: where each of its producers was made, then where
        its own node was (``ModuleCalls.attribute_all``'s answers), from one
        lookup for the whole backward; None each without a model."""
        calls = self._calls
        if calls is None:
            return [[None] * (len(slot.producers) + 1) for slot in slots]
        seqs = []
        for slot in slots:
            seqs += [producer[1] for producer in slot.producers]
            seqs.append(slot.seq)
        found = calls.attribute_all(seqs)
        out, start = [], 0
        for slot in slots:
            end = start + len(slot.producers) + 1
            out.append(found[start:end])
            start = end
        return out

    def _describe(self, slot, wheres):
        """A SlotAdvice (name, kind, producers) for a slot of a backward, and
        where each producer was made; ``wheres``: ``_attribute``'s answer
        for the slot (its producers', then its own node's).

        Runs at the end of every watched backward, once per producer: what
        depends only on the module (its drop-in, its class, its residual) and
        on the module and the slot's parameter (whether the module owns it)
        is worked out once per block (modules and parameters outlive it)."""
        is_parameter = self._is_parameter(slot)
        leaf_key = id(slot.leaf) if is_parameter else None  # a parameter outlives the block
        producers = []
        calls = self._calls
        slot_where = wheres[-1]
        wheres = wheres[:-1]
        labels, fusings = self._labels, self._fusing
        for (op, _, _, _), where in zip(slot.producers, wheres):
            if where is None:
                producers.append(ProducerAdvice(op))
                continue
            path, module, call = where
            key = (id(module), type(module), leaf_key, op)  # fuse() may change a class mid-block
            fusing = fusings.get(key)
            if fusing is None:
                fusing = fusings[key] = self._drop_in(module, slot, is_parameter, op)
            label = labels.get((path, call))
            if label is None:
                label = labels[path, call] = calls.path_name(path) + (f"#{call}" if call else "")
            producers.append(ProducerAdvice(op, label, *fusing))
        if slot.leaf is not None:
            name = self._names.name(slot.leaf) if self._names else None
            if name is not None:
                return SlotAdvice(name, "parameter", producers, slot.grad_bytes or 0,
                                  tied=self._names.tied(slot.leaf)), wheres
            return SlotAdvice(f"leaf tensor {list(slot.leaf.shape)}", "tensor", producers,
                              slot.grad_bytes or 0), wheres
        where = slot_where
        op = slot.op + (f"[{slot.nr}]" if slot.nr else "")
        if where is not None:
            path, _, call = where
            op += f" in {self._calls.path_name(path)}" + (f"#{call}" if call else "")
        return SlotAdvice(op, "activation", producers, slot.grad_bytes or 0), wheres

    def _drop_in(self, module, slot, is_parameter, op):
        """(drop-in name or None, stock class name, residual bytes) of one
        producer (its node's name ``op``) of a module for the slot: the same
        for every call of the module and every backward of a block, so
        worked out once per block."""
        drop_in = _drop_ins().drop_in_for(module)
        if drop_in is not None:
            owned = slot.leaf is not None and self._names.owned_by(slot.leaf, module, getattr(drop_in, "fuses_submodules", False))
            # FusedLinear, FusedConv1D and FusedGRUCell also add into their
            # input's buffer; the others fuse their own parameters only.
            fuses_input = any(klass.__name__ in _FUSE_INPUT for klass in drop_in.__mro__)
            if not owned and not (fuses_input and not is_parameter):
                drop_in = None
            # A drop-in made of several ops replaces some of them only (a
            # cell's products, not its gates' arithmetic): those it names.
            stock_ops = getattr(drop_in, "stock_ops", None)
            if stock_ops is not None and op not in stock_ops:
                drop_in = None
        route = None
        if drop_in is None and is_parameter and op in _ROUTED_OPS and not self._names.owned_by(slot.leaf, module):
            route = self._names.attribute(slot.leaf, self._calls.paths.get(id(module), ""))
        return drop_in.__name__ if drop_in else None, type(module).__name__, _residual(module), route

    def _is_parameter(self, slot):
        return slot.leaf is not None and self._names is not None and self._names.name(slot.leaf) is not None
