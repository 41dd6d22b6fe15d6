"""pytest plugin of torch_ctxext: the ``ctx_contract`` fixture.

Installing torch_ctxext registers this module through the ``pytest11`` entry
point, so every pytest run in that environment loads it. It is a top-level
module on purpose: loading it imports neither torch nor torch_ctxext (whose
import patches torch), so a pytest run that does not use the fixture runs on
torch exactly as installed. The fixture imports torch_ctxext when a test asks
for it.

A test is then one line::

    def test_my_function(ctx_contract):
        ctx_contract(MyFunction, torch.randn(4, 3, requires_grad=True), w)

The fixture is :func:`torch_ctxext.testing.check_function`: it returns the
report, and fails the test with the report (an AssertionError whose first
line, the one pytest's summary shows, names the failed rule) when a rule of
the ctx contract is broken; neither its frame nor check_function's is shown
in the failure (``__tracebackhide__``), your test's line and your code are. Without the installed entry point (a source
checkout), enable it with ``-p torch_ctxext_pytest``.

It also adds ``--ctx-device`` and ``--ctx-device-module``, which choose the
device the conformance suite runs on (``pytest --pyargs
torch_ctxext.conformance --ctx-device testdevice``; see docs/vendors.md).
They are prefixed because this plugin is loaded into every pytest run of the
environment, where a project's own ``--device`` must not clash with ours.
A device whose backend a Python module registers (``--ctx-device-module``,
or torch_ctxext's own test device) has that module imported here, at
configure time: before anything in the run can start the autograd engine,
which starts no thread for a backend registered after the first backward().
(Importing torch_ctxext runs no backward: it may come before or after.)
"""
import importlib
import os

import pytest

# The module that registers each PrivateUse1 backend this project knows
# (torch_ctxext.conformance._device.KNOWN_MODULES, which cannot be imported
# here without importing torch_ctxext).
_KNOWN_DEVICE_MODULES = {"testdevice": "torch_ctxext_testdevice"}


def pytest_addoption(parser):
    group = parser.getgroup("torch_ctxext", "ctx contract conformance (torch_ctxext)")
    group.addoption(
        "--ctx-device",
        default=os.environ.get("TORCH_CTXEXT_DEVICE"),
        help="device the conformance suite's tensors are on: cpu (default), cuda, xpu, "
        "mps, or a PrivateUse1 backend's name ($TORCH_CTXEXT_DEVICE)",
    )
    group.addoption(
        "--ctx-device-module",
        default=os.environ.get("TORCH_CTXEXT_DEVICE_MODULE"),
        help="module to import first, which registers the --ctx-device backend "
        "($TORCH_CTXEXT_DEVICE_MODULE; testdevice: torch_ctxext_testdevice)",
    )


def pytest_configure(config):
    device = config.getoption("ctx_device") or ""
    module = config.getoption("ctx_device_module") or _KNOWN_DEVICE_MODULES.get(device.split(":")[0])
    if module:
        try:
            importlib.import_module(module)
        except Exception as e:
            raise pytest.UsageError(
                f"--ctx-device {device}: importing {module!r}, which registers it, failed: {e}"
            ) from None


@pytest.fixture
def ctx_contract():
    """``ctx_contract(FunctionClass, *sample_args, **options)``: check a custom
    autograd Function against the ctx contract (see
    :func:`torch_ctxext.testing.check_function`)."""
    from torch_ctxext.testing import check_function

    def check(function, *sample_args, **options):
        __tracebackhide__ = True
        return check_function(function, *sample_args, **options)

    return check
