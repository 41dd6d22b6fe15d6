"""Check a custom ``torch.autograd.Function`` against the ctx contract.

``check_function(MyFunction, x, w)`` runs ``MyFunction`` through the rules of
the documented contract and returns a :class:`FunctionReport`; when a rule is
broken it raises :class:`ContractViolation` (an ``AssertionError``) carrying
the report. Every failure names the rule, the input or output concerned and
how to fix it. See docs/checking-your-function.md.

The checks:

``forward``                 ``Function.apply`` runs on the sample arguments.
``mark_dirty``              every input forward changes in place is marked dirty.
``mark_non_differentiable`` every output that cannot carry a gradient
                            (integer, bool) is marked non-differentiable.
``gradcheck``               gradients against finite differences (float64
                            copies of the sample where the Function allows).
``gradgradcheck``           the same for double backward, unless backward is
                            ``@once_differentiable``.
``input_grad_buffers``      for a Function that reads ``ctx.input_grad_buffers``:
                            for each input, the same graph with the input's
                            buffer exposed and with it None gives the same
                            gradients, and no buffer outlives the backward.
``set_output_grad_dtype``   declared gradient dtypes are valid, and backward
                            receives them for root gradients of another dtype.
``boxed_grads``             a ``boxed_grads_call`` Function's backward releases
                            the gradients it removes from the list.

The checker patches ``FunctionCtx`` (``mark_dirty``,
``mark_non_differentiable``, ``set_output_grad_dtype``, ``input_grad_buffers``)
and the checked Function's backward class with recording wrappers while it
runs, and restores them afterwards: do not check Functions from several
threads at once.
"""
import contextlib
import gc
import inspect
import re
import warnings
import weakref
from dataclasses import dataclass, field

import torch
from torch.autograd.function import Function, FunctionCtx, once_differentiable

from . import _explain, _features

__all__ = ["check_function", "FunctionReport", "CheckResult", "ContractViolation"]

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"

RULES = {
    "forward": "Function.apply runs on the sample arguments",
    "mark_dirty": "every input that forward changes in place is passed to ctx.mark_dirty",
    "mark_non_differentiable": (
        "every output that cannot carry a gradient (integer or bool dtype) is "
        "passed to ctx.mark_non_differentiable"
    ),
    "gradcheck": "backward's gradients match finite differences",
    "gradgradcheck": (
        "double backward matches finite differences, or backward is @once_differentiable"
    ),
    "input_grad_buffers.fused_matches_fallback": (
        "the gradients are the same whether an input's ctx.input_grad_buffers "
        "entry is exposed (fused path) or None (fallback path)"
    ),
    "input_grad_buffers.not_retained": (
        "a buffer from ctx.input_grad_buffers is not kept after backward returns"
    ),
    "set_output_grad_dtype.valid": (
        "each declaration is None or a floating point / complex dtype of the "
        "output's kind, one per output, concrete only for differentiable outputs"
    ),
    "set_output_grad_dtype.honoured": (
        "backward receives each output's gradient in the declared dtype, "
        "whatever the dtype of the root gradient"
    ),
    "boxed_grads.released": (
        "with boxed_grads_call, a gradient backward removes from the list is "
        "freed (nothing else keeps it) by the time backward returns"
    ),
}


@dataclass
class CheckResult:
    """One check: which rule, passed/failed/skipped, about what, how to fix."""

    name: str
    status: str
    detail: str = ""
    subject: str | None = None  # "input 0 (x)", "output 1"
    fix: str | None = None

    @property
    def rule(self):
        return RULES[self.name]

    @property
    def failed(self):
        return self.status == FAILED

    def __str__(self):
        tag = {PASSED: "PASS", FAILED: "FAIL", SKIPPED: "SKIP"}[self.status]
        head = f"{tag}  {self.name}"
        if self.subject:
            head += f" [{self.subject}]"
        if self.status == PASSED:
            return head + (f": {self.detail}" if self.detail else "")
        lines = [head]
        if self.status == FAILED:
            lines.append(f"      rule:  {self.rule}")
        for i, text in enumerate(self.detail.splitlines() or [""]):
            lines.append(("      found: " if i == 0 else "             ") + text)
        if self.fix:
            lines.append(f"      fix:   {self.fix}")
        return "\n".join(lines)


