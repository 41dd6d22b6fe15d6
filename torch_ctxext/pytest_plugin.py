"""The ``ctx_contract`` fixture, for ``-p torch_ctxext.pytest_plugin`` or
``pytest_plugins = ["torch_ctxext.pytest_plugin"]`` in a conftest.py.

An installed torch_ctxext already provides the fixture to every pytest run
through the ``pytest11`` entry point, which loads the top-level module
``torch_ctxext_pytest`` (it imports nothing until the fixture is used). This
module is the same fixture under the package's name, for projects that name
their plugins explicitly; importing it imports torch_ctxext.
"""
from torch_ctxext_pytest import ctx_contract

__all__ = ["ctx_contract"]
