"""The lock that makes the processes of one job build (or verify) once.

Several processes importing at once (the ranks of a job) build once: the
first takes an exclusive ``flock`` on ``<key>.lock`` beside the build and
builds, the others wait for it and then load what it made. The kernel
releases the lock when its holder dies, whatever kills it. The lock file
names its holder (pid, host, pid namespace, start time), so that a waiter
says at once when the holder is stopped or gone, rather than being silent
until its timeout.

No wait is unbounded: a process waits at most ``timeout`` seconds
($TORCH_CTXEXT_BUILD_TIMEOUT, :func:`build_timeout`), then gives up
(:class:`LockTimeout`). Waiters poll (never a blocking flock under an
alarm: SIGALRM is the main thread's, and an import may run on any).

What a process says while it waits goes to the importer's stderr
(:func:`say`), which it never redirects.
"""
import contextlib
import datetime
import fcntl
import json
import os
import socket
import sys
import time

# How often a waiter tries the lock again and looks at its holder.
_POLL = 0.2
ENV_TIMEOUT = "TORCH_CTXEXT_BUILD_TIMEOUT"
# How long an import waits for another process's build of the same extension.
# A build takes 15 to 20 s on 2 idle cores (docs/benchmarks.md) and was
# measured at 2.5 min on a loaded 2-core CI machine when it took a minute on
# idle ones; 600 s is four times that. A builder that has not
# finished by then is almost certainly stuck (stopped with Ctrl-Z, hung on a
# network filesystem) rather than slow, and a waiter is better off importing
# without the members than hanging the job. Waiting processes all time out
# about together, so the ranks of a job still agree with each other.
DEFAULT_TIMEOUT = 600.0


def to_stderr(text):
    """Write ``text`` to the importer's ``sys.stderr`` as it is now, whatever
    it is: None (fd 2 closed, a pythonw-like service), an object with only
    ``write`` (a log forwarder), a stream closed meanwhile. What the build
    says is never worth failing the import over."""
    stream = sys.stderr
    if stream is None:
        return
    try:
        stream.write(text)
        flush = getattr(stream, "flush", None)
        if flush is not None:
            flush()
    except (OSError, ValueError, AttributeError, TypeError):
        pass


def stderr_is_a_terminal():
    try:
        return bool(sys.stderr.isatty())
    except (AttributeError, OSError, ValueError, TypeError):  # None, no isatty, closed
        return False


def say(message):
    to_stderr(f"torch_ctxext: {message}\n")


def build_timeout():
    """Seconds to wait for another process's build: $TORCH_CTXEXT_BUILD_TIMEOUT
    (``inf``: no bound), else DEFAULT_TIMEOUT. A value that is not a
    non-negative number is said and ignored: an import never fails over it."""
    value = os.environ.get(ENV_TIMEOUT, "").strip()
    if not value:
        return DEFAULT_TIMEOUT
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:  # also NaN
        say(f"ignoring {ENV_TIMEOUT}={value!r} (not a number of seconds); waiting at most {DEFAULT_TIMEOUT:.0f} s")
        return DEFAULT_TIMEOUT
    return seconds


