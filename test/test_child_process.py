"""The children an import starts (the build, the layout probe) start whatever the importer's other threads do.

``torch_ctxext._ext.child.run`` starts its command through an intermediate
cloned from the importer's thread, which runs Python with the interpreter's
state as it was at the clone. An importer's other thread that waits for the
GIL asks for it after one switch interval; had it asked by the clone, the
intermediate would hand the GIL to a thread it does not have, and wait for
it forever (the import hung). Here a thread that never blocks competes for
the GIL with a switch interval of 1 us, so that it asks during every clone.
"""
import subprocess
import sys
import textwrap

import pytest

from torch_ctxext._ext import child

pytestmark = pytest.mark.skipif(not child.supported(), reason="child.run starts children on Linux x86_64/aarch64 only")

IMPORTER = textwrap.dedent("""
    import sys, threading
    from torch_ctxext._ext import child

    stop = threading.Event()
    def busy():  # never blocks: it waits for the GIL whenever it lacks it
        while not stop.is_set():
            pass
    threading.Thread(target=busy, daemon=True).start()
    sys.setswitchinterval(1e-6)
    for _ in range(4):
        ended = child.run(["/bin/sh", "-c", "echo started; exit 3"], timeout=60)
        assert (ended.status, ended.signal, ended.output) == (3, None, "started\\n"), ended
    assert sys.getswitchinterval() < 1e-3, "the importer's switch interval was not put back"
    stop.set()
    print("all started")
""")


def test_a_child_starts_while_another_thread_of_the_importer_waits_for_the_gil():
    try:
        completed = subprocess.run([sys.executable, "-c", IMPORTER], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("child.run hung: the intermediate waited for the GIL another thread had asked for")
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert completed.stdout.strip() == "all started"
