"""Loading the C++ extension, only a build made for the running torch.

The extension reads autograd-engine structures by the layout of the headers it
was compiled with. Loaded into any other torch build it would read garbage, so
:func:`load` takes, in this order:

1. a binary installed with the package: one of the binary wheel's
   (``_binaries/manifest.json``, ``tools/wheels.py``) made for this torch
   version, git hash, C++ ABI and CPython (its digest checked first), or
   the one ``pip install --no-build-isolation`` compiled (``_C`` beside
   ``_build_info.py``), if that is the running torch; nothing is compiled;
2. a packaged binary for the same release and CPython from another build of
   it (a source or vendor build of torch: the git hash or the local version
   differs), if the layout verdict for it against this torch (a probe in a
   child process, kept in the cache) finds nothing amiss;
3. the build for the running torch in the cache (``build``);
4. a new build in the cache, compiled now (first import after an install from
   source or a torch upgrade), unless ``TORCH_CTXEXT_JIT=0``: then the
   ImportError names what was looked for and what was found.

A build that is found but does not load (the dynamic loader refuses it: a
C library older than the one it was built with, ``version `GLIBC_2.34' not
found``; a library it links that is missing here; a file that is not a
shared library) is passed over with an :class:`UnloadableBuildWarning`
that names the file and quotes the loader, and the next one in this order
is tried: the next packaged binary, the cache, a build now. A build in the
cache that does not load is built again, in its place, by the first import
that may build (``build.build``'s ``replace``); with ``TORCH_CTXEXT_JIT=0``
it is left where it is (the node cannot tell whether it is damaged or only
unfit for this machine, and in a shared cache other nodes may load it), and
each import tries it again, at the cost of one refused ``dlopen``, and says
so. When nothing loads, :func:`load` raises ExtensionBuildError quoting
every refusal: the import succeeds without the members, never with an
ImportError from the dynamic loader.

:data:`choice` says which, and why (``python -m torch_ctxext info``).

The record is checked before the shared library is loaded, and the library
repeats the check with the values compiled into it. Then
:func:`layout_verdict` says which members the build must not provide on this
torch: the verdict of the layout probe, made once per build and torch in a
child process (``layout_verdict``), read from where ``verdict_store`` keeps
it, never trusted as an address.
"""
import collections
import functools
import hashlib
import importlib.util
import json
import os
import sys
import warnings

import torch
from _torch_ctxext_build import extension, layout_verdict as _verdict, verdict_store
from _torch_ctxext_build.build_lock import LockTimeout
from _torch_ctxext_build.cache import BUILD_AGAIN

from .. import _features, _releases
from . import build, build_cache
from .build import ExtensionBuildError  # noqa: F401  (raised by load())

# The package this layer belongs to (torch_ctxext, or the name a library
# vendors it under): its _C is the extension.
PACKAGE = __package__.rpartition(".")[0]
# The command that installs torch_ctxext again, its build made for the running torch.
REINSTALL = "pip install --no-build-isolation --force-reinstall --no-deps torch_ctxext"
BUILD_AHEAD = f"{build.ENV_JIT}=1 python -m torch_ctxext build"

# Where the loaded extension came from (``python -m torch_ctxext info``):
# origin is "package" (installed with it), "cache" or "built" (at this import).
Loaded = collections.namedtuple("Loaded", "path origin torch_version torch_git_version")
loaded = None


class BuildMismatchError(ImportError):
    """torch_ctxext was built for another torch than the one running."""


def _mismatch(built_version, built_git):
    return BuildMismatchError(
        f"torch_ctxext was built for torch {built_version} (git {built_git[:12]}) "
        f"but torch {torch.__version__} (git {torch.version.git_version[:12]}) "
        "is running. Its extension reads autograd internals by layout and must "
        f"be rebuilt against the running torch: unset {build.ENV_JIT} (it is 0) "
        f"to build it at import, build it ahead of time with `{BUILD_AHEAD}`, or "
        f"reinstall with `{REINSTALL}` (`.` instead of torch_ctxext in a checkout)."
    )


