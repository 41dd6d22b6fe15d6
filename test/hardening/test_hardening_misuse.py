"""A catalogue of wrong uses of the ctx contract.

Each wrong use of ``ctx.input_grad_buffers`` / ``ctx.set_output_grad_dtype``
(wrong types and counts, wrong moment, wrong thread, a retained ctx or buffer
used later, a non-tensor where a tensor is needed, a hand-made FunctionCtx,
dtype objects of the wrong kind, ...) must be answered by a Python exception
whose exact text is pinned on the case (``@case(answer)``), and none may crash the process or trip an internal
assert. A few wrong uses cannot be detected at all (a buffer kept past its
backward); for those the pinned text records the defined outcome.

All cases run in one subprocess (``python test_hardening_misuse.py
--catalogue``) which reports each case as it completes: a segfault or abort
fails the case that was running (and the ones after it) instead of killing
pytest.

Where torch 2.15 answers differently the native text is pinned too
(``native=``); where it does not answer at all or trips its own INTERNAL
ASSERT (docs/deviations.md) the case is skipped on native torch with the
reason (``skip_native=``).
"""
import functools
import json
import os
import signal
import sys
import threading
from typing import NamedTuple, Optional

import torch
from torch.autograd import Function
from torch.autograd.function import FunctionCtx

import torch_ctxext
from doubling_functions import doubling, fuse_into_buffer  # class F: pinned answers name FBackward
from support import TESTS, python

if __name__ != "__main__":
    import pytest

FEATURES = torch_ctxext.features()
BACKPORT = FEATURES["input_grad_buffers"] == "torch_ctxext"
NATIVE_DTYPE = FEATURES["set_output_grad_dtype"] == "native"

CASES = {}
PINS = {}


class Pin(NamedTuple):
    """What a case answers: ``answer`` ('Type: message', or 'no exception'
    and what it returned), on native torch too unless ``native`` differs;
    ``skip_native``: why native torch is not asked."""

    answer: str
    native: Optional[str] = None
    skip_native: Optional[str] = None


def case(answer, native=None, skip_native=None):
    """Register a wrong use and pin its answer."""

    def register(f):
        CASES[f.__name__] = f
        PINS[f.__name__] = Pin(answer, native, skip_native)
        return f

    return register


def case_table(build, rows):
    """Register one case per row, ``name: (keyword arguments of build, Pin)``."""
    for name, (arguments, pin) in rows.items():
        CASES[name] = functools.partial(build, **arguments)
        PINS[name] = pin


# The answers several wrong uses share.
ONLY_WHILE_BACKWARD_RUNS = (
    "RuntimeError: input_grad_buffers can only be accessed while autograd is executing backward()"
)
ONLY_FROM_ITS_OWN_BACKWARD = (
    "RuntimeError: input_grad_buffers can only be accessed from the currently executing "
    "autograd.Function backward()"
)
ONLY_WHILE_ITS_APPLY_RUNS = (
    "RuntimeError: set_output_grad_dtype can only be called from forward or setup_context while "
    "this Function's apply is running on this thread: it was called from backward or jvp, after "
    "apply returned, or from another thread, where the declaration could no longer take effect. "
    "Declare the gradient dtypes in forward or setup_context."
)


def leaf(*values):
    return torch.tensor(values, requires_grad=True)


# A correct fused Function, used as the victim of retained-ctx misuse.
Fused = doubling(fuse_into_buffer)


def in_forward(body):
    """A Function y = 2x whose forward runs body(ctx) first, applied to a leaf."""
    doubling(lambda ctx, g: g, in_forward=body).apply(leaf(1.0))


def in_setup_context(body):
    """A Function y = 2x whose setup_context runs body(ctx), applied to a leaf."""

    class F(Function):
        @staticmethod
        def forward(x):
            return x * 2

        @staticmethod
        def setup_context(ctx, inputs, output):
            body(ctx)

        @staticmethod
        def backward(ctx, g):
            return g

    F.apply(leaf(1.0))


