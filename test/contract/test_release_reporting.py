"""What the reports say per torch release: the check's verdict counts
upstream deviations, a deviation of older releases applies up to its release
only, the differential allows a native difference only on the releases it
names, and the compatibility matrix shows each release's column."""
import json
import os
import sys

import pytest

from torch_ctxext import _releases
from torch_ctxext.conformance import report as _report
from torch_ctxext.conformance import conftest
from support import ROOT

sys.path.insert(0, os.path.join(ROOT, "tools", "differential"))

import compat_matrix  # noqa: E402
import run as differential  # noqa: E402


@pytest.mark.parametrize(
    "conforms,deviations,verdict",
    [
        (True, 0, "conforms"),
        (True, 1, "conforms, 1 upstream deviation"),
        (True, 10, "conforms, 10 upstream deviations"),
        (False, 3, "does not conform"),
    ],
)
def test_the_verdict_names_the_upstream_deviations_it_conforms_with(conforms, deviations, verdict):
    assert _report.verdict(conforms, deviations) == verdict


class Marker:
    def __init__(self, member, number, **kwargs):
        self.args, self.kwargs = (member, number), kwargs


@pytest.mark.parametrize(
    "provider,until,release,expected",
    [
        ("native", None, (2, 15), True),          # a deviation of torch 2.15 itself
        ("torch_ctxext", None, (2, 13), False),   # torch_ctxext keeps the contract there
        ("native", (2, 10), (2, 9), True),        # an older release's deviation, on it
        ("native", (2, 10), (2, 10), True),
        ("native", (2, 10), (2, 11), False),      # fixed upstream since: the test must pass
    ],
)
def test_a_deviation_applies_where_the_member_is_native_up_to_its_release(provider, until, release, expected):
    kwargs = {} if until is None else {"until": until}
    marker = Marker("mark_dirty", "anomaly-hint", **kwargs)
    assert conftest.deviates(marker, {"mark_dirty": provider}, release) is expected


def test_the_differential_allows_a_release_qualified_difference_only_on_those_releases(tmp_path):
    allow = tmp_path / "deviations.txt"
    allow.write_text(
        "# comment\n"
        "q12_declare_int64                  # deviation 1\n"
        "q01_kwargs_oldstyle  torch<=2.12   # native apply-kwargs\n"
    )
    everywhere = differential.load_allowed(str(allow))
    assert set(everywhere) == {"q12_declare_int64", "q01_kwargs_oldstyle"}
    assert set(differential.load_allowed(str(allow), "2.6.0+cu124")) == set(everywhere)
    assert set(differential.load_allowed(str(allow), "2.12.1+cu130")) == set(everywhere)
    assert set(differential.load_allowed(str(allow), "2.13.0+cpu")) == {"q12_declare_int64"}


def report(version, providers, failed=0, deviations=0, verdict="conforms"):
    return {
        "torch": version,
        "verdict": verdict,
        "members": {
            m: {"provider": p, "failed": failed, "upstream_deviations": deviations, "route": "r"}
            for m, p in providers.items()
        },
    }


def test_a_matrix_column_shows_provider_failures_and_deviations():
    cells, verdict = compat_matrix.column(
        report("2.9.1+cu128", {"a": "torch_ctxext", "b": "native", "c": "unavailable: why"},
               deviations=2, verdict="conforms, 4 upstream deviations")
    )
    assert cells == {"a": "**torch_ctxext** (2 dev.)", "b": "native (2 dev.)", "c": "unavailable (2 dev.)"}
    assert verdict == "conforms, 4 upstream deviations"


def test_the_matrix_check_compares_each_run_with_the_kept_report_of_its_release(tmp_path, monkeypatch):
    kept = tmp_path / "compat"
    kept.mkdir()
    monkeypatch.setattr(compat_matrix, "KEPT", str(kept))
    monkeypatch.setattr(compat_matrix, "PAGE", str(tmp_path / "compatibility.md"))
    readme = tmp_path / "README.md"
    readme.write_text(f"x\n{compat_matrix.BEGIN}\nold\n{compat_matrix.END}\ny\n")
    monkeypatch.setattr(compat_matrix, "README", str(readme))
    old = report("2.6.0+cu124", {"a": "torch_ctxext"})
    new = report("2.15.0+cu132", {"a": "native"}, deviations=1, verdict="conforms, 1 upstream deviation")
    paths = []
    for r in (old, new):
        paths.append(tmp_path / f"{r['torch']}.json")
        paths[-1].write_text(json.dumps(r))
    assert compat_matrix.main(["--store"] + [str(p) for p in paths]) == 0
    assert "| `a` | **torch_ctxext** | native (1 dev.) |" in readme.read_text()
    assert compat_matrix.main(["--check", str(paths[1])]) == 0  # a subset of the releases
    changed = tmp_path / "changed.json"
    changed.write_text(json.dumps(report("2.15.0+cu132", {"a": "native"}, failed=1, verdict="does not conform")))
    assert compat_matrix.main(["--check", str(changed)]) == 1
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps(report("2.5.1", {"a": "native"})))
    assert compat_matrix.main(["--check", str(unknown)]) == 1


def test_the_kept_reports_cover_every_supported_release():
    """`python3 tools/run.py matrix` runs the releases of torch_ctxext/_releases.py;
    the matrix in the docs holds a report for each."""
    out = list(_releases.RELEASES)
    assert sorted(compat_matrix.kept_reports()) == sorted(out)
