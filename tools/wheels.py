"""Build torch_ctxext's binary wheels: one per CPython, a binary for every torch.

    python3 tools/wheels.py [--python 3.10,3.13] [--torch 2.6.0,2.13.0] [--out DIR] [--verify]

(``python3 tools/run.py wheels`` runs it.) For every CPython asked for (default
3.10 to 3.13) and every supported torch release (default: all of them; where
torch provides every member natively the binary is advise()'s C++ watch
alone, which only advise() loads: torch_ctxext/_ext/advise_module.py), it:

1. fetches torch's wheels for that release and CPython without their
   dependencies (``pip download --no-deps``): PyPI's, and any other build
   this machine's own pip configuration gives (a local CPU build); nothing
   is installed or imported;
2. unpacks what a compile needs (``include/``, the four libraries the
   extension links, ``version.py``) once per torch build, and reads its
   facts from the files (``_torch_ctxext_build/compile.py``: version, git hash, C++ ABI,
   pybind11's ABI strings);
3. compiles the extension against it with ninja (the flags a build at first
   import uses, ``compile.cflags``); a second run with unchanged sources
   compiles nothing (ninja's own bookkeeping);
4. writes one wheel per CPython: the package, each binary under
   ``torch_ctxext/_binaries/<build>/_C.so`` and their manifest
   (``_binaries/manifest.json``: torch version, git hash, C++ ABI, CPython,
   digest), requiring ``torch>=2.6`` (no upper bound: on a newer torch the import is a no-op) and no build tool, tagged with
   the platform ``auditwheel show`` says its binaries need.

``--verify`` then, for each wheel and each torch build it carries a binary
for, makes a fresh venv with that torch, adds the binary's layout verdict
against it to the wheel (tools/wheel_verdicts.py: the wheel is rewritten in
place, so that the first import on every torch verified here reads the
verdict and starts no process), installs the wheel where no compiler can be
found, imports it, checks that nothing was built and nothing started, and
runs ``python -m torch_ctxext check`` (tools/wheel_check.py; a release step:
every release x CPython, hours and ~5 GB of disk per venv at a time).

Everything downloaded or compiled is kept in ``--cache`` (default
$TORCH_CTXEXT_CACHE/wheels, ~/.cache/torch_ctxext/wheels: ``_torch_ctxext_build.cache.home()``).
"""
import argparse
import base64
import csv
import glob
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile

import find_cpython  # beside this file (run as a script, tools/ is on sys.path)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the checkout's build layer, which this tool compiles with
from _torch_ctxext_build import releases, sources  # noqa: E402
from _torch_ctxext_build.cache import LIBRARY, home as cache_home  # noqa: E402
from _torch_ctxext_build import compile as compile_  # noqa: E402

PYTHONS = ("3.10", "3.11", "3.12", "3.13")
# What a compile needs of a torch wheel.
MEMBERS = ("torch/version.py", "torch/lib/libc10.so", "torch/lib/libtorch.so", "torch/lib/libtorch_cpu.so",
           "torch/lib/libtorch_python.so")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")


MANIFEST = "manifest.json"


def say(text):
    print(f"wheels: {text}", flush=True)


def interpreter(version):
    """The path of CPython ``version`` here (tools/find_cpython.py: pyenv's, else on PATH)."""
    path = find_cpython.find(version)
    if not path:
        sys.exit(f"wheels: no CPython {version} here (put python{version} on PATH, or pyenv install {version})")
    return path


def python_facts(python):
    code = ("import json, sys, sysconfig; print(json.dumps({'include': sysconfig.get_path('include', "
            "scheme='posix_prefix'), 'tag': sys.implementation.cache_tag, 'abi': 'cp%d%d' % sys.version_info[:2]}))")
    return json.loads(subprocess.check_output([python, "-c", code], text=True))


def advise_only(release):
    """Whether the binary for ``release`` is advise()'s watch and the
    drop-ins' C++ Functions alone (a torch that provides every member
    natively)."""
    return releases.all_native(release)


# --- 1. fetching torch ---------------------------------------------------------


def fetched(release, python_version, cache):
    """The torch packages unpacked for ``release`` and CPython
    ``python_version``: from an earlier run's record, else fetched now."""
    record = os.path.join(cache, "fetched", f"torch-{release}-cp{python_version.replace('.', '')}.json")
    try:
        with open(record) as f:
            names = json.load(f)
        dirs = [os.path.join(cache, "torch", n, "torch") for n in names]
        if all(os.path.exists(os.path.join(os.path.dirname(d), ".complete")) for d in dirs):
            return list(zip(names, dirs))
    except (OSError, ValueError):
        pass
    found = []
    for wheel in fetch(release, python_version, os.path.join(cache, "downloads")):
        found.append((os.path.basename(wheel)[: -len(".whl")], unpack(wheel, os.path.join(cache, "torch"))))
        os.remove(wheel)
    os.makedirs(os.path.dirname(record), exist_ok=True)
    with open(record, "w") as f:
        json.dump([name for name, _ in found], f)
    return found


