"""Where the extension touches torch's internals directly.

* Every function of the extension that reads a ctx by its layout checks the
  object's real type: an object that only claims to be a ctx (``__class__``)
  gets a TypeError, never a cast.
* The engine hook that validates producers reaching an exposed buffer later
  (placed on a machine with accelerators, forced here) sees those producers,
  leaves the gradients exact, and keeps the patched page's protection. Where
  it cannot be placed (torch <= 2.9), a slot that still expects later
  producers is not exposed in such a process.

The forced-hook scenarios run in a subprocess: the hook stays for the life of
the process that placed it.
"""
from unittest import mock

import pytest
import torch
from torch.autograd.function import BackwardCFunction

import torch_ctxext
from support import TESTS, python

BACKPORT = torch_ctxext.features()["input_grad_buffers"] == "torch_ctxext"
pytestmark = pytest.mark.skipif(
    not BACKPORT, reason="input_grad_buffers is native: the extension is not loaded"
)


class Liar(list):
    """A builtin subclass whose __class__ claims to be a ctx."""

    @property
    def __class__(self):
        return BackwardCFunction


IMPOSTORS = {
    "mock": lambda: mock.MagicMock(spec=BackwardCFunction),
    "liar": Liar,
    "plain object": object,
}


def extension_entry_points():
    from torch_ctxext._ext import loader as _extension

    ext = _extension.load()
    return {
        "input_grad_buffers": ext.input_grad_buffers,
        "explain_input_grad_buffers": ext.explain_input_grad_buffers,
        "exposed_in_running_task": ext.exposed_in_running_task,
        "read_ctx_layout": ext.read_ctx_layout,
        "differentiable_outputs": ext.differentiable_outputs,
        "set_output_grad_dtype": lambda obj: ext.set_output_grad_dtype(obj, 0, torch.float32),
    }


@pytest.mark.parametrize("impostor", IMPOSTORS)
@pytest.mark.parametrize("entry", list(extension_entry_points()) if BACKPORT else [])
def test_an_object_that_is_not_a_ctx_gets_a_type_error_from_the_extension(entry, impostor):
    obj = IMPOSTORS[impostor]()
    with pytest.raises(TypeError, match="expects the ctx of a custom autograd.Function"):
        extension_entry_points()[entry](obj)


@pytest.mark.parametrize("impostor", IMPOSTORS)
def test_explain_refuses_an_object_that_is_not_a_ctx(impostor):
    with pytest.raises(TypeError, match="explain\\(\\) expects the ctx"):
        torch_ctxext.explain(IMPOSTORS[impostor]())


def run(code, **env):
    """Run ``code`` in a fresh interpreter, with this folder on PYTHONPATH
    (for doubling_functions); its stdout."""
    result = python(code=code, path=[TESTS], **env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


FUSED_WITH_LATER_PRODUCERS = """
    import torch, torch_ctxext
    from doubling_functions import doubling, fuse_into_buffer
    from torch_ctxext._ext import loader as _extension

    ext = _extension.load()
    Scale = doubling(fuse_into_buffer)

    def train_step():
        x = torch.tensor([1.0, 2.0], requires_grad=True)
        # x is used before and after the two Scales: producers of x's
        # gradient run before, between and after their backwards.
        loss = (x * 3).sum() + Scale.apply(x).sum() + (x * 5).sum() + Scale.apply(x).sum() + (x * 7).sum()
        loss.backward()
        return x.grad.tolist()
"""


def later_producers_hookable():
    from torch_ctxext._ext import loader as _extension

    return not _extension.load().boundaries["ADD_WITHOUT_CONSUMER_NODE"]


needs_producer_hook = pytest.mark.skipif(
    BACKPORT and not later_producers_hookable(),
    reason="InputBuffer::add takes no consumer node before torch 2.10: the hook cannot be placed",
)


@needs_producer_hook
def test_the_producer_hook_validates_later_producers_and_keeps_gradients_exact():
    out = run(
        FUSED_WITH_LATER_PRODUCERS
        + """
    import collections

    def libtorch_protections():  # bytes of libtorch_cpu.so mapped with each protection
        sizes = collections.Counter()
        for line in open("/proc/self/maps"):
            fields = line.split()
            if len(fields) >= 6 and fields[5].endswith("libtorch_cpu.so"):
                start, end = (int(v, 16) for v in fields[0].split("-"))
                sizes[fields[1]] += end - start
        return sizes

    assert not ext._testing.producer_hook_placed()
    before = train_step()
    protections = libtorch_protections()
    ext._testing.place_producer_hook()
    assert ext._testing.producer_hook_placed()
    # The GOT page got back exactly the protection it had.
    assert libtorch_protections() == protections, (protections, libtorch_protections())
    after = [train_step() for _ in range(3)]
    print(before, after[-1], ext._testing.validated_later_producers() > 0)
    """,
        TORCH_CTXEXT_VALIDATE_LATER_PRODUCERS="never",
    )
    assert out.strip() == "[19.0, 19.0] [19.0, 19.0] True", out


@needs_producer_hook
def test_the_producer_hook_is_placed_at_the_first_exposure_where_later_producers_need_it():
    """TORCH_CTXEXT_VALIDATE_LATER_PRODUCERS=always stands for a machine whose
    engine runs device threads (an accelerator is present)."""
    out = run(
        FUSED_WITH_LATER_PRODUCERS
        + """
    assert not ext._testing.producer_hook_placed()
    grads = train_step()
    print(grads, ext._testing.producer_hook_placed(), ext._testing.validated_later_producers() > 0)
    """,
        TORCH_CTXEXT_VALIDATE_LATER_PRODUCERS="always",
    )
    assert out.strip() == "[19.0, 19.0] True True", out


def test_without_accelerators_no_hook_is_placed():
    out = run(
        FUSED_WITH_LATER_PRODUCERS
        + """
    grads = train_step()
    print(grads, ext._testing.producer_hook_placed())
    """
    )
    assert out.strip() == "[19.0, 19.0] False", out


@pytest.mark.skipif(
    not BACKPORT or later_producers_hookable(),
    reason="the producer hook can be placed on this torch (2.10 or later)",
)
def test_where_the_producer_hook_cannot_be_placed_slots_expecting_later_producers_stay_none():
    """torch <= 2.9 in a process whose engine runs device threads (forced by
    TORCH_CTXEXT_VALIDATE_LATER_PRODUCERS=always): a buffer that later
    producers will still reach is not exposed, and explain() says why; the
    last producer's buffer is exposed; the gradients are exact."""
    out = run(
        """
    import torch, torch_ctxext
    from doubling_functions import doubling, fuse_into_buffer
    from torch_ctxext._ext import loader as _extension

    codes = []

    def explain_then_fuse(ctx, g):
        codes.append(torch_ctxext.explain(ctx)[0].code)
        return fuse_into_buffer(ctx, g)

    Scale = doubling(explain_then_fuse)

    x = torch.tensor([1.0, 2.0], requires_grad=True)
    # Backward runs (x * 7), the second Scale, (x * 5), the first Scale:
    # the second Scale's buffer still expects (x * 5) and the first Scale.
    loss = Scale.apply(x).sum() + (x * 5).sum() + Scale.apply(x).sum() + (x * 7).sum()
    loss.backward()
    print(codes, x.grad.tolist(), _extension.load()._testing.producer_hook_placed())
    """,
        TORCH_CTXEXT_VALIDATE_LATER_PRODUCERS="always",
    )
    assert out.strip() == "['later_producers_unvalidated', 'exposed'] [16.0, 16.0] False", out
