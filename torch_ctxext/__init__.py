"""torch_ctxext: the whole documented ctx contract of torch.autograd.Function.

``import torch_ctxext`` adds to ``FunctionCtx`` / ``BackwardCFunction`` the
members of the contract the running torch lacks, and nothing else: members
torch provides natively stay untouched. :func:`features` says who provides
what.

The members it adds need its C++ extension, built for the running torch: at
install where pip could see torch, else by the first import, once, into a
cache (about 20 s on 2 cores; ``python -m torch_ctxext info`` says which build is
loaded). If no build can be made here, the import still succeeds, warns once
saying why (:class:`ExtensionUnavailableWarning`), :func:`features` reports
those members unavailable, and using one raises
:class:`MemberUnavailableError` with the same reason. A build that is found
but does not load (the dynamic loader refuses it) is passed over with an
:class:`UnloadableBuildWarning` and the next one is tried; the import never
raises the loader's ImportError.

On a torch newer than the tested range (2.16, a nightly) the import is a
no-op with a :class:`NewerTorchWarning`: torch provides the whole contract
natively from 2.15 on, and a member it lacks there is a regression of torch,
reported unavailable (``python -m torch_ctxext check`` fails on it), never
patched by an extension built for engine structures it was not tested with.
"""
import importlib

from . import _features
from ._features import (
    ExtensionUnavailableWarning, MemberUnavailableError, NewerTorchWarning, UnloadableBuildWarning, features,
)

__all__ = [
    "ExtensionUnavailableWarning", "MemberUnavailableError", "NewerTorchWarning", "UnloadableBuildWarning",
    "advise", "explain", "features", "nn", "testing",
]
__version__ = "0.1.0"

# The members torch_ctxext can provide, in the order they are installed, and
# the module that does it.
_INSTALLERS = (
    ("input_grad_buffers", "._backport.input_grad_buffers"),
    ("set_output_grad_dtype", "._backport.output_grad_dtype"),
    ("apply_boxed", "._backport.boxed_grads"),
)


def _install(warn=True):
    """What ``import torch_ctxext`` does: refuse an unsupported torch, then
    add the members the running torch lacks (loading, or building, the C++
    extension they need).

    Raises ImportError where the import must fail (an unsupported torch; no
    build and TORCH_CTXEXT_JIT=0), the same one on every call; a build that
    fails only makes those members unavailable (and warns, unless ``warn``
    is false: ``info`` says it itself). Runs once; later calls return, or
    raise, what the first did.
    """
    if _INSTALLED:
        if _INSTALLED[0] is not None:
            raise _INSTALLED[0]
        return
    try:
        _install_members(warn)
    except ImportError as refusal:
        _INSTALLED.append(refusal)
        raise
    _INSTALLED.append(None)


def _install_members(warn):
    global _C
    _features.check_supported_torch()
    _features.record_native()
    missing = [member for member, _ in _INSTALLERS if _features.lacks(member)]
    if missing and _features.newer_torch():
        # A regression of a torch newer than the tested range: reported, not
        # patched (no extension is loaded into a torch it was not tested with).
        for member in missing:
            _features.UNAVAILABLE[member] = (
                f"torch {_features.torch.__version__} is newer than the releases torch_ctxext was tested with "
                f"and should provide it natively (torch does from {_features.native_from(member)})"
            )
    elif missing:
        from ._ext import loader as _loader

        try:
            _C = _loader.load()  # also set by load(): torch_ctxext._C
        except _loader.ExtensionBuildError as error:
            # No build for this torch, and none could be made here: the rest of
            # the contract still works, and features() says why these do not.
            _features.report_unavailable(missing, error, warn=warn)
        else:
            # Members whose engine structures do not read back as the headers
            # say are not installed; features() gives the reason. The verdict
            # was made once for this build and torch, in a child process (the
            # import itself runs nothing of autograd).
            _features.UNAVAILABLE.update(_loader.layout_verdict())
            for member, module in _INSTALLERS:
                if member in missing and member not in _features.UNAVAILABLE:
                    # Each installer says what it installed, or why it could not.
                    installed = importlib.import_module(module, __name__).install(_C)
                    _features.record(installed, member)
    # A member that could not be provided says why where it is used.
    _features.mark_unavailable(missing)


def _command_line_import():
    """Whether this import is the command line's own: ``python -m
    torch_ctxext`` (runpy imports the package while it locates __main__,
    sys.argv[0] being "-m" meanwhile) or the ``torch-ctxext`` script.
    The command line then installs the members itself, for the commands
    that need them, and says what is wrong where the import would refuse,
    instead of a traceback (``--version`` and ``--help`` need nothing)."""
    import os
    import sys

    argv = getattr(sys, "orig_argv", [])
    as_module = any(
        arg in ("-m" + __name__, "-m" + __name__ + ".__main__")
        or (arg == "-m" and argv[i + 1 : i + 2] in ([__name__], [__name__ + ".__main__"]))
        for i, arg in enumerate(argv)
    )
    if as_module and sys.argv[:1] == ["-m"]:
        return True
    script = os.path.basename(sys.argv[0]) if sys.argv else ""
    return script in ("torch-ctxext", "torch-ctxext.exe", "torch-ctxext-script.py")


_INSTALLED = []  # once _install() has run: [None], or [the ImportError it raised]
if not _command_line_import():
    _install()


# The checker (testing/, thousands of lines), explain(), advise() and the
# drop-in modules (nn/) are not for every training process that imports
# torch_ctxext: they load on first use, as torch_ctxext.testing,
# torch_ctxext.explain, torch_ctxext.advise and torch_ctxext.nn.
_LAZY = {"testing": ".testing", "explain": "._explain", "advise": "._advise", "nn": ".nn"}


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(_LAZY[name], __name__)
    value = getattr(module, name) if name in ("explain", "advise") else module
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
