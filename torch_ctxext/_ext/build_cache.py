"""The build cache's key: which build in it is the running torch's.

Where builds live and what a published one is: ``_torch_ctxext_build.cache``
(``$TORCH_CTXEXT_CACHE/builds/<key>/``, re-exported here for the package).
``<key>`` names the torch version, its git hash, the Python ABI, the machine,
the C library (``glibc2.36``: :func:`c_library`) and a fingerprint of what
the build's layouts and code come from: the torch
headers the extension includes (the structures it reads by layout are
declared there), torch's build configuration, the extension's own sources
and its compiler flags. So another torch, or the same version built
differently, or an edited ``csrc/`` gets a build of its own, and environments
with the same torch and the same torch_ctxext share one, wherever each is
installed. Nothing here compiles (``build`` does): finding a build costs
reading and hashing those few files, about 2 ms.
"""
import hashlib
import json
import os
import platform
import re
import sys

import torch
from _torch_ctxext_build import compile, sources
from _torch_ctxext_build.cache import (  # noqa: F401  (the package's names for them)
    ENV_CACHE, LIBRARY, RECORD, identity, published, record_of, root,
)

_INCLUDE = re.compile(rb'^\s*#\s*include\s*<([^>]+)>', re.M)


def torch_include_dirs():
    include = os.path.join(os.path.dirname(torch.__file__), "include")
    return [include, os.path.join(include, "torch", "csrc", "api", "include")]


def _layout_headers(source_files):
    """The torch headers the extension includes directly, and torch's build
    configuration: the files the layouts it reads are declared in (relative
    to torch's include directory, and their paths)."""
    names = set()
    for path in source_files:
        with open(path, "rb") as f:
            names.update(n.decode() for n in _INCLUDE.findall(f.read()) if b"/" in n)  # not <vector>
    names.add("c10/macros/cmake_macros.h")
    include, api = torch_include_dirs()
    found = {}
    for name in sorted(names):
        for d in (include, api):
            candidate = os.path.join(d, name)
            if os.path.isfile(candidate):
                found[candidate[len(include) + 1:]] = candidate
                break
    return found


def fingerprint(csrc):
    """Digest of what the build's layouts and code come from: torch's headers
    that the extension includes, its sources and headers, its flags, the
    Python ABI and the machine."""
    own = sources.sources(csrc) + sources.headers(csrc)
    digest = hashlib.sha256()
    for name, path in sorted(_layout_headers(own).items()):
        with open(path, "rb") as f:
            digest.update(b"torch-header\0%s\0%s" % (name.encode(), f.read()))
    for path in own:
        with open(path, "rb") as f:
            digest.update(b"source\0%s\0%s" % (os.path.basename(path).encode(), f.read()))
    # Every flag of the build (compile: cpp_extension's and ours), with the
    # places torch and Python's headers are at left out: environments with
    # the same torch share one build wherever each is installed.
    target = compile.target_of_running_torch(torch, "<python>")._replace(torch_dir="<torch>")
    flags = compile.cflags(target) + compile.ldflags(target)
    # How the sources are put together (sources.UNITS): what each translation unit includes.
    units = [[name, [os.path.basename(m) for m in members]] for name, members in sources.units(csrc, torch.__version__)]
    digest.update(json.dumps([flags, units, sys.implementation.cache_tag, platform.machine()]).encode())
    return digest.hexdigest()


def c_library():
    """The C library a build made here depends on, as a piece of its key:
    ``glibc2.36`` (the running process's glibc, ``platform.libc_ver()``),
    or "" where it cannot be told (musl, macOS).

    A library is linked against the symbol versions of the C library it is
    built with (``memcpy@GLIBC_2.14``, ``__libc_start_main@GLIBC_2.34``), and
    the dynamic loader refuses it on a machine whose C library is older
    (``version `GLIBC_2.34' not found``). A shared cache built into on a
    newer machine for older nodes (docs/install-cluster.md) must not hand
    the nodes that build: with the version in the key, each C library gets
    a build of its own. (An older glibc's build would load on a newer one;
    it is still built again there: a key says what a build was made with,
    not what it could serve.)"""
    name, version = platform.libc_ver()
    return f"{name}{version}" if name and version else ""


def build_key(csrc):
    """The cache directory name of the build for the running torch:
    ``torch-<version>-git<hash>-<python>-<machine>[-<libc>]-<fingerprint>``,
    the C library's piece left out where it is unknown."""
    git = (torch.version.git_version or "unknown")[:12]
    libc = c_library()
    return (
        f"torch-{torch.__version__}-git{git}-{sys.implementation.cache_tag}-"
        f"{platform.machine()}-{libc + '-' if libc else ''}{fingerprint(csrc)[:16]}"
    )


def cached_library():
    """Path of the published build for the running torch, or None."""
    csrc = sources.csrc_dir()
    if csrc is None:
        return None
    directory = os.path.join(root(), build_key(csrc))
    return os.path.join(directory, LIBRARY) if published(directory) else None
