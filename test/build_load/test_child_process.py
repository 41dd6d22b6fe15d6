"""The children an import starts (the build, the layout probe), in a big process.

``_torch_ctxext_build.child.run`` starts a small helper that is exec'd at once
(``posix_spawn``) and starts the command: nothing of the importer is copied,
no handler of the importer runs outside it, no fd of the importer's reaches
the helper or the command, any number of open fds works, and where
``posix_spawn`` is refused the helper is started with ``subprocess``. Each
scenario runs in a fresh interpreter, as the user's process would be.
"""
import os
import shutil
import signal
import subprocess
import textwrap

import pytest

from install_env import ROOT
from _torch_ctxext_build import child
from support import python

pytestmark = pytest.mark.skipif(not child.supported(), reason="child.run needs a POSIX system and sys.executable")

# Imports only the build layer's child, as the build's importer reaches it
# (not the package: no build is wanted here).
PRELUDE = textwrap.dedent(f"""
    import os, signal, sys, threading, time
    sys.path.insert(0, {ROOT!r})
    from _torch_ctxext_build import child
""")


def _importer(code, timeout=120, **env):
    return python(code=PRELUDE + textwrap.dedent(code), timeout=timeout, **env)


def test_a_child_starts_while_another_thread_of_the_importer_waits_for_the_gil():
    completed = _importer("""
        stop = threading.Event()
        def busy():  # never blocks: it waits for the GIL whenever it lacks it
            while not stop.is_set():
                pass
        threading.Thread(target=busy, daemon=True).start()
        sys.setswitchinterval(1e-6)
        for _ in range(4):
            ended = child.run(["/bin/sh", "-c", "echo started; exit 3"], timeout=60)
            assert (ended.status, ended.signal, ended.output) == (3, None, "started\\n"), ended
        stop.set()
        print("all started")
    """)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert completed.stdout.strip() == "all started"


def test_a_signal_to_the_group_runs_the_importers_handler_in_the_importer_only():
    # The handler takes a lock another thread holds while the child starts:
    # run anywhere but in the importer (where that thread releases it), it
    # would hang there.
    completed = _importer("""
        lock = threading.Lock()
        ran_in = []
        def handler(signum, frame):
            with lock:
                ran_in.append(os.getpid())
        signal.signal(signal.SIGTERM, handler)
        holding = threading.Event()
        def hold():
            with lock:
                holding.set()
                time.sleep(1.0)
        threading.Thread(target=hold).start()
        holding.wait()
        def group_signal():
            time.sleep(0.5)
            os.killpg(os.getpgid(0), signal.SIGTERM)
        threading.Thread(target=group_signal).start()
        ended = child.run(["/bin/sleep", "30"], timeout=60)
        time.sleep(0.2)  # the handler runs in the main thread, at its next bytecode
        assert ended.signal == signal.SIGTERM, ended  # the command ended by the group's signal
        print("ran in", ran_in == [os.getpid()])
    """, start_new_session=True)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert completed.stdout.strip() == "ran in True"


def test_a_group_signal_runs_an_asyncio_signal_callback_once():
    completed = _importer("""
        import asyncio
        calls = []
        async def main():
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGTERM, lambda: calls.append(1))
            def start_child():  # the import, on another thread
                return child.run(["/bin/sleep", "30"], timeout=60)
            running = loop.run_in_executor(None, start_child)
            await asyncio.sleep(0.5)
            os.killpg(os.getpgid(0), signal.SIGTERM)
            ended = await running
            await asyncio.sleep(0.3)
            return ended
        ended = asyncio.run(main())
        print(ended.signal == signal.SIGTERM, len(calls))
    """, start_new_session=True)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert completed.stdout.strip() == "True 1"


def test_any_number_of_open_fds_works_and_none_reaches_the_command():
    completed = _importer("""
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < 2000:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
        opened = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]
        inheritable = os.open("/dev/null", os.O_RDONLY)
        os.set_inheritable(inheritable, True)  # even one the importer made inheritable
        ended = child.run(["/bin/sh", "-c", "ls /proc/$$/fd"], timeout=60)
        print(sorted(int(fd) for fd in ended.output.split()))
    """)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    # sh's stdin, stdout and stderr (and the directory ls reads it through, at most)
    assert eval(completed.stdout.strip())[:3] == [0, 1, 2]
    assert len(eval(completed.stdout.strip())) <= 4


def test_a_listening_socket_the_importer_closes_during_the_run_can_be_bound_again():
    completed = _importer("""
        import socket
        server = socket.socket()
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        result = {}
        def run():
            result["ended"] = child.run(["/bin/sleep", "2"], timeout=60)
        thread = threading.Thread(target=run)
        thread.start()
        time.sleep(0.5)
        server.close()
        again = socket.socket()
        again.bind(("127.0.0.1", port))  # EADDRINUSE where a child kept a copy
        again.listen()
        thread.join()
        print("rebound", result["ended"].status)
    """)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert completed.stdout.strip() == "rebound 0"


