"""pytest plugin: the ``ctx_contract`` fixture.

Registered through the ``pytest11`` entry point when torch_ctxext is
installed; without the installed entry point, enable it with
``-p torch_ctxext.pytest_plugin`` or ``pytest_plugins = ["torch_ctxext.pytest_plugin"]``
in your top-level conftest.py. A test is then one line::

    def test_my_function(ctx_contract):
        ctx_contract(MyFunction, torch.randn(4, 3, requires_grad=True), w)

The fixture is :func:`torch_ctxext.testing.check_function`: it returns the
report, and fails the test with the report (an AssertionError) when a rule of
the ctx contract is broken.

This module imports torch only when the fixture is used, so that having
torch_ctxext installed costs other pytest runs nothing.
"""
import pytest


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
