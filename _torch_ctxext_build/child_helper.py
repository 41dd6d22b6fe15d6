"""The helper between an importer and the command it runs (``child.run``).

Run by ``child.run`` in a fresh interpreter, exec'd (``child.python_running``:
``python -I -S``, :func:`main` given SPEC_FD and STATUS_FD), so nothing of the
importer (its memory, its threads, its signal handlers, its fds) is in it. It

1. ignores SIGINT, SIGTERM and SIGHUP for itself (a signal to the importer's
   process group reaches the command too, which ends by it; the helper
   stays to report how) and sets SIGCHLD back to the default (an ignored
   SIGCHLD survives exec, and under it no child can be waited for);
2. dies with the importer (``PR_SET_PDEATHSIG``), and ends at once if the
   importer already ended;
3. reads the command (``{"argv", "cwd", "parent"}``, JSON) from SPEC_FD and
   closes every fd but 0, 1, 2 and STATUS_FD;
4. starts the command with ``posix_spawn`` (stdin, stdout and stderr its
   own; SIGCHLD, SIGPIPE, SIGINT, SIGTERM, SIGHUP, SIGQUIT and SIGXFSZ at
   the default and no signal blocked, whatever the importer set), waits for
   it, and writes to STATUS_FD what happened, as 8-byte records
   ``(kind, value)`` (:data:`STATUS`): ``STARTED`` with its pid, then
   ``ENDED`` with its wait status; or ``NOT_STARTED`` with the errno of the
   failed start.

The standard library only, and no site (``-S``): it starts in milliseconds.
"""
import errno
import json
import os
import signal
import struct

# The records on the status pipe: (kind, value).
STARTED, ENDED, NOT_STARTED = 1, 2, 3
STATUS = struct.Struct("=ii")
# What the command gets at the default whatever the helper had: Python
# itself ignores SIGPIPE and SIGXFSZ, and the helper ignores the next three.
RESET_SIGNALS = ("SIGCHLD", "SIGPIPE", "SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGXFSZ")


def _say(fd, kind, value):
    os.write(fd, STATUS.pack(kind, value))


def die_with_parent():
    """Be killed (SIGKILL) when the parent process dies (``PR_SET_PDEATHSIG``;
    nothing where the C library has no prctl)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError, ImportError):
        pass


def _read_all(fd):
    chunks = []
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _defaults():
    for sig in _reset:
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, ())


_reset = [getattr(signal, name) for name in RESET_SIGNALS if hasattr(signal, name)]
# Where the command itself cannot be started: not a refusal of posix_spawn.
_NOT_A_REFUSAL = (errno.ENOENT, errno.EACCES, errno.ENOEXEC, errno.ENOTDIR, errno.E2BIG, errno.ELOOP)


def _start(argv):
    """The command's pid: posix_spawn, or where that is refused (a seccomp
    profile, an LD_PRELOAD shim), fork and exec by subprocess."""
    try:
        return os.posix_spawn(argv[0], argv, os.environ, setsigdef=_reset, setsigmask=())
    except OSError as e:
        if e.errno in _NOT_A_REFUSAL:
            raise
    import subprocess

    process = subprocess.Popen(argv, close_fds=True, preexec_fn=_defaults)
    process.returncode = 0  # reaped below, by pid
    return process.pid


def main(argv):
    """``argv``: SPEC_FD and STATUS_FD; returns the helper's exit status."""
    spec_fd, status_fd = int(argv[0]), int(argv[1])
    for name in ("SIGINT", "SIGTERM", "SIGHUP"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    die_with_parent()
    spec = json.loads(_read_all(spec_fd))
    os.close(spec_fd)
    if os.getppid() != spec["parent"]:  # the importer ended before PR_SET_PDEATHSIG was set
        return 1
    # Only what the command needs: its stdin, stdout and stderr (the status
    # pipe is closed in it at exec).
    os.set_inheritable(status_fd, False)
    for low, high in ((3, status_fd), (status_fd + 1, os.sysconf("SC_OPEN_MAX"))):
        if low < high:
            os.closerange(low, high)
    argv = spec["argv"]
    try:
        if spec.get("cwd") is not None:
            os.chdir(spec["cwd"])
        pid = _start(argv)
    except OSError as e:
        _say(status_fd, NOT_STARTED, e.errno or 0)
        return 127
    _say(status_fd, STARTED, pid)
    _, status = os.waitpid(pid, 0)  # EINTR is retried by Python; nothing else can fail for our own child
    _say(status_fd, ENDED, status)
    return 0

