"""torch_ctxext: the whole documented ctx contract of torch.autograd.Function.

``import torch_ctxext`` adds to ``FunctionCtx`` / ``BackwardCFunction`` the
members of the contract the running torch lacks, and nothing else: members
torch provides natively stay untouched. :func:`features` says who provides
what.
"""
import importlib

from . import _features
from ._features import features

__all__ = ["explain", "features", "testing"]
__version__ = "0.1.0"

# The members torch_ctxext can provide, in the order they are installed, and
# the module that does it.
_INSTALLERS = (
    ("input_grad_buffers", "._input_grad_buffers"),
    ("set_output_grad_dtype", "._output_grad_dtype"),
    ("apply_boxed", "._boxed_grads"),
)

_features.check_supported_torch()
_features.record_native()
if any(_features.lacks(member) for member, _ in _INSTALLERS):
    from . import _extension, _layout_check

    _ext = _extension.load()
    # Members whose engine structures do not read back as the headers say
    # are not installed; features() gives the reason.
    _features.UNAVAILABLE.update(_layout_check.unavailable_members(_ext))
    for _member, _module in _INSTALLERS:
        if _features.lacks(_member) and _member not in _features.UNAVAILABLE:
            _installer = importlib.import_module(_module, __name__)
            _why = getattr(_installer, "unavailable_reason", lambda ext: None)(_ext)
            if _why:
                _features.UNAVAILABLE[_member] = _why
            else:
                _installer.install(_ext)

from . import testing  # noqa: E402  (check_function, after the patches above)
from ._explain import explain  # noqa: E402