class AnotherCopyError(ExtensionBuildError):
    """Another copy of torch_ctxext's extension is already loaded in this
    process (a second path, or a package that vendors torch_ctxext under
    another name): this one is not loaded.

    Each copy would hook the autograd engine itself and replace the first
    copy's hooks (csrc/module.cpp, claim_engine_hooks). An
    ExtensionBuildError, so that ``import torch_ctxext`` reports it like a
    failed build: it warns, and features() names both copies.
    """


# Where the first copy to load records itself (csrc/module.cpp): in torch._C,
# one per process whatever the copies are called.
HOOKS_OWNER = "_torch_ctxext_engine_hooks_owner"


def _another_copy(first, ours):
    return AnotherCopyError(
        "torch_ctxext: another copy of torch_ctxext's C++ extension is already "
        f"loaded in this process: {first}. This copy, {ours}, is not loaded: each "
        "copy hooks the autograd engine itself (libtorch_cpu's GOT, PyNode's "
        "vtable) and a second copy would replace the first one's hooks. Import a "
        "single torch_ctxext per process (a library that vendors it should use "
        "the installed one when present)."
    )


def _not_built(looked=None):
    return ImportError(
        "torch_ctxext's C++ extension has not been built for torch "
        f"{torch.__version__} (git {torch.version.git_version[:12]}), and "
        f"{build.ENV_JIT}=0 forbids building it at import. Looked for "
        f"{looked or 'a packaged binary'}, then a build in the cache {build_cache.root()}: none. "
        f"Install the binary wheel for this CPython (docs/install.md), build it ahead of time "
        f"with `{BUILD_AHEAD}` (into {build_cache.root()}), or unset "
        f"{build.ENV_JIT} to build it at the next import."
    )


def _same_build(version, git):
    return version == torch.__version__ and git == torch.version.git_version


# The binary wheels' binaries (tools/wheels.py): <package>/_binaries/<build>/_C.so
# and the manifest that says what each was built for.
BINARIES = "_binaries"
MANIFEST = "manifest.json"
# Why the loader took what it took, or passed over a packaged binary (info).
choice = None


def _release_of(version):
    return version.split("+", 1)[0]


def _describe(entry):
    abi = "C++11 ABI" if entry.get("cxx11_abi") else "pre-C++11 ABI"
    return f"torch {entry.get('torch')} (git {str(entry.get('git'))[:12]}, {abi}, {entry.get('python')})"


