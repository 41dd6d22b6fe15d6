"""torch_ctxext's test device: an accelerator emulated on host memory.

A test tool, not a product. ``import torch_ctxext_testdevice`` registers a
PrivateUse1 backend named ``testdevice`` with :data:`DEVICE_COUNT` devices,
each with :data:`STREAMS_PER_DEVICE` streams (stream 0 is the default one),
a thread-local current device and current stream per device, events, and an
allocator on host memory. The autograd engine treats it as it treats CUDA:
one worker thread per device, the forward's current stream recorded per
node, stream-aware accumulation of gradients. Work runs synchronously, so
every event is complete once recorded.

Import it before the first ``backward()`` of the process, as any backend:
the engine starts its device threads once, counting the devices registered
at that moment (a backend registered later has no thread, and backward on
it fails inside the engine). Its import, like a real backend's, runs
nothing of autograd: a process that imports it can still fork children that
run backward, until its own first backward.

The functions below mirror ``torch.cuda``'s, so that a test written against
``getattr(torch, device.type)`` runs on CUDA and on this device alike::

    >>> import torch, torch_ctxext_testdevice
    >>> x = torch.ones(2, device="testdevice", requires_grad=True)
    >>> side = torch.testdevice.Stream()
    >>> with torch.testdevice.stream(side):
    ...     y = x * 2
    >>> torch.testdevice.current_stream() == torch.testdevice.default_stream()
    True
    >>> y.sum().backward()
    >>> x.grad.cpu()
    tensor([2., 2.])

It imports nothing of torch_ctxext: the reference behaviour is recorded on
native torch with this device alone.
"""
import contextlib
import sys

import torch

from . import _C

__all__ = [
    "DEVICE_COUNT",
    "STREAMS_PER_DEVICE",
    "Stream",
    "counters",
    "current_device",
    "current_stream",
    "default_stream",
    "device_count",
    "is_available",
    "set_device",
    "set_stream",
    "stream",
    "synchronize",
]

NAME = "testdevice"
DEVICE_COUNT = _C.DEVICE_COUNT
STREAMS_PER_DEVICE = _C.STREAMS_PER_DEVICE


def _register():
    current = torch._C._get_privateuse1_backend_name()
    if current == NAME:
        return
    if current != "privateuseone":
        raise ImportError(
            f"torch_ctxext_testdevice: the PrivateUse1 backend is already registered as "
            f"{current!r} in this process; the test device needs it (run it in a process "
            "without another PrivateUse1 backend)"
        )
    torch.utils.rename_privateuse1_backend(NAME)
    torch._register_device_module(NAME, sys.modules[__name__])
    torch.utils.generate_methods_for_privateuse1_backend(
        for_tensor=True, for_module=True, for_storage=True
    )


def _index(device):
    """The device index ``device`` (None, an int, a string or a torch.device) names."""
    if device is None:
        return _C.current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != NAME:
        raise ValueError(f"expected a {NAME} device, got {device}")
    return _C.current_device() if device.index is None else device.index


def is_available():
    return True


def is_initialized():
    return True


def _is_in_bad_fork():
    return False


def device_count():
    return DEVICE_COUNT


def current_device():
    return _C.current_device()


def set_device(device):
    _C.set_device(_index(device))


def _stream(index, stream_id):
    return torch.Stream(stream_id=stream_id, device_index=index, device_type=_C.DEVICE_TYPE)


def Stream(device=None, priority=0):
    """A new (non-default) stream of ``device``, from its pool, as a ``torch.Stream``."""
    index = _index(device)
    return _stream(index, _C.new_stream_id(index))


def current_stream(device=None):
    index = _index(device)
    return _stream(index, _C.current_stream_id(index))


def default_stream(device=None):
    return _stream(_index(device), 0)


def set_stream(stream):
    """Make ``stream`` its device's current stream on this thread."""
    _C.exchange_stream_id(stream.device_index, stream.stream_id)


@contextlib.contextmanager
def stream(stream):
    """Make ``stream`` current on this thread for the ``with`` block, then restore."""
    if stream is None:
        yield
        return
    previous = _C.exchange_stream_id(stream.device_index, stream.stream_id)
    try:
        yield
    finally:
        _C.exchange_stream_id(stream.device_index, previous)


def synchronize(device=None):
    """Work is synchronous: nothing to wait for (checks the device exists)."""
    index = _index(device)
    if not 0 <= index < DEVICE_COUNT:
        raise ValueError(f"{NAME}: no device {index}")


def manual_seed(seed):
    """Random numbers come from the CPU generator (operators run on the CPU)."""


def manual_seed_all(seed):
    """Random numbers come from the CPU generator (operators run on the CPU)."""


def get_amp_supported_dtype():
    return [torch.float16, torch.bfloat16]


def counters():
    """What the device and the engine did so far in this process: live
    allocations and bytes, events recorded and waited on, stream exchanges,
    and device queries (calls of the device guard's ``deviceCount()``, as
    the engine makes when it starts: the analogue of CUDA's
    ``cudaGetDeviceCount``)."""
    return _C.counters()


_register()
