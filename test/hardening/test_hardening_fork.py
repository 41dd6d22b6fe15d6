"""fork() while an engine thread is inside a lock of torch_ctxext.

The engine hooks of torch_ctxext take process-global locks without the GIL
(the validate_outputs wrapper behind set_output_grad_dtype(None) on torch
<= 2.9, the InputBuffer::add hook that validates later producers of an
exposed buffer). A fork() made while another thread is inside one would copy
the lock held into the child, whose first backward() would then wait forever
(csrc/fork_safety.h). Each case runs in a subprocess that makes the engine
take the lock in a training thread, parks that thread inside the locked
region (a test-only hook of the extension), forks right then, and lets the
child run backward passes; the parent waits for the child with a bound and
kills it if it hangs.

Copies of the extension refused in the process (another path, a package
that vendors torch_ctxext) must leave the loaded copy's locks as they were:
each copy's list of locks is its own (csrc/fork_safety.h), and a refused
copy registers no fork handler (seen through an interposer of glibc's
__register_atfork, behind every pthread_atfork).

Run directly (``python test_hardening_fork.py LOCK [REFUSED_COPY...]``) it is
that subprocess; it first loads each REFUSED_COPY (a copy of the library),
which must be refused.
"""
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
from support import TESTS, python, reap, wait_until

CHILD_BOUND_S = 20  # a backward of a few nodes takes milliseconds
PARK_MS = 1000  # how long the training thread sits inside the locked region


def run_case(lock, extra_env=None, refused_copies=()):
    proc = python(os.path.abspath(__file__), lock, *refused_copies, timeout=CHILD_BOUND_S + 120, path=[TESTS],
                  **(extra_env or {}))
    return proc.returncode, proc.stdout + proc.stderr


def loaded_extension():
    import torch_ctxext  # noqa: F401
    from torch_ctxext._ext import loader as _extension

    return _extension.load() if _extension.loaded else None


LOCKS = [
    ("output_grad_dtype", {}),
    # The InputBuffer::add hook is placed only where the engine has
    # device threads, unless asked for.
    ("direct_accumulation", {"TORCH_CTXEXT_VALIDATE_LATER_PRODUCERS": "always"}),
    # No lock at all: a fork while another thread trains, as a control
    # (and the whole test on native torch 2.15).
    ("none", {}),
]


def skip_unless_taken(lock, ext):
    old_side = ext.boundaries if ext is not None else {}
    if lock == "output_grad_dtype" and not old_side.get("ENGINE_CASTS_TO_OPTIONS_DTYPE"):
        pytest.skip("no validate_outputs wrapper on this torch (torch > 2.9 or native)")
    if lock == "direct_accumulation" and old_side.get("ADD_WITHOUT_CONSUMER_NODE", True):
        pytest.skip("no InputBuffer::add hook on this torch (torch <= 2.9 or native)")


@pytest.mark.parametrize("lock, env", LOCKS)
def test_child_forked_while_an_engine_thread_holds_a_lock_can_run_backward(lock, env):
    skip_unless_taken(lock, loaded_extension())
    code, output = run_case(lock, env)
    assert code == 0, output
    assert "child: ok" in output, output


# More copies than fork_safety.h lists locks (kMaxMutexes, 8), at one lock a copy.
REFUSED_COPIES = 9

# Preloaded into the subprocess: says which library registers fork handlers.
# pthread_atfork is linked into each library from libc_nonshared.a and calls
# libc's __register_atfork, which a preloaded library can interpose.
FORK_HANDLER_LOG = r"""
#include <dlfcn.h>
#include <stdio.h>
using Handler = void (*)();
extern "C" int __register_atfork(Handler prepare, Handler parent, Handler child, void* dso) {
  using Register = int (*)(Handler, Handler, Handler, void*);
  static const Register real = reinterpret_cast<Register>(dlsym(RTLD_NEXT, "__register_atfork"));
  Handler any = prepare ? prepare : parent ? parent : child;
  Dl_info info;
  if (any != nullptr && dladdr(reinterpret_cast<void*>(any), &info) != 0 && info.dli_fname != nullptr) {
    fprintf(stderr, "fork handlers registered by %s\n", info.dli_fname);
  }
  return real(prepare, parent, child, dso);
}
"""


def fork_handler_log(directory):
    """The interposer above, compiled into ``directory``."""
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        pytest.skip("no C++ compiler to build the __register_atfork interposer")
    source, library = os.path.join(directory, "fork_handler_log.cpp"), os.path.join(directory, "fork_handler_log.so")
    with open(source, "w") as f:
        f.write(FORK_HANDLER_LOG)
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", library, source, "-ldl"], check=True)
    return library


def registrations(output):
    """The libraries that registered fork handlers, by their real paths."""
    prefix = "fork handlers registered by "
    return [os.path.realpath(line[len(prefix):]) for line in output.splitlines() if line.startswith(prefix)]


@pytest.mark.parametrize("lock, env", LOCKS[:2])
def test_copies_refused_in_the_process_leave_the_loaded_copys_locks_fork_safe(lock, env, tmp_path):
    """Any number of copies of the library loaded after the first one (each
    from its own path) are refused and change nothing: the process goes on,
    the loaded copy still lists its own locks and nothing else, no refused
    copy registers fork handlers, and a child forked while an engine thread
    holds one of the loaded copy's locks runs backward."""
    ext = loaded_extension()
    if ext is None:
        pytest.skip("no extension loaded (native torch 2.15)")
    skip_unless_taken(lock, ext)
    from torch_ctxext._ext import loader as _extension

    copies = []
    for i in range(REFUSED_COPIES):
        (tmp_path / str(i)).mkdir()
        copies.append(shutil.copyfile(_extension.loaded.path, tmp_path / str(i) / "_C.so"))
    preload = " ".join(filter(None, [os.environ.get("LD_PRELOAD"), fork_handler_log(str(tmp_path))]))
    code, output = run_case(lock, dict(env, LD_PRELOAD=preload), copies)
    assert code == 0, output
    assert f"refused copies: {REFUSED_COPIES} of {REFUSED_COPIES}" in output, output
    assert f"locks after them: {sorted(ext.fork_safe_locks())}" in output, output
    registered = registrations(output)
    assert registered.count(os.path.realpath(_extension.loaded.path)) == 1, output
    assert [path for path in registered if path.startswith(os.path.realpath(tmp_path))] == [], output
    assert "child: ok" in output, output


