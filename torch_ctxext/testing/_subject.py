"""The Function being checked, its sample arguments, and how to run it.

Every run gets fresh copies of every tensor argument (a forward that changes
an ``out`` buffer in place must not see the previous run's result) and
starts from the same random-number state (a forward that draws random
numbers, like dropout, is then a function of its inputs, which finite
differences need).
"""
import contextlib
import time
import weakref
from dataclasses import dataclass

import torch

from .. import _explain
from ._common import as_tuple, is_float, random_like, wide
from ._function_info import arg_names


class BudgetSpent(Exception):
    """The time budget ran out in the middle of a check."""


@dataclass
class OutputInfo:
    """One value forward returned, as seen in the first run."""

    index: int
    is_tensor: bool
    dtype: torch.dtype | None
    shape: tuple | None
    requires_grad: bool
    marked: bool  # passed to ctx.mark_non_differentiable

    @property
    def differentiable(self):
        return self.requires_grad

    @property
    def name(self):
        return f"output {self.index}"


class Budget:
    """Seconds the checker may spend; ``None``: unlimited."""

    def __init__(self, seconds):
        self.seconds = seconds
        self.start = time.perf_counter()
        self.paused_seconds = 0.0

    def elapsed(self):
        return time.perf_counter() - self.start

    def left(self):
        return float("inf") if self.seconds is None else self.seconds - self.elapsed()

    def spent(self):
        return self.left() <= 0

    def check(self):
        if self.spent():
            raise BudgetSpent()

    @contextlib.contextmanager
    def paused(self):
        """Time spent inside does not count (torch's one-time warm-ups)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.start += time.perf_counter() - start
            self.paused_seconds += time.perf_counter() - start

    def skip_reason(self):
        return (
            f"the time budget of {self.seconds:g} s was spent ({self.elapsed():.2f} s "
            "so far): pass a larger time_budget= or smaller samples"
        )


class Subject:
    """The Function under check, its samples and options, and what the
    checks learnt about it so far (filled in as they run)."""

    def __init__(self, fn, args, options):
        self.fn = fn
        self.args = args
        self.options = options
        self.names = arg_names(fn, len(args))
        self.positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        # Inputs gradients are checked for: floating tensors that require grad.
        self.grad_positions = [
            i for i in self.positions if args[i].requires_grad and is_float(args[i])
        ]
        self.budget = Budget(options.time_budget)
        self._rng_states = None
        self.dtype = None  # None: the sample's dtypes; float64: wide copies
        # Filled in by the forward checks.
        self.outputs = []  # [OutputInfo]
        self.declared = None  # set_output_grad_dtype's declarations
        self.dirtied = set()
        self.forward_ran = False
        self.saved_for_forward = False
        self.saved_for_backward = False
        self.backward_received = None  # per output: what the first backward got
        # Recording of ctx method calls and buffer reads (see runner).
        self.recording = False
        self.calls = []  # (method, ctx, args)
        self.reads = 0
        self.run_reads = None

    # -- names -------------------------------------------------------------------

    def name_of(self, i):
        return self.names[i]

    def param(self, i):
        name = self.names[i]
        return name[name.index("(") + 1 : -1] if "(" in name else f"<input {i}>"

    @property
    def differentiable_outputs(self):
        return [o.index for o in self.outputs if o.differentiable]

    # -- runs --------------------------------------------------------------------

    @contextlib.contextmanager
    def seeded(self):
        """Every run starts from the same random state: a forward that draws
        random numbers computes the same function each time. (Setting a
        saved generator state is ~100 times cheaper than manual_seed.)"""
        if self._rng_states is None:
            self._rng_states = _seeded_states(self.options.seed, self._devices())
        saved = [(gen, gen.get_state()) for gen, _ in self._rng_states]
        for gen, state in self._rng_states:
            gen.set_state(state)
        try:
            yield
        finally:
            for gen, state in saved:
                gen.set_state(state)

    def _devices(self):
        return sorted({a.device for a in self.args if isinstance(a, torch.Tensor)
                       and a.device.type == "cuda"}, key=str)

    def fresh(self, dtype=None, values=None):
        """(leaves, passed): fresh copies of the sample for one run.

        ``leaves`` are new tensors (the sample's values, or ``values[i]`` for
        a position given there), in ``dtype`` (float64 / complex128 copies)
        where given; ``passed`` is what goes to ``apply``: a clone of each
        leaf that requires grad (so that forward may change it in place,
        with mark_dirty, without touching the leaf), the leaf itself
        otherwise (a fresh copy already)."""
        leaves, passed = [], []
        for i, a in enumerate(self.args):
            if not isinstance(a, torch.Tensor):
                leaves.append(a)
                passed.append(a)
                continue
            source = values[i] if values is not None and i in values else a
            t = source.detach().clone()
            if dtype is not None and is_float(t):
                t = t.to(wide(t.dtype))
            t.requires_grad_(a.requires_grad and is_float(t))
            leaves.append(t)
            passed.append(t.clone() if t.requires_grad else t)
        return leaves, passed

    def apply(self, passed):
        return self.fn.apply(*passed)

    def backward_with_fresh_grads(self, outs, extra=None, seed_offset=1):
        """Backward of sum((o * r).sum()) (+ extra): the gradient of each
        output is a fresh tensor that only the engine owns (MulBackward)."""
        gen = torch.Generator().manual_seed(self.options.seed + seed_offset)
        terms = [
            (o * random_like(o, gen)).sum()
            for o in as_tuple(outs)
            if isinstance(o, torch.Tensor) and o.requires_grad
        ]
        if extra is not None:
            terms.append(extra)
        terms = [t.real if t.is_complex() else t for t in terms]
        if terms:
            sum(terms).backward()

    # -- recording (installed by the runner) --------------------------------------

    def on_read(self, ctx, result, raw):
        if getattr(type(ctx), "_forward_cls", None) is not self.fn:
            return
        self.reads += 1
        if self.run_reads is not None:
            self.run_reads.append(BufferRead(ctx, result, raw))

    def on_ctx_call(self, name):
        def make(original):
            def wrapper(ctx, *args, **kwargs):
                # Only while recording: holding ctx objects later would keep
                # buffers stored on a ctx alive past the graph.
                if self.recording and getattr(type(ctx), "_forward_cls", None) is self.fn:
                    self.calls.append((name, ctx, args))
                return original(ctx, *args, **kwargs)

            wrapper.__doc__ = original.__doc__
            return wrapper

        return make

    def marked(self, name):
        return [t for method, _, args in self.calls if method == name for t in args]


class BufferRead:
    """One read of ctx.input_grad_buffers by the checked Function; keeps
    weak references only."""

    def __init__(self, ctx, result, raw):
        self.exposed = [b is not None for b in result]
        self.refs = {i: weakref.ref(b) for i, b in enumerate(result) if b is not None}
        self.explanation = _explain.build_reasons(ctx, result, raw)

    def alive(self):
        return [i for i, ref in self.refs.items() if ref() is not None]


def refuse_samples_without_grad(fn, args):
    """Raise ValueError unless a sample argument is a tensor that requires
    grad: gradcheck's rule (``torch.autograd.gradcheck`` refuses such
    inputs too). Without one backward never runs, so every rule about
    backward and gradients would be skipped and the Function would pass
    without being checked. A tensor that requires grad inside a list, tuple
    or dict does not count: ``apply`` passes it to forward as it is, and no
    gradient flows back to it."""
    __tracebackhide__ = True  # pytest shows the caller's line and this message
    if any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return
    names = arg_names(fn, len(args))
    nested = [names[i] for i, a in enumerate(args) if _holds_grad_tensors(a)]
    if nested:
        why = (
            f"{', '.join(nested)} {'holds' if len(nested) == 1 else 'hold'} tensors that "
            "require grad inside a list, tuple or dict, but Function.apply treats only "
            "tensors passed directly as inputs: no gradient flows back to those"
        )
        how = "pass those tensors to apply (and to check_function) as separate arguments"
    else:
        why = (
            "none of the sample arguments is a tensor that requires grad, so backward "
            "never runs and there are no gradients to check"
        )
        how = (
            "pass at least one floating point (or complex) tensor with requires_grad=True, "
            "as you would in training, e.g. torch.randn(4, 3, dtype=torch.float64, "
            "requires_grad=True)"
        )
    raise ValueError(
        f"check_function({fn.__qualname__}): {why} (torch.autograd.gradcheck refuses "
        f"such inputs too): {how}"
    )


def _holds_grad_tensors(value):
    """A list, tuple or dict (nested any depth) holding a tensor that
    requires grad."""
    if isinstance(value, dict):
        value = list(value.values())
    if not isinstance(value, (list, tuple)):
        return False
    return any(isinstance(v, torch.Tensor) and v.requires_grad or _holds_grad_tensors(v)
               for v in value)


def _seeded_states(seed, cuda_devices):
    """[(generator, state after manual_seed(seed))] for the CPU and each device."""
    result = []
    cpu = torch.Generator()
    cpu.manual_seed(seed)
    result.append((torch.default_generator, cpu.get_state()))
    for device in cuda_devices:
        gen = torch.cuda.default_generators[device.index or 0]
        fresh = torch.Generator(device=device)
        fresh.manual_seed(seed)
        result.append((gen, fresh.get_state()))
    return result