def fetch(release, python_version, directory):
    """The torch wheels pip can get for ``release`` and CPython ``python_version``
    (PyPI's, and a different one from this machine's own configuration)."""
    os.makedirs(directory, exist_ok=True)
    found = []
    for config in ("pypi", "machine"):
        env = dict(os.environ, PIP_NO_CACHE_DIR="1")
        if config == "pypi":
            env.update(PIP_CONFIG_FILE=os.devnull)
            env.pop("PIP_FIND_LINKS", None)
        before = set(os.listdir(directory))
        command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                   "--python-version", python_version, "--implementation", "cp", "-d", directory,
                   f"torch=={release}"] + [a for p in PLATFORMS for a in ("--platform", p)]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            if config == "pypi":
                say(f"torch {release} for CPython {python_version}: none ({done.stderr.strip().splitlines()[-1:]})")
            continue
        names = sorted(set(os.listdir(directory)) - before) or _matching(directory, release, python_version)
        found += [os.path.join(directory, n) for n in names if n.endswith(".whl")]
    return sorted(set(found))


def _matching(directory, release, python_version):
    cp = "cp" + python_version.replace(".", "")
    return [n for n in os.listdir(directory) if re.match(rf"torch-{re.escape(release)}(\+[^-]+)?(-\d+)?-{cp}-", n)]


# --- 2. unpacking ----------------------------------------------------------------


def unpack(wheel, directory):
    """The torch package directory of ``wheel``, with what a compile needs."""
    target = os.path.join(directory, os.path.basename(wheel)[: -len(".whl")])
    done = os.path.join(target, ".complete")
    if not os.path.exists(done):
        shutil.rmtree(target, ignore_errors=True)
        with zipfile.ZipFile(wheel) as z:
            names = [n for n in z.namelist() if n.startswith("torch/include/") or n in MEMBERS]
            z.extractall(target, names)
        for member in MEMBERS[1:]:  # the same library in the wheels of each CPython: stored once
            _share(os.path.join(target, member), os.path.join(directory, ".shared"))
        open(done, "w").close()
    return os.path.join(target, "torch")


