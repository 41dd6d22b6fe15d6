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

A run whose only targets are the conformance suite (``pytest --pyargs
torch_ctxext.conformance``, or one of its modules) loads no conftest.py of
the directory it is run from, nor of that directory's parents: a project's
autouse fixture (seeding, a default dtype or device) would change what the
suite checks, and the failures would blame torch. The suite's report header
says whether the run was isolated (an ini file found in the caller's
directory still applies: ``python -m torch_ctxext check`` runs the suite with
its own).
"""
import importlib
import os

import pytest

# The module that registers each PrivateUse1 backend this project knows
# (torch_ctxext.conformance._device.KNOWN_MODULES, which cannot be imported
# here without importing torch_ctxext).
_KNOWN_DEVICE_MODULES = {"testdevice": "torch_ctxext_testdevice"}


# The conformance suite, as a --pyargs target.
_SUITE = "torch_ctxext.conformance"


def _suite_directory():
    """The conformance suite's directory, or None, found without importing
    torch_ctxext (whose import patches torch): from the top package's spec,
    which finding does not execute (finding a subpackage's spec imports its
    parent package)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(_SUITE.partition(".")[0])
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    directory = os.path.join(list(spec.submodule_search_locations)[0], _SUITE.partition(".")[2])
    return directory if os.path.isdir(directory) else None


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    """Keep the caller's conftest.py files out of a run of the suite alone.

    pytest loads the initial conftest.py files of a --pyargs run from the
    directory it is run in and that directory's parents (its targets are no
    paths), and --confcutdir only cuts off the parents of its own directory.
    So, before pytest loads them (this hook runs first), the targets it
    loads them for become the suite's directory, and confcutdir that
    directory: the suite's conftest.py alone is loaded. The run's real
    targets are parsed afresh later; collection is unchanged.
    """
    namespace = early_config.known_args_namespace
    targets = [str(target).split("::")[0] for target in namespace.file_or_dir]
    if not namespace.pyargs or not targets:
        return
    if not all(target == _SUITE or target.startswith(_SUITE + ".") for target in targets):
        return  # other tests too: their conftest.py files are theirs to load
    directory = _suite_directory()
    if directory is not None:
        namespace.file_or_dir = [directory]
        namespace.confcutdir = directory


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
