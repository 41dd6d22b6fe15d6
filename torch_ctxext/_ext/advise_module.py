"""advise()'s C++ watch and the drop-ins' C++ Functions on a torch that provides every member natively (torch 2.15).

There ``import torch_ctxext`` loads no library: it has nothing to patch. The
build for such a torch is advise()'s watch (csrc/advise_module.cpp,
csrc/advise_watch.cpp: the walk over the C++ graph and C++ hooks, which
record sizes and addresses without Python in the engine) and FusedLinear's
C++ Function (csrc/fused_linear.cpp) alone. advise() loads it the first time
it watches a backward, FusedLinear at its first call with a gradient, under a
name of its own (:data:`NAME`), so that nothing else finds a
``torch_ctxext._C``. It takes only
a build made for exactly the running torch (version, git, C++ ABI, CPython),
in this order:

1. a binary the package carries (a binary wheel's, ``tools/wheels.py``), its
   digest checked;
2. the build pip compiled at install (``_C`` beside ``_build_info.py``);
3. the build in the cache (``python -m torch_ctxext build``).

It never compiles, never starts a process and never probes a layout (the
watch reads public structures only). Without such a build advise() watches in
Python, as it can anywhere, at a higher cost per backward
(docs/where-fusing-pays.md), and FusedLinear runs its Python Function, at a
higher cost per call. Looked for once per process; :data:`choice`
says what was taken, or why nothing was (``python -m torch_ctxext info``).
"""
import sys
import threading

import torch
from _torch_ctxext_build import extension, sources

from . import build_cache, loader

# The module's name: beside advise's Python (torch_ctxext._advise), never
# torch_ctxext._C, which says "the extension is loaded" to the rest of the
# package. Its initialisation is PyInit__C: the last part must stay _C.
NAME = loader.PACKAGE + "._advise._C"
choice = None  # what load() took, or why it took nothing
_lock = threading.Lock()
_looked = False
_module = None


def load(path=None):
    """The advise-only build for the running torch, imported, or None
    (:data:`choice` says why). ``path``: that library (``python -m
    torch_ctxext build`` names the one it made); else looked for as the
    module's docstring says, once per process. Never raises."""
    global _looked, _module, choice
    if _looked and path is None:
        return _module
    with _lock:
        if _looked and path is None:
            return _module
        try:
            _module = _load(path)
        except Exception as e:  # a damaged file, a library that does not load: Python's watch
            _module, choice = None, f"not loaded ({type(e).__name__}: {e}): advise() watches in Python"
        _looked = True
        return _module


def _load(path):
    global choice
    if not sources.advise_only(torch.__version__):
        choice = "not used: this torch's build of torch_ctxext's extension carries advise()'s watch"
        return None
    if NAME in sys.modules:
        return sys.modules[NAME]
    found = (path, "given") if path else _find()
    if found is None:
        return None
    path, origin = found
    module = extension.load(NAME, path)  # not in sys.modules until it proves to be for this torch
    built_for = (getattr(module, "built_for_torch", None), getattr(module, "built_for_git_version", None))
    if not getattr(module, "advise_only", False) or built_for != (torch.__version__, torch.version.git_version):
        choice = (f"{path} is not advise()'s watch built for torch {torch.__version__} "
                  f"(git {torch.version.git_version[:12]}): advise() watches in Python")
        return None
    sys.modules[NAME] = module
    choice = f"{origin}: {path}"
    return module


def _find():
    """(path, where it came from) of the advise-only build for the running
    torch, or None; sets :data:`choice` when there is none."""
    global choice
    here = loader._this_torch()
    damaged = []
    for entry in loader.packaged_binaries():
        if {key: entry.get(key) for key in here} == here:
            problem = loader._intact(entry)
            if problem is None:
                return entry["file"], "the packaged binary"
            damaged.append(problem)
    installed = loader.packaged_build()
    if installed is not None and installed[1:] == (torch.__version__, torch.version.git_version):
        return installed[0], "the build pip compiled at install"
    cached = build_cache.cached_library()
    if cached is not None:
        return cached, "the build in the cache"
    choice = ("no build of advise()'s C++ watch for torch "
              f"{torch.__version__} (git {torch.version.git_version[:12]}): none packaged, none installed, "
              f"none in the cache {build_cache.root()}" + ("; " + "; ".join(damaged) if damaged else "")
              + "; advise() watches in Python (`python -m torch_ctxext build` makes one)")
    return None
