"""A copy of the torch_ctxext package as an install lays it out, for the tests and benchmarks that install one by hand.

* :func:`sources_only_copy`: the package with its C++ sources and its build
  layer (``_torch_ctxext_build``, beside it) and nothing built (no
  extension, no build record, no packaged binaries, no layout verdict of a
  build made in place): what an sdist or a checkout installs, whichever
  install it is copied from;
* :func:`synced_copy`: a checkout's copy kept in step with it, where what
  did not change keeps its time (CI's background builds read one);
* :func:`add_packaged_binaries`: binaries as a wheel carries them,
  ``_binaries/<name>/_C.so`` and ``_binaries/manifest.json`` (each build's
  manifest entry with its path and digest; see ``torch_ctxext/_ext/loader.py``).

    >>> import os, tempfile
    >>> site = tempfile.mkdtemp()
    >>> package = sources_only_copy(os.path.join(ROOT, "torch_ctxext"), site)
    >>> sorted(n for n in os.listdir(package) if n in ("csrc", "_binaries"))
    ['csrc']
    >>> sorted(os.listdir(site))
    ['_torch_ctxext_build', 'torch_ctxext']
"""
import filecmp
import fnmatch
import hashlib
import json
import os
import shutil

__all__ = ["sources_only_copy", "add_packaged_binaries", "synced_copy", "ROOT", "BUILD_OUTPUTS", "CHECKOUT_OUTPUTS"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD_LAYER = "_torch_ctxext_build"
# What a build leaves in the package: the extension, its record, packaged
# binaries, and the layout verdicts kept beside a library built in place
# (layout_verdict.verdict_name: layout-<key>.json, .layout-*.tmp while written).
BUILD_OUTPUTS = ("__pycache__", "_C*", "*.so", "_build_info.py", "_binaries", "layout-*.json", ".layout-*.tmp")
# What a checkout holds beyond its sources: the build outputs, setup.py's
# build/, dist/ and egg-info, git's and the tools' folders. A copy "without
# its build outputs" (CI's snapshot, the tests' checkout copies) leaves them out.
CHECKOUT_OUTPUTS = BUILD_OUTPUTS + (".git", "build", "dist", "*.egg-info", ".venv*", ".hypothesis", ".pytest_cache")
_NOT_SOURCES = shutil.ignore_patterns(*BUILD_OUTPUTS)


def sources_only_copy(package_dir, site):
    """Copy the package at ``package_dir`` (a checkout's ``torch_ctxext/`` or
    an installed one) to ``site/torch_ctxext`` without anything built, with
    ``csrc/`` inside it (taken from beside the package in a checkout), and
    its build layer to ``site/_torch_ctxext_build``; returns the copy's
    directory."""
    package = os.path.join(site, "torch_ctxext")
    shutil.copytree(package_dir, package, ignore=_NOT_SOURCES)
    beside = os.path.dirname(os.path.abspath(package_dir))
    shutil.copytree(os.path.join(beside, BUILD_LAYER), os.path.join(site, BUILD_LAYER),
                    ignore=shutil.ignore_patterns("__pycache__"))
    csrc = os.path.join(beside, "csrc")
    if not os.path.isdir(os.path.join(package, "csrc")) and os.path.isdir(csrc):
        shutil.copytree(csrc, os.path.join(package, "csrc"))
    return package


def add_packaged_binaries(package, builds, python=None):
    """Write ``builds``, ``[(name, binary bytes, manifest entry)]``, into
    ``package/_binaries`` as a wheel carries them (the manifest names this
    CPython's tag when ``python`` is given); returns that directory."""
    binaries = os.path.join(package, "_binaries")
    manifest = {"format": 1, "builds": []}
    if python is not None:
        manifest["python"] = python
    for name, data, entry in builds:
        os.makedirs(os.path.join(binaries, name))
        with open(os.path.join(binaries, name, "_C.so"), "wb") as f:
            f.write(data)
        manifest["builds"].append(dict(entry, path=f"{name}/_C.so", sha256=hashlib.sha256(data).hexdigest()))
    with open(os.path.join(binaries, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    return binaries


def synced_copy(source, copy, leave_out=CHECKOUT_OUTPUTS):
    """Make ``copy`` hold the tree at ``source`` less the names matching
    ``leave_out``, and return ``copy``.

    A file whose bytes and mode are already in the copy is left as it is, its
    time included; any other file is copied with its time; what the copy
    holds beyond the tree goes. A build reading the copy (ninja decides by
    files' times) so compiles again only what changed since the last copy,
    even when ``source`` is a fresh clone, every file of which is new."""
    def kept(name):
        return not any(fnmatch.fnmatch(name, pattern) for pattern in leave_out)

    wanted = set()
    for folder, dirs, files in os.walk(source):
        dirs[:] = [d for d in dirs if kept(d)]
        relative = os.path.relpath(folder, source)
        os.makedirs(os.path.join(copy, relative), exist_ok=True)
        wanted.add(os.path.normpath(relative))
        for name in files:
            if not kept(name):
                continue
            path = os.path.normpath(os.path.join(relative, name))
            wanted.add(path)
            original, target = os.path.join(source, path), os.path.join(copy, path)
            if (os.path.isfile(target) and not os.path.islink(target)
                    and os.stat(target).st_mode == os.stat(original).st_mode
                    and filecmp.cmp(original, target, shallow=False)):
                continue
            if os.path.islink(target) or (os.path.lexists(target) and not os.path.isfile(target)):
                _remove(target)  # a folder or a link where the tree has a file
            shutil.copy2(original, target, follow_symlinks=False)
    for folder, dirs, files in os.walk(copy, topdown=False):
        relative = os.path.relpath(folder, copy)
        for name in files + dirs:
            path = os.path.normpath(os.path.join(relative, name))
            if path not in wanted:
                _remove(os.path.join(copy, path))
    return copy


def _remove(path):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)
