"""Child processes an import starts and waits for: never a copy of the importer.

An import runs inside someone else's process: a training job of many GB,
with its own signal handlers, SIGCHLD disposition, threads and thousands of
fds. Its children (the build, the layout probe) must neither copy it nor
run its handlers nor keep its fds, and must report their status right
whatever the importer did to SIGCHLD (``SIG_IGN``: the kernel reaps every
child at its exit, so ``waitpid`` fails with ``ECHILD``; a handler that
reaps whatever exits takes the status first).

:func:`run` starts a small helper, ``child_helper``, exec'd at once
(``posix_spawn``: the kernel shares the importer's memory until the exec
instead of copying its page tables, and the C library sets every signal
the importer handles back to the default in the child before anything can
run a handler). The helper is a fresh interpreter: it starts the command
with SIGCHLD at its default, waits for it and writes its wait status to a
pipe the importer reads. So the status comes over the pipe whoever reaps
the helper; an ignored SIGCHLD or a reaping handler changes nothing. The
importer's own SIGCHLD handler may run once, for the helper's exit
(docs/reliability.md).

Every fd of the importer is close-on-exec (Python's default) or closed by
the helper at its start: the helper keeps only the pipes it needs, and the
command only its stdin, stdout and stderr. Every wait here has a bound and
a reason in its error, and errors keep their errno. Where ``posix_spawn``
is refused (a seccomp profile, a platform without it), the helper is
started with ``subprocess`` instead (:data:`how` says which).

Every child here is a fresh interpreter that imports what it runs from this
package (:func:`python_running`), isolated from the importer's path.
"""
import collections
import errno
import json
import os
import select
import signal
import sys
import time

from .child_helper import ENDED, NOT_STARTED, STATUS

# The directory holding this package: the one entry beyond the standard
# library on the path of the interpreters started here.
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# `python -I -S -c _BOOT PACKAGE_PARENT module args...`: main(args) of that module.
_BOOT = ("import sys; sys.path.append(sys.argv[1]); import importlib; "
         "sys.exit(importlib.import_module(sys.argv[2]).main(sys.argv[3:]))")
# The helper starts in milliseconds; on a machine under load, in seconds.
HELPER_START_TIMEOUT = 60.0
# After the command's status came: how long its output may still flow (a
# process it left behind may hold the pipe open), and how long the helper
# may take to exit.
DRAIN_TIMEOUT = 5.0
EXIT_TIMEOUT = 10.0

# How children are started in this process: "posix_spawn", or "subprocess
# (posix_spawn refused: ...)" once it was refused here (then it is not
# tried again). For `python -m torch_ctxext info`.
how = "posix_spawn"

Finished = collections.namedtuple("Finished", "status signal output")
Finished.__doc__ = """How a child ended: ``status`` (its exit status, or None
if a signal ended it), ``signal`` (that signal's number, or None) and
everything it wrote to stdout and stderr, as text."""


class ChildNotStarted(OSError):
    """The command could not be started (no such file, no memory, ...): its
    ``errno`` is the one the start failed with."""


class ChildTimeout(Exception):
    """The child did not finish in time: it was killed and reaped. ``output``
    is what it had written."""

    def __init__(self, timeout, output):
        super().__init__(f"did not finish within {timeout:g} s")
        self.timeout, self.output = timeout, output


def python_running(module, *args):
    """The command line of a fresh interpreter that runs ``main(args)`` of
    ``module`` (a module of this package) and exits with what it returns.
    Isolated (``-I -S``): neither the importer's working directory, its
    script's directory, $PYTHONPATH nor site-packages is on its path, only
    the standard library and this package's directory, so that nothing there
    (a ``json.py``, another copy of torch_ctxext) stands in for either. A
    child that needs more (torch) takes the importer's path from its spec."""
    return [sys.executable, "-I", "-S", "-c", _BOOT, PACKAGE_PARENT, f"{__package__}.{module}", *map(str, args)]


def default_sigchld():
    """Set SIGCHLD back to the default in this process, where it was
    ignored (an ignored SIGCHLD survives exec, and under it nothing this
    process starts can be waited for)."""
    if signal.getsignal(signal.SIGCHLD) == signal.SIG_IGN:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)


def supported():
    """Whether children can be started here: a POSIX system whose Python
    has an interpreter to run the helper with."""
    return os.name == "posix" and bool(sys.executable) and os.access(sys.executable, os.X_OK)


def _above_stdio(fd):
    """``fd`` moved to a number above 4 (close-on-exec), so that the helper's
    fds 0 to 4 can be set from it in any order, even where the importer had
    closed its stdin, stdout or stderr and a pipe got one of their numbers."""
    if fd > 4:
        return fd
    import fcntl

    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 5)
    os.close(fd)
    return moved


def _pipe():
    read, write = os.pipe()  # both close-on-exec
    return _above_stdio(read), _above_stdio(write)


