"""Add to a binary wheel the layout verdict of its binary for this environment's torch.

    python tools/wheel_verdicts.py WHEEL [WHEEL ...]

Run it with the interpreter of an environment that has the torch (and the
CPython) the verdict is for: ``tools/run.py``'s ``Job.wheel_check`` and
``tools/wheels.py --verify`` run it in each venv they check a wheel in,
after torch is installed and before the wheel is. For each WHEEL it:

1. picks the binary the loader would load for that torch, the exact build
   (``torch_ctxext/_binaries/manifest.json``: torch version, git hash, C++
   ABI and CPython equal to the running ones, as ``loader.choose_packaged``
   matches them), its digest checked against the manifest;
2. extracts the wheel's package and build layer to a temporary directory and
   runs the wheel's own ``_torch_ctxext_build.layout_verdict`` there (``verify``:
   the layout probe, in a child process, against this torch): the verdict is made by the
   code that will read it, whichever checkout runs this tool;
3. refuses a verdict that is not clean (a structure that does not read back
   as the headers say, a probe that crashed or could not run): the wheel is
   left as it was and the exit status is 1;
4. rewrites WHEEL, under the same name, with the verdict beside the binary,
   ``torch_ctxext/_binaries/<build>/layout-<key>.json``, and its row in the
   wheel's RECORD (sha256 and size, as tools/wheels.py ``assemble`` writes
   them). A verdict of the same name already there is replaced: running it
   twice changes nothing but the verdict's date.

The key is the one the installed binary computes at import
(``layout_verdict.key``): the binary's GNU build id (its contents: the same
extracted or installed) and those of torch's libraries, read from the same
torch files the import will use. So the first import of the installed wheel
on this torch reads that verdict beside its binary and starts no process; on
any other build of torch the key differs and the import runs the probe as it
did before. Where a torch library has no build id, its identity is its
path and mtime: the verdict then fits this installation of torch only (said).

Where torch provides every member natively the import loads no binary and
reads no verdict: nothing is added (exit 0). One line per wheel; exit 1 on
the first wheel that gets no verdict.
"""
import argparse
import base64
import csv
import hashlib
import importlib
import io
import json
import os
import shutil
import sys
import tempfile
import time
import zipfile

PACKAGE = "torch_ctxext"
BUILD_LAYER = "_torch_ctxext_build"
BINARIES = f"{PACKAGE}/_binaries"
MANIFEST = f"{BINARIES}/manifest.json"


class NoVerdict(Exception):
    """The wheel gets no verdict for this torch (the reason is the message)."""


def say(text):
    print(f"wheel_verdicts: {text}", flush=True)


def _build_layer(directory, name):
    """The module ``name`` of the wheel's own build layer, unpacked in
    ``directory`` (imported from there: the key and the probe are the ones
    the installed wheel uses)."""
    if directory not in sys.path:
        sys.path.insert(0, directory)
    module = importlib.import_module(f"{BUILD_LAYER}.{name}")
    if not module.__file__.startswith(os.path.join(directory, "")):
        raise RuntimeError(f"{module.__name__} was imported from {module.__file__}, not from the wheel")
    return module