def _share(path, store):
    """Replace ``path`` by a hard link to the identical file in ``store``."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    os.makedirs(store, exist_ok=True)
    kept = os.path.join(store, digest.hexdigest())
    if not os.path.exists(kept):
        os.link(path, kept)
    else:
        os.remove(path)
        os.link(kept, path)


# --- 3. compiling ----------------------------------------------------------------


def build_name(target, tag):
    abi = "cxx11" if target.cxx11_abi else "cxx03"
    return f"torch-{target.torch_version}-git{target.git_version[:12]}-{tag}-{abi}"


def compile_one(target, tag, directory):
    """Compile against ``target`` in ``directory`` (ninja: nothing if
    nothing changed); return (library path, whether anything was compiled)."""
    os.makedirs(directory, exist_ok=True)
    compile_.write_ninja(target, sources.csrc_dir(), directory)
    ninja = shutil.which("ninja") or shutil.which("ninja", path=os.path.dirname(sys.executable))
    if ninja is None:
        sys.exit("wheels: ninja is needed (pip install ninja)")
    done = subprocess.run([ninja] + compile_.ninja_arguments(), cwd=directory, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"wheels: the build against torch {target.torch_version} ({tag}) failed:\n{done.stdout[-4000:]}")
    return os.path.join(directory, LIBRARY), "no work to do" not in done.stdout


# --- 4. the wheels ---------------------------------------------------------------


def pure_wheel(workdir):
    """The package as a pure wheel (sources only), built once."""
    out = os.path.join(workdir, "pure")
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ, TORCH_CTXEXT_BUILD_EXT="0")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", out, ROOT], env=env, check=True)
    (wheel,) = glob.glob(os.path.join(out, "*.whl"))
    return wheel


def _digest(data):
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def assemble(pure, python, binaries, out, platform):
    """One wheel for ``python`` (its facts) holding ``binaries`` [(name, path, entry)]."""
    files = {}
    with zipfile.ZipFile(pure) as z:
        for name in z.namelist():
            files[name] = z.read(name)
    info = next(n for n in files if n.endswith(".dist-info/WHEEL"))
    dist_info = info.rsplit("/", 1)[0]
    version = dist_info[: -len(".dist-info")].split("-")[1]
    tag = f"{python['abi']}-{python['abi']}-{platform}"
    files[info] = ("Wheel-Version: 1.0\nGenerator: torch_ctxext tools/wheels.py\nRoot-Is-Purelib: false\n"
                   f"Tag: {tag}\n").encode()
    metadata = files[f"{dist_info}/METADATA"].decode()
    # The binary wheel needs no build tool: ninja is for builds at import.
    metadata = "".join(line for line in metadata.splitlines(True) if not line.startswith("Requires-Dist: ninja"))
    files[f"{dist_info}/METADATA"] = metadata.encode()
    manifest = {"format": 1, "python": python["tag"], "builds": []}
    for name, path, entry in binaries:
        with open(path, "rb") as f:
            data = f.read()
        files[f"torch_ctxext/_binaries/{name}/{LIBRARY}"] = data
        manifest["builds"].append(dict(entry, path=f"{name}/{LIBRARY}", sha256=hashlib.sha256(data).hexdigest(),
                                       size=len(data)))
    files[f"torch_ctxext/_binaries/{MANIFEST}"] = (json.dumps(manifest, indent=1) + "\n").encode()
    record = f"{dist_info}/RECORD"
    rows = io.StringIO()
    writer = csv.writer(rows, lineterminator="\n")
    for name, data in sorted(files.items()):
        if name != record:
            writer.writerow([name, _digest(data), len(data)])
    writer.writerow([record, "", ""])
    files[record] = rows.getvalue().encode()
    path = os.path.join(out, f"torch_ctxext-{version}-{tag}.whl")
    with zipfile.ZipFile(path + ".tmp", "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(zipfile.ZipInfo(name, date_time=(2026, 1, 1, 0, 0, 0)), data, zipfile.ZIP_DEFLATED)
    os.replace(path + ".tmp", path)
    return path


def auditwheel_platform(wheel, workdir):
    """The platform tag ``auditwheel show`` gives the wheel's binaries (torch's
    own libraries, which the binaries link, are the user's torch: not counted)."""
    venv = os.path.join(workdir, "auditwheel")
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        subprocess.run([python, "-m", "pip", "install", "-q", "auditwheel==6.4.2"], check=True,
                       env=dict(os.environ, PIP_CONFIG_FILE=os.devnull))
    shown = subprocess.run([python, "-m", "auditwheel", "show", wheel], capture_output=True, text=True)
    text = " ".join((shown.stdout + shown.stderr).split())
    # The binaries link torch's libraries, which the wheel does not carry
    # (they are the user's torch): auditwheel then says "linux_x86_64", and
    # names the tag the versioned symbols of the system's libraries allow.
    match = re.search(r'constrains the platform tag to "?([a-z0-9_]+)"?', text) or \
        re.search(r'consistent with the following platform tag: "?([a-z0-9_]+)"?', text)
    if not match:
        sys.exit(f"wheels: auditwheel show gave no platform tag for {wheel}:\n{shown.stdout}{shown.stderr}")
    return match.group(1), text


# --- --verify --------------------------------------------------------------------


def requirement_of(built_from):
    """``torch==X`` for the torch wheel a binary was built against (its
    distribution version: a local label like +cpu kept, PyPI's without)."""
    match = re.match(r"torch-([^-]+)-", built_from)
    return f"torch=={match.group(1)}"