@dataclass
class FunctionReport:
    """What :func:`check_function` found; ``str()`` is the readable report."""

    function: str
    torch_version: str
    providers: dict
    precision: str = ""
    results: list = field(default_factory=list)

    @property
    def passed(self):
        return not self.failures

    @property
    def failures(self):
        return [r for r in self.results if r.status == FAILED]

    def results_for(self, name):
        return [r for r in self.results if r.name == name or r.name.startswith(name + ".")]

    def add(self, name, status, detail="", subject=None, fix=None):
        result = CheckResult(name, status, detail, subject, fix)
        self.results.append(result)
        return result

    def __str__(self):
        counts = {s: sum(r.status == s for r in self.results) for s in (PASSED, FAILED, SKIPPED)}
        head = (
            f"check_function({self.function}): {counts[PASSED]} passed, "
            f"{counts[FAILED]} failed, {counts[SKIPPED]} skipped"
        )
        info = (
            f"  torch {self.torch_version}; input_grad_buffers: "
            f"{self.providers.get('input_grad_buffers')}, set_output_grad_dtype: "
            f"{self.providers.get('set_output_grad_dtype')}"
        )
        if self.precision:
            info += f"; {self.precision}"
        body = ["  " + line for r in self.results for line in str(r).splitlines()]
        return "\n".join([head, info] + body)


class ContractViolation(AssertionError):
    """A check failed; ``.report`` is the :class:`FunctionReport`."""

    def __init__(self, report):
        super().__init__(str(report))
        self.report = report


# --- helpers ------------------------------------------------------------------

_ONCE_DIFFERENTIABLE_CODE = once_differentiable(lambda ctx: None).__code__


def _user_backward(fn):
    vjp = getattr(fn, "vjp", None)
    if vjp is not None and vjp is not Function.vjp:
        return vjp
    return fn.backward


def _is_once_differentiable(fn):
    return getattr(_user_backward(fn), "__code__", None) is _ONCE_DIFFERENTIABLE_CODE