def _start_helper(in_read, out_write, spec_read, status_write, new_session, environment):
    """The helper's pid (it passes ``environment`` on to the command).
    posix_spawn where allowed, else subprocess."""
    global how
    if how == "posix_spawn" and hasattr(os, "posix_spawn"):
        try:
            return os.posix_spawn(
                sys.executable, python_running("child_helper", 3, 4), environment,
                file_actions=[
                    (os.POSIX_SPAWN_DUP2, in_read, 0), (os.POSIX_SPAWN_DUP2, out_write, 1),
                    (os.POSIX_SPAWN_DUP2, out_write, 2), (os.POSIX_SPAWN_DUP2, spec_read, 3),
                    (os.POSIX_SPAWN_DUP2, status_write, 4),
                ],
                # The helper sets its own dispositions; nothing blocked, and
                # the importer's ignored signals back to the default.
                setsigdef=[s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)
                           and signal.getsignal(s) == signal.SIG_IGN],
                setsigmask=(),
                setsid=new_session,
            )
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.EACCES, errno.ENOEXEC):
                raise ChildNotStarted(e.errno, f"{sys.executable}: {os.strerror(e.errno)}") from None
            how = f"subprocess (posix_spawn refused: {e.strerror or e})"
    import subprocess

    try:
        process = subprocess.Popen(
            python_running("child_helper", spec_read, status_write),
            stdin=in_read, stdout=out_write, stderr=out_write, pass_fds=(spec_read, status_write),
            close_fds=True, start_new_session=new_session, restore_signals=True, env=environment,
        )
    except OSError as e:
        raise ChildNotStarted(e.errno, f"starting the helper: {e.strerror or e} (after: {how})") from None
    # The helper is reaped here, by pid, not by this object (it would warn
    # when collected with the helper still running).
    process.returncode = 0
    return process.pid


class _Status:
    """Reads the helper's records from the status pipe."""

    def __init__(self, fd):
        self.fd, self.pending, self.closed = fd, b"", False

    def read(self):
        """One record, or None at end of file; blocks: call when readable."""
        while len(self.pending) < STATUS.size:
            chunk = os.read(self.fd, STATUS.size - len(self.pending))
            if not chunk:
                self.closed = True
                return None
            self.pending += chunk
        record, self.pending = STATUS.unpack(self.pending), b""
        return record