def _digest(data):
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def this_torch():
    """What the loader matches a manifest entry against (loader._this_torch)."""
    import torch

    return {"torch": torch.__version__, "git": torch.version.git_version,
            "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI), "python": sys.implementation.cache_tag}


def exact_entry(manifest, here):
    """The manifest entry of the binary made for exactly ``here`` (torch
    version, git hash, C++ ABI, CPython), or None."""
    for entry in manifest.get("builds") or []:
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            continue
        if all(entry.get(k) == here[k] for k in ("torch", "git", "cxx11_abi", "python")):
            return entry
    return None


def _rewrite(wheel, added):
    """Rewrite ``wheel`` in place with ``added`` {name: bytes} (replacing
    members of the same name) and a RECORD that lists every member."""
    with zipfile.ZipFile(wheel) as z:
        members = [(info, z.read(info.filename)) for info in z.infolist()]
    record = next(i.filename for i, _ in members if i.filename.endswith(".dist-info/RECORD"))
    files = {info.filename: (info, data) for info, data in members}
    for name, data in added.items():
        template = files.get(name, (None, None))[0]
        info = zipfile.ZipInfo(name, date_time=template.date_time if template else (2026, 1, 1, 0, 0, 0))
        info.external_attr = template.external_attr if template else 0o644 << 16
        files[name] = (info, data)
    rows = io.StringIO()
    writer = csv.writer(rows, lineterminator="\n")
    for name, (_, data) in sorted(files.items()):
        if name != record:
            writer.writerow([name, _digest(data), len(data)])
    writer.writerow([record, "", ""])
    files[record] = (files[record][0], rows.getvalue().encode())
    temporary = wheel + ".tmp"
    with zipfile.ZipFile(temporary, "w", zipfile.ZIP_DEFLATED) as z:
        for name, (template, data) in files.items():
            info = zipfile.ZipInfo(name, date_time=template.date_time)
            info.external_attr = template.external_attr
            z.writestr(info, data, zipfile.ZIP_DEFLATED)
    os.replace(temporary, wheel)


def add_verdict(wheel):
    """Verify the binary of ``wheel`` for the running torch and add its
    verdict to ``wheel``; return what was done (a sentence). Raises
    NoVerdict where the wheel gets none and needs one (it is then unchanged)."""
    here = this_torch()
    with zipfile.ZipFile(wheel) as z:
        try:
            manifest = json.loads(z.read(MANIFEST))
        except KeyError:
            raise NoVerdict("it carries no packaged binaries (no manifest): not a binary wheel") from None
        entry = exact_entry(manifest, here)
        if entry is None:
            found = ", ".join(f"{e.get('torch')} (git {str(e.get('git'))[:12]}, {e.get('python')})"
                              for e in manifest.get("builds") or [] if isinstance(e, dict))
            raise NoVerdict(f"it carries no binary for torch {here['torch']} (git {here['git'][:12]}, "
                            f"{here['python']}); it carries: {found or 'none'}")
        binary = f"{BINARIES}/{entry['path']}"
        directory = tempfile.mkdtemp(prefix="torch_ctxext-wheel-verdict-")
        try:
            # The package and its build layer, less the other builds' binaries (not needed, and large).
            z.extractall(directory, [n for n in z.namelist() if n.startswith((PACKAGE + "/", BUILD_LAYER + "/"))
                                     and (not n.startswith(BINARIES + "/") or n == binary)])
            return _verify_and_add(wheel, directory, binary, entry, here)
        finally:
            shutil.rmtree(directory, ignore_errors=True)


def _verify_and_add(wheel, directory, binary, entry, here):
    library = os.path.join(directory, *binary.split("/"))
    with open(library, "rb") as f:
        if hashlib.sha256(f.read()).hexdigest() != entry.get("sha256"):
            raise NoVerdict(f"its binary {binary} is damaged (its digest is not the manifest's)")
    releases = _build_layer(directory, "releases")
    if releases.all_native(here["torch"]):
        return (f"torch {here['torch']} provides every member natively: the import loads no binary and "
                "reads no verdict; nothing added")
    # The wheel's own copy, without the package (as setup.py imports it); its
    # probe's process imports the same copy.
    verdicts = _build_layer(directory, "layout_verdict")
    try:
        record = verdicts.verify(library)
    except verdicts.ProbeNotRun as e:
        raise NoVerdict(f"the layout probe gave no verdict ({e})") from None
    if record["found"]:
        raise NoVerdict(f"its binary does not read this torch's structures as its headers say: {record['found']}")
    # Where it was verified is a temporary directory: name the wheel's member.
    record["library"] = binary
    name = f"{os.path.dirname(binary)}/{verdicts.verdict_name(library)}"
    with tempfile.TemporaryDirectory() as scratch:  # written as the loader's verdicts are
        verdicts.write(os.path.join(scratch, "verdict.json"), record)
        with open(os.path.join(scratch, "verdict.json"), "rb") as f:
            data = f.read()
    _rewrite(wheel, {name: data})
    by_path = [lib for lib, identity in record["torch"]["libraries"].items() if not identity.startswith("build-id:")]
    note = (f"; {', '.join(by_path)} of this torch have no GNU build id: the verdict fits this installation "
            "of torch only" if by_path else "")
    return f"added {name} for torch {here['torch']} (git {here['git'][:12]}), probed in {record['seconds']} s{note}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheels", nargs="+", metavar="WHEEL")
    args = parser.parse_args(argv)
    for wheel in args.wheels:
        start = time.monotonic()
        try:
            done = add_verdict(os.path.abspath(wheel))
        except NoVerdict as e:
            say(f"{os.path.basename(wheel)}: no verdict added: {e}")
            return 1
        say(f"{os.path.basename(wheel)}: {done} ({time.monotonic() - start:.1f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
