"""The build's process as a supervisor: it ends with the importer, and so does the build.

``build_child`` calls :func:`become_the_supervisor` first. From then on the
process leads a session of its own (``child.run(new_session=True)``: a kill
of the importer's process group does not reach it), the kernel sends it
SIGTERM when its parent dies (PR_SET_PDEATHSIG; its parent is
``child.run``'s helper, which dies with the importer), and it adopts
whatever the build leaves behind (PR_SET_CHILD_SUBREAPER). Told to stop
(SIGTERM, SIGINT, SIGHUP: the importer died or was interrupted), it ends
ninja, which ends its compiles; kills and reaps whatever is left; removes
the build's private directory; and exits, killed by that signal.
"""
import os
import shutil
import signal
import subprocess

# What there is to end: set by build_child as the build goes.
ninja_process = None
partial_dir = None


def children():
    """The pids whose parent is this process."""
    mine, found = str(os.getpid()).encode(), []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open("/proc/%s/stat" % entry, "rb") as f:
                data = f.read()
            if data[data.rindex(b")") + 2:].split()[1] == mine:
                found.append(int(entry))
        except (OSError, ValueError, IndexError):
            pass
    return found


def end(signum, frame):
    """SIGTERM, SIGINT, SIGHUP: ninja ends its compiles, whatever is left of
    the build (re-parented here) is killed and reaped, the private directory
    removed; then exit, killed by that signal."""
    for name in ("SIGTERM", "SIGINT", "SIGHUP"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    if ninja_process is not None and ninja_process.poll() is None:
        ninja_process.terminate()
        try:
            ninja_process.wait(10)
        except subprocess.TimeoutExpired:
            pass
    for _ in range(100):
        left = children()
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for pid in left:
            try:
                os.waitpid(pid, 0)
            except OSError:
                pass
    if partial_dir is not None:
        shutil.rmtree(partial_dir, ignore_errors=True)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)


def parent_of(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return int(data[data.rindex(b")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def become_the_supervisor(importer):
    """Ignore nothing the build needs; end with the importer; adopt orphans."""
    helper = os.getppid()  # child.run's helper; its parent is the importer
    if signal.getsignal(signal.SIGCHLD) == signal.SIG_IGN:  # inherited: ninja could not wait for its compiles
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
        libc.prctl(36, 1)                   # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass
    for name in ("SIGTERM", "SIGINT", "SIGHUP"):
        signal.signal(getattr(signal, name), end)
    if os.getppid() != helper or parent_of(helper) != importer:  # gone already
        end(signal.SIGTERM, None)
