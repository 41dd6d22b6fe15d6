"""The test device (tools/testdevice) and what runs on it: the device's own
contract (devices, thread-local streams, events, allocator, copies), the
engine's accelerator paths it drives, and ``check --device``'s answers.

Each test runs in a fresh interpreter: the device must be registered before
the first backward() of a process, and this one has run many. (Its import
runs no backward, as a real backend's: test_import_leaves_the_process.py.)
"""
import importlib.util
import textwrap

import pytest

import torch_ctxext
from support import TESTS, python

# Looked up, not imported: the device must not be registered in this process,
# whose engine started long ago (its import would refuse, rightly).
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch_ctxext_testdevice") is None,
    reason="the test device is not installed (tools/run.py installs it)",
)


# Each script ends with os._exit: on torch 2.12 and 2.14 the interpreter's
# own shutdown aborts now and then ("terminate called without an active
# exception") when an autograd device thread drops its last graph task while
# Python finalizes, with or without this device (2.12: a backward on any
# non-main thread does it). These tests are about the device, not shutdown.
EXIT = "\nimport os, sys\nsys.stdout.flush()\nsys.stderr.flush()\nos._exit(0)\n"


def run(code, *args):
    """Run ``code`` in a fresh interpreter, with this folder on PYTHONPATH
    (for doubling_functions); its stdout's lines."""
    completed = python(*args, code=textwrap.dedent(code) + EXIT, path=[TESTS])
    assert completed.returncode == 0, completed.stdout + completed.stderr
    return completed.stdout.strip().splitlines()


# --- the device -----------------------------------------------------------------


def test_the_device_has_two_devices_and_copies_to_and_from_the_cpu_exactly():
    out = run("""
        import torch, torch_ctxext_testdevice
        x = torch.arange(6.0).reshape(2, 3)
        for index in range(torch.testdevice.device_count()):
            d = x.to(f"testdevice:{index}")
            assert d.device == torch.device("testdevice", index)
            assert torch.equal(d.t().contiguous().cpu(), x.t().contiguous())
            assert torch.equal((d @ d.t()).cpu(), x @ x.t())
        out = torch.empty(0, device="testdevice")
        torch.add(x.to("testdevice"), 1, out=out)  # out= resizes on the device
        print(torch.testdevice.device_count(), out.cpu().tolist())
    """)
    assert out == ["2 [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]"]


def test_new_device_memory_is_poisoned_so_unwritten_reads_show():
    out = run("""
        import torch, torch_ctxext_testdevice
        print(torch.empty(3, device="testdevice").isnan().all().item())
    """)
    assert out == ["True"]


def test_the_current_stream_is_per_thread_and_per_device():
    out = run("""
        import threading, torch, torch_ctxext_testdevice as td
        side = td.Stream("testdevice:0")
        seen = {}
        with td.stream(side):
            seen["here"] = td.current_stream("testdevice:0").stream_id
            seen["other device"] = td.current_stream("testdevice:1").stream_id
            t = threading.Thread(target=lambda: seen.update(thread=td.current_stream("testdevice:0").stream_id))
            t.start(); t.join()
        seen["after"] = td.current_stream("testdevice:0").stream_id
        print(side.stream_id != 0, seen["here"] == side.stream_id, seen["other device"], seen["thread"], seen["after"])
    """)
    assert out == ["True True 0 0 0"]


def test_the_engine_records_and_waits_on_events_between_streams():
    """Gradients crossing from a side stream to the default stream make the
    engine record an event on one and block the other on it."""
    out = run("""
        import torch, torch_ctxext_testdevice as td
        x = torch.ones(3, device="testdevice", requires_grad=True)
        side = td.Stream()
        with td.stream(side):
            y = x * 2
        before = td.counters()
        (y.sum() + (x * 3).sum()).backward()
        after = td.counters()
        print(after["events_recorded"] > before["events_recorded"],
              after["events_blocked"] > before["events_blocked"], x.grad.cpu().tolist())
    """)
    assert out == ["True True [5.0, 5.0, 5.0]"]


# --- the engine hook on InputBuffer::add, placed where device threads exist ------


@pytest.mark.skipif(
    torch_ctxext.features()["input_grad_buffers"] == "native",
    reason="the InputBuffer::add hook is torch_ctxext's extension's: native 2.15 validates later "
    "producers in its own engine (the conformance suite's accelerator tests check that)")
def test_later_producers_are_validated_by_the_engine_hook_in_a_process_with_device_threads():
    """With the device registered, the engine runs device threads, so a slot
    exposed while a later producer still has to add to it is checked by the
    InputBuffer::add hook (2.10 on); before 2.10 the slot stays None."""
    out = run("""
        import torch, torch_ctxext_testdevice
        import torch_ctxext
        from torch_ctxext import _C, _features
        from doubling_functions import doubling, fuse_into_buffer
        seen = []
        Scale = doubling(lambda ctx, g: fuse_into_buffer(ctx, g, exposed=seen))
        x = torch.ones(3, device="testdevice", requires_grad=True)
        before = _C._testing.validated_later_producers()
        ((x * 3).sum() + Scale.apply(x).sum() + (x * 5).sum()).backward()
        validated = _C._testing.validated_later_producers() - before
        print(_features.buffer_exposure()["later_producer_slots"], _C._testing.producer_hook_placed(),
              seen, validated > 0, x.grad.cpu().tolist())
    """)
    line = out[0]
    if line.startswith("True"):  # 2.10 on: the hook is placed and validates the later producer
        assert line == "True True [True] True [10.0, 10.0, 10.0]"
    else:  # before 2.10: the slot stays None, the gradient is exact
        assert line == "False False [False] False [10.0, 10.0, 10.0]"


# --- check --device ---------------------------------------------------------------


@pytest.mark.parametrize(
    "device, message",
    [
        ("nosuch", "unknown device 'nosuch': expected cpu, cuda, xpu, mps or the name of a registered PrivateUse1 backend"),
        ("testdevice:5", "device 'testdevice:5' does not exist: testdevice has 2 device(s)"),
        ("meta", "device 'meta' has no data"),
    ],
)
def test_check_refuses_an_unknown_or_missing_device_with_the_reason(device, message):
    completed = python("-m", "torch_ctxext", "check", "--device", device)
    assert completed.returncode == 2, completed.stdout + completed.stderr
    assert message in completed.stderr
    assert "Traceback" not in completed.stderr


def test_check_refuses_a_device_module_that_does_not_import():
    completed = python("-m", "torch_ctxext", "check", "--device", "npu", "--device-module", "no_such_backend")
    assert completed.returncode == 2, completed.stdout + completed.stderr
    assert "importing 'no_such_backend', which registers the device, failed" in completed.stderr
