"""torch_ctxext: the whole documented ctx contract of torch.autograd.Function.

``import torch_ctxext`` adds to ``FunctionCtx`` / ``BackwardCFunction`` the
members of the contract the running torch lacks, and nothing else: members
torch provides natively stay untouched. :func:`features` says who provides
what.

The members it adds need its C++ extension, built for the running torch: at
install where pip could see torch, else by the first import, once, into a
cache (about a minute; ``python -m torch_ctxext info`` says which build is
loaded). If no build can be made here, the import still succeeds, warns once
saying why, and :func:`features` reports those members unavailable.
"""
from torch.autograd.function import BackwardCFunction, FunctionCtx

from . import _features
from ._features import features

__all__ = ["explain", "features", "testing"]
__version__ = "0.1.0"

_features.check_supported_torch()
_features.record_native()
# The members this torch lacks that torch_ctxext adds with its C++ extension.
_missing = [
    name
    for owner, name in (
        (FunctionCtx, "input_grad_buffers"),
        (FunctionCtx, "set_output_grad_dtype"),
        (BackwardCFunction, "apply_boxed"),
    )
    if not hasattr(owner, name)
]
if _missing:
    from . import _extension

    try:
        _ext = _extension.load()
    except _extension.ExtensionBuildError as error:
        # No build for this torch, and none could be made here: the rest of
        # the contract still works, and features() says why these do not.
        _features.report_unavailable(_missing, error)
    else:
        if "input_grad_buffers" in _missing:
            from . import _input_grad_buffers

            _input_grad_buffers.install(_ext)
        if "set_output_grad_dtype" in _missing:
            from . import _output_grad_dtype

            _output_grad_dtype.install(_ext)
        if "apply_boxed" in _missing:
            from . import _boxed_grads

            _boxed_grads.install(_ext)

from . import testing  # noqa: E402  (check_function, after the patches above)
from ._explain import explain  # noqa: E402
