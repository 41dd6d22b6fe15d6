"""Whether a build of the extension reads this torch's structures as its
headers say: verified once per build, in a child process, and kept beside it.

The extension reads, and for two members writes, torch's internal structures
(THPFunction, the node's InputMetadata and VariableInfo, the GraphTask) by
the layout of the headers it was compiled with. The loader's checks (torch
version, git hash, release boundaries) cannot see a torch built from an
edited tree, with an ``Unknown`` git hash, or patched by a distribution,
whose layout differs. The layout probe (``layout_check``) can: it runs a
Function forward and backward and compares everything the extension reads of
it with what Python knows of it.

That probe runs a backward, and a backward is the autograd engine's
once-per-process start: it counts the devices of every registered backend
(on a CUDA build, ``cudaGetDeviceCount``, which initialises the driver),
starts a thread per device, and from then on a forked child cannot run
backward. ``import torch`` does none of that, so ``import torch_ctxext``
must not either. The probe therefore runs in a child process, once per
build and torch: when the build is made (``build``, setup.py's build_ext),
or, the first time a build is loaded against a torch it was not verified
with, at that import. Its verdict is kept in a small JSON file, named by a
key made of the build's identity and the torch binaries' identities (their
GNU build ids: a digest of their contents), so that a verdict is never
reused for another build of either. The import itself only reads that file.

A build that does not read back as expected leaves the members that depend
on the structure unavailable, with the reason (``verdicts``); so does a
probe that crashes (a wrong layout can make it read garbage: in the child,
not in the user's process) or a probe that could not run at all (not
recorded: the next import tries again).

This module is the verdict's format and the probe's launch; where verdicts
are kept and read is ``verdict_store``. The standard library only at the
top: torch is imported where the running one is asked.
"""
import contextlib
import hashlib
import json
import os
import signal
import struct
import sys
import tempfile
import time

FORMAT = 1
# What each member reads or writes by layout (layout_check: the structures).
NEEDS = {
    "input_grad_buffers": ("ctx", "node", "task"),
    "set_output_grad_dtype": ("ctx", "node", "metadata"),
    "apply_boxed": ("ctx", "node", "metadata"),
}
PARTS = ("ctx", "node", "metadata", "task")
# The torch libraries whose binaries hold the structures the extension reads:
# TensorImpl (c10), the engine, nodes and graph tasks (torch_cpu), THPFunction
# and PyNode (torch_python).
TORCH_LIBRARIES = ("libc10.so", "libtorch_cpu.so", "libtorch_python.so")
# A probe that has not answered by then is stuck, not slow (it imports torch,
# 2 s on an idle machine, and runs two tiny backwards).
PROBE_TIMEOUT = 120.0
# Signals that say the probe itself crashed (a layout read as another): a
# verdict. Any other end (killed for memory, a timeout) may not recur.
_CRASHES = {signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL, signal.SIGFPE}


# --- identities -----------------------------------------------------------

_NT_GNU_BUILD_ID = 3


def gnu_build_id(path):
    """The GNU build id of the ELF file at ``path`` (a digest of its contents
    that the linker writes; PyPI's torch and gcc's default links have one),
    as hex, or None. Reads the program headers and notes only."""
    try:
        with open(path, "rb") as f:
            ident = f.read(64)
            if len(ident) < 64 or ident[:4] != b"\x7fELF":
                return None
            is64, order = ident[4] == 2, "<" if ident[5] == 1 else ">"
            if is64:
                phoff, = struct.unpack_from(order + "Q", ident, 32)
                phentsize, phnum = struct.unpack_from(order + "HH", ident, 54)
            else:
                phoff, = struct.unpack_from(order + "I", ident, 28)
                phentsize, phnum = struct.unpack_from(order + "HH", ident, 42)
            f.seek(phoff)
            table = f.read(phentsize * phnum)
            for i in range(phnum):
                entry = table[i * phentsize:(i + 1) * phentsize]
                if is64:
                    kind, _, offset, _, _, size = struct.unpack_from(order + "IIQQQQ", entry)
                else:
                    kind, offset, _, _, size = struct.unpack_from(order + "IIIII", entry)
                if kind != 4:  # PT_NOTE
                    continue
                f.seek(offset)
                notes, at = f.read(size), 0
                while at + 12 <= len(notes):
                    namesz, descsz, note = struct.unpack_from(order + "III", notes, at)
                    name_at = at + 12
                    desc_at = name_at + (namesz + 3) // 4 * 4
                    if note == _NT_GNU_BUILD_ID and notes[name_at:name_at + namesz] == b"GNU\0":
                        return notes[desc_at:desc_at + descsz].hex()
                    at = desc_at + (descsz + 3) // 4 * 4
    except (OSError, struct.error):
        return None
    return None


