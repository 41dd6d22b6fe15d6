"""Which member of the ctx contract the running torch provides, and how."""
import collections
import warnings

import torch
from torch.autograd.function import BackwardCFunction, FunctionCtx

from . import _releases

# The members of the documented ctx contract, and where each lives.
MEMBERS = (
    "apply",
    "apply_boxed",
    "apply_jvp",
    "input_grad_buffers",
    "mark_dirty",
    "mark_non_differentiable",
    "save_for_backward",
    "save_for_forward",
    "set_materialize_grads",
    "set_output_grad_dtype",
)


def member_of_test_module(filename):
    """The member a conformance test module checks: test_<member>.py, or
    test_<member>_<concern>.py for a member whose tests are split by concern
    (tools/contract_table.py reads the suite the same way)."""
    name = filename[len("test_") : -len(".py")]
    for member in sorted(MEMBERS, key=len, reverse=True):
        if name == member or name.startswith(member + "_"):
            return member
    return name


def newer_torch():
    """Whether the running torch is newer than every tested release."""
    return _releases.newer(torch.__version__)


def native_from(member):
    """The release from which torch provides ``member`` natively: '2.15'."""
    return ".".join(map(str, _releases.NATIVE_FROM[member]))


def torch_release(version=None):
    """(major, minor) of a torch version string such as '2.13.0+cpu' (the
    running torch's by default)."""
    return _releases.release(version or torch.__version__)


class NewerTorchWarning(UserWarning):
    """The running torch is newer than every release torch_ctxext was tested
    with: the import patches nothing there (``features()`` says what torch
    provides; ``python -m torch_ctxext check`` whether it conforms)."""


def check_supported_torch():
    """Refuse a torch older than the supported range; warn on a newer one.

    On a newer torch (2.16, a nightly) the import succeeds as a no-op: every
    member torch_ctxext can add is native from 2.15 on, and a member such a
    torch lacks (a regression) is reported unavailable, for the conformance
    suite to fail, rather than patched with an extension built for engine
    structures it was never tested against.
    """
    version = torch.__version__
    if _releases.newer(version):
        warnings.warn(
            f"torch_ctxext was tested with torch {_releases.range_text()}; torch {version} is newer. "
            "It patches nothing on it (torch provides the whole contract natively from 2.15); "
            "`python -m torch_ctxext check` says whether this torch conforms.",
            NewerTorchWarning,
            stacklevel=5,
        )
        return
    if not _releases.supported(version):
        raise ImportError(
            f"torch_ctxext supports torch {_releases.range_text()}, "
            f"but torch {version} is installed. Install a supported "
            f"torch (for example `pip install 'torch{_releases.requirement()}'`)."
        )


_NATIVE = {}
# Members torch_ctxext replaced although torch had them (BackwardCFunction.apply
# of torch 2.6 to 2.12, which cannot box grads).
PROVIDED = set()
# Members torch_ctxext meant to provide but could not, with the reason.
UNAVAILABLE = {}


class Installed(collections.namedtuple("Installed", "provided unavailable")):
    """What a member's installer did: ``provided``, the members it installed
    (its own, and a native one it had to replace: ``apply`` on torch 2.6 to
    2.12); ``unavailable``, ``{member: why}`` for those it could not."""

    @classmethod
    def of(cls, *provided):
        return cls(frozenset(provided), {})

    @classmethod
    def refused(cls, member, why):
        return cls(frozenset(), {member: str(why)})


def record(outcome, member):
    """Record an installer's outcome for ``member``: what it replaced although
    torch had it (PROVIDED) and what it could not provide (UNAVAILABLE)."""
    PROVIDED.update(name for name in outcome.provided if name != member and _NATIVE.get(name))
    UNAVAILABLE.update(outcome.unavailable)


class ExtensionUnavailableWarning(UserWarning):
    """torch_ctxext has no C++ extension for the running torch: the members
    that need it are unavailable (features() says which, and why)."""


class UnloadableBuildWarning(UserWarning):
    """A build of torch_ctxext's C++ extension was found for the running
    torch but the dynamic loader refused it (its message is quoted, with the
    file): it was passed over, and the next build in the loader's order was
    tried. Not an :class:`ExtensionUnavailableWarning`: the extension may
    still load from the next one; where nothing loads, that warning follows
    with every refusal in its reason."""


class MemberUnavailableError(AttributeError):
    """A member of the ctx contract that the running torch lacks and
    torch_ctxext could not provide was used. An ``AttributeError``, so that
    ``hasattr(ctx, "input_grad_buffers")`` and ``getattr(ctx, name, None)``
    still say the member is absent; its message names the member, the reason
    and what to run."""


