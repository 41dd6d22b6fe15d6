"""The device the conformance suite runs on (``--device``), and what tests
need of it: its streams, its device module, a second device.

Only torch and pytest are used here: the suite runs against bare torch.

The device's backend must be registered before the first ``backward()`` of
the process: the autograd engine starts one thread per device of every
backend registered at that moment, once. ``import torch_ctxext`` runs no
backward, so the order of the imports does not matter:
``python -m torch_ctxext check --device NAME`` imports the backend's module
when it selects the device, and with plain pytest ``--ctx-device`` (or ``-p
MODULE``) does (``pytest --pyargs torch_ctxext.conformance --ctx-device
testdevice``). A backend registered after the process's first backward is
refused with the reason (``select``), not with the engine's internal assert.
"""
import contextlib
import importlib
import os

import torch

# The module that registers each PrivateUse1 backend this project knows.
KNOWN_MODULES = {"testdevice": "torch_ctxext_testdevice"}
BUILT_IN = ("cpu", "cuda", "xpu", "mps")

_selected = torch.device("cpu")


class DeviceError(ValueError):
    """The device asked for cannot run the suite; the message says why and what to do."""


def _privateuse1_name():
    return torch._C._get_privateuse1_backend_name()


def module_for(name):
    """The module that registers the backend ``name`` (None: built into torch)."""
    base = name.split(":")[0]
    return None if base in BUILT_IN else KNOWN_MODULES.get(base)


def requested(config):
    """(device, module) asked for: pytest options of torch_ctxext's plugin
    (``--ctx-device``, ``--ctx-device-module``), else the environment."""
    def option(name, env):
        try:
            value = config.getoption(name)
        except ValueError:  # the plugin is not loaded (a source checkout without -p)
            value = None
        return value or os.environ.get(env)

    return option("ctx_device", "TORCH_CTXEXT_DEVICE") or "cpu", option(
        "ctx_device_module", "TORCH_CTXEXT_DEVICE_MODULE"
    )


def select(name, module=None):
    """Resolve ``name`` (``cpu``, ``cuda:1``, ``testdevice``, ...) and make it
    the suite's device; raise DeviceError with the reason when it cannot be."""
    global _selected
    name = (name or "cpu").strip()
    module = module or module_for(name)
    if module and _privateuse1_name() != name.split(":")[0]:
        try:
            importlib.import_module(module)
        except Exception as e:  # ImportError, or the module's own refusal
            raise DeviceError(f"importing {module!r}, which registers the device, failed: {e}") from None
    try:
        device = torch.device(name)
    except RuntimeError:
        raise DeviceError(
            f"unknown device {name!r}: expected cpu, cuda, xpu, mps or the name of a "
            "registered PrivateUse1 backend (name the module that registers it with "
            "--device-module)"
        ) from None
    if device.type == "meta":
        raise DeviceError("device 'meta' has no data: the contract is about gradients, run on a real device")
    if device.type == "cpu":
        _selected = torch.device("cpu")
        return _selected
    device_module = getattr(torch, device.type, None)
    available = getattr(device_module, "is_available", None)
    if available is None or not available():
        raise DeviceError(
            f"device {name!r} is not available here (torch.{device.type}.is_available() "
            f"is {None if available is None else False})"
        )
    count = device_module.device_count() if hasattr(device_module, "device_count") else 1
    if device.index is not None and not 0 <= device.index < count:
        raise DeviceError(f"device {name!r} does not exist: {device.type} has {count} device(s)")
    if device.index is None:  # name it as the engine and error texts do
        device = torch.device(device.type, device_module.current_device())
    _check_engine_runs(device)
    _selected = device
    return device


def _check_engine_runs(device):
    """A backward on ``device``: the engine must have a thread for it."""
    x = torch.ones(1, device=device, requires_grad=True)
    try:
        (x * 2).sum().backward()
    except RuntimeError as e:
        if "device_ready_queues_" not in str(e):
            raise
        module = module_for(str(device)) or "the module that registers it"
        raise DeviceError(
            f"device {device.type!r} was registered after the autograd engine started, "
            f"so the engine runs no thread for it: import {module} before the first "
            f"backward() of the process (pytest -p {module} ...)"
        ) from None


def selected():
    """The suite's device."""
    return _selected


def is_accelerator():
    return _selected.type != "cpu"


def describe():
    device = _selected
    if device.type == "cpu":
        return "cpu"
    what = "PrivateUse1 backend" if device.type == _privateuse1_name() else "accelerator"
    count = getattr(torch, device.type).device_count()
    return f"{device} ({what}, {count} device{'s' if count != 1 else ''})"


@contextlib.contextmanager
def as_default():
    """``selected()`` as torch's default device for the block (nothing on the CPU)."""
    if _selected.type == "cpu":
        yield
        return
    previous = torch.get_default_device()
    torch.set_default_device(_selected)
    try:
        yield
    finally:
        torch.set_default_device(previous)


# --- what accelerator tests use: the device's module, streams, devices ------


def device_module():
    """``torch.cuda``, ``torch.xpu``, ``torch.testdevice``, ...: current_stream,
    Stream, stream, synchronize, device_count."""
    return getattr(torch, _selected.type)


def new_stream(device=None):
    """A new non-default stream of the device."""
    return device_module().Stream(device if device is not None else _selected)


def stream(s):
    """Context manager: ``s`` current on this thread for the block."""
    return device_module().stream(s)


def current_stream(device=None):
    return device_module().current_stream(device if device is not None else _selected)


def synchronize():
    device_module().synchronize()


def device_count():
    return device_module().device_count()


# Where an accelerator test runs its forward: the device's default stream, a
# side stream, the second device (where there is one).
PLACES = ["default stream", "side stream", "second device"]


def place(where):
    """(device, stream to run the forward on or None) for ``where``; skips
    the test where the device has one device only."""
    if where == "second device":
        return second_device_or_skip(), None
    return _selected, (new_stream(_selected) if where == "side stream" else None)


def run_on(s, fn):
    """``fn()`` with ``s`` (a stream, or None: as it is) current."""
    if s is None:
        return fn()
    with stream(s):
        return fn()


def second_device():
    """Another device of the same type, or None where there is only one."""
    if device_count() < 2:
        return None
    index = _selected.index or 0
    return torch.device(_selected.type, 1 - index if index <= 1 else 0)


def second_device_or_skip():
    """second_device(); skips the test where the device has one device only."""
    import pytest

    device = second_device()
    if device is None:
        pytest.skip("the device has one device only")
    return device