def _poll(fds, timeout):
    """The fds of ``fds`` that are readable (or hung up) within ``timeout``
    seconds (None: no bound). ``poll``, not ``select``: any fd number."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    return [fd for fd, _ in poller.poll(None if timeout is None else max(0, int(timeout * 1000) + 1))]


def _reap(pid, deadline):
    """Reap the helper ``pid`` by ``deadline`` (SIGKILL after it). True if a
    status was taken here; False where someone else reaped it (the
    importer's SIGCHLD ignored, or a handler that reaps whatever exits)."""
    killed = False
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return False
        if done == pid:
            return True
        if time.monotonic() > deadline and not killed:
            _kill(pid, signal.SIGKILL)
            killed, deadline = True, time.monotonic() + EXIT_TIMEOUT
        elif killed and time.monotonic() > deadline:
            raise ChildNotStarted(errno.ETIMEDOUT, f"the helper {pid} did not exit after SIGKILL")
        time.sleep(0.01)


def _kill(pid, sig):
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _finished(status, output):
    if os.WIFSIGNALED(status):
        return Finished(None, os.WTERMSIG(status), output)
    return Finished(os.WEXITSTATUS(status), None, output)


def run(argv, *, env=None, cwd=None, input=None, timeout=None, on_line=None,
        new_session=False, on_interrupt=signal.SIGTERM):
    """Run ``argv`` (its first item a path: nothing is looked up on PATH) to
    its end and return how it ended (:class:`Finished`).

    Its stdin reads ``input`` (bytes or str, or nothing); stdout and stderr
    go to one pipe read here, each line handed to ``on_line`` as it comes
    and all of it returned. ``new_session``: it leads a session of its own
    (a kill of the importer's process group does not reach it). Its
    SIGCHLD, SIGPIPE, SIGINT, SIGTERM, SIGHUP, SIGQUIT and SIGXFSZ are the
    defaults and no signal is blocked, whatever the importer set; it has
    no fd of the importer's but those three. If this thread is interrupted
    while it waits (a KeyboardInterrupt), the command gets ``on_interrupt``
    and is waited for (bounded) before the exception goes on. Raises
    ChildNotStarted (with the errno of the failed start), ChildTimeout
    (after killing it)."""
    if not supported():
        missing = bool(sys.executable) and not os.path.exists(sys.executable)
        raise ChildNotStarted(errno.ENOENT if missing else errno.ENOEXEC,
                              f"no Python interpreter to start children with ({sys.executable!r})")
    if not os.path.isabs(argv[0]) or not os.access(argv[0], os.X_OK):
        raise ChildNotStarted(errno.ENOENT, f"{argv[0]!r} is not an executable file")
    data = input.encode() if isinstance(input, str) else (input or b"")
    environment = dict(os.environ if env is None else env)
    fds = []
    try:
        for _ in range(4):
            fds.extend(_pipe())
        in_read, in_write, out_read, out_write, spec_read, spec_write, status_read, status_write = fds
        helper = _start_helper(in_read, out_write, spec_read, status_write, new_session, environment)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    for fd in (in_read, out_write, spec_read, status_write):
        os.close(fd)
    spec = {"argv": [os.fsdecode(a) for a in argv], "cwd": cwd, "parent": os.getpid()}
    status = _Status(status_read)
    command = None
    try:
        fd, spec_write = spec_write, None
        _feed(fd, json.dumps(spec).encode())
        command = _started(status, out_read, argv)
        fd, in_write = in_write, None
        _feed(fd, data)
        output, ended = _wait(out_read, status, timeout, on_line)
        _reap(helper, time.monotonic() + EXIT_TIMEOUT)
        if ended is None:  # the helper was killed (with the importer's group, or by hand): so was the command
            return Finished(None, signal.SIGKILL, output)
        return _finished(ended, output)
    except BaseException as e:
        if command is not None:
            _end(command, signal.SIGKILL if isinstance(e, ChildTimeout) else on_interrupt, helper, status)
        else:
            _kill(helper, signal.SIGKILL)
            _reap(helper, time.monotonic() + EXIT_TIMEOUT)
        raise
    finally:
        for fd in (spec_write, in_write, out_read, status_read):
            if fd is not None:
                os.close(fd)


def _started(status, out_read, argv):
    """The command's pid, once the helper said it started it."""
    deadline = time.monotonic() + HELPER_START_TIMEOUT
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ChildNotStarted(errno.ETIMEDOUT, f"the helper did not start {argv[0]!r} within "
                                                   f"{HELPER_START_TIMEOUT:g} s")
        if status.fd in _poll([status.fd], left):
            break
    record = status.read()
    if record is None:  # the helper died before it could start the command
        said = _drain(out_read, time.monotonic() + 1.0).strip().splitlines()
        raise ChildNotStarted(errno.ECHILD, f"the helper ended before it started {argv[0]!r}"
                                            + (f": {said[-1]}" if said else ""))
    kind, value = record
    if kind == NOT_STARTED:
        raise ChildNotStarted(value, f"{argv[0]!r} could not be started: {os.strerror(value)}")
    return value


def _drain(out_read, deadline):
    chunks = []
    while time.monotonic() < deadline and _poll([out_read], deadline - time.monotonic()):
        chunk = os.read(out_read, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def _end(command, sig, helper, status):
    """Send ``sig`` to the command, SIGKILL to it and the helper after
    EXIT_TIMEOUT; reap the helper."""
    _kill(command, sig)
    deadline = time.monotonic() + EXIT_TIMEOUT
    while not status.closed and time.monotonic() < deadline:
        if _poll([status.fd], deadline - time.monotonic()):
            if status.read() is None:
                break
    if not status.closed:
        _kill(command, signal.SIGKILL)
    _reap(helper, time.monotonic() + EXIT_TIMEOUT)


def _feed(in_write, data):
    """The command's whole input, then end of file."""
    try:
        while data:
            data = data[os.write(in_write, data):]
    except BrokenPipeError:  # it did not read it
        pass
    finally:
        os.close(in_write)


def _wait(out_read, status, timeout, on_line):
    """Read the command's output until it ends; return (its output, its wait
    status, or None if the helper was killed before it could say it).

    The command has ended when the helper's status pipe closes; its output
    may then flow for DRAIN_TIMEOUT more (a process it left behind may hold
    the pipe open: that does not keep the import waiting)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    chunks, pending, ended, out_open, drain_until = [], b"", None, True, None
    while out_open or not status.closed:
        now = time.monotonic()
        if status.closed:
            drain_until = drain_until or now + DRAIN_TIMEOUT
            if now >= drain_until:
                break
            left = drain_until - now
        elif deadline is not None and now >= deadline:
            raise ChildTimeout(timeout, b"".join(chunks).decode(errors="replace"))
        else:
            left = None if deadline is None else deadline - now
        watched = ([out_read] if out_open else []) + ([] if status.closed else [status.fd])
        ready = _poll(watched, left)
        if status.fd in ready:
            record = status.read()
            if record is not None and record[0] == ENDED:
                ended = record[1]
        if out_read in ready:
            chunk = os.read(out_read, 65536)
            if not chunk:
                out_open = False
                continue
            chunks.append(chunk)
            if on_line is not None:
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    on_line(line.decode(errors="replace"))
    if on_line is not None and pending:
        on_line(pending.decode(errors="replace"))
    return b"".join(chunks).decode(errors="replace"), ended
