"""``ctx.input_grad_buffers`` on an accelerator: device threads and streams.

The engine runs each device's nodes on that device's own thread, guarded
onto the stream the node's forward ran on, and accumulates each buffer slot
on a recorded stream. A buffer is handed out only where fusing into it is as
safe as the engine's own accumulation: same device, same engine thread, same
stream. Every test here needs an accelerator (``--ctx-device cuda``,
``--ctx-device testdevice``, ...) and is skipped on the CPU.

Where a release's route leaves a slot ``None`` (torch_ctxext on torch 2.6
and 2.7: every accelerator slot; on 2.6 to 2.9: slots that later producers
still reach, in a process with accelerators), the test says so and checks
that the slot is ``None`` and the gradients are still exact
(``buffer_exposure``, docs/compatibility.md).
"""
import threading

import pytest
import torch
from torch.autograd import Function

try:
    from . import _device
    from ._helpers import read_error
except ImportError:  # run as plain files
    import _device
    from _helpers import read_error

pytestmark = pytest.mark.accelerator

DIRECT = "Direct InputBuffer accumulation"


def make_scale(record, fuse=True):
    """x * w; the backward records its entries and, where fuse is set,
    accumulates grad_x into x's buffer."""

    class Scale(Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x * w

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            entries = ctx.input_grad_buffers
            record.append(entries)
            gx, gw = g * w, g * x
            if fuse and entries[0] is not None:
                entries[0].add_(gx)
                gx = None
            if fuse and entries[1] is not None:
                entries[1].add_(gw)
                gw = None
            return gx, gw

    return Scale


def exposed(entries):
    return [entry is not None for entry in entries]


PLACES, place, run_on = _device.PLACES, _device.place, _device.run_on


def leaves(device, dtype, *rows):
    return [torch.tensor(row, dtype=dtype, device=device, requires_grad=True) for row in rows]


# --- exposed where fusing is as safe as the engine's own accumulation ----------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("where", PLACES)
def test_a_buffer_on_the_running_nodes_stream_is_exposed_and_fusing_is_exact(where, dtype, buffer_exposure):
    """All engine-scheduled producers on the same device, thread and stream:
    the buffer is exposed, on the device, and the fused gradient equals the
    unfused one."""
    device, stream = place(where)
    results = []
    for fuse in (True, False):
        record = []
        Scale = make_scale(record, fuse=fuse)
        x, w = leaves(device, dtype, [1.0, 2.0], [3.0, 4.0])
        run_on(stream, lambda: (Scale.apply(x, w).sum() + (x * 5).sum()).backward())
        _device.synchronize()
        results.append((record[0], x.grad.cpu(), w.grad.cpu()))
    (fused_entries, fx, fw), (_, px, pw) = results
    if buffer_exposure["accelerator_slots"]:
        assert exposed(fused_entries) == [True, False]
        assert fused_entries[0].device == device and fused_entries[0].dtype == dtype
    else:  # the release records no stream per slot: nothing is exposed
        assert exposed(fused_entries) == [False, False]
    torch.testing.assert_close(fx, px)
    torch.testing.assert_close(fw, pw)
    torch.testing.assert_close(fx, torch.tensor([8.0, 9.0], dtype=dtype, device="cpu"))


@pytest.mark.parametrize("where", PLACES)
def test_each_input_is_judged_separately(where, buffer_exposure):
    """Availability is independent for each input: both exposed when both
    slots hold a gradient, only the one that does otherwise."""
    device, stream = place(where)
    for with_w, expected in ((True, [True, True]), (False, [True, False])):
        record = []
        Scale = make_scale(record)
        x, w = leaves(device, torch.float32, [1.0, 2.0], [3.0, 4.0])

        def loss():
            total = Scale.apply(x, w).sum() + (x * 5).sum()
            return total + (w * 1).sum() if with_w else total

        run_on(stream, lambda: loss().backward())
        _device.synchronize()
        if not buffer_exposure["accelerator_slots"]:
            expected = [False, False]
        assert exposed(record[0]) == expected
        torch.testing.assert_close(x.grad.cpu(), torch.tensor([8.0, 9.0], device="cpu"))
        torch.testing.assert_close(w.grad.cpu(), torch.tensor([2.0, 3.0] if with_w else [1.0, 2.0], device="cpu"))


@pytest.mark.parametrize("where", ["default stream", "side stream"])
def test_later_producers_on_the_same_thread_and_stream_are_accepted(where, buffer_exposure):
    """A buffer exposed while a producer created earlier has yet to add to
    it: that producer runs later on the same device thread and stream, so its
    contribution accumulates into the fused buffer exactly."""
    device, stream = place(where)
    record = []
    Scale = make_scale(record)
    x, w = leaves(device, torch.float32, [1.0, 2.0], [3.0, 4.0])
    # Backward runs the newest node first: x * 5, Scale, then x * 3 (later).
    run_on(stream, lambda: ((x * 3).sum() + Scale.apply(x, w).sum() + (x * 5).sum()).backward())
    _device.synchronize()
    if buffer_exposure["accelerator_slots"] and buffer_exposure["later_producer_slots"]:
        assert exposed(record[0]) == [True, False]
    else:  # the release cannot validate later producers: the slot stays None
        assert exposed(record[0]) == [False, False]
    torch.testing.assert_close(x.grad.cpu(), torch.tensor([11.0, 12.0], device="cpu"))
    torch.testing.assert_close(w.grad.cpu(), torch.tensor([1.0, 2.0], device="cpu"))


def test_each_slot_is_judged_by_its_own_streams(buffer_exposure):
    """Per-slot accumulation streams: the Function runs on a side stream; x's
    slot was filled by a producer on that stream, w's by one on the default
    stream. Reading the entries is refused for w's slot, with 2.15's text,
    though x's alone would be exposed."""
    device = _device.selected()
    side = _device.new_stream(device)
    record = []
    Scale = make_scale(record)
    x, w = leaves(device, torch.float32, [1.0, 2.0], [3.0, 4.0])
    with _device.stream(side):
        loss = Scale.apply(x, w).sum() + (x * 5).sum()
    _device.current_stream(device).wait_stream(side)
    loss = loss + (w * 1).sum()  # created last, on the default stream: runs first
    with pytest.raises(RuntimeError) if buffer_exposure["accelerator_slots"] else _no_error() as error:
        loss.backward()
    _device.synchronize()
    if not buffer_exposure["accelerator_slots"]:
        assert exposed(record[0]) == [False, False]
        return
    assert str(error.value).startswith(f"{DIRECT} requires the same stream, but got producer stream {side.stream_id}"), error.value


class _no_error:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# --- refused where the engine's own rules would not allow it -------------------


@pytest.mark.parametrize("where", ["side stream", "second device side stream"])
def test_a_buffer_is_refused_to_a_node_on_another_stream(where, buffer_exposure):
    """The running node's stream differs from the buffer's accumulation
    stream: reading the entries raises, with 2.15's text."""
    device = _device.selected()
    if where.startswith("second device"):
        device = _device.second_device_or_skip()
    record = []

    class Scale(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            record.append(read_error(ctx))
            return g * 2

    x = torch.ones(3, device=device, requires_grad=True)
    side = _device.new_stream(device)
    with _device.stream(side):
        y = Scale.apply(x)  # the node records the side stream
    _device.current_stream(device).wait_stream(side)
    (y.sum() + (x * 3).sum()).backward()
    _device.synchronize()
    if not buffer_exposure["accelerator_slots"]:
        assert record == [(None,)]
        return
    expected = (
        f"{DIRECT} requires the same stream, but got producer stream {side.stream_id} on device "
        f"{device}, consumer stream {side.stream_id} on device {device}, accumulation stream "
        f"{side.stream_id} on device {device}, and ready stream 0 on device {device}"
    )
    if device.type == "cuda":  # CUDA names its streams by handle, not by a small id
        assert isinstance(record[0], str) and record[0].startswith(f"{DIRECT} requires the same stream"), record
    else:
        assert record == [expected]
    torch.testing.assert_close(x.grad.cpu(), torch.full((3,), 5.0, device="cpu"))


class ToDevice(Function):
    """Moves a CPU input to the device and scales it: its node runs on the
    device's thread, with a stream, while its input's buffer is on the CPU."""

    @staticmethod
    def forward(ctx, x, device):
        return x.to(device) * 2

    @staticmethod
    def backward(ctx, g):
        buffer, _ = ctx.input_grad_buffers
        if buffer is not None:
            buffer.add_((g * 2).cpu())
            return None, None
        return (g * 2).cpu(), None


def test_a_cpu_buffer_is_refused_to_a_node_on_the_device_thread():
    """A CPU buffer (a CPU-offloaded parameter) reaching a node that runs on
    an accelerator's thread with a stream: the non-accelerator rule refuses,
    with 2.15's text, and the next backward works."""
    device = _device.selected()
    x = torch.ones(3, device="cpu", requires_grad=True)
    y = ToDevice.apply(x, device)
    loss = y.sum().cpu() + (x * 3).sum()  # x * 3 runs first, on the CPU thread
    with pytest.raises(RuntimeError) as error:
        loss.backward()
    assert str(error.value) == (
        f"{DIRECT} for a non-accelerator buffer requires producer and consumer streams to be "
        "absent, but got producer stream present: 1 and consumer stream present: 0"
    )
    x.grad = None
    (x.to(device) * 2).sum().backward()  # no state left behind
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0, device="cpu"))


