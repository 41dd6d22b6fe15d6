"""Child processes an import starts and waits for, unseen by the importer's SIGCHLD.

An import runs inside someone else's process, whose SIGCHLD is theirs: set
to ``SIG_IGN`` (the kernel then reaps every child at its exit: ``waitpid``
fails with ``ECHILD``, which ``subprocess`` reports as status 0, and ninja
under such a parent cannot wait for its compiles), or handled by a handler
that reaps whatever exits (``waitpid(-1)``), taking the status the import
waits for; any handler at all runs for the import's children. None of that
may break a build or a layout probe, and the importer must not see them.

Linux lets the parent choose the signal a child sends at its exit (the low
byte of ``clone``'s flags): a child started with none is a "clone child".
The kernel never reaps one on its own, whatever SIGCHLD's disposition;
``waitpid(-1)`` and ``waitpid(pid)`` without ``__WALL`` do not see it; it
signals nobody when it exits. An exec makes it an ordinary child again (the
kernel resets the exit signal to SIGCHLD at every exec), so :func:`run`
starts an intermediate with ``clone(0)`` that never execs: it sets SIGCHLD
back to the default for itself, starts the command with ``posix_spawn``
(the command is the intermediate's child, so neither the importer's
disposition nor its handler applies to it), waits for it and writes its
wait status to a pipe. The importer reads the status there and reaps the
intermediate itself with ``waitpid(pid, __WALL)``: the status is the
command's own, and the importer's handlers never run for either.

Between ``clone`` and its exit the intermediate runs only calls prepared
before the clone (ctypes functions called with the GIL held, whose
arguments were converted in the parent): no import, and no allocation by
the C library that another thread of the parent could have held a lock of.
A command inherits an ignored signal across exec; posix_spawn sets SIGCHLD,
SIGPIPE, SIGINT, SIGTERM and SIGHUP back to the default and unblocks every
signal in the command.

The standard library only: setup.py and the build's own child processes
load this file by its path.
"""
import collections
import ctypes
import errno
import os
import platform
import select
import signal
import sys
import time

# clone and execve, by machine: the raw system calls, so that the child
# sends no signal at its exit (glibc's fork() always asks for SIGCHLD).
_SYSCALLS = {"x86_64": (56, 59), "aarch64": (220, 221)}
_WALL = 0x40000000  # waitpid: any child, clone children included
_PR_SET_PDEATHSIG = 1

Finished = collections.namedtuple("Finished", "status signal output")
Finished.__doc__ = """How a child ended: ``status`` (its exit status, or None
if a signal ended it), ``signal`` (that signal's number, or None) and
everything it wrote to stdout and stderr, as text."""


class ChildNotStarted(OSError):
    """The command could not be started (no such file, no memory, ...)."""


class ChildTimeout(Exception):
    """The child did not finish in time: it was killed and reaped. ``output``
    is what it had written."""

    def __init__(self, timeout, output):
        super().__init__(f"did not finish within {timeout:g} s")
        self.timeout, self.output = timeout, output


def default_sigchld():
    """Set SIGCHLD back to the default in this process, where it was
    ignored (an ignored SIGCHLD survives exec, and under it nothing this
    process starts can be waited for)."""
    if signal.getsignal(signal.SIGCHLD) == signal.SIG_IGN:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)


def _c_strings(values):
    array = (ctypes.c_char_p * (len(values) + 1))()
    array[:-1] = [os.fsencode(v) for v in values]
    array[-1] = None
    return array


