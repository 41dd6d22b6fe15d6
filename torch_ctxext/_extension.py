"""Loading the C++ extension, only against the torch it was built for.

The extension reads autograd-engine structures by the layout of the headers it
was compiled with. Loaded into any other torch build it would read garbage, so
the check runs before the shared library is loaded (from the build record
setup.py writes) and the library repeats it with the values compiled into it.
"""
import functools

import torch

REBUILD = "pip install --no-build-isolation --force-reinstall --no-deps torch_ctxext"


class BuildMismatchError(ImportError):
    """torch_ctxext was built for another torch than the one running."""


def _mismatch(built_version, built_git):
    return BuildMismatchError(
        f"torch_ctxext was built for torch {built_version} (git {built_git[:12]}) "
        f"but torch {torch.__version__} (git {torch.version.git_version[:12]}) "
        "is running. Its extension reads autograd internals by layout and must "
        "be rebuilt against the running torch: from a source checkout run "
        f"`{REBUILD.replace(' torch_ctxext', ' .')}`, or `{REBUILD}` for a "
        "source distribution."
    )


def _same_build(version, git):
    return version == torch.__version__ and git == torch.version.git_version


@functools.lru_cache(maxsize=None)
def load():
    """Return the torch_ctxext._C module, or raise ImportError saying why not."""
    try:
        from . import _build_info
    except ImportError:
        raise ImportError(
            "torch_ctxext's C++ extension has not been built. Install the "
            f"package (`pip install --no-build-isolation .` in a checkout) "
            "rather than importing it from the source tree."
        ) from None
    if not _same_build(_build_info.TORCH_VERSION, _build_info.TORCH_GIT_VERSION):
        raise _mismatch(_build_info.TORCH_VERSION, _build_info.TORCH_GIT_VERSION)
    from . import _C

    if not _same_build(_C.built_for_torch, _C.built_for_git_version):
        raise _mismatch(_C.built_for_torch, _C.built_for_git_version)
    return _C