def with_backward(body):
    """A Function y = 2x whose backward runs body(ctx, g) and returns its
    result, applied to a leaf that has an earlier producer (x * 3, created
    after), so that the buffer for x is exposed."""
    x = leaf(1.0, 2.0)
    (doubling(body).apply(x).sum() + (x * 3).sum()).backward()
    return x


# ------------------------------------------------------ input_grad_buffers:
# wrong moment


@case(ONLY_WHILE_BACKWARD_RUNS)
def igb_read_in_forward():
    in_forward(lambda ctx: ctx.input_grad_buffers)


@case(ONLY_WHILE_BACKWARD_RUNS)
def igb_read_in_setup_context():
    in_setup_context(lambda ctx: ctx.input_grad_buffers)


@case(ONLY_WHILE_BACKWARD_RUNS)
def igb_read_in_jvp():
    import torch.autograd.forward_ad as fwAD

    def jvp(ctx, t):
        ctx.input_grad_buffers
        return t * 2

    F = doubling(lambda ctx, g: g * 2, jvp=jvp)
    with fwAD.dual_level():
        F.apply(fwAD.make_dual(torch.ones(1), torch.ones(1)))


@case(ONLY_WHILE_BACKWARD_RUNS)
def igb_retained_ctx_read_after_backward():
    x = leaf(1.0)
    y = Fused.apply(x)
    y.sum().backward()
    y.grad_fn.input_grad_buffers


@case(ONLY_WHILE_BACKWARD_RUNS)
def igb_direct_grad_fn_apply():
    y = Fused.apply(leaf(1.0))
    y.grad_fn.apply(torch.ones(1))


@case("RuntimeError: input_grad_buffers does not support create_graph=True")
def igb_create_graph():
    x = leaf(1.0)
    (Fused.apply(x).sum() + (x * 3).sum()).backward(create_graph=True)


