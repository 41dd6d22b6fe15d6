"""Where builds of the extension live, and what a published one is.

    $TORCH_CTXEXT_CACHE/builds/<key>/_C.so        (default ~/.cache/torch_ctxext)
    $TORCH_CTXEXT_CACHE/builds/<key>/build.json   what it was built for, when, how long

A build is published when its build.json is there: it is written last, once
the library loaded (``build_child.publish``); a directory with a library and
no record is the remains of a build killed on the way, and nothing loads it.
The key (``torch_ctxext._ext.build_cache.build_key``) names the torch and
what the build comes from. The rest of the cache: ``layouts/`` (verdicts of
builds outside it, ``verdict_store``), ``wheels/`` (``tools/wheels.py``) and
the tools' venvs.
"""
import json
import os

ENV_CACHE = "TORCH_CTXEXT_CACHE"
# A build's library and its record, in its directory.
LIBRARY = "_C.so"
RECORD = "build.json"
# The command that builds the running torch's extension again, whatever the
# cache holds (a recorded compile error included).
BUILD_AGAIN = "python -m torch_ctxext build --force"


def user_cache():
    """The user's own cache directory for torch_ctxext: $XDG_CACHE_HOME/torch_ctxext,
    else ~/.cache/torch_ctxext."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.path.abspath(base), "torch_ctxext")


def home():
    """torch_ctxext's cache directory: $TORCH_CTXEXT_CACHE, else :func:`user_cache`."""
    value = os.environ.get(ENV_CACHE)
    return os.path.abspath(value) if value else user_cache()


def root():
    """Where builds are kept: ``builds/`` of :func:`home`."""
    return os.path.join(home(), "builds")


def own_layouts():
    """The importer's own directory for verdicts (as :func:`root` is without
    $TORCH_CTXEXT_CACHE), for builds in a cache it cannot write (a
    cluster's shared one)."""
    return os.path.join(user_cache(), "builds", "layouts")


def published(directory):
    """Whether ``directory`` holds a published build: its library, and its
    record, written last."""
    return os.path.isfile(os.path.join(directory, LIBRARY)) and os.path.isfile(os.path.join(directory, RECORD))


def identity(library):
    """What tells this file at ``library`` from one put in its place later
    (a rebuild renames a new directory there): [inode, size, mtime in ns],
    or None if it is gone."""
    try:
        st = os.stat(library)
    except OSError:
        return None
    return [st.st_ino, st.st_size, st.st_mtime_ns]


def record_of(library):
    """What build.json says about a published build (its torch, when it was built)."""
    try:
        with open(os.path.join(os.path.dirname(library), RECORD)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}