def _is_float(t):
    return isinstance(t, torch.Tensor) and (t.dtype.is_floating_point or t.dtype.is_complex)


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def _arg_names(fn, count):
    try:
        params = list(inspect.signature(fn.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    uses_setup_context = getattr(fn, "setup_context", None) is not getattr(
        torch.autograd.function._SingleLevelFunction, "setup_context", None
    )
    if params and not uses_setup_context:
        params = params[1:]  # ctx
    names = []
    for i in range(count):
        if i < len(params) and params[i].kind in (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        ):
            names.append(f"input {i} ({params[i].name})")
        else:
            names.append(f"input {i}")
    return names


def _other_dtype(dtype):
    """A dtype of the same kind that differs from ``dtype``."""
    if dtype.is_complex:
        return torch.complex64 if dtype == torch.complex128 else torch.complex128
    return torch.float32 if dtype == torch.float64 else torch.float64


def _random_like(t, gen):
    real = t.dtype.to_real() if t.dtype.is_complex else t.dtype
    value = torch.rand(t.shape, generator=gen, dtype=torch.float64) * 2 - 1
    if t.dtype.is_complex:
        imag = torch.rand(t.shape, generator=gen, dtype=torch.float64) * 2 - 1
        value = torch.complex(value, imag)
        return value.to(t.dtype).to(t.device)
    return value.to(real).to(t.device)


def _tolerances(dtypes):
    """(eps, atol, rtol) for finite differences at the lowest precision seen."""
    if any(d in (torch.float16, torch.bfloat16) for d in dtypes):
        return 1e-1, 1e-1, 1e-1
    if any(d in (torch.float32, torch.complex64) for d in dtypes):
        return 1e-3, 1e-2, 1e-2
    return 1e-6, 1e-5, 1e-3


def _close(a, b, atol, rtol):
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape:
        return False
    return torch.allclose(a.to(b.dtype), b, atol=atol, rtol=rtol, equal_nan=True)


def _same_values(a, b):
    """Equal values, NaN equal to NaN."""
    try:
        if torch.equal(a, b):
            return True
        if not (a.dtype.is_floating_point or a.dtype.is_complex):
            return False
        return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(
            torch.nan_to_num(a), torch.nan_to_num(b)
        )
    except RuntimeError:
        return False


def _max_abs(a, b):
    return (a.to(torch.float64) - b.to(torch.float64)).abs().max().item() if a.numel() else 0.0


def _first_lines(text, n=12):
    lines = str(text).strip().splitlines()
    return "\n".join(lines[:n] + (["..."] if len(lines) > n else []))


def _error_text(exc):
    return f"{type(exc).__name__}: {_first_lines(exc)}"


@contextlib.contextmanager
def _patched(owner, name, make_wrapper):
    """Replace ``owner.<name>`` by ``make_wrapper(original)``; restore after."""
    had_own = name in owner.__dict__
    own = owner.__dict__.get(name)
    original = getattr(owner, name)
    setattr(owner, name, make_wrapper(original))
    try:
        yield original
    finally:
        if had_own:
            setattr(owner, name, own)
        else:
            delattr(owner, name)


class _Read:
    """One read of ctx.input_grad_buffers by the checked Function."""

    def __init__(self, ctx, result, raw):
        self.exposed = [b is not None for b in result]
        self.refs = {
            i: weakref.ref(b) for i, b in enumerate(result) if b is not None
        }
        self.explanation = _explain.build_reasons(ctx, result, raw)

    def alive(self):
        return [i for i, ref in self.refs.items() if ref() is not None]


class _Checker:
    def __init__(self, fn, args, options):
        self.fn = fn
        self.args = args
        self.atol = options.pop("atol", None)
        self.rtol = options.pop("rtol", None)
        self.eps = options.pop("eps", None)
        self.run_gradcheck = options.pop("gradcheck", True)
        self.double_backward = options.pop("double_backward", None)
        self.fast_mode = options.pop("fast_mode", False)
        self.seed = options.pop("seed", 0)
        if options:
            raise TypeError(f"check_function() got unknown options: {sorted(options)}")
        self.names = _arg_names(fn, len(args))
        self.positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        self.report = FunctionReport(
            function=fn.__qualname__,
            torch_version=torch.__version__,
            providers=_features.features(),
        )
        self.reads = 0
        self.run_reads = None  # list of _Read during a run, else None
        self.calls = []  # (method, ctx, args) of ctx methods called by fn
        self.recording = False
        self.dtype = None  # None: the sample's dtypes; torch.float64: float64 copies

    # -- inputs and runs ---------------------------------------------------------

    def inputs(self, dtype=None):
        """Fresh leaves (copies of the sample) and what to pass to apply: a
        clone of each leaf that requires grad, so that forward may change it
        in place (mark_dirty) without touching the leaf."""
        leaves, passed = [], []
        for a in self.args:
            if not isinstance(a, torch.Tensor):
                leaves.append(a)
                passed.append(a)
                continue
            t = a.detach().clone()
            if dtype is not None and _is_float(t):
                t = t.to(torch.complex128 if t.dtype.is_complex else torch.float64)
            t.requires_grad_(a.requires_grad)
            leaves.append(t)
            passed.append(t.clone() if t.requires_grad else t)
        return leaves, passed

    def on_read(self, ctx, result, raw):
        if getattr(type(ctx), "_forward_cls", None) is not self.fn:
            return
        self.reads += 1
        if self.run_reads is not None:
            self.run_reads.append(_Read(ctx, result, raw))

    def on_ctx_call(self, name):
        def make(original):
            def wrapper(ctx, *args, **kwargs):
                # Only during the forward check: holding ctx objects later would
                # keep buffers stored on a ctx alive past the graph.
                if self.recording and getattr(type(ctx), "_forward_cls", None) is self.fn:
                    self.calls.append((name, ctx, args))
                return original(ctx, *args, **kwargs)

            wrapper.__doc__ = original.__doc__
            return wrapper

        return make

    def marked(self, name):
        return [t for method, _, args in self.calls if method == name for t in args]

    def differentiable_outputs(self, outs):
        return [o for o in _as_tuple(outs) if isinstance(o, torch.Tensor) and o.requires_grad]

    def backward_with_fresh_grads(self, outs, extra=None):
        """Backward of sum((o * r).sum()) (+ extra): the gradient of each
        output is a fresh tensor that only the engine owns (MulBackward)."""
        gen = torch.Generator().manual_seed(self.seed + 1)
        terms = [(o * _random_like(o, gen)).sum() for o in self.differentiable_outputs(outs)]
        if extra is not None:
            terms.append(extra)
        terms = [t.real if t.is_complex() else t for t in terms]
        if terms:
            sum(terms).backward()

    def name_of(self, i):
        return self.names[i]

    # -- the checks ------------------------------------------------------------

    def run(self):
        fn = self.fn
        with contextlib.ExitStack() as stack:
            stack.enter_context(_explain.observe(self.on_read, wants_reasons=True))
            for method in ("mark_dirty", "mark_non_differentiable", "set_output_grad_dtype"):
                if hasattr(FunctionCtx, method):
                    stack.enter_context(_patched(FunctionCtx, method, self.on_ctx_call(method)))
            if not self.check_forward():
                return self.report
            if not self.check_output_grad_dtype():
                self.report.add(
                    "gradcheck", SKIPPED, "the declared gradient dtypes are invalid"
                )
                return self.report
            self.choose_precision()
            self.check_gradients()
            if self.declared is not None:
                self.check_output_grad_dtype_honoured()
            self.check_input_grad_buffers()
            if getattr(fn, "boxed_grads_call", False):
                self.check_boxed()
        return self.report

    def check_forward(self):
        r = self.report
        leaves, passed = self.inputs()
        before = {
            i: (passed[i]._version, passed[i].detach().clone()) for i in self.positions
        }
        self.calls.clear()
        self.recording = True
        try:
            outs = self.fn.apply(*passed)
        except Exception as exc:  # noqa: BLE001 - reported
            fix = "see the error; the remaining checks need a forward that runs"
            if "set_output_grad_dtype" in str(exc):
                fix = (
                    "declare one torch.dtype or None per value forward returns: a "
                    "floating point or complex dtype of the output's kind, None for "
                    "non-tensor and non-differentiable outputs"
                )
            r.add("forward", FAILED, _error_text(exc), fix=fix)
            return False
        finally:
            self.recording = False
        r.add("forward", PASSED)
        outs_t = _as_tuple(outs)
        self.output_dtypes = [o.dtype if isinstance(o, torch.Tensor) else None for o in outs_t]
        self.declared = None
        for method, ctx, args in self.calls:
            if method == "set_output_grad_dtype":
                self.declared = tuple(args)

        # mark_dirty
        dirty = self.marked("mark_dirty")
        self.dirtied = set()
        problems = []
        for i in self.positions:
            version, snapshot = before[i]
            t = passed[i]
            changed = t._version != version or not _same_values(t.detach(), snapshot)
            if not changed:
                continue
            self.dirtied.add(i)
            if not any(t is d for d in dirty):
                how = "its values changed" if t._version == version else "its version counter moved"
                problems.append((i, how))
        for i, how in problems:
            r.add(
                "mark_dirty",
                FAILED,
                f"forward changed {self.name_of(i)} in place ({how}) without "
                "ctx.mark_dirty: autograd does not know the tensor's value changed, "
                "so gradients through it (and saved copies of it) are wrong",
                subject=self.name_of(i),
                fix=f"call ctx.mark_dirty({self._param(i)}) in forward and return the "
                "modified tensor as an output, or work on a copy (x = x.clone())",
            )
        if not problems:
            r.add(
                "mark_dirty",
                PASSED,
                f"inputs changed in place: {sorted(self.dirtied) or 'none'}",
            )

        # mark_non_differentiable
        nondiff = self.marked("mark_non_differentiable")
        problems = 0
        for k, o in enumerate(outs_t):
            if not isinstance(o, torch.Tensor) or _is_float(o):
                continue
            marked = any(o is m for m in nondiff)
            if o.requires_grad or not marked:
                problems += 1
                r.add(
                    "mark_non_differentiable",
                    FAILED,
                    f"output {k} is a {o.dtype} tensor, which cannot carry a gradient, "
                    "but forward did not mark it non-differentiable"
                    + (" (and it requires grad)" if o.requires_grad else "")
                    + ": backward still receives a gradient argument for it, a "
                    "materialized zero tensor",
                    subject=f"output {k}",
                    fix=f"call ctx.mark_non_differentiable(...) with output {k} in "
                    "forward (as for the indices of a sort)",
                )
        if not problems:
            r.add("mark_non_differentiable", PASSED)
        self.calls.clear()
        return True

    def _param(self, i):
        name = self.names[i]
        return name[name.index("(") + 1 : -1] if "(" in name else f"<input {i}>"

    def choose_precision(self):
        floats = [self.args[i] for i in self.positions if _is_float(self.args[i])]
        if all(t.dtype in (torch.float64, torch.complex128) for t in floats):
            self.dtype = None
            self.report.precision = "checked in float64" if floats else ""
            return
        try:
            leaves, passed = self.inputs(torch.float64)
            outs = self.fn.apply(*passed)
            self.backward_with_fresh_grads(outs)
        except Exception as exc:  # noqa: BLE001 - fall back to the sample's dtypes
            self.dtype = None
            self.report.precision = (
                "checked in the sample's dtypes (float64 copies fail: "
                f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]})"
            )
        else:
            self.dtype = torch.float64
            self.report.precision = "checked in float64 copies of the sample"

    def _func(self):
        """The Function as gradcheck sees it: tensors in, tensor outputs out."""
        template = list(self.args)

        def func(*tensors):
            full = list(template)
            for p, t in zip(self.positions, tensors):
                full[p] = t.clone() if t.requires_grad else t
            outs = self.fn.apply(*full)
            return tuple(o for o in _as_tuple(outs) if isinstance(o, torch.Tensor))

        return func

    def _gradcheck_setup(self):
        leaves, _ = self.inputs(self.dtype)
        tensors = tuple(leaves[p] for p in self.positions)
        with torch.no_grad():
            outs = self._func()(*[t.detach() for t in tensors])
        dtypes = [t.dtype for t in tensors if _is_float(t)] + [
            o.dtype for o in outs if _is_float(o)
        ]
        eps, atol, rtol = _tolerances(dtypes)
        kwargs = dict(
            eps=self.eps if self.eps is not None else eps,
            atol=self.atol if self.atol is not None else atol,
            rtol=self.rtol if self.rtol is not None else rtol,
            fast_mode=self.fast_mode,
        )
        return tensors, kwargs

    def check_gradients(self):
        r = self.report
        if not self.run_gradcheck:
            r.add("gradcheck", SKIPPED, "disabled (gradcheck=False)")
            r.add("gradgradcheck", SKIPPED, "disabled (gradcheck=False)")
            return
        if not any(isinstance(a, torch.Tensor) and a.requires_grad and _is_float(a) for a in self.args):
            r.add("gradcheck", SKIPPED, "no floating point sample argument requires grad")
            r.add("gradgradcheck", SKIPPED, "no floating point sample argument requires grad")
            return
        tensors, kwargs = self._gradcheck_setup()
        func = self._func()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.autograd.gradcheck(func, tensors, **kwargs)
        except Exception as exc:  # noqa: BLE001 - reported
            fix = (
                "backward must return, for each input, the gradient of the outputs "
                "with respect to that input (grad_output times the Jacobian): check the "
                "formula against the forward, and that a fused path adds its contribution "
                "exactly once"
            )
            if "handle undefined output grads" in str(exc):
                fix = (
                    "make backward work when an output's gradient is a materialized zero "
                    "tensor (or None with ctx.set_materialize_grads(False)); where its "
                    "dtype matters, cast it yourself (g.to(dtype))"
                )
            r.add(
                "gradcheck",
                FAILED,
                self._describe_jacobian_error(exc),
                subject=self._jacobian_subject(exc),
                fix=fix,
            )
            r.add("gradgradcheck", SKIPPED, "first-order gradients are wrong")
            return
        r.add("gradcheck", PASSED, f"eps={kwargs['eps']:g}, atol={kwargs['atol']:g}, rtol={kwargs['rtol']:g}")
        self.check_double_backward(func, tensors, kwargs)

    def check_double_backward(self, func, tensors, kwargs):
        r = self.report
        if self.double_backward is False:
            r.add("gradgradcheck", SKIPPED, "disabled (double_backward=False)")
            return
        if _is_once_differentiable(self.fn):
            r.add("gradgradcheck", SKIPPED, "backward is @once_differentiable")
            return
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.autograd.gradgradcheck(func, tensors, **kwargs)
        except Exception as exc:  # noqa: BLE001 - reported
            text = str(exc)
            if "input_grad_buffers does not support create_graph=True" in text:
                r.add(
                    "gradgradcheck",
                    SKIPPED,
                    "backward reads ctx.input_grad_buffers, which raises under "
                    "create_graph=True (as documented): this Function has first-order "
                    "gradients only. Decorate backward with @once_differentiable to say "
                    "so, or read the property only when not torch.is_grad_enabled().",
                )
                return
            r.add(
                "gradgradcheck",
                FAILED,
                self._describe_jacobian_error(exc),
                subject=self._jacobian_subject(exc),
                fix="make backward differentiable (compute it with differentiable torch "
                "operations: no .detach(), .data, torch.no_grad() or numpy), or decorate "
                "it with @torch.autograd.function.once_differentiable so that double "
                "backward raises a clear error instead of giving wrong values",
            )
            return
        r.add("gradgradcheck", PASSED)

    def _jacobian_subject(self, exc):
        m = re.search(r"output (\d+) with respect to input (\d+)", str(exc))
        if not m:
            return None
        k, j = int(m.group(1)), int(m.group(2))
        i = self.positions[j] if j < len(self.positions) else j
        return f"{self.name_of(i)}, output {k}"

    def _describe_jacobian_error(self, exc):
        text = _error_text(exc)
        if "handle undefined output grads" in text:
            text += (
                "\ngradcheck calls backward with one output's gradient undefined (it "
                "arrives as zeros unless ctx.set_materialize_grads(False)); backward "
                "raised or returned a wrong gradient for it"
            )
            if self.declared is not None and self.report.providers.get(
                "set_output_grad_dtype"
            ) == "native":
                text += (
                    ". Note: on this torch such zeros arrive in the output's dtype, "
                    "not the declared one (upstream deviation 2, docs/deviations.md)"
                )
        return text

    # -- set_output_grad_dtype ---------------------------------------------------

    def check_output_grad_dtype(self):
        r = self.report
        if self.declared is None:
            r.add("set_output_grad_dtype.valid", SKIPPED, "forward does not call set_output_grad_dtype")
            return True
        problems = 0
        if len(self.declared) != len(self.output_dtypes):
            problems += 1
            r.add(
                "set_output_grad_dtype.valid",
                FAILED,
                f"{len(self.declared)} declarations for {len(self.output_dtypes)} outputs",
                fix="declare one dtype or None per value forward returns, non-tensors included",
            )
        for k, (d, od) in enumerate(zip(self.declared, self.output_dtypes)):
            if d is None:
                continue
            if not isinstance(d, torch.dtype):
                why = f"{d!r} is not a torch.dtype"
            elif od is None or not (od.is_floating_point or od.is_complex):
                why = f"a dtype ({d}) was declared for an output that has no gradient ({od or 'not a tensor'})"
            elif not (d.is_floating_point or d.is_complex):
                why = f"{d} cannot carry a gradient"
                if self.report.providers.get("set_output_grad_dtype") == "native":
                    why += (" (this torch accepts it and fails inside the engine at "
                            "backward: upstream deviation 1, docs/deviations.md)")
            elif d.is_complex != od.is_complex:
                why = f"{d} is not of the output's kind ({od})"
            else:
                continue
            problems += 1
            r.add(
                "set_output_grad_dtype.valid",
                FAILED,
                f"output {k}: {why}",
                subject=f"output {k}",
                fix="declare a floating point dtype for a real output, a complex dtype "
                "for a complex one, or None (required for non-tensor and "
                "non-differentiable outputs)",
            )
        if problems:
            return False
        r.add("set_output_grad_dtype.valid", PASSED, f"declared {self._dtypes_text(self.declared)}")
        return True

    @staticmethod
    def _dtypes_text(dtypes):
        return "(" + ", ".join(str(d).replace("torch.", "") for d in dtypes) + ")"

    def check_output_grad_dtype_honoured(self):
        r = self.report
        seen = []

        def record(grads):
            seen.append([g.dtype if isinstance(g, torch.Tensor) else None for g in grads])

        def spy_apply(original):
            def apply(ctx, *args):
                record(args)
                return original(ctx, *args)

            return apply

        def spy_apply_boxed(original):
            def apply_boxed(ctx, *args):
                record(args[0] if len(args) == 1 and isinstance(args[0], list) else args)
                return original(ctx, *args)

            return apply_boxed

        leaves, passed = self.inputs()
        outs = _as_tuple(self.fn.apply(*passed))
        roots, grads, expect = [], [], {}
        for k, o in enumerate(outs):
            if not (isinstance(o, torch.Tensor) and o.requires_grad):
                continue
            d = self.declared[k] if k < len(self.declared) else o.dtype
            root_dtype = _other_dtype(d if d is not None else o.dtype)
            if k < len(self.declared):
                expect[k] = d if d is not None else root_dtype
            roots.append(o)
            grads.append(torch.ones(o.shape, dtype=root_dtype, device=o.device))
        if not expect:
            r.add("set_output_grad_dtype.honoured", SKIPPED, "no differentiable output to check")
            return
        bw = self.fn._backward_cls
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(_patched(bw, "apply", spy_apply))
                if hasattr(bw, "apply_boxed"):
                    stack.enter_context(_patched(bw, "apply_boxed", spy_apply_boxed))
                torch.autograd.backward(roots, grads)
        except Exception as exc:  # noqa: BLE001 - reported
            r.add(
                "set_output_grad_dtype.honoured",
                FAILED,
                "backward failed when the root gradients had other dtypes than the "
                f"outputs ({self._dtypes_text([g.dtype for g in grads])}): {_error_text(exc)}",
                fix="backward must accept gradients in the declared dtypes; an output "
                "declared None receives its gradient in whatever dtype it arrives",
            )
            return
        if not seen:
            r.add("set_output_grad_dtype.honoured", SKIPPED, "backward was not called")
            return
        got = seen[0]
        problems = 0
        for k, d in expect.items():
            if k < len(got) and got[k] != d:
                problems += 1
                r.add(
                    "set_output_grad_dtype.honoured",
                    FAILED,
                    f"output {k}: declared {d if self.declared[k] is not None else 'None'}"
                    f", backward received {got[k]} (root gradient {grads[list(expect).index(k)].dtype})",
                    subject=f"output {k}",
                    fix="report this: the engine did not apply the declaration "
                    "(see docs/set_output_grad_dtype.md)",
                )
        if not problems:
            r.add(
                "set_output_grad_dtype.honoured",
                PASSED,
                "backward received " + self._dtypes_text([got[k] for k in expect]),
            )

    # -- input_grad_buffers ------------------------------------------------------

    def buffer_run(self, i, exposed):
        """Backward of the Function plus an extra consumer (x_i * c).sum() of
        input i: created after the Function (it runs first: the buffer holds
        its fresh dense gradient, exposed) or before (the Function runs first:
        None). Returns (leaf grads, reads, liveness)."""
        leaves, passed = self.inputs(self.dtype)
        gen = torch.Generator().manual_seed(self.seed + 2)
        c = _random_like(passed[i], gen)
        extra = None
        if not exposed:
            extra = (passed[i] * c).sum()
        self.run_reads = reads = []
        try:
            outs = self.fn.apply(*passed)
            if exposed:
                extra = (passed[i] * c).sum()
            if extra.is_complex():
                extra = extra.real
            self.backward_with_fresh_grads(outs, extra)
        finally:
            self.run_reads = None
        grads = [
            (l.grad.detach().clone() if l.grad is not None else None)
            if isinstance(l, torch.Tensor)
            else None
            for l in leaves
        ]
        # Retention: nothing but the Function may hold an exposed buffer now.
        # A leaf's .grad may be the buffer itself (AccumulateGrad steals it).
        for l in leaves:
            if isinstance(l, torch.Tensor):
                l.grad = None
        del extra
        alive_with_graph = [idx for read in reads for idx in read.alive()]
        del outs  # the graph and the ctx go with it
        alive_after = []
        if alive_with_graph:
            gc.collect()
            alive_after = [idx for read in reads for idx in read.alive()]
        return grads, c, reads, alive_with_graph, alive_after

    def check_input_grad_buffers(self):
        r = self.report
        name = "input_grad_buffers.fused_matches_fallback"
        if not hasattr(FunctionCtx, "input_grad_buffers"):
            r.add(name, SKIPPED, "this torch has no ctx.input_grad_buffers")
            return
        if self.reads == 0:  # no backward has run yet (gradcheck=False, float64 sample)
            try:
                leaves, passed = self.inputs(self.dtype)
                self.backward_with_fresh_grads(self.fn.apply(*passed))
            except Exception:  # noqa: BLE001 - the runs below report it
                pass
        if self.reads == 0:
            r.add(name, SKIPPED, "backward does not read ctx.input_grad_buffers")
            return
        candidates = [
            i
            for i in self.positions
            if self.args[i].requires_grad and _is_float(self.args[i])
        ]
        retained = set()
        any_exposed = False
        for i in candidates:
            subject = self.name_of(i)
            if i in self.dirtied:
                r.add(name, SKIPPED, "forward changes this input in place: no later consumer "
                      "of its old value can be arranged", subject=subject)
                continue
            try:
                fused, c, reads, alive_graph, alive_after = self.buffer_run(i, exposed=True)
                fallback, _, fb_reads, fb_alive_graph, fb_alive_after = self.buffer_run(i, exposed=False)
            except Exception as exc:  # noqa: BLE001 - reported
                r.add(
                    name,
                    FAILED,
                    "backward raised when another consumer's gradient was waiting in "
                    f"the buffer: {_error_text(exc)}",
                    subject=subject,
                    fix="both paths (buffer exposed, buffer None) must run",
                )
                continue
            for idx in sorted(set(alive_graph + fb_alive_graph)):
                if idx not in retained:
                    retained.add(idx)
                    self._report_retained(idx, idx in set(alive_after + fb_alive_after))
            was_exposed = any(read.exposed[i] for read in reads if i < len(read.exposed))
            any_exposed |= any(any(read.exposed) for read in reads + fb_reads)
            if not reads:
                r.add(name, SKIPPED, "backward did not read ctx.input_grad_buffers in this "
                      "graph", subject=subject)
                continue
            if not was_exposed:
                why = reads[0].explanation[i].text if i < len(reads[0].explanation) else "?"
                r.add(name, SKIPPED, f"could not arrange an exposed buffer: {why}", subject=subject)
                continue
            mismatches = [
                j
                for j in range(len(self.args))
                if isinstance(fused[j], torch.Tensor) or isinstance(fallback[j], torch.Tensor)
                if not _close(fused[j], fallback[j], *self._compare_tolerances(fallback[j]))
            ]
            if not mismatches:
                r.add(name, PASSED, "exposed and None give the same gradients", subject=subject)
                continue
            for j in mismatches:
                r.add(
                    name,
                    FAILED,
                    self._diagnose(i, j, fused[j], fallback[j], c),
                    subject=subject if j == i else f"{self.name_of(j)}, with {subject}'s buffer exposed",
                    fix=self._buffer_fix(i, j, fused[j], fallback[j], c),
                )
        if any_exposed and not retained:
            r.add("input_grad_buffers.not_retained", PASSED, "no buffer outlives backward")

    def _compare_tolerances(self, ref):
        if ref is None:
            return 0.0, 0.0
        _, atol, rtol = _tolerances([ref.dtype])
        if ref.dtype in (torch.float64, torch.complex128):
            atol, rtol = 1e-7, 1e-7
        return (self.atol or atol), (self.rtol or rtol)

    def _classify(self, i, j, fused, fallback, c):
        if fused is None or fallback is None:
            return "missing"
        if j != i:
            return "other"
        atol, rtol = self._compare_tolerances(fallback)
        c = c.to(fallback.dtype)
        own = fallback - c  # this Function's contribution
        if _close(fused, fallback + own, atol, rtol):
            return "twice"
        if _close(fused, own, atol, rtol):
            return "overwrote"
        if _close(fused, c, atol, rtol):
            return "dropped"
        return "other"

    def _diagnose(self, i, j, fused, fallback, c):
        kind = self._classify(i, j, fused, fallback, c)
        head = {
            "twice": "the fused path counts this Function's contribution twice: it "
            "accumulated into the buffer and also returned a gradient for the input",
            "overwrote": "the fused path lost the other consumer's contribution: it "
            "overwrote the buffer (copy_ or assignment) instead of adding to it",
            "dropped": "the fused path lost this Function's contribution: it returned "
            "None without accumulating into the buffer in place",
            "missing": "a gradient is missing on one of the paths",
            "other": "the gradients differ",
        }[kind]
        if fused is None or fallback is None:
            return head
        return (
            f"{head} (buffer exposed vs None: max abs difference "
            f"{_max_abs(fused, fallback):.3g})"
        )

    def _buffer_fix(self, i, j, fused, fallback, c):
        kind = self._classify(i, j, fused, fallback, c)
        if kind == "twice":
            return "return None for an input whose buffer you accumulated into"
        if kind == "overwrote":
            return "accumulate in place (buffer.add_(g), buffer.addmm_(...)), never copy_ into the buffer"
        if kind == "dropped":
            return ("add your contribution into the buffer itself, in place (add_, addmm_), "
                    "not into a copy (buffer + g), before returning None")
        return ("the fused path (buffer exposed) must compute the same gradient as the "
                "fallback: accumulate into the buffer in place and return None for that "
                "input, and leave the other inputs' gradients unchanged")

    def _report_retained(self, idx, outlives_graph):
        where = (
            "in a global, a closure or a class attribute (it outlives the graph)"
            if outlives_graph
            else "on ctx or on something the graph keeps alive (it dies with the graph)"
        )
        self.report.add(
            "input_grad_buffers.not_retained",
            FAILED,
            f"the buffer handed out for {self.name_of(idx)} is still alive after "
            f"backward returned: it is kept {where}. A later producer may replace "
            "the engine's buffer, making the kept tensor stale, and holding it makes "
            "the engine fall back to out-of-place accumulation",
            subject=self.name_of(idx),
            fix="use the buffer only inside backward, synchronously, and drop every "
            "reference to it (and to views of it) before returning",
        )

    # -- boxed grads -------------------------------------------------------------

    def check_boxed(self):
        r = self.report
        name = "boxed_grads.released"
        bw = self.fn._backward_cls
        if not hasattr(bw, "apply_boxed"):
            r.add(name, SKIPPED, "this torch has no boxed grads call")
            return
        seen = {}

        def spy(original):
            def apply_boxed(ctx, *args):
                grads = args[0] if len(args) == 1 and isinstance(args[0], list) else None
                if grads is None:
                    return original(ctx, *args)
                refs = [(k, weakref.ref(g)) for k, g in enumerate(grads) if isinstance(g, torch.Tensor)]
                result = original(ctx, *args)
                remaining = {id(g) for g in grads}
                returned = [t for t in _as_tuple(result) if isinstance(t, torch.Tensor)]
                kept, removed = [], []
                for k, ref in refs:
                    g = ref()
                    if g is None:
                        removed.append(k)
                        continue
                    if id(g) in remaining:
                        continue
                    removed.append(k)
                    if not any(_shares_storage(g, t) for t in returned):
                        kept.append(k)
                    del g
                seen.setdefault("calls", []).append((kept, removed, len(refs)))
                return result

            return apply_boxed

        leaves, passed = self.inputs(self.dtype)
        try:
            with _patched(bw, "apply_boxed", spy):
                outs = self.fn.apply(*passed)
                self.backward_with_fresh_grads(outs)
        except Exception as exc:  # noqa: BLE001 - reported elsewhere too
            r.add(name, FAILED, f"backward raised: {_error_text(exc)}", fix="see the error")
            return
        calls = seen.get("calls")
        if not calls:
            r.add(name, SKIPPED, "the engine did not call apply_boxed")
            return
        kept, removed, total = calls[0]
        for k in kept:
            r.add(
                name,
                FAILED,
                f"backward removed output {k}'s gradient from the list but it is still "
                "referenced when backward returns (kept on ctx, in a global or a "
                "closure, or in a copy of the list): its memory is not released, which "
                "is what boxed_grads_call is for",
                subject=f"output {k}",
                fix="do not keep gradients (or copies of the list) beyond their use: take "
                "them with grads.pop() / del grads[i] / grads.clear() and let the last "
                "reference go",
            )
        if not kept:
            detail = f"{len(removed)} of {total} gradient(s) removed and freed"
            if not removed:
                detail = ("backward removes no gradient from the list: boxed_grads_call "
                          "frees nothing early here")
            r.add(name, PASSED, detail)


def _shares_storage(a, b):
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.device == b.device
    except (RuntimeError, NotImplementedError):
        return a is b


def check_function(function, *sample_args, raise_on_failure=True, **options):
    """Run ``function`` (a ``torch.autograd.Function`` subclass) through the
    ctx contract with ``sample_args`` (what you would pass to ``apply``; keep
    the tensors small: gradients are checked by finite differences).

    Options: ``atol``, ``rtol``, ``eps`` (finite differences; chosen from the
    precision otherwise), ``gradcheck=False`` (skip finite differences),
    ``double_backward=False`` (skip gradgradcheck), ``fast_mode`` (gradcheck's),
    ``seed``, ``raise_on_failure=False`` (return the report instead of
    raising).

    Returns a :class:`FunctionReport`; raises :class:`ContractViolation` (an
    AssertionError whose message is the report) when a check fails.
    """
    if not (isinstance(function, type) and issubclass(function, Function)):
        raise TypeError(
            f"check_function expects a torch.autograd.Function subclass, got {function!r}"
        )
    report = _Checker(function, sample_args, dict(options)).run()
    if raise_on_failure and not report.passed:
        raise ContractViolation(report)
    return report