def test_an_ignored_or_reaping_sigchld_leaves_every_status_right():
    completed = _importer("""
        statuses = []
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)
        statuses.append(child.run(["/bin/sh", "-c", "exit 5"]).status)
        reaped = []
        def reap(signum, frame):
            try:
                while True:
                    pid, _ = os.waitpid(-1, os.WNOHANG)
                    if not pid:
                        break
                    reaped.append(pid)
            except ChildProcessError:
                pass
        signal.signal(signal.SIGCHLD, reap)
        statuses.append(child.run(["/bin/sh", "-c", "exit 7"]).status)
        statuses.append(child.run(["/bin/sh", "-c", "kill -KILL $$"]).signal)
        print(statuses)
    """)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert completed.stdout.strip() == f"[5, 7, {int(signal.SIGKILL)}]"


def test_a_start_that_fails_keeps_its_errno():
    with pytest.raises(child.ChildNotStarted) as raised:
        child.run(["/nonexistent/program"])
    assert raised.value.errno == 2
    completed = _importer("""
        import tempfile
        path = os.path.join(tempfile.mkdtemp(), "not-a-program")
        with open(path, "w") as f:
            f.write("neither ELF nor a script")
        os.chmod(path, 0o755)
        try:
            child.run([path])
        except child.ChildNotStarted as e:
            print(e.errno)
    """)
    assert completed.stdout.strip() == str(8)  # ENOEXEC, as exec said it


SHIM = r"""
#include <errno.h>
#include <spawn.h>
int posix_spawn(pid_t *pid, const char *path, const posix_spawn_file_actions_t *actions,
                const posix_spawnattr_t *attr, char *const argv[], char *const envp[]) {
    return EPERM;  /* as a seccomp profile that refuses it would */
}
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler for the LD_PRELOAD shim")
def test_where_posix_spawn_is_refused_children_start_with_subprocess(tmp_path):
    (tmp_path / "shim.c").write_text(SHIM)
    shim = tmp_path / "shim.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(shim), str(tmp_path / "shim.c")], check=True)
    completed = _importer("""
        ended = child.run(["/bin/sh", "-c", "echo hello; exit 4"], timeout=60)
        print(ended.status, ended.output.strip(), child.how)
    """, LD_PRELOAD=shim)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert completed.stdout.strip() == "4 hello subprocess (posix_spawn refused: Operation not permitted)"


def test_a_child_start_costs_no_more_in_a_process_of_several_gb():
    # What grows with the importer's memory (a copy of its page tables, pages
    # copied on write) would show here: 2 GB touched against a small process.
    code = """
        import statistics
        big = bytearray(int(sys.argv[1]) << 20)
        for i in range(0, len(big), 4096):
            big[i] = 1
        times = []
        for _ in range(7):
            start = time.perf_counter()
            child.run(["/bin/true"], timeout=60)
            times.append(time.perf_counter() - start)
        print(statistics.median(times))
    """
    medians = {}
    for megabytes in (50, 2048, 50, 2048):  # interleaved: the machine's load drifts
        completed = python(megabytes, code=PRELUDE + textwrap.dedent(code))
        assert completed.returncode == 0, completed.stderr
        medians.setdefault(megabytes, []).append(float(completed.stdout))
    small, big = min(medians[50]), min(medians[2048])
    print(f"child start: {small * 1000:.1f} ms at 50 MB, {big * 1000:.1f} ms at 2 GB")
    assert big < 2 * small + 0.05, (small, big)


def test_info_says_how_children_are_started():
    code = textwrap.dedent("""
        import sys
        from torch_ctxext.__main__ import main
        from _torch_ctxext_build import child
        main(["info"])
        child.how = "subprocess (posix_spawn refused: Operation not permitted)"
        main(["info"])
    """)
    completed = python(code=code, PYTHONPATH=ROOT)
    assert completed.returncode == 0, completed.stderr
    lines = [line for line in completed.stdout.splitlines() if line.startswith("children ")]
    assert lines == [
        "children       posix_spawn of a helper exec'd at once (no copy of this process); subprocess where refused",
        "children       subprocess (posix_spawn refused: Operation not permitted)",
    ]


def test_a_build_process_that_cannot_start_names_its_errno_and_no_log_that_was_never_written(tmp_path):
    import torch_ctxext

    if torch_ctxext.features()["input_grad_buffers"] == "native":
        pytest.skip("the running torch provides input_grad_buffers natively: nothing is built")
    code = textwrap.dedent("""
        import sys, warnings
        import torch
        sys.executable = "/nonexistent/python"  # nothing can be started with it
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import torch_ctxext
        print([str(w.message) for w in caught if w.category is torch_ctxext.ExtensionUnavailableWarning][0])
    """)
    completed = python(code=code, PYTHONPATH=ROOT, TORCH_CTXEXT_CACHE=tmp_path / "cache")
    assert completed.returncode == 0, completed.stderr
    said = completed.stdout.strip()
    assert "its build process could not start" in said and "errno 2" in said, said
    assert "Build log" not in said
    assert not list((tmp_path / "cache").rglob("*.log"))