def test_a_later_producer_on_another_engine_thread_is_refused(buffer_exposure):
    """A CPU buffer exposed on the CPU thread, and a producer that reaches it
    later from the device's thread: ToDevice's backward, which can only run
    after CpuScale's backward has produced the gradient it needs."""
    device = _device.selected()
    seen = []

    class ToDeviceOnly(Function):
        @staticmethod
        def forward(ctx, x):
            return x.to(device)

        @staticmethod
        def backward(ctx, g):
            return g.cpu()

    class CpuScale(Function):
        @staticmethod
        def forward(ctx, x, w):
            return x * 2 + w.cpu()

        @staticmethod
        def backward(ctx, g):
            (buffer, _) = ctx.input_grad_buffers
            seen.append(buffer is not None)
            if buffer is not None:
                buffer.add_(g * 2)
                return None, g.to(device)
            return g * 2, g.to(device)

    x = torch.ones(3, device="cpu", requires_grad=True)
    loss = CpuScale.apply(x, ToDeviceOnly.apply(x)).sum() + (x * 3).sum()
    if not buffer_exposure["later_producer_slots"]:
        loss.backward()  # the slot a later producer still reaches stays None
        assert seen == [False]
        torch.testing.assert_close(x.grad, torch.full((3,), 6.0, device="cpu"))
        return
    with pytest.raises(RuntimeError) as error:
        loss.backward()
    assert seen == [True]
    assert str(error.value).startswith(
        f"{DIRECT} requires the same autograd engine thread, but the buffer was exposed on thread "
    )


