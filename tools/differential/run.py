"""Run the differential scenarios or compare two result files.

    python run.py --out FILE.json [-k SUBSTRING] [--device testdevice]
    python run.py --compare A.json B.json [--allow deviations.txt]

``--device NAME`` runs the accelerator scenarios (scenarios_device.py) on
that device instead of the CPU ones; for ``testdevice`` its module
(torch_ctxext_testdevice) is imported before any scenario runs backward.

With TORCH_CTXEXT_IMPORT=1 in the environment, ``import torch_ctxext`` is done
before the scenarios run (to exercise the backport on older torch).
"""

import argparse
import json
import os
import sys
import traceback


def _jsonable(obj):
    """Make sure the observations are JSON-serialisable (fallback: repr)."""
    return json.loads(json.dumps(obj, default=repr, sort_keys=True))


DEVICE_MODULES = {"testdevice": "torch_ctxext_testdevice"}


def run(out, k=None, device=None):
    if device:  # the backend before the first backward (torch_ctxext's import runs one)
        import importlib

        importlib.import_module(DEVICE_MODULES.get(device.split(":")[0], "torch"))
    if os.environ.get("TORCH_CTXEXT_IMPORT") == "1":
        import torch_ctxext  # noqa: F401

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch

    if device:
        import scenarios_device
        import scenarios_device_slots  # noqa: F401 - adds its scenarios to the table

        scenarios_device.DEVICE = torch.device(device if ":" in device else f"{device}:0")
        table = scenarios_device.DEVICE_SCENARIOS
    else:
        import scenarios

        table = scenarios.load()
    results = {}
    for name, fn in table:
        if k and k not in name:
            continue
        try:
            obs = fn()
        except Exception as e:  # noqa: BLE001
            obs = {
                "__scenario_error__": {"exc_type": type(e).__name__, "msg": str(e)},
                "__traceback_tail__": traceback.format_exc().splitlines()[-3:],
            }
        finally:
            torch.autograd.set_detect_anomaly(False)
            torch.set_grad_enabled(True)
        try:
            results[name] = _jsonable(obs)
        except Exception as e:  # noqa: BLE001
            results[name] = {"__unserialisable__": repr(e)}
    meta = {"torch": torch.__version__, "ctxext": os.environ.get("TORCH_CTXEXT_IMPORT") == "1"}
    with open(out, "w") as f:
        json.dump({"__meta__": meta, **results}, f, indent=1, sort_keys=True)
    errs = [n for n, v in results.items() if isinstance(v, dict) and "__scenario_error__" in v]
    print(f"{len(results)} scenarios -> {out} (torch {torch.__version__});"
          f" {len(errs)} raised outside their own handling: {errs}")
    return 0


# The release facts (the build layer): native 2.15 runs the scenarios
# without importing torch_ctxext.
sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from _torch_ctxext_build.releases import release  # noqa: E402


def load_allowed(path, torch_version=None):
    """Scenario names allowed to differ, one per line: ``NAME  # why``, or
    ``NAME  torch<=2.12  # why`` for a difference only up to that release of
    the compared run (a native deviation of older releases). Entries for
    other releases are left out when ``torch_version`` is given."""
    allowed = {}
    if path:
        with open(path) as f:
            for line in f:
                fields, _, why = line.partition("#")
                fields = fields.split()
                if not fields:
                    continue
                name, until = fields[0], None
                for qualifier in fields[1:]:
                    if not qualifier.startswith("torch<="):
                        raise SystemExit(f"{path}: cannot read {qualifier!r} (expected torch<=X.Y)")
                    until = release(qualifier[len("torch<="):])
                if until is None or torch_version is None or release(torch_version) <= until:
                    allowed[name] = why.strip()
    return allowed


def compare(a_path, b_path, allowed=None):
    allowed = allowed or {}
    with open(a_path) as f:
        a = json.load(f)
    with open(b_path) as f:
        b = json.load(f)
    a.pop("__meta__", None)
    b.pop("__meta__", None)
    diff = []
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            diff.append(name)
            where = a_path if name not in a else b_path
            print(f"--- {name}: missing in {where}")
            continue
        if a[name] != b[name]:
            if name in allowed:
                print(f"--- {name}: differs as documented ({allowed[name]})")
                continue
            diff.append(name)
            print(f"--- {name}")
            print(f"  A: {json.dumps(a[name], sort_keys=True)}")
            print(f"  B: {json.dumps(b[name], sort_keys=True)}")
    counts = [(n, _exposed(a[n]), _exposed(b[n])) for n in sorted(set(a) & set(b))]
    counted = [c for c in counts if c[1] is not None]
    if counted:
        same = sum(c[1] == c[2] for c in counted)
        print(f"non-None buffers as in A in {same} of {len(counted)} scenarios that read buffers")
        for name, in_a, in_b in counted:
            if in_a != in_b:
                print(f"    {name}: {in_a} in A, {in_b} in B")
    stale = sorted(n for n in allowed if n in a and n in b and a[n] == b[n])
    for name in stale:
        print(f"--- {name}: listed as a deviation but no longer differs")
    diff += stale
    print(f"{len(diff)} unexpected difference(s) among {len(set(a) | set(b))} scenarios")
    return 1 if diff else 0


def _exposed(observation):
    """The number of non-None buffers a scenario saw (None: it read none)."""
    found = []

    def walk(value):
        if isinstance(value, dict):
            if "exposed" in value and isinstance(value["exposed"], (int, bool)):
                found.append(int(value["exposed"]))
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(observation)
    return sum(found) if found else None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("-k", default=None)
    p.add_argument("--device", default=None, help="run the accelerator scenarios on this device")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"))
    p.add_argument("--allow", help="file of scenario names allowed to differ")
    args = p.parse_args()
    if args.compare:
        with open(args.compare[1]) as f:  # the run whose release the entries are about
            torch_version = json.load(f).get("__meta__", {}).get("torch")
        return compare(*args.compare, allowed=load_allowed(args.allow, torch_version))
    if not args.out:
        p.error("--out or --compare is required")
    return run(args.out, args.k, args.device)


if __name__ == "__main__":
    status = main()
    # os._exit once everything is written: torch 2.12 to 2.15 abort now and
    # then at interpreter shutdown ("terminate called without an active
    # exception") after a backward ran on an engine device thread, with or
    # without torch_ctxext (seen once in about 40 runs of the device
    # scenarios on native 2.15); the scenarios are done by then.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status or 0)