def packaged_binaries():
    """[manifest entries, each with its "file" path] of the binaries the
    package carries (a binary wheel), or [] (a source install)."""
    directory = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), BINARIES)
    try:
        with open(os.path.join(directory, MANIFEST)) as f:
            manifest = json.load(f)
        builds = manifest["builds"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    found = []
    for entry in builds if isinstance(builds, list) else []:
        if isinstance(entry, dict) and isinstance(entry.get("path"), str) and ".." not in entry["path"].split("/"):
            found.append(dict(entry, file=os.path.join(directory, *entry["path"].split("/"))))
    return found


def _intact(entry):
    """None if the packaged binary is there with the digest the manifest
    records, else what is wrong with it."""
    try:
        with open(entry["file"], "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
    except OSError as e:
        return f"the packaged binary {entry['file']} cannot be read ({e.strerror or e})"
    if digest != entry.get("sha256"):
        return f"the packaged binary {entry['file']} is damaged (its digest is not the manifest's)"
    return None


def _this_torch():
    return {"torch": torch.__version__, "git": torch.version.git_version,
            "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI), "python": sys.implementation.cache_tag}


def choose_packaged(entries=None, unloadable=None):
    """(path, origin) of the packaged binary to load for the running torch,
    or (None, what was found): the exact build first, else one for the same
    release from another build whose layout verdict here is clean. Sets
    :data:`choice`. Nothing is compiled; a probe may run in a child process.

    ``unloadable``: {path: the dynamic loader's message} of binaries that
    were chosen before and did not load: each is passed over (and named in
    the choice), so that calling this again gives the next candidate."""
    global choice
    here = _this_torch()
    entries = packaged_binaries() if entries is None else entries
    unloadable = unloadable or {}
    compatible = [e for e in entries if e.get("python") == here["python"] and e.get("cxx11_abi") == here["cxx11_abi"]]
    exact = [e for e in compatible if e.get("torch") == here["torch"] and e.get("git") == here["git"]]
    release = [e for e in compatible if e not in exact and _release_of(str(e.get("torch"))) == _release_of(here["torch"])]
    problems = [f"the packaged binary {path} does not load ({why})"
                for path, why in unloadable.items() if any(e["file"] == path for e in exact + release)]
    exact = [e for e in exact if e["file"] not in unloadable]
    release = [e for e in release if e["file"] not in unloadable]
    for entry in exact:
        problem = _intact(entry)
        if problem is None:
            choice = "".join(p + "; " for p in problems) + (
                f"the packaged binary for {_describe(here)}: loaded, nothing compiled")
            return entry["file"], "package"
        problems.append(problem)
    for entry in release:
        problem = _intact(entry)
        if problem is None:
            try:
                record, _ = verdict_of(entry["file"])
            except (_verdict.ProbeNotRun, LockTimeout) as e:
                problem = f"the packaged binary for {_describe(entry)} could not be verified against this torch build ({e})"
            else:
                if not record["found"]:
                    choice = "".join(p + "; " for p in problems) + (
                        f"the packaged binary for {_describe(entry)}, the same release from another build: "
                        "its layout verdict against this torch finds nothing amiss; loaded, nothing compiled")
                    return entry["file"], "package (verified)"
                problem = (f"the packaged binary for {_describe(entry)} does not read this torch build's structures "
                           f"as its headers say ({', '.join(sorted(record['found']))})")
        problems.append(problem)
    if entries:
        found = "; ".join(_describe(e) for e in entries)
        looked = f"a packaged binary for {_describe(here)} (this copy carries: {found})"
    else:
        looked = "a packaged binary (this copy carries none: installed from source)"
    choice = looked + ("; " + "; ".join(problems) if problems else "")
    return None, choice


def packaged_build():
    """(path of _C, torch version, git) of the build installed with the
    package, or None if it carries none."""
    try:
        from .. import _build_info
    except ImportError:
        return None
    spec = importlib.util.find_spec(PACKAGE + "._C")
    if spec is None or not spec.origin:
        return None
    return spec.origin, _build_info.TORCH_VERSION, _build_info.TORCH_GIT_VERSION


def _import(path):
    """Import the library at ``path`` as torch_ctxext._C."""
    name = PACKAGE + "._C"
    if name in sys.modules:
        return sys.modules[name]
    # The library refuses the same way when loaded; checked here first so that
    # a second copy is never even mapped, and is reported as unavailable.
    first = getattr(torch._C, HOOKS_OWNER, None)
    if first is not None:
        raise _another_copy(first, f"{path} (module {name})")
    module = extension.load(name, path, register=True)
    setattr(sys.modules[PACKAGE], "_C", module)
    return module


def _check_boundaries(compiled, path):
    """Refuse a build whose release boundaries (csrc/engine_layout.h, as the
    build defined them) are not those _releases gives the running torch: a
    build made before _releases.py was edited would take another route than
    the one features() describes. (A build in the cache cannot differ: its
    key covers the macros.)"""
    expected = _releases.boundaries(torch.__version__)
    if dict(compiled) != expected:
        differ = sorted(k for k in set(compiled) | set(expected) if compiled.get(k) != expected.get(k))
        raise BuildMismatchError(
            f"torch_ctxext's extension {path} was compiled with other release "
            f"boundaries than torch_ctxext/_releases.py gives torch {torch.__version__} "
            f"(differ: {', '.join(differ)}): reinstall with `{REINSTALL}` "
            "(`.` instead of torch_ctxext in a checkout)."
        )


class UnloadableBuild(Exception):
    """The dynamic loader refused a build (``message``: what it said)."""

    def __init__(self, path, message):
        super().__init__(f"{path}: {message}")
        self.path, self.message = path, message


def _open(path, what, then):
    """_import(path), or raise UnloadableBuild after warning (an
    :class:`UnloadableBuildWarning`) that ``what`` at ``path`` does not load,
    quoting the dynamic loader, and ``then``, what the import does next.

    Any ImportError of the import but ExtensionBuildError (another copy,
    refused before it is mapped) is a build that does not load: the
    loader's own (``dlopen``: an ELF header, a missing library, a symbol
    version), or the module's initialisation failing. Neither may escape
    from ``import torch_ctxext``."""
    try:
        return _import(path)
    except ExtensionBuildError:
        raise
    except ImportError as e:
        message = str(e) or type(e).__name__
        warnings.warn(
            f"torch_ctxext: {what} {path} does not load (the dynamic loader: {message}); "
            f"it is passed over: {then}", _features.UnloadableBuildWarning, stacklevel=3,
        )
        raise UnloadableBuild(path, message) from None


def _nothing_loads(unloadable, after):
    """The ExtensionBuildError for an import where every build found was
    refused by the dynamic loader (``unloadable``: {path: message}) and
    nothing else could be had (``after``: why, e.g. the failed build's
    message). Every refusal is quoted: it is the reason features() gives."""
    refused = "; ".join(f"{path} does not load ({why})" for path, why in unloadable.items())
    error = ExtensionBuildError(
        f"torch_ctxext could not load its C++ extension for torch {torch.__version__}: {refused}. "
        f"{after}"
    )
    error.what = refused
    error.remembered = getattr(after, "remembered", False)
    return error


@functools.lru_cache(maxsize=None)
def load():
    """Return the torch_ctxext._C module built for the running torch.

    Takes the first build, in the order of this module's docstring, that
    loads; one that the dynamic loader refuses is warned about and passed
    over. Raises ExtensionBuildError (an ImportError) if it had to be built
    and the build failed, or if every build found was refused (the message
    quotes each refusal); BuildMismatchError or ImportError if
    TORCH_CTXEXT_JIT=0 and there is no build for the running torch.
    """
    global loaded, choice
    # {path: the dynamic loader's message} of the builds passed over.
    unloadable = {}
    module = path = None
    jit = build.jit_enabled()
    then_cache = "the build cache is tried next" if jit else f"the build cache is tried next ({build.ENV_JIT}=0)"
    packaged = packaged_build()
    entries = [] if packaged else packaged_binaries()  # the manifest, read once
    binary, looked = (None, None) if packaged else choose_packaged(entries)
    if packaged and _same_build(packaged[1], packaged[2]):
        try:
            path, origin = packaged[0], "package"
            module = _open(path, "the build pip compiled at install", then_cache)
            choice = "the build pip compiled for this torch at install: loaded, nothing compiled"
        except UnloadableBuild as e:
            unloadable[e.path] = e.message
            choice = f"the build pip compiled for this torch at install, {e.path}, does not load ({e.message})"
    while binary is not None:
        try:
            path, origin = binary, looked
            module = _open(path, "the packaged binary",
                           "the next packaged binary that fits, else the build cache, is tried")
            break
        except UnloadableBuild as e:
            unloadable[e.path] = e.message
            binary, looked = choose_packaged(entries, unloadable)
    replace = None  # the cache's build that does not load, for build() to build again
    if module is None and (cached := build_cache.cached_library()):
        identity = build_cache.identity(cached)  # before it is tried: a build made meanwhile is not replaced
        then = (f"this import builds it again, in its place ({build.ENV_JIT})" if jit else
                f"{build.ENV_JIT}=0 forbids building it again at import; `{BUILD_AGAIN}` "
                "on a machine like this one replaces it")
        try:
            path, origin = cached, "cache"
            module = _open(path, "the build in the cache", then)
            choice = (looked + "; " if looked else "") + "the build in the cache for this torch: loaded"
        except UnloadableBuild as e:
            unloadable[e.path] = e.message
            replace = identity
            choice = (looked + "; " if looked else "") + f"the build in the cache {e.path} does not load ({e.message})"
    if module is None and not jit:
        if packaged and packaged[0] not in unloadable:
            error = _mismatch(packaged[1], packaged[2])
        else:
            error = _not_built(looked or "the build pip compiled at install")
        if unloadable:
            raise _nothing_loads(unloadable, str(error))
        raise error
    if module is None:
        if replace is not None:
            reason = f"the build in the cache does not load here ({unloadable[cached]})"
        elif packaged and unloadable:
            reason = f"the build pip compiled at install does not load here ({unloadable[packaged[0]]})"
        elif packaged:
            reason = f"the installed build is for torch {packaged[1]} (git {packaged[2][:12]})"
        elif entries:
            reason = f"none of its packaged binaries fits ({looked})"
        else:
            reason = "this copy of torch_ctxext carries no build (installed from source)"
        try:
            path, built = build.build(reason, replace=replace)
        except ExtensionBuildError as e:
            if unloadable:
                raise _nothing_loads(unloadable, e) from None
            raise
        origin = "built" if built else "cache"  # or another process built it meanwhile
        choice = f"{reason}; built at this import" if built else f"{reason}; the build in the cache: loaded"
        try:
            module = _open(path, "the build made at this import" if built else "the build in the cache",
                           "nothing is left to try")
        except UnloadableBuild as e:
            unloadable[e.path] = e.message
            raise _nothing_loads(unloadable, "") from None
    if origin != "package (verified)" and not _same_build(module.built_for_torch, module.built_for_git_version):
        raise _mismatch(module.built_for_torch, module.built_for_git_version)
    _check_boundaries(module.boundaries, path)
    loaded = Loaded(path, origin, module.built_for_torch, module.built_for_git_version)
    return module


# The layout verdict of the loaded build (layout_verdict.verify's record: what
# did not read back, the facts the probe noted of this torch's binaries), and
# where it was read or written (``info``); None where there is none.
verdict = None
verdict_path = None
def _unverified(why):
    reason = (
        "torch_ctxext could not verify that its extension reads the structures of torch "
        f"{torch.__version__} as its headers say ({why}); nothing that depends on them is "
        "installed in this process, and the next import verifies again "
        "(`python -m torch_ctxext build` verifies ahead of time)"
    )
    # Said, not only recorded: the other ranks of the job may have them.
    warnings.warn(reason, _features.ExtensionUnavailableWarning, stacklevel=3)
    return {member: reason for member in _verdict.NEEDS}


def layout_verdict():
    """{member: why} for the members the loaded build must not provide here
    (empty when its layout verdict found nothing amiss). The verdict is read
    from beside the build; where there is none for this build and torch (a
    build made before verdicts, a torch reinstalled in place, a wheel built
    elsewhere), or it is damaged, the probe runs now, once, in a child
    process, and its verdict is kept for the next imports. No autograd runs
    in this process; nothing of a verdict raises out of here."""
    global verdict, verdict_path
    try:
        verdict, verdict_path = verdict_of(loaded.path)
    except _verdict.ProbeNotRun as e:
        return _unverified(str(e))
    except LockTimeout as e:
        return _unverified(f"it waited {e.timeout:.0f} s for another process's verification")
    except OSError as e:  # the lock file went away or became unreadable meanwhile
        return _unverified(f"{e.strerror or e}: {e.filename}")
    return _verdict.verdicts(verdict["found"])


def _trusted(record, library):
    """Whether the facts of ``record`` hold in this process: the offset of
    PyNode's vtable is PyNode's vtable in the libtorch_python loaded here
    (checked by the loaded extension, bounded: a damaged offset reads as
    "not it", never as a crash). A build not loaded here is not asked (its
    offset is checked again before the boxed path is installed)."""
    offset = record["facts"].get("pynode_vtable_offset")
    ext = sys.modules.get(PACKAGE + "._C")
    if offset is None or loaded is None or loaded.path != library or not hasattr(ext, "is_pynode_vtable_offset"):
        return True
    try:
        return bool(ext.is_pynode_vtable_offset(offset))
    except Exception:  # (read() took it for an offset: only a bug gets here)
        return False


def verdict_of(library):
    """(the layout verdict of ``library`` against the running torch, where
    it is kept or None): ``verdict_store.verdict_of``, a verdict's facts
    trusted only where they hold in this process. Raises ProbeNotRun, or
    LockTimeout after waiting that long for another process's verification."""
    return verdict_store.verdict_of(library, trusted=lambda record: _trusted(record, library))