class _Prepared:
    """Everything the intermediate does, converted to C before the clone.

    The intermediate is a clone child (it sends no signal at its exit, and
    the importer's waitpid(-1) does not see it) that never execs: an exec
    would make it an ordinary child again (the kernel resets the exit
    signal to SIGCHLD at every exec). It sets SIGCHLD back to the default
    for itself, starts the command with posix_spawn (the command is its
    child: neither the importer's disposition nor its handler applies to
    it), waits for it, writes its wait status to a pipe and exits."""

    def __init__(self, argv, env, cwd, stdin_fd, stdout_fd, status_fd, close_before, close_after, new_session):
        libc = ctypes.PyDLL(None, use_errno=True)  # PyDLL: the GIL stays held in the intermediate
        self.libc = libc
        for name in ("syscall", "signal", "prctl", "posix_spawn", "waitpid", "write", "close", "_exit", "chdir"):
            setattr(self, name.lstrip("_"), getattr(libc, name))
        self.syscall.restype = ctypes.c_long
        self.signal.restype = ctypes.c_void_p
        self.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
        clone, _ = _SYSCALLS[platform.machine()]
        self.clone_args = (ctypes.c_long(clone),) + tuple(ctypes.c_long(0) for _ in range(5))
        self.sigchld = (ctypes.c_int(int(signal.SIGCHLD)), ctypes.c_void_p(0))  # SIG_DFL
        self.pdeathsig = (ctypes.c_int(_PR_SET_PDEATHSIG), ctypes.c_long(int(signal.SIGKILL)))
        self.path = ctypes.c_char_p(os.fsencode(argv[0]))
        self.argv = _c_strings(argv)
        self.envp = _c_strings([f"{k}={v}" for k, v in env.items()])
        self.cwd = ctypes.c_char_p(os.fsencode(cwd)) if cwd is not None else None
        self.pid = ctypes.c_int(0)
        self.status = ctypes.c_int(0)
        self.status_fd = ctypes.c_int(status_fd)
        self.close_before = [ctypes.c_int(fd) for fd in close_before]
        self.close_after = [ctypes.c_int(fd) for fd in close_after]
        self.zero, self.failed = ctypes.c_int(0), ctypes.c_int(127)
        self.int_size = ctypes.c_size_t(ctypes.sizeof(ctypes.c_int))
        # posix_spawn's file actions and attributes, made here (they allocate).
        self.actions = ctypes.create_string_buffer(256)  # posix_spawn_file_actions_t (80 bytes in glibc)
        self.attr = ctypes.create_string_buffer(512)     # posix_spawnattr_t (336 bytes in glibc)
        _check(libc.posix_spawn_file_actions_init(self.actions), "posix_spawn_file_actions_init")
        for old, new in ((stdin_fd, 0), (stdout_fd, 1), (stdout_fd, 2)):
            _check(libc.posix_spawn_file_actions_adddup2(self.actions, old, new), "adddup2")
        if cwd is not None:  # glibc 2.29: posix_spawn_file_actions_addchdir_np
            adder = getattr(libc, "posix_spawn_file_actions_addchdir_np", None)
            if adder is not None:
                _check(adder(self.actions, os.fsencode(cwd)), "addchdir")
                self.cwd = None
        _check(libc.posix_spawnattr_init(self.attr), "posix_spawnattr_init")
        flags = _POSIX_SPAWN_SETSIGDEF | _POSIX_SPAWN_SETSIGMASK | (_POSIX_SPAWN_SETSID if new_session else 0)
        sigset = ctypes.create_string_buffer(128)
        libc.sigemptyset(sigset)
        _check(libc.posix_spawnattr_setsigmask(self.attr, sigset), "setsigmask")
        for sig in (signal.SIGCHLD, signal.SIGPIPE, signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            libc.sigaddset(sigset, int(sig))
        _check(libc.posix_spawnattr_setsigdefault(self.attr, sigset), "setsigdefault")
        _check(libc.posix_spawnattr_setflags(self.attr, ctypes.c_short(flags)), "setflags")
        self.sigset = sigset

    def release(self):
        self.libc.posix_spawn_file_actions_destroy(self.actions)
        self.libc.posix_spawnattr_destroy(self.attr)

    def in_intermediate(self):
        """Runs in the intermediate: spawn, wait, say the status. Never returns."""
        try:
            self.signal(*self.sigchld)
            self.prctl(*self.pdeathsig)  # the importer dies: so does this, and the command is told (its own PDEATHSIG)
            for fd in self.close_before:  # the importer's ends of the pipes
                self.close(fd)
            if self.cwd is not None and self.chdir(self.cwd) != 0:
                self.exit(self.failed)
            if self.posix_spawn(ctypes.byref(self.pid), self.path, self.actions, self.attr, self.argv, self.envp) != 0:
                self.exit(self.failed)
            for fd in self.close_after:  # the command's ends: EOF when the command is done with them
                self.close(fd)
            self.write(self.status_fd, ctypes.byref(self.pid), self.int_size)
            while self.waitpid(self.pid, ctypes.byref(self.status), self.zero) < 0:
                pass  # EINTR
            self.write(self.status_fd, ctypes.byref(self.status), self.int_size)
            self.exit(self.zero)
        finally:
            self.exit(self.failed)


_POSIX_SPAWN_SETSIGDEF, _POSIX_SPAWN_SETSIGMASK, _POSIX_SPAWN_SETSID = 0x04, 0x08, 0x80


def _check(code, what):
    if code != 0:
        raise ChildNotStarted(code, f"{what}: {os.strerror(code)}")


# How long, at least, no thread of the importer may ask for the GIL around the
# clone (sys.setswitchinterval): longer than the clone itself takes (it copies
# the page tables of the whole process: tens of milliseconds for tens of GB).
_GIL_QUIET_S = 1.0


def _spawn(prepared):
    """clone(0): the intermediate runs ``prepared.in_intermediate``; return its pid.

    The intermediate is a copy of this thread holding the GIL, with the
    interpreter's state as it was at the clone, and no other thread. Had
    another thread of the importer asked for the GIL by then (it does after
    waiting one switch interval), the copy would hand the GIL over at its
    first bytecode and wait for a thread that does not exist in it, forever
    (os.fork() clears that state in C, PyOS_AfterFork_Child, before any
    bytecode runs; a clone made from Python cannot). So no thread may be
    able to ask during the clone: the switch interval is raised first, then
    this thread sleeps past the old interval (every wait begun under it ends
    meanwhile: it took the free GIL or waits again under the new one), and
    takes the GIL back, which clears any request; a request then needs
    ``_GIL_QUIET_S`` more. The interval is put back once the clone is done.
    """
    interval = sys.getswitchinterval()
    sys.setswitchinterval(max(interval, _GIL_QUIET_S))
    try:
        time.sleep(interval + 0.001)
        pid = prepared.syscall(*prepared.clone_args)
        if pid == 0:
            prepared.in_intermediate()  # never returns (nor runs the finally)
    finally:
        sys.setswitchinterval(interval)
    if pid < 0:
        raise ChildNotStarted(ctypes.get_errno(), f"clone: {os.strerror(ctypes.get_errno())}")
    return pid


def supported():
    """Whether children can be started unseen here (Linux on x86_64 or aarch64)."""
    return os.uname().sysname == "Linux" and platform.machine() in _SYSCALLS


def _reap(pid, options=0):
    while True:
        try:
            return os.waitpid(pid, options | _WALL)
        except InterruptedError:
            continue


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
    SIGCHLD, SIGPIPE, SIGINT, SIGTERM and SIGHUP are the defaults and no
    signal is blocked, whatever the importer set. If this thread is
    interrupted while it waits (a KeyboardInterrupt), the command gets
    ``on_interrupt`` and is reaped before the exception goes on. Raises
    ChildNotStarted, ChildTimeout (after killing it)."""
    if not supported():
        raise ChildNotStarted(errno.ENOSYS, f"cannot start a child unseen on {platform.machine()}")
    if not os.path.isabs(argv[0]) or not os.access(argv[0], os.X_OK):
        raise ChildNotStarted(errno.ENOENT, f"{argv[0]!r} is not an executable file")
    env = dict(os.environ if env is None else env)
    data = input.encode() if isinstance(input, str) else (input or b"")
    in_read, in_write = os.pipe()
    out_read, out_write = os.pipe()
    status_read, status_write = os.pipe()
    fds = [in_read, in_write, out_read, out_write, status_read, status_write]
    prepared = None
    try:
        prepared = _Prepared(list(argv), env, cwd, in_read, out_write, status_write,
                             [in_write, out_read, status_read], [in_read, out_write], new_session)
        intermediate = _spawn(prepared)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    finally:
        if prepared is not None:
            prepared.release()
    for fd in (in_read, out_write, status_write):
        os.close(fd)
    command = None
    try:
        command = _read_int(status_read)
        if command is None:  # posix_spawn failed in the intermediate
            _reap(intermediate)
            raise ChildNotStarted(errno.ENOEXEC, f"{argv[0]!r} could not be started")
        _feed(in_write, data)
        in_write = None
        output = _wait(out_read, timeout, on_line)
        status = _read_int(status_read)
        _, ended = _reap(intermediate)
        if status is None:  # the intermediate was killed: the command dies with it (PDEATHSIG), or was killed too
            return Finished(None, os.WTERMSIG(ended) if os.WIFSIGNALED(ended) else signal.SIGKILL, output)
        return _finished(status, output)
    except BaseException as e:
        if command is not None:
            _end(command, signal.SIGKILL if isinstance(e, ChildTimeout) else on_interrupt, intermediate)
        raise
    finally:
        for fd in (in_write, out_read, status_read):
            if fd is not None:
                os.close(fd)


def _read_int(fd):
    data = b""
    while len(data) < 4:
        try:
            chunk = os.read(fd, 4 - len(data))
        except InterruptedError:
            continue
        if not chunk:
            return None
        data += chunk
    return int.from_bytes(data, "little" if sys.byteorder == "little" else "big", signed=True)


def _end(command, sig, intermediate):
    """Send ``sig`` to the command (SIGKILL after 10 s); reap the intermediate."""
    try:
        os.kill(command, sig)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if _reap(intermediate, os.WNOHANG)[0] == intermediate:
                return
        except ChildProcessError:
            return
        time.sleep(0.05)
    for pid in (command, intermediate):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        _reap(intermediate)
    except ChildProcessError:
        pass


def _feed(in_write, data):
    """The command's whole input, then end of file."""
    try:
        while data:
            data = data[os.write(in_write, data):]
    except BrokenPipeError:  # it did not read it
        pass
    finally:
        os.close(in_write)


def _wait(out_read, timeout, on_line):
    """Read the command's output to its end; return it."""
    deadline = None if timeout is None else time.monotonic() + timeout
    chunks, pending = [], b""
    while True:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select([out_read], [], [], left)
        if not ready:
            raise ChildTimeout(timeout, b"".join(chunks).decode(errors="replace"))
        chunk = os.read(out_read, 65536)
        if not chunk:
            break
        chunks.append(chunk)
        if on_line is not None:
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                on_line(line.decode(errors="replace"))
    if on_line is not None and pending:
        on_line(pending.decode(errors="replace"))
    return b"".join(chunks).decode(errors="replace")