class _Unavailable:
    """Stands where a member torch_ctxext could not provide would be, so that
    using it says why (the build's message, what to run) instead of a bare
    ``'LinearBackward' object has no attribute 'input_grad_buffers'`` far
    from the import's warning. Reading it on the class or on a ctx raises
    :class:`MemberUnavailableError`; nothing else changes."""

    def __init__(self, member, reason):
        self.member = member
        self.reason = reason

    def __get__(self, instance, owner=None):
        where = "ctx" if _owner(self.member) is FunctionCtx else "BackwardCFunction"
        raise MemberUnavailableError(
            f"{where}.{self.member} is unavailable: torch {torch.__version__} lacks it and "
            f"torch_ctxext could not provide it: {self.reason}\n"
            "(`python -m torch_ctxext info` says what this torch provides, and why.)"
        )


def mark_unavailable(members):
    """Put an :class:`_Unavailable` where each of ``members`` (each in
    UNAVAILABLE, still absent) would be."""
    for name in members:
        if lacks(name) and name in UNAVAILABLE:
            setattr(_owner(name), name, _Unavailable(name, UNAVAILABLE[name]))


def report_unavailable(members, error, warn=True):
    """Record that ``members`` cannot be provided because of ``error``, and
    say so once (``warn``; the command line's ``info`` says it itself)."""
    for name in members:
        UNAVAILABLE[name] = str(error)
    if warn:
        # stacklevel: past _install_members, _install and the package, to the import.
        warnings.warn(str(error), ExtensionUnavailableWarning, stacklevel=5)


# Members another copy of torch_ctxext (vendored by a library under another
# name, imported first) installed: {member: that copy's module}.
OTHER_COPY = {}


def record_native():
    """Remember what torch itself provides, before torch_ctxext patches it.

    A member that is present but was installed by another copy of
    torch_ctxext is not native: it is that copy's (and this copy, refused
    its own extension while the other one holds the engine hooks, says so).
    """
    if _NATIVE:
        return
    for name in MEMBERS:
        other = _installed_by_another_copy(name)
        if other:
            OTHER_COPY[name] = other
        _NATIVE[name] = not lacks(name) and not other


# This copy of the package: torch_ctxext, or the name a library vendors it under.
PACKAGE = __name__.rpartition(".")[0]
# The modules a copy installs its members from, in its own package; anything
# else (torch's own, a user's patch) is no copy's.
_INSTALLERS = (
    "._backport.input_grad_buffers", "._backport.output_grad_dtype", "._backport.boxed_grads",
    "._input_grad_buffers", "._output_grad_dtype", "._boxed_grads",  # before the _backport layer
)


def _installer_of(name):
    """The module (its name) of the torch_ctxext copy, this one or another,
    whose installer put ``name`` in place as it is now, or None. Wrappers that
    name what they wrap (``__wrapped__``: explain()'s observer) are seen
    through."""
    import inspect

    try:
        member = inspect.getattr_static(_owner(name), name)
    except AttributeError:
        return None
    function = member.fget if isinstance(member, property) else member
    try:
        function = inspect.unwrap(function)
    except ValueError:  # a cycle of __wrapped__
        return None
    module = getattr(function, "__module__", None) or ""
    return module if module.endswith(_INSTALLERS) else None


def _installed_by_another_copy(name):
    """The module of the torch_ctxext copy that installed ``name``, if one did."""
    module = _installer_of(name)
    if module is None or module.startswith(PACKAGE + "."):
        return None  # no copy's, or this copy's (a second import of the same package)
    return module


def extension_behind(name):
    """The C++ extension that member ``name``, as installed now, reads
    through: the ``_C`` of the torch_ctxext copy whose installer put it there
    (this copy, or one vendored under another name that was imported first),
    or None where torch provides it natively, no copy's extension provides it
    or something else replaced it.

    Only a library already loaded is returned: nothing is loaded, refused or
    built here, so that explain() and the checker may ask from an engine
    thread, inside a user's backward. (One copy's extension per process:
    csrc/module.cpp, PyInit__C.)
    """
    import sys
    import types

    module = sys.modules.get(_installer_of(name) or "")
    extension = getattr(module, "_C", None)
    return extension if isinstance(extension, types.ModuleType) else None


def _owner(name):
    return BackwardCFunction if name.startswith("apply") else FunctionCtx