@case("RuntimeError: input_grad_buffers does not support anomaly detection")
def igb_anomaly_detection():
    import warnings

    x = leaf(1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autograd.detect_anomaly(check_nan=False):
            (Fused.apply(x).sum() + (x * 3).sum()).backward()


@case("RuntimeError: input_grad_buffers does not support post-hooks on the producing autograd node because directly accumulated gradients are returned as None and cannot be observed or replaced by those hooks")
def igb_post_hook_on_node():
    x = leaf(1.0)
    y = Fused.apply(x)
    y.grad_fn.register_hook(lambda grad_inputs, grad_outputs: None)
    (y.sum() + (x * 3).sum()).backward()


def reentrant_after_buffer(reenter):
    """A backward that took its exposed buffer runs ``reenter(z)`` on a fresh
    leaf z: a reentrant backward or grad."""

    def body(ctx, g):
        (b,) = ctx.input_grad_buffers
        assert b is not None
        with torch.enable_grad():
            reenter(leaf(1.0))
        return g * 2

    with_backward(body)


REENTRANT_AFTER_BUFFER = Pin(
    "RuntimeError: Calling backward or grad reentrantly after accessing a non-None ctx.input_grad_buffers entry is not supported"
)
case_table(reentrant_after_buffer, {
    "igb_reentrant_backward_after_buffer": (
        dict(reenter=lambda z: (z * 2).sum().backward()), REENTRANT_AFTER_BUFFER),
    "igb_reentrant_grad_after_buffer": (
        dict(reenter=lambda z: torch.autograd.grad((z * 2).sum(), (z,))), REENTRANT_AFTER_BUFFER),
})


# ------------------------------------------------------ input_grad_buffers:
# wrong ctx, wrong thread


# A FunctionCtx made by hand is no autograd node: torch 2.15's property is an
# attribute lookup that such an object cannot answer, and the backport's is
# the same lookup, whether or not a backward is running.
@case("AttributeError: 'FunctionCtx' object has no attribute '_input_grad_buffers'")
def igb_handmade_ctx():
    FunctionCtx().input_grad_buffers


@case("AttributeError: 'FunctionCtx' object has no attribute '_input_grad_buffers'")
def igb_handmade_ctx_during_backward():
    def body(ctx, g):
        FunctionCtx().input_grad_buffers
        return g * 2

    with_backward(body)


@case(ONLY_FROM_ITS_OWN_BACKWARD)
def igb_other_functions_ctx_during_backward():
    x = leaf(1.0)
    other = Fused.apply(x)

    def body(ctx, g):
        other.grad_fn.input_grad_buffers
        return g * 2

    (doubling(body).apply(x).sum() + other.sum()).backward()


@case(ONLY_FROM_ITS_OWN_BACKWARD)
def igb_retained_ctx_read_in_later_backward():
    x = leaf(1.0)
    old = Fused.apply(x)
    old.sum().backward(retain_graph=True)

    def body(ctx, g):
        old.grad_fn.input_grad_buffers
        return g * 2

    with_backward(body)


@case(ONLY_FROM_ITS_OWN_BACKWARD)
def igb_read_in_tensor_hook_during_backward():
    x = leaf(1.0)
    y = Fused.apply(x)
    z = y * 1
    z.register_hook(lambda g: y.grad_fn.input_grad_buffers)
    (z.sum() + (x * 3).sum()).backward()


@case(ONLY_WHILE_BACKWARD_RUNS)
def igb_read_from_non_autograd_thread_during_backward():
    errors = []

    def body(ctx, g):
        def read():
            try:
                ctx.input_grad_buffers
            except BaseException as e:
                errors.append(e)

        t = threading.Thread(target=read)
        t.start()
        t.join()
        return g * 2

    with_backward(body)
    if errors:
        raise errors[0]


@case(ONLY_FROM_ITS_OWN_BACKWARD)
def igb_read_ctx_of_backward_running_in_another_thread():
    """Thread A is inside its backward (blocked); thread B, inside its own
    backward, reads A's ctx."""
    a_ctx = []
    a_inside = threading.Event()
    b_done = threading.Event()
    errors = []

    def body_a(ctx, g):
        a_ctx.append(ctx)
        a_inside.set()
        assert b_done.wait(30)
        return g * 2

    def body_b(ctx, g):
        try:
            a_ctx[0].input_grad_buffers
        except BaseException as e:
            errors.append(e)
        return g * 2

    def thread_b():
        assert a_inside.wait(30)
        try:
            with_backward(body_b)
        finally:
            b_done.set()

    t = threading.Thread(target=thread_b)
    t.start()
    with_backward(body_a)
    t.join(30)
    if errors:
        raise errors[0]


# CPython's own text for a property without a setter (3.11 named the property and its owner).
@case("AttributeError: property 'input_grad_buffers' of 'FBackward' object has no setter"
      if sys.version_info >= (3, 11) else "AttributeError: can't set attribute 'input_grad_buffers'")
def igb_assign_to_property():
    def body(ctx, g):
        ctx.input_grad_buffers = (None,)
        return g * 2

    with_backward(body)


# ------------------------------------------------------ input_grad_buffers:
# what backward does with a buffer


@case("RuntimeError: expected Variable or None (got str)")
def igb_backward_returns_non_tensor_for_fused_input():
    def body(ctx, g):
        (b,) = ctx.input_grad_buffers
        b.add_(g * 2)
        return "fused"

    with_backward(body)


# torch's own (unclear) error; not validated at the point of misuse, as in 2.15.
@case("RuntimeError: The size of tensor a (3) must match the size of tensor b (2) at non-singleton dimension 1")
def igb_buffer_transposed_in_place():
    def body(ctx, g):
        (b,) = ctx.input_grad_buffers
        b.t_()
        return None

    x = torch.ones(2, 3, requires_grad=True)
    (doubling(body).apply(x).sum() + (x * 3).sum()).backward()


# Not validated, by torch 2.15 either: .grad silently gets another shape.
# docs/reliability.md: change a buffer's values only, never its metadata.
@case("no exception: x is (2,) but x.grad is (5,)")
def igb_buffer_resized_in_place():
    """Not detected (by torch 2.15 either): x.grad ends up with another shape."""

    def body(ctx, g):
        (b,) = ctx.input_grad_buffers
        b.resize_(5).fill_(1.0)
        return None

    x = with_backward(body)
    return f"x is {tuple(x.shape)} but x.grad is {tuple(x.grad.shape)}"


@case("no exception: x.grad [5.0, 5.0] (unchanged: True, shares storage with the kept buffer: False)")
def igb_retained_buffer_mutated_after_backward():
    """Not detectable: the retained tensor is stale; x.grad is not affected."""
    held = []

    def body(ctx, g):
        (b,) = ctx.input_grad_buffers
        b.add_(g * 2)
        held.append(b)
        return None

    x = with_backward(body)
    before = x.grad.clone()
    held[0].add_(100.0)
    return (
        f"x.grad {x.grad.tolist()} (unchanged: {torch.equal(before, x.grad)}, "
        f"shares storage with the kept buffer: "
        f"{held[0].untyped_storage().data_ptr() == x.grad.untyped_storage().data_ptr()})"
    )


@case("no exception: x.grad [3.0, 3.0] (correct: [5.0, 5.0])")
def igb_stale_buffer_used_in_later_backward():
    """Not detectable: accumulating into a buffer kept from an earlier pass
    loses that contribution in the new pass."""
    held = []

    def first(ctx, g):
        (b,) = ctx.input_grad_buffers
        held.append(b)
        b.add_(g * 2)
        return None

    def second(ctx, g):
        held[0].add_(g * 2)  # the wrong (stale) buffer
        return None

    with_backward(first)
    x = with_backward(second)
    return f"x.grad {x.grad.tolist()} (correct: [5.0, 5.0])"


# --------------------------------------------------- set_output_grad_dtype:
# counts


def declaring(*decl, outputs=lambda x: x * 2, non_differentiable=False):
    class F(Function):
        @staticmethod
        def forward(ctx, x):
            out = outputs(x)
            if non_differentiable:
                ctx.mark_non_differentiable(out)
            ctx.set_output_grad_dtype(*decl)
            return out

        @staticmethod
        def backward(ctx, *grads):
            return grads[0]

    return F


@case("RuntimeError: set_output_grad_dtype can only be called once")
def sogd_called_twice():
    def declare_twice(ctx):
        ctx.set_output_grad_dtype(torch.float64)
        ctx.set_output_grad_dtype(torch.float64)

    in_forward(declare_twice)


@case("RuntimeError: set_output_grad_dtype can only be called once")
def sogd_called_in_setup_context_and_again():
    def declare_twice(ctx):
        ctx.set_output_grad_dtype(torch.float64)
        ctx.set_output_grad_dtype(None)

    in_setup_context(declare_twice)


def declared(declarations, outputs=lambda x: x * 2, non_differentiable=False, backward=False):
    """Apply ``declaring(*declarations, ...)`` to a leaf; with ``backward``,
    run backward through it too."""
    y = declaring(*declarations, outputs=outputs, non_differentiable=non_differentiable).apply(leaf(1.0))
    if backward:
        y.sum().backward()


def count_mismatch(returned, declared):
    return (
        "RuntimeError: set_output_grad_dtype expected the number of declarations to match the number "
        f"of outputs: the Function returned {returned} values but {declared} declarations were provided"
    )


def not_a_dtype(type_name):
    return (
        "RuntimeError: set_output_grad_dtype expects each declaration to be a torch.dtype or None, "
        f"but got {type_name}"
    )


def not_a_differentiable_output(index):
    return (
        f"RuntimeError: set_output_grad_dtype: got a concrete dtype for output {index}, but that output "
        "is not a differentiable tensor (it is a non-tensor, was marked non-differentiable, or has a "
        f"non-differentiable dtype). Pass None for output {index} instead."
    )


def cannot_carry_a_gradient(dtype):
    return (
        f"RuntimeError: set_output_grad_dtype: {dtype} cannot carry a gradient, but it was declared for "
        "output 0 (torch.float32). Declare a floating point or complex dtype, or None to keep the "
        "gradient's own dtype."
    )


case_table(declared, {
    "sogd_too_few_declarations": (dict(declarations=(torch.float64,), outputs=lambda x: (x * 2, x * 3)), Pin(count_mismatch(2, 1))),
    "sogd_too_many_declarations": (dict(declarations=(torch.float64, None)), Pin(count_mismatch(1, 2))),
    "sogd_no_declarations": (dict(declarations=()), Pin(count_mismatch(1, 0))),
})


@case("TypeError: FunctionCtx.set_output_grad_dtype() got an unexpected keyword argument 'dtype'")
def sogd_keyword_argument():
    in_forward(lambda ctx: ctx.set_output_grad_dtype(dtype=torch.float64))


# --------------------------------------------------- set_output_grad_dtype:
# objects that are not a torch.dtype


case_table(declared, {
    "sogd_string": (dict(declarations=("float64",)), Pin(not_a_dtype("str"))),
})


@case(not_a_dtype("numpy.dtypes.Float64DType"))
def sogd_numpy_dtype():
    import numpy as np

    declared((np.dtype("float64"),))


case_table(declared, {
    "sogd_python_type": (dict(declarations=(float,)), Pin(not_a_dtype("type"))),
    "sogd_the_torch_dtype_class": (dict(declarations=(torch.dtype,)), Pin(not_a_dtype("type"))),
    "sogd_finfo": (dict(declarations=(torch.finfo(torch.float64),)), Pin(not_a_dtype("torch.finfo"))),
    "sogd_list_of_dtypes": (dict(declarations=([torch.float64],)), Pin(not_a_dtype("list"))),
})


# --------------------------------------------------- set_output_grad_dtype:
# dtypes of the wrong kind, outputs without a gradient


case_table(declared, {
    "sogd_concrete_dtype_for_non_tensor_output": (
        dict(declarations=(None, torch.float64), outputs=lambda x: (x * 2, 3)),
        Pin(not_a_differentiable_output(1)),
    ),
    "sogd_concrete_dtype_for_non_differentiable_output": (
        dict(declarations=(torch.float64,), non_differentiable=True),
        Pin(not_a_differentiable_output(0)),
    ),
    "sogd_concrete_dtype_for_integer_tensor_output": (
        dict(declarations=(None, torch.float64), outputs=lambda x: (x * 2, torch.ones(1, dtype=torch.int64))),
        Pin(not_a_differentiable_output(1)),
    ),
    "sogd_integer_dtype": (
        dict(declarations=(torch.int64,), backward=True),
        Pin(cannot_carry_a_gradient("torch.int64"), skip_native="accepted, then the engine trips its INTERNAL ASSERT at backward (docs/deviations.md, deviation 1)"),
    ),
    "sogd_bool_dtype": (
        dict(declarations=(torch.bool,), backward=True),
        Pin(cannot_carry_a_gradient("torch.bool"), skip_native="accepted, then the engine trips its INTERNAL ASSERT at backward (docs/deviations.md, deviation 1)"),
    ),
    "sogd_quantized_dtype": (
        dict(declarations=(torch.qint8,), backward=True),
        Pin(cannot_carry_a_gradient("torch.qint8"), native="RuntimeError: empty_strided not supported on quantized tensors yet see https://github.com/pytorch/pytorch/issues/74540"),
    ),
    "sogd_complex_dtype_for_real_output": (
        dict(declarations=(torch.complex64,), backward=True),
        Pin("RuntimeError: set_output_grad_dtype: output 0 is a real tensor (torch.float32) but torch.complex64 was declared for its gradient. A real output needs a real floating point gradient dtype and a complex output a complex one.",
            native="RuntimeError: Expected isFloatingType(grad.scalar_type()) || (input_is_complex == grad_is_complex) to be true, but got false.  (Could this error message be improved?  If so, please report an enhancement request to PyTorch.)"),
    ),
})


@case("RuntimeError: set_output_grad_dtype: output 0 is a complex tensor (torch.complex64) but torch.float64 was declared for its gradient. A real output needs a real floating point gradient dtype and a complex output a complex one.", native="no exception")
def sogd_real_dtype_for_complex_output():
    x = torch.ones(1, dtype=torch.complex64, requires_grad=True)
    declaring(torch.float64).apply(x).abs().sum().backward()


# --------------------------------------------------- set_output_grad_dtype:
# wrong moment, wrong ctx, wrong thread


@case(ONLY_WHILE_ITS_APPLY_RUNS, skip_native="silently ignored (docs/deviations.md, deviation 3)")
def sogd_called_from_backward():
    def body(ctx, g):
        ctx.set_output_grad_dtype(torch.float64)
        return g

    doubling(body).apply(leaf(1.0)).sum().backward()


@case(ONLY_WHILE_ITS_APPLY_RUNS, skip_native="silently ignored (docs/deviations.md, deviation 3)")
def sogd_called_on_retained_ctx_after_apply():
    y = Fused.apply(leaf(1.0))
    y.grad_fn.set_output_grad_dtype(torch.float64)


# Deviation 3 family: torch 2.15 ignores the call; the backport says why it
# cannot take effect.
@case(ONLY_WHILE_ITS_APPLY_RUNS, native="no exception: backward received torch.float32")
def sogd_called_from_jvp():
    import torch.autograd.forward_ad as fwAD

    seen = []

    def backward(ctx, g):
        seen.append(g.dtype)
        return g.float() * 2

    def jvp(ctx, t):
        ctx.set_output_grad_dtype(torch.float64)
        return t * 2

    F = doubling(backward, jvp=jvp)
    with fwAD.dual_level():
        y = F.apply(fwAD.make_dual(leaf(1.0), torch.ones(1)))
    y.sum().backward()
    return f"backward received {seen[0]}"


# A hand-made FunctionCtx is no autograd node: like torch 2.15, the backport
# fails on the attribute FunctionCtx only annotates.
@case("AttributeError: 'FunctionCtx' object has no attribute 'output_grad_dtypes'")
def sogd_handmade_ctx():
    FunctionCtx().set_output_grad_dtype(torch.float64)


# The same, made inside another Function's forward: the enclosing apply is
# not affected.
@case("AttributeError: 'FunctionCtx' object has no attribute 'output_grad_dtypes'")
def sogd_handmade_ctx_inside_forward():
    in_forward(lambda ctx: FunctionCtx().set_output_grad_dtype(torch.float64))


# Differs from torch 2.15, which applies a declaration made from another
# thread while forward runs; the backport raises, naming that case.
@case(ONLY_WHILE_ITS_APPLY_RUNS, native="no exception: backward received torch.float64")
def sogd_called_from_another_thread_during_forward():
    errors, seen = [], []

    def declare_from_another_thread(ctx):
        def declare():
            try:
                ctx.set_output_grad_dtype(torch.float64)
            except BaseException as e:
                errors.append(e)

        t = threading.Thread(target=declare)
        t.start()
        t.join()

    def backward(ctx, g):
        seen.append(g.dtype)
        return g.float()

    doubling(backward, in_forward=declare_from_another_thread).apply(leaf(1.0)).sum().backward()
    if errors:
        raise errors[0]
    return f"backward received {seen[0]}"


# ------------------------------------------------------------------ runner


def describe(name):
    """Run one case; 'Type: message' of what it raised, or 'no exception: ...'."""
    try:
        outcome = CASES[name]()
    except BaseException as e:  # noqa: BLE001 - the catalogue records everything
        return f"{type(e).__name__}: {e}"
    return "no exception" + (f": {outcome}" if outcome else "")


def run_catalogue():
    import warnings

    warnings.simplefilter("ignore")
    # Self-test of the crash detection: die by a signal when reaching this case
    # (SIGABRT, which AddressSanitizer does not intercept: tools/sanitizers.sh).
    crash_at = os.environ.get("TORCH_CTXEXT_MISUSE_CRASH_AT")
    for name in CASES:
        print(json.dumps({"start": name}), flush=True)
        if name == crash_at:
            os.kill(os.getpid(), signal.SIGABRT)
        print(json.dumps({"case": name, "result": describe(name)}), flush=True)


if __name__ == "__main__" and sys.argv[1:] == ["--catalogue"]:
    run_catalogue()
    sys.exit(0)


def run_in_subprocess(**extra_env):
    """Run every case in one subprocess; {name: text}, where the case that was
    running when the process died, and every later one, read 'CRASH: ...'."""
    proc = python(os.path.abspath(__file__), "--catalogue", path=[TESTS], **extra_env)
    results, running = {}, None
    for line in proc.stdout.splitlines():
        if not line.startswith("{"):
            continue
        record = json.loads(line)
        if "start" in record:
            running = record["start"]
        else:
            results[record["case"]] = record["result"]
            running = None
    if proc.returncode != 0 or running is not None:
        crash = (
            f"CRASH: the catalogue process exited with {proc.returncode} while "
            f"running {running}; stderr: {proc.stderr[-2000:]}"
        )
        for name in CASES:
            results.setdefault(name, crash)
    return results


_RESULTS = None


def catalogue():
    global _RESULTS
    if _RESULTS is None:
        _RESULTS = run_in_subprocess()
    return _RESULTS


def outcome(name):
    text = catalogue()[name]
    assert not text.startswith("CRASH"), text
    assert "INTERNAL ASSERT" not in text, text
    return text


def skip_on_native(reason, member="set_output_grad_dtype"):
    """Skip where torch itself provides ``member`` (torch_ctxext's answer is
    then not the one tested): who provides it is a fact of the release
    (features()), not a release number."""
    return pytest.mark.skipif(FEATURES[member] == "native", reason=f"native torch: {reason}")


def test_catalogue_covers_every_case_and_nothing_crashed():
    results = catalogue()
    assert set(results) == set(CASES)
    crashed = [n for n, t in results.items() if t.startswith("CRASH")]
    assert not crashed, results[crashed[0]]
    assert len(CASES) >= 20


def test_a_crash_in_a_case_fails_that_case_instead_of_killing_pytest():
    victim = "sogd_string"
    results = run_in_subprocess(TORCH_CTXEXT_MISUSE_CRASH_AT=victim)
    names = list(CASES)
    before, after = names[: names.index(victim)], names[names.index(victim):]
    assert not any(results[n].startswith("CRASH") for n in before)
    assert all(results[n].startswith("CRASH") for n in after)
    assert f"exited with -{int(signal.SIGABRT)} while running {victim}" in results[victim]


def test_every_case_has_a_pin():
    assert list(PINS) == list(CASES), sorted(set(CASES) ^ set(PINS))


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=skip_on_native(pin.skip_native)) if pin.skip_native else name
    for name, pin in PINS.items()
])
def test_each_wrong_use_gets_its_pinned_answer(name):
    pin = PINS[name]
    expected = pin.native if NATIVE_DTYPE and pin.native is not None else pin.answer
    assert outcome(name) == expected
