"""Show that the conformance suite reports each deliberately broken variant.

    python tools/broken_variants/run.py

For each variant in variants.py, runs ``python -m torch_ctxext check --json``
with the breakage applied (a pytest plugin) and checks that the report fails
the member the variant breaks. Exits 1 if any variant goes unreported.
"""
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from variants import VARIANTS  # noqa: E402

PLUGIN = '''
import torch_ctxext
from variants import VARIANTS

def pytest_configure(config):
    VARIANTS[{name!r}][1]()
'''


def _report(name, tmp):
    """The conformance report with variant ``name`` applied (a pytest plugin)."""
    plugin = f"broken_{name}"
    with open(os.path.join(tmp, plugin + ".py"), "w") as f:
        f.write(PLUGIN.format(name=name))
    report_path = os.path.join(tmp, name + ".json")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [tmp, HERE] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    subprocess.run(
        [sys.executable, "-m", "torch_ctxext", "check", "--json", report_path,
         "--", "-p", plugin],
        env=env, capture_output=True, text=True, cwd=tmp,
    )
    with open(report_path) as f:
        return json.load(f)


def main():
    unreported = []
    print(f"{'variant':<42}{'member':<26}{'failed tests':>13}  verdict")
    with tempfile.TemporaryDirectory() as tmp:
        # Two variants at a time: each is a process of its own, and the
        # machines this runs on have two cores or more.
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            reports = {name: pool.submit(_report, name, tmp) for name in VARIANTS}
            for name, (member, _) in VARIANTS.items():
                report = reports[name].result()
                failed = report["members"][member]["failed"]
                reported = not report["conforms"] and failed > 0
                print(f"{name:<42}{member:<26}{failed:>13}  {report['verdict']}", flush=True)
                if not reported:
                    unreported.append(name)
    if unreported:
        print("NOT REPORTED: " + ", ".join(unreported))
        return 1
    print(f"all {len(VARIANTS)} broken variants reported")
    return 0


if __name__ == "__main__":
    sys.exit(main())