def _file_identity(path, digest_if_no_id):
    build_id = gnu_build_id(path)
    if build_id:
        return "build-id:" + build_id
    try:
        if digest_if_no_id:  # small (the extension): its contents
            with open(path, "rb") as f:
                return "sha256:" + hashlib.sha256(f.read()).hexdigest()
        st = os.stat(path)  # large (torch's): the file as installed
        return f"stat:{st.st_size}:{st.st_mtime_ns}:{os.path.realpath(path)}"
    except OSError:
        return "absent"


def torch_identity():
    """What identifies the running torch's binaries: its version, git hash
    and the identity of each library holding a structure read by layout."""
    import torch

    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    return {
        "version": torch.__version__,
        "git": torch.version.git_version,
        "libraries": {name: _file_identity(os.path.join(lib, name), False) for name in TORCH_LIBRARIES},
    }


def key(library):
    """The name of the verdict for ``library`` against the running torch."""
    identity = [_file_identity(library, True), torch_identity()]
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]


def verdict_name(library):
    return f"layout-{key(library)}.json"


def beside(library):
    """Where the verdict of ``library`` is kept beside it (by the build step
    and setup.py, which make the build)."""
    return os.path.join(os.path.dirname(library), verdict_name(library))


# --- the probe, in a child process ------------------------------------------

# Run in a child process (``layout_probe``, started by child.run: the
# importer's SIGCHLD neither breaks it nor sees it), in "/", with the
# importer's import path (strings, less the entry Python put first for its
# cwd or script, ``probe_path``). Its answer is the line after ANSWER (its
# stdout and stderr come as one stream).
ANSWER = "torch_ctxext-layout-probe-answer: "
# The probe's working directory: none of the importer's (a json.py or
# signal.py there would be imported in its place).
PROBE_CWD = "/"


class ProbeNotRun(Exception):
    """The probe could not give a verdict (could not start, timed out, was
    killed): not recorded, the next import tries again."""


class ProbeTimedOut(ProbeNotRun):
    """The probe did not finish in time (stuck, not killed)."""