def test_every_lock_the_engine_takes_without_the_gil_is_fork_safe():
    ext = loaded_extension()
    if ext is None:
        pytest.skip("no extension loaded (native torch 2.15)")
    expected = {"direct_accumulation"}
    if ext.boundaries["ENGINE_CASTS_TO_OPTIONS_DTYPE"]:
        expected.add("output_grad_dtype")
    assert set(ext.fork_safe_locks()) == expected


# --- the subprocess --------------------------------------------------------------


def _load_refused_copies(paths):
    """Load each copy of the library, under a name of its own; each must be
    refused (an ImportError naming the loaded copy)."""
    from _torch_ctxext_build import extension

    refused = 0
    for i, path in enumerate(paths):
        try:
            extension.load(f"refused_copy_{i}._C", path)
        except ImportError as error:
            refused += "another copy of torch_ctxext's C++ extension is already loaded" in str(error)
    print(f"refused copies: {refused} of {len(paths)}", flush=True)


def _main(lock, refused_copies):
    import torch
    from engine_hook_functions import Uncast, fused_backward, uncast_backward

    import torch_ctxext  # noqa: F401
    from torch_ctxext._ext import loader as _extension

    ext = _extension.load() if _extension.loaded else None
    if refused_copies:
        _load_refused_copies(refused_copies)
        print(f"locks after them: {sorted(ext.fork_safe_locks())}", flush=True)

    def uncast_step():
        x = uncast_backward()
        assert torch.equal(x.grad, torch.full((3,), 2.0)), x.grad

    # Make the engine take the lock on every node it runs, on any graph.
    keep = None
    if lock == "output_grad_dtype":
        keep = Uncast.apply(torch.ones(3, requires_grad=True))  # a live declaration
        assert ext._testing.live_uncast_declarations() == 1
    elif lock == "direct_accumulation":
        fused_backward()  # a recorded exposure, and the InputBuffer::add hook
        assert ext._testing.producer_hook_placed()

    # torch initialises some process-wide state on the first backward (on a
    # CUDA build, the device count: a function-local static). A fork while
    # another thread is inside that first initialisation leaves its guard
    # held in the child, whose backward then waits forever: torch's own
    # state, not a lock of torch_ctxext, so it is settled before any thread
    # trains (seen on 2.6: the child parked in c10::cuda::device_count).
    warm = torch.ones(1, requires_grad=True)
    (warm * 2).sum().backward()

    stop = threading.Event()
    errors = []

    def train():
        try:
            while not stop.is_set():
                y = torch.ones(8, requires_grad=True)
                z = y
                for _ in range(20):
                    z = z * 1.5
                z.sum().backward()
        except BaseException as error:  # reported by the parent
            errors.append(error)

    worker = threading.Thread(target=train)
    worker.start()
    if lock != "none":
        ext._testing.park_next_gil_free_lock(lock, PARK_MS)
        try:
            wait_until(ext._testing.lock_parked, 10, "the training thread entered the lock", interval=0.001)
        except AssertionError as error:
            print(f"parent: {error}")
            sys.exit(2)
    else:
        time.sleep(0.05)

    pid = os.fork()
    if pid == 0:
        try:
            a = torch.ones(3, requires_grad=True)
            (a * 2).sum().backward()
            assert torch.equal(a.grad, torch.full((3,), 2.0)), a.grad
            if ext is not None or hasattr(torch.autograd.function.FunctionCtx, "input_grad_buffers"):
                fused_backward()
                uncast_step()
            print("child: ok", flush=True)
            os._exit(0)
        except BaseException as error:
            print(f"child: {type(error).__name__}: {error}", flush=True)
            os._exit(3)

    if lock != "none":
        ext._testing.release_parked_lock()
    stop.set()
    worker.join()
    del keep
    code = reap(pid, timeout=CHILD_BOUND_S)
    if code == -signal.SIGKILL:
        print(f"parent: the child hung in backward for {CHILD_BOUND_S} s (killed)")
        sys.exit(1)
    if errors:
        print(f"parent: the training thread failed: {errors[0]!r}")
        sys.exit(1)
    print(f"parent: child exited with {code}")
    sys.exit(code)


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2:])


def test_a_child_forked_while_a_thread_holds_explains_locks_can_explain():
    """explain()'s Python locks (observe()'s and a report's) held by another
    thread at fork(): the child gets fresh ones and explain() works there."""
    code = r"""
import os, sys, threading, torch, torch_ctxext
from torch_ctxext import _explain
report = _explain.BufferReport()
held, release = threading.Event(), threading.Event()
def hold():
    with _explain._lock, report._lock:
        held.set()
        release.wait()
t = threading.Thread(target=hold)
t.start()
held.wait()
pid = os.fork()
if pid == 0:
    import signal
    signal.alarm(20)  # a hang is a failure, not a stuck test
    with torch_ctxext.explain() as child_report:
        x = torch.ones(2, requires_grad=True)
        (x * 2).sum().backward()
    report.record("F", [])
    os._exit(0)
release.set()
t.join()
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status))
"""
    done = python(code=code, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1] == "0", done.stdout + done.stderr