def verify(wheel, python_version, cache):
    """Install ``wheel`` beside each torch its manifest names, in a fresh
    venv each, once that torch's layout verdict is added to it
    (tools/wheel_verdicts.py: ``wheel`` is rewritten, and in the end carries
    one verdict a torch build verified), and check it there without a
    compiler (tools/wheel_check.py); return one result a torch build."""
    with zipfile.ZipFile(wheel) as z:
        manifest = json.loads(z.read(f"torch_ctxext/_binaries/{MANIFEST}"))
    results = []
    for entry in manifest["builds"]:
        venv = os.path.join(cache, "verify", f"venv-{python_version}")
        shutil.rmtree(venv, ignore_errors=True)
        t0 = time.monotonic()
        subprocess.run([interpreter(python_version), "-m", "venv", venv], check=True)
        python = os.path.join(venv, "bin", "python")
        requirement = requirement_of(entry["built_from"])
        env = dict(os.environ, PIP_NO_CACHE_DIR="1")
        if "+" not in requirement:  # PyPI's build (this machine's configuration may cap or replace it)
            env.update(PIP_CONFIG_FILE=os.devnull)
            env.pop("PIP_FIND_LINKS", None)
        subprocess.run([python, "-m", "pip", "install", "-q", requirement, "numpy", "pytest", "hypothesis", "expecttest"],
                       check=True, env=env)
        # The verdict for this torch goes into the wheel before it is installed
        # (tools/wheel_verdicts.py): the wheel released carries one for every
        # torch verified here, and the first import on each starts no process.
        done = subprocess.run([python, os.path.join(ROOT, "tools", "wheel_verdicts.py"), wheel],
                              capture_output=True, text=True)
        if done.returncode == 0:
            subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", wheel], check=True, env=env)
            done = subprocess.run([python, os.path.join(ROOT, "tools", "wheel_check.py"), "--rounds", "5"],
                                  capture_output=True, text=True)
        line = (done.stdout.strip().splitlines() or ["no output"])[-1]
        results.append({"python": python_version, "torch": entry["torch"], "ok": done.returncode == 0,
                        "result": json.loads(line) if done.returncode == 0 else line + done.stderr[-2000:],
                        "seconds": round(time.monotonic() - t0)})
        say(f"verified {os.path.basename(wheel)} with torch {entry['torch']}: "
            f"{'conforms, nothing built' if done.returncode == 0 else 'FAILED: ' + line} ({results[-1]['seconds']} s)")
        shutil.rmtree(venv, ignore_errors=True)
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=",".join(PYTHONS), help="CPython versions (default %(default)s)")
    parser.add_argument("--torch", default=",".join(releases.RELEASES),
                        help="torch releases (default: every supported one)")
    parser.add_argument("--out", default=os.path.join(ROOT, "dist"))
    parser.add_argument("--verify", action="store_true",
                        help="then install each wheel beside each torch in a fresh venv and check it there")
    parser.add_argument("--cache", default=os.path.join(cache_home(), "wheels"))
    args = parser.parse_args(argv)
    pythons = [p.strip() for p in args.python.split(",") if p.strip()]
    wanted = [r.strip() for r in args.torch.split(",") if r.strip()]
    for release in wanted:
        if not releases.supported(release):
            sys.exit(f"wheels: torch {release} is not supported (torch{releases.requirement()})")
        if advise_only(release):
            say(f"torch {release} provides every member natively: its binary is advise()'s C++ watch and the "
                "drop-ins' C++ Functions alone")
    os.makedirs(args.out, exist_ok=True)
    start, compiled, summary = time.monotonic(), 0, []
    pure = pure_wheel(args.cache)
    for version in pythons:
        python = python_facts(interpreter(version))
        binaries = []
        for release in wanted:
            for wheel, torch_dir in fetched(release, version, args.cache):
                target = compile_.target_of_unpacked_torch(torch_dir, python["include"])
                name = build_name(target, python["abi"])
                t0 = time.monotonic()
                library, did = compile_one(target, python["abi"], os.path.join(args.cache, "builds", name))
                compiled += did
                say(f"{name}: {'compiled in %.0f s' % (time.monotonic() - t0) if did else 'up to date'}")
                binaries.append((name, library, {
                    "torch": target.torch_version, "git": target.git_version, "cxx11_abi": target.cxx11_abi,
                    "python": python["tag"], "built_from": wheel + ".whl",
                }))
        if not binaries:
            say(f"CPython {version}: no torch build to compile against; no wheel")
            continue
        wheel = assemble(pure, python, binaries, args.out, "linux_x86_64")
        platform, _ = auditwheel_platform(wheel, args.cache)
        final = assemble(pure, python, binaries, args.out, platform)
        if final != wheel:
            os.remove(wheel)
        summary.append((final, len(binaries), os.path.getsize(final), version))
    for path, count, size, _ in summary:
        say(f"{os.path.basename(path)}: {count} binaries, {size / 1e6:.2f} MB")
    seconds = time.monotonic() - start
    say(f"{len(summary)} wheels in {seconds:.0f} s ({compiled} builds compiled)")
    # What the benchmarks page says of the wheels (benchmarks/run_all.py --remeasure wheels).
    with open(os.path.join(args.out, "wheels.json"), "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "seconds": round(seconds),
                   "compiled": compiled, "load_average": os.getloadavg()[0],
                   "wheels": [{"wheel": os.path.basename(p), "binaries": n, "bytes": b, "python": v}
                              for p, n, b, v in summary]}, f, indent=1)
    if args.verify:
        verified = [r for path, _, _, version in summary for r in verify(path, version, args.cache)]
        with open(os.path.join(args.out, "verified.json"), "w") as f:
            json.dump(verified, f, indent=1)
        failed = [r for r in verified if not r["ok"]]
        say(f"verified {len(verified) - len(failed)} of {len(verified)} CPython x torch builds "
            f"in {time.monotonic() - start:.0f} s in all")
        return 1 if failed else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