def _child_environment():
    env = dict(os.environ)
    # The probe runs on the CPU: no GPU is touched, no out-of-tree backend
    # autoloaded (torch 2.5 on), whatever the engine counts at its start.
    env.update(CUDA_VISIBLE_DEVICES="", HIP_VISIBLE_DEVICES="", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    return env


def _implicit_first_entry():
    """The entry Python itself put first on the importer's path (its cwd for
    ``-c``, ``-m`` and the prompt, its script's directory), or None where
    it put none (``-P``, ``-I``, an embedding without argv)."""
    if getattr(sys.flags, "safe_path", False) or sys.flags.isolated or not getattr(sys, "argv", None):
        return None
    script = sys.argv[0]
    if script in ("", "-c"):
        return {"", os.getcwd()}
    return {os.getcwd(), os.path.dirname(os.path.realpath(script)), os.path.dirname(os.path.abspath(script))}


def probe_path():
    """The import path the probe runs with: the importer's ``sys.path``
    entries that its own imports use (strings; bytes decoded; anything else,
    a ``pathlib.Path`` say, is skipped by the import system and here too),
    absolute (the probe runs in another directory), less the entry Python
    put first for the importer's cwd or script directory. Whatever the
    importer put there itself stays; if torch resolves from elsewhere
    without that entry, the probe says so (and gives no verdict)."""
    entries = [os.fsdecode(e) for e in sys.path if isinstance(e, (str, bytes))]
    implicit = _implicit_first_entry()
    if entries and implicit is not None and (entries[0] in implicit or os.path.abspath(entries[0]) in implicit):
        entries = entries[1:]
    path = []
    for entry in entries:
        entry = os.path.abspath(entry)
        if entry not in path:
            path.append(entry)
    return path


def _crash_or_not_run(sig):
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = f"signal {sig}"
    if sig in _CRASHES:
        crash = f"the layout probe crashed ({name}) reading it"
        return {part: crash for part in PARTS}, {}
    raise ProbeNotRun(f"the layout probe was killed by {name}")


def probe(library, timeout=PROBE_TIMEOUT):
    """({structure: what did not read back}, {fact: value}) for ``library``
    against the running torch (empty: everything read back as expected),
    from a child process. A crash of the probe is a verdict (every
    structure); ProbeNotRun when there is none."""
    import torch

    from . import child

    spec = {"path": probe_path(), "torch": torch.__file__, "library": os.path.abspath(library),
            "parent": os.getpid()}
    try:
        ended = child.run(child.python_running("layout_probe", json.dumps(spec)), env=_child_environment(),
                          cwd=PROBE_CWD, timeout=timeout)
    except child.ChildTimeout:
        raise ProbeTimedOut(f"the layout probe did not finish within {timeout:.0f} s") from None
    except child.ChildNotStarted as e:
        raise ProbeNotRun(f"the layout probe could not start {sys.executable!r} ({e.strerror or e})") from None
    if ended.signal is not None:
        return _crash_or_not_run(ended.signal)
    lines = ended.output.strip().splitlines()
    answers = [line[len(ANSWER):] for line in lines if line.startswith(ANSWER)]
    said = ([line for line in lines if not line.startswith(ANSWER)] or [""])[-1]
    try:
        answer = json.loads(answers[-1]) if answers else None
    except ValueError:
        answer = None
    if not isinstance(answer, dict) or ended.status != 0:
        raise ProbeNotRun(f"the layout probe exited with status {ended.status}: {said or 'no output'}")
    if "error" in answer:
        raise ProbeNotRun(answer["error"])
    found, facts = answer.get("found"), answer.get("facts")
    if not isinstance(found, dict) or not isinstance(facts, dict):
        raise ProbeNotRun(f"the layout probe answered {answers[-1]!r}")
    return {str(part): str(text) for part, text in found.items()}, facts


# --- verdicts kept beside the build -----------------------------------------


def verify(library):
    """Run the probe for ``library`` and return the verdict record to keep."""
    start = time.monotonic()
    found, facts = probe(library)
    return {
        "format": FORMAT,
        "found": found,
        "facts": facts,
        "library": os.path.abspath(library),
        "torch": torch_identity(),
        "verified_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": round(time.monotonic() - start, 2),
    }


def write(path, record):
    """Write a verdict atomically (a reader never sees half of one)."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=".layout-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise


def read(path):
    """The verdict at ``path`` ({"found": ..., "facts": ..., ...}), or None
    if there is none (or it is unreadable, of another format: then it is as
    if there were none, and the probe runs again)."""
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        return None
    found, facts = record.get("found"), record.get("facts")
    if not isinstance(found, dict) or not all(isinstance(v, str) for v in found.values()) or not isinstance(facts, dict):
        return None
    if "pynode_vtable_offset" in facts and not is_offset(facts["pynode_vtable_offset"]):
        return None
    return record


def is_offset(value):
    """Whether ``value`` can be an offset into a loaded library (a positive
    int, pointer-aligned, below 2**40: not a bool, a float, 2**64). That it
    is PyNode's vtable is checked in the process, before it is read through
    (the extension's ``is_pynode_vtable_offset``)."""
    return type(value) is int and 0 < value < 1 << 40 and value % 8 == 0


def verdicts(found):
    """{member: reason} for the members that depend on a structure in
    ``found`` (empty when everything read back as expected)."""
    import torch

    result = {}
    for member, parts in NEEDS.items():
        bad = [found[p] for p in parts if p in found]
        if bad:
            result[member] = (
                f"torch {torch.__version__} does not lay out its autograd "
                f"structures as the headers torch_ctxext was built with ({bad[0]}); "
                "rebuild torch_ctxext against this torch, from the same source tree"
            )
    return result
