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
report, and fails the test with the report (an AssertionError) when a rule of
the ctx contract is broken. Without the installed entry point (a source
checkout), enable it with ``-p torch_ctxext_pytest``.
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
