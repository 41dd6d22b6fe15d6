"""Where layout verdicts are kept, and how one is read or made for a build.

A verdict (``layout_verdict``: its format and its probe) is kept beside the
build it is for when that build is in the cache (or was installed with one),
else in the cache's own ``layouts/`` (a packaged build: nothing is written
into site-packages after pip), else in the importer's own (a build in a
cache it cannot write, a cluster's shared one). :func:`verdict_of` reads the
first there is, or makes one: the probe runs once per build and torch, the
ranks of a job waiting for the first under a lock beside where it goes, and
keeps it where the next imports read it. The standard library at the top
(the running torch is only named, where a probe runs).
"""
import contextlib
import os
import tempfile

from . import build_lock, cache, layout_verdict

# Probes one verification runs before it gives up: a probe killed (by the
# OOM killer, a job's time limit, a stray kill) is not a verdict, and the
# ranks waiting on the lock would otherwise each probe again and get one.
PROBE_ATTEMPTS = 3


def places(library):
    """Where the verdict for ``library`` may be, in the order read: beside
    it, the cache's own directory for verdicts, then the importer's own.
    Every rank of a job reads the same places."""
    found = [layout_verdict.beside(library)]
    name = os.path.basename(found[0])
    for directory in (os.path.join(cache.root(), "layouts"), cache.own_layouts()):
        if os.path.join(directory, name) not in found:
            found.append(os.path.join(directory, name))
    return found


def store_at(library, candidates):
    """The first of ``candidates`` the importer can write a verdict into (and
    its lock beside it), never beside a build outside the cache; None if
    none (it is then made for this process only, and said)."""
    root = cache.root()
    in_cache = os.path.commonpath([os.path.abspath(library), root]) == root
    for place in candidates if in_cache else candidates[1:]:
        directory = os.path.dirname(place)
        try:
            os.makedirs(directory, exist_ok=True)
            os.close(os.open(place + ".lock", os.O_RDWR | os.O_CREAT, 0o644))
            # A lock file left there opens in a directory that is read-only
            # now (a shared cache made read-only after use): the verdict is
            # written as a new file beside it, so the directory itself must
            # take one, or every rank would verify again.
            fd, probe = tempfile.mkstemp(prefix=".layout-", suffix=".tmp", dir=directory)
            os.close(fd)
            os.remove(probe)
        except OSError:  # read-only: another user's build, a read-only cache
            continue
        return place
    return None


def _read_trusted(path, trusted):
    record = layout_verdict.read(path)
    return record if record is not None and trusted(record) else None


def verdict_of(library, trusted=lambda record: True):
    """(the layout verdict of ``library`` against the running torch, where
    it is kept or None), read, or made now in a child process and kept.
    ``trusted(record)``: whether the facts of a verdict read hold in this
    process; one that cannot be read, or is not trusted, is made again.
    Raises ProbeNotRun, or build_lock.LockTimeout after waiting
    $TORCH_CTXEXT_BUILD_TIMEOUT seconds for another process's verification."""
    candidates = places(library)
    for path in candidates:
        record = _read_trusted(path, trusted)
        if record is not None:
            return record, path
    return _verify_into(library, store_at(library, candidates), trusted)


def _verify_into(library, target, trusted):
    """Run the probe for ``library`` (one process at a time: the ranks of a
    job wait for the first, under the lock beside ``target``), keep its
    verdict at ``target`` (None: nowhere writable, this process only), and
    return (it, where it is kept or None)."""
    if target is None:
        lock = contextlib.nullcontext()
        build_lock.say("no place to keep the layout verdict is writable: verifying for this process only")
    else:
        lock = build_lock.locked(target + ".lock", lambda holder: build_lock.say(
            f"waiting for another process that verifies the extension's layout: {holder}"
        ), build_lock.build_timeout())
    with lock:
        record = None if target is None else _read_trusted(target, trusted)  # made by the process waited for
        if record is not None:
            return record, target
        import torch  # the running one, already imported: only its version is said

        build_lock.say(
            f"verifying that its extension reads the structures of torch {torch.__version__} "
            "as its headers say (once for this build and torch, in a child process)"
        )
        record = verify(library)
        if target is None:
            return record, None
        try:
            layout_verdict.write(target, record)
        except OSError:
            return record, None
        return record, target


def verify(library):
    """layout_verdict.verify(library), probing again where a probe was killed
    (up to PROBE_ATTEMPTS times), so that this rank gets the verdict the
    ranks after it would; a probe that timed out is not run again."""
    for attempt in range(1, PROBE_ATTEMPTS + 1):
        try:
            return layout_verdict.verify(library)
        except layout_verdict.ProbeTimedOut:
            raise  # stuck, not killed: another try would wait as long again
        except layout_verdict.ProbeNotRun as e:
            if attempt == PROBE_ATTEMPTS:
                raise layout_verdict.ProbeNotRun(f"{e}, {PROBE_ATTEMPTS} times") from None
            build_lock.say(f"{e}; verifying again ({attempt + 1} of {PROBE_ATTEMPTS})")