def lacks(name):
    """Whether the running torch has no ``name`` yet: neither natively nor
    from an earlier import of torch_ctxext (an :class:`_Unavailable`
    placeholder reads as absent: it raises AttributeError)."""
    return not hasattr(_owner(name), name)


def features():
    """Say, for each member of the ctx contract, who provides it.

    Returns a dict ``{member: status}`` where status is ``"native"`` (the
    running torch implements it), ``"torch_ctxext"`` (this package does) or
    ``"unavailable: <why>"``.

    >>> import torch_ctxext
    >>> torch_ctxext.features()["save_for_backward"]
    'native'
    """
    result = {}
    for name in MEMBERS:
        if name in PROVIDED or name in OTHER_COPY:
            result[name] = "torch_ctxext"
        elif _NATIVE.get(name):
            result[name] = "native"
        elif not lacks(name):
            result[name] = "torch_ctxext"
        elif name in UNAVAILABLE:
            result[name] = f"unavailable: {UNAVAILABLE[name]}"
        else:
            result[name] = (
                f"unavailable: torch {torch.__version__} lacks it and torch_ctxext "
                "does not provide it on this release"
            )
    return result


def routes():
    """Say, for each member of the ctx contract, how the running torch gets it.

    ``"native"``, or for a member torch_ctxext provides the engine route it
    takes on this release (which differs by release: csrc/engine_layout.h),
    or ``"unavailable"``. For ``python -m torch_ctxext info`` and the
    compatibility notes; :func:`features` says who provides what.
    """
    status = features()
    result = {}
    for name in MEMBERS:
        if name in OTHER_COPY:
            result[name] = f"provided by another copy of torch_ctxext, loaded first ({OTHER_COPY[name]})"
        elif status[name] == "native":
            result[name] = "native"
        elif status[name].startswith("unavailable"):
            result[name] = "unavailable"
        else:
            result[name] = _route(name)
    return result


def buffer_exposure():
    """Which ``input_grad_buffers`` slots the running torch can expose, where
    a release's route leaves some ``None`` (docs/compatibility.md):

    ``accelerator_slots``: slots on an accelerator (False where the engine
    records no stream per slot: torch_ctxext on torch 2.6 and 2.7);
    ``later_producer_slots``: slots that later producers still reach, in a
    process whose engine runs device threads (False where they cannot be
    validated: torch_ctxext on torch 2.6 to 2.9).

    Both are True where the member is native. The conformance suite reads
    them so that its accelerator tests check the route each release takes.
    """
    if features()["input_grad_buffers"] == "native":
        return {"accelerator_slots": True, "later_producer_slots": True}
    old_side = boundaries()
    if old_side is None:
        return {"accelerator_slots": False, "later_producer_slots": False}
    return {
        "accelerator_slots": not old_side["NO_SLOT_STREAMS"],
        "later_producer_slots": not old_side["ADD_WITHOUT_CONSUMER_NODE"],
    }


def boundaries():
    """The release boundaries (``_releases.BOUNDARIES``) the loaded C++
    extension was compiled with, ``{name: on its old side}`` (its
    ``boundaries``, checked against ``_releases`` at load), or None where no
    extension is loaded (native torch 2.15, a failed build)."""
    ext = loaded_extension()
    return dict(ext.boundaries) if ext is not None else None


def loaded_extension():
    """The C++ extension loaded in this process for this copy: its own, or
    where another copy installed its members (a vendored copy imported
    second), that copy's, whose build its routes describe. None where
    neither is loaded. Never loads one."""
    import sys

    own = sys.modules.get(PACKAGE + "._C")
    if own is not None:
        return own
    return next((ext for ext in map(extension_behind, OTHER_COPY) if ext is not None), None)


def _route(name):
    old_side = boundaries() or {}
    if name == "input_grad_buffers":
        rule = "adjusted_use_count" if old_side.get("STEALABLE_BY_USE_COUNT") else "is_tensor_stealable"
        route = f"GraphTask InputBuffer slots, in-place rule {rule}"
        if old_side.get("ADD_WITHOUT_CONSUMER_NODE"):
            route += "; with accelerators, slots later producers still reach stay None"
        if old_side.get("NO_SLOT_STREAMS"):
            route += "; accelerator slots stay None"
        return route
    if name == "set_output_grad_dtype":
        if old_side.get("ENGINE_CASTS_TO_OPTIONS_DTYPE"):
            return "InputMetadata options dtype; None via a validate_outputs hook"
        return "InputMetadata grad_dtype"
    if name in ("apply", "apply_boxed"):
        return "PyNode::apply vtable slot, boxed grads to ctx.apply_boxed"
    return "torch_ctxext"
