"""Configuration of the conformance suite: profiles and upstream deviations.

Hypothesis profiles: ``fast`` (default, for CI) and ``thorough`` (nightly);
choose with ``--hypothesis-profile thorough`` or
``TORCH_CTXEXT_HYPOTHESIS_PROFILE=thorough``.

A test marked ``upstream_deviation(member, n)`` checks the documented contract
at a place where native torch is known to break it (docs/deviations.md). Where
``member`` is provided natively by torch, such a test is expected to fail
(strict xfail): it fails loudly the day upstream fixes the deviation. A
deviation of older releases only, fixed upstream since, says up to which
release it exists: ``upstream_deviation(member, n, until=(2, 10))``; on later
releases the test must pass.

``--ctx-device DEVICE`` (pytest, from torch_ctxext's pytest plugin), ``python
-m torch_ctxext check --device DEVICE`` or ``TORCH_CTXEXT_DEVICE`` runs the
suite with its tensors on DEVICE: ``cpu`` (the default), ``cuda``, ``xpu``,
``mps``, or a PrivateUse1 backend by name (``--ctx-device-module`` names the
module that registers it; ``testdevice`` is torch_ctxext's own test device). Every test
then runs with DEVICE as torch's default device; a test that is about the
CPU by nature is marked ``cpu_only(reason)`` and skipped with that reason,
and a test that needs an accelerator (streams, device threads) is marked
``accelerator`` and skipped on the CPU. See docs/vendors.md.
"""
import os

import pytest
from hypothesis import HealthCheck, settings

from . import _device

settings.register_profile(
    "fast",
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
settings.register_profile(
    "thorough",
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("TORCH_CTXEXT_HYPOTHESIS_PROFILE", "fast"))


# Warnings the suite raises on purpose, where it uses torch as the contract
# allows but torch warns anyway; they say nothing about the torch under test.
DELIBERATE_WARNINGS = (
    # test_*create_graph*: backward(create_graph=True) on a leaf.
    "ignore:Using backward\\(\\) with create_graph=True will create a reference cycle:UserWarning",
    # test_*_accelerators: forwards on side streams whose leaves were created
    # on the default stream.
    "ignore:The AccumulateGrad node's stream does not match:UserWarning",
    # On the test device: view operators with no device kernel fall back to
    # the CPU as copies (tools/testdevice/README.md).
    "ignore:.*appears to be a view operator, but it has no implementation for the backend:UserWarning",
)


def pytest_configure(config):
    for line in DELIBERATE_WARNINGS:
        config.addinivalue_line("filterwarnings", line)
    # The device first: selecting it imports its backend's module and runs
    # a backward on it (the engine must run a thread for it, and starts its
    # threads at the first backward of the process, counting the devices
    # registered then).
    try:
        _device.select(*_device.requested(config))
    except _device.DeviceError as e:
        raise pytest.UsageError(str(e)) from None
    # Then torch_ctxext, before the test modules detect what torch has
    # (``_helpers.HAS_BOXED_GRADS`` is read at their import).
    import torch_ctxext  # noqa: F401
    config.addinivalue_line(
        "markers",
        "cpu_only(reason): a test about the CPU by nature, skipped with that reason "
        "when the suite runs on another device",
    )
    config.addinivalue_line(
        "markers",
        "accelerator: needs an accelerator (streams, device threads): runs where "
        "--device is one, skipped on the CPU",
    )
    config.addinivalue_line(
        "markers",
        "upstream_deviation(member, number, until=None): checks the contract "
        "where native torch (up to release `until`, default every release) is "
        "known to break it (docs/deviations.md)",
    )


def deviates(marker, features, release):
    """Whether the running torch has the deviation ``marker`` describes."""
    member, _number = marker.args
    until = marker.kwargs.get("until")
    return features.get(member) == "native" and (until is None or release <= tuple(until))


def pytest_report_header(config):
    # Whether the caller's conftest.py files or ini could change what the
    # suite checks (torch_ctxext.conformance.report.isolation).
    from .report import isolation, isolation_line

    return [
        f"ctx contract conformance on device: {_device.describe()}",
        f"ctx contract conformance: {isolation_line(isolation(config))}",
    ]


@pytest.fixture(autouse=True)
def _on_the_device():
    """Every test creates its tensors on the suite's device."""
    with _device.as_default():
        yield


@pytest.fixture
def buffer_exposure():
    """Which input_grad_buffers slots the running torch can expose, where a
    release's route leaves some None (torch_ctxext._features.buffer_exposure)."""
    from torch_ctxext import _features

    return _features.buffer_exposure()


def pytest_collection_modifyitems(config, items):
    import torch_ctxext
    from torch_ctxext import _features

    features = torch_ctxext.features()
    release = _features.torch_release()
    device = _device.selected()
    exposure = _features.buffer_exposure()
    # Where torch_ctxext's route on this release leaves accelerator slots, or
    # slots later producers reach, None, the input_grad_buffers tests written
    # for the CPU's rules cannot hold on an accelerator; the accelerator tests
    # check that route instead (docs/compatibility.md).
    route_limits = device.type != "cpu" and not all(exposure.values())
    route = _features.routes()["input_grad_buffers"]
    for item in items:
        module = item.nodeid.split("::")[0].rsplit("/", 1)[-1]
        if route_limits and module in ("test_input_grad_buffers.py", "test_input_grad_buffers_refusals.py"):
            item.add_marker(pytest.mark.skip(
                reason=f"on an accelerator, torch_ctxext's route on this release ({route}) "
                "leaves these slots None; test_input_grad_buffers_accelerators.py checks it"))
        cpu_only = item.get_closest_marker("cpu_only")
        if cpu_only is not None and device.type != "cpu":
            item.add_marker(pytest.mark.skip(reason=f"CPU only: {cpu_only.args[0]}"))
        if item.get_closest_marker("accelerator") is not None and not _device.is_accelerator():
            item.add_marker(pytest.mark.skip(
                reason="needs an accelerator (streams, device threads): run the suite "
                "with --device cuda, --device testdevice, ..."))
        marker = item.get_closest_marker("upstream_deviation")
        if marker is None or not deviates(marker, features, release):
            continue
        member, number = marker.args
        item.add_marker(
            pytest.mark.xfail(
                strict=True,
                reason=f"known upstream deviation {number} of {member} on torch "
                f"{release[0]}.{release[1]} (docs/deviations.md); an XPASS means "
                "upstream fixed it",
            )
        )