# --- crossing devices -----------------------------------------------------------


def test_a_buffer_reached_across_the_device_to_cpu_boundary_is_on_the_cpu(buffer_exposure):
    """A Function on the CPU whose input came from the device: its input's
    slot (the device-to-CPU copy's) is a CPU buffer on the CPU thread, exposed
    where the CPU rules allow, and the gradient flows back to the device."""
    device = _device.selected()
    record = []
    Scale = make_scale(record)
    x_dev = torch.tensor([1.0, 2.0], device=device, requires_grad=True)
    w = torch.tensor([3.0, 4.0], device="cpu", requires_grad=True)
    x = x_dev.cpu()
    (Scale.apply(x, w).sum() + (x * 5).sum()).backward()
    _device.synchronize()
    assert exposed(record[0]) == [True, False]
    assert record[0][0].device.type == "cpu"
    torch.testing.assert_close(x_dev.grad.cpu(), torch.tensor([8.0, 9.0], device="cpu"))


def test_inputs_on_two_devices_are_judged_on_their_own_devices(buffer_exposure):
    """A Function whose inputs live on two devices runs on the thread of the
    first: the input on that device is exposed; the one on the other device,
    whose slot no other producer filled, is None; both gradients exact."""
    first = _device.selected()
    second = _device.second_device_or_skip()
    record = []

    class TwoDevices(Function):
        @staticmethod
        def forward(ctx, x, w):
            return x * w.to(x.device)

        @staticmethod
        def backward(ctx, g):
            record.append(read_error(ctx))
            return g * 2, (g * 3).to(second)

    x = torch.tensor([1.0, 2.0], device=first, requires_grad=True)
    w = torch.tensor([3.0, 4.0], device=second, requires_grad=True)
    (TwoDevices.apply(x, w).sum() + (x * 5).sum()).backward()
    _device.synchronize()
    assert exposed(record[0]) == [buffer_exposure["accelerator_slots"], False]
    if buffer_exposure["accelerator_slots"]:
        assert record[0][0].device == first
    torch.testing.assert_close(x.grad.cpu(), torch.tensor([7.0, 7.0], device="cpu"))
    torch.testing.assert_close(w.grad.cpu(), torch.tensor([3.0, 3.0], device="cpu"))


# --- the engine's other threads -----------------------------------------------------


def test_works_from_several_threads_running_backward_on_the_device_at_once(buffer_exposure):
    """Several threads each running backward on the device at once: each
    task's buffers are its own, every fused gradient exact."""
    device = _device.selected()
    errors, barrier = [], threading.Barrier(4)

    def work():
        try:
            barrier.wait()
            for _ in range(10):
                record = []
                Scale = make_scale(record)
                x, w = leaves(device, torch.float32, [1.0, 2.0], [3.0, 4.0])
                (Scale.apply(x, w).sum() + (x * 5).sum()).backward()
                assert exposed(record[0]) == [buffer_exposure["accelerator_slots"], False]
                torch.testing.assert_close(x.grad.cpu(), torch.tensor([8.0, 9.0], device="cpu"))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors[:3]