def now():
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _pid_namespace():
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _proc_stat(pid):
    """(state letter, start time in clock ticks) of ``pid`` (or
    ``pid/task/tid``) from /proc, or None if there is no such process here."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        fields = data[data.rindex(b")") + 2:].split()  # after "pid (comm) ", comm may hold anything
        return fields[0].decode(), int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def _threads_state(pid, state):
    """The holder's state, ``T`` if any of its threads is stopped: a stopped
    process whose main thread was in an uninterruptible wait (a vfork for
    its compiler, whose child was stopped too) shows ``D`` there for good."""
    if state in "Tt":
        return state
    try:
        threads = os.listdir(f"/proc/{int(pid)}/task")
    except OSError:
        return state
    for tid in threads:
        stat = _proc_stat(f"{int(pid)}/task/{tid}")
        if stat and stat[0] in "Tt":
            return stat[0]
    return state


def _identity():
    """This process, as the lock file records its holder."""
    stat = _proc_stat(os.getpid())
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "pid_namespace": _pid_namespace(),
        "start": stat[1] if stat else None,
        "since": now(),
    }


def _read_holder(fd):
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"null")
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) and isinstance(holder.get("pid"), int) else None


def _holder_state(holder):
    """(what can be said of the lock's holder, how it stands): "stopped",
    "gone", "blocked" (state D) or "running" where it can be looked at (same
    host and pid namespace), else "unknown"."""
    if holder is None:
        return "a process that did not say which (the lock file names none)", "unknown"
    who = f"pid {holder['pid']} on {holder.get('host', 'an unknown host')}"
    if (holder.get("host") != socket.gethostname() or holder.get("pid_namespace") != _pid_namespace()
            or not os.path.isdir("/proc/self")):  # another machine or container, or no /proc to look in
        return who, "unknown"
    stat = _proc_stat(int(holder["pid"]))
    if stat is None or stat[0] in "ZX" or (holder.get("start") is not None and stat[1] != holder["start"]):
        return (
            f"{who}, which has exited; the lock is still held, by a process that "
            "inherited its file (a child it forked)", "gone",
        )
    state = _threads_state(holder["pid"], stat[0])
    if state in "Tt":
        return (
            f"{who}, which is stopped (state {state}): "
            f"resume it (`kill -CONT {holder['pid']}`, or `fg` in its shell) or end it", "stopped",
        )
    if state == "D":
        return f"{who}, in uninterruptible sleep (state D: waiting on a device or a network filesystem)", "blocked"
    return who, "running"


def _try_lock(fd):
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _wait_for_lock(fd, on_wait, timeout, say):
    """Poll the lock until it is ours or ``timeout`` seconds have passed
    (polling, not a blocking flock with an alarm: SIGALRM is the main
    thread's, and an import may run on any). Say at once what the holder is,
    and again whenever that changes to stopped, gone or blocked; return
    whether the lock was taken, and what was last said of the holder."""
    deadline = time.monotonic() + timeout
    holder, state = _holder_state(_read_holder(fd))
    on_wait(holder)
    said, previous = (holder, state), None
    while True:
        if _try_lock(fd):
            return True, holder
        left = deadline - time.monotonic()
        if left <= 0:
            return False, holder
        holder, state = _holder_state(_read_holder(fd))
        # Said once it has been seen twice in a row: a new holder writes its
        # record just after taking the lock, and a waiter must not report
        # the previous holder's record as the new one gone.
        if (holder, state) == previous and (holder, state) != said and state != "unknown":
            say(f"the build it waits for: {holder}")
            said = (holder, state)
        previous = (holder, state)
        time.sleep(min(_POLL, left))


class LockTimeout(Exception):
    """Another process held the lock for longer than the wait allowed
    (``holder``: what was last said of it; ``timeout``: the seconds waited)."""

    def __init__(self, holder, timeout):
        super().__init__(holder, timeout)
        self.holder, self.timeout = holder, timeout


@contextlib.contextmanager
def locked(path, on_wait, timeout, say=say):
    """An exclusive flock on ``path``, waited for at most ``timeout`` seconds
    (else LockTimeout); the kernel releases it if we die. While it is held,
    the file names its holder (pid, host, pid namespace, start time), so
    that waiters can tell a stopped or vanished holder from a slow one."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if not _try_lock(fd):
            taken, holder = _wait_for_lock(fd, on_wait, timeout, say)
            if not taken:
                raise LockTimeout(holder, timeout)
        with contextlib.suppress(OSError):  # advisory: a full disk must not stop the build
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(_identity()) + "\n").encode(), 0)
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # released: no holder to name
    finally:
        os.close(fd)
