"""torch_ctxext: the whole documented ctx contract of torch.autograd.Function.

``import torch_ctxext`` adds to ``FunctionCtx`` / ``BackwardCFunction`` the
members of the contract the running torch lacks, and nothing else: members
torch provides natively stay untouched. :func:`features` says who provides
what.
"""
from torch.autograd.function import BackwardCFunction, FunctionCtx

from . import _features
from ._features import features

__all__ = ["explain", "features", "testing"]
__version__ = "0.1.0"

_features.check_supported_torch()
_features.record_native()
if not hasattr(FunctionCtx, "input_grad_buffers"):
    from . import _extension, _input_grad_buffers

    _input_grad_buffers.install(_extension.load())
if not hasattr(FunctionCtx, "set_output_grad_dtype"):
    from . import _extension, _output_grad_dtype

    _output_grad_dtype.install(_extension.load())
if not hasattr(BackwardCFunction, "apply_boxed"):
    from . import _boxed_grads, _extension

    _boxed_grads.install(_extension.load())

from . import testing  # noqa: E402  (check_function, after the patches above)
from ._explain import explain  # noqa: E402
