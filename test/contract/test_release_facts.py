"""The release facts live in one place, torch_ctxext/_releases.py.

What reads them must agree with it: the C++ extension's boundary macros
(csrc/engine_layout.h, exported as ``_C.boundaries``), the members the running
torch provides natively, setup.py's requirement and tools/run.py's release
lists. The header's table of boundaries must name every boundary and exactly
the files that branch on it, and adding a release in which everything is
native must be a one-line change.
"""
import glob
import os
import re

import pytest
import torch

import torch_ctxext
from torch_ctxext import _features, _releases
from torch_ctxext._ext import loader as _extension
from support import ROOT, python

CSRC = os.path.join(ROOT, "csrc")
HEADER = os.path.join(CSRC, "engine_layout.h")
NAMES = [b.name for b in _releases.BOUNDARIES]


def _header_table():
    """{boundary: (last old release, {file, ...})} from engine_layout.h's comment."""
    table, current, in_files = {}, None, False
    for line in open(HEADER):
        row = re.match(r"// ([A-Z_]+) \((\d+)\.(\d+)\)$", line.rstrip())
        if row:
            current = row.group(1)
            table[current] = ((int(row.group(2)), int(row.group(3))), set())
            continue
        files = re.match(r"//   (files: )?(.*)", line)
        if current and files and (files.group(1) or in_files):
            in_files = bool(files.group(1)) or in_files
            listed = files.group(2).split(" (")[0].split(":")[0]
            table[current][1].update(re.findall(r"\b([a-z_]+\.(?:h|cpp))\b", listed))
            in_files = listed.rstrip().endswith(",")
        else:
            in_files = False
    return table


def _files_branching_on():
    """{macro name: {file whose #if/#elif uses it}} over csrc/."""
    found = {}
    for path in glob.glob(os.path.join(CSRC, "*.cpp")) + glob.glob(os.path.join(CSRC, "*.h")):
        for line in open(path):
            if re.match(r"\s*#\s*(if|elif)\b", line) and "defined(" not in line:
                for name in re.findall(r"TORCH_CTXEXT_([A-Z_]+)", line):
                    found.setdefault(name, set()).add(os.path.basename(path))
    return found


def test_the_release_is_read_from_any_torch_version_string():
    assert _releases.release("2.13.0+cpu") == (2, 13)
    assert _releases.release("2.10.0a0+git449b176") == (2, 10)
    assert _releases.release("2.9.1") == (2, 9)
    with pytest.raises(ValueError, match="not a torch version: 'nightly'"):
        _releases.release("nightly")


def test_the_supported_range_runs_from_the_first_to_the_last_tested_release():
    assert _releases.SUPPORTED_RANGE == (_releases.release(_releases.RELEASES[0]), _releases.release(_releases.RELEASES[-1]))
    assert _releases.supported(torch.__version__)
    assert not _releases.supported("2.5.1")
    assert set(_releases.CI_RELEASES) <= set(_releases.RELEASES)
    assert {_releases.REFERENCE, _releases.DEFAULT} <= set(_releases.RELEASES)
    assert list(_releases.RELEASES) == sorted(_releases.RELEASES, key=_releases.release)


def test_adding_a_release_in_which_everything_is_native_is_one_line():
    with open(_releases.__file__) as f:
        text = f.read()
    edited = text.replace('    "2.15.0",\n)', '    "2.15.0",\n    "2.16.0",\n)', 1)
    assert edited != text, "RELEASES no longer ends with 2.15.0: update this test's edit"
    namespace = {"__name__": "edited_releases"}
    exec(compile(edited, "edited _releases.py", "exec"), namespace)
    assert namespace["requirement"]() == ">=2.6"  # no upper bound, before or after
    assert namespace["supported"]("2.16.0+cu130") and not namespace["newer"]("2.16.0+cu130")
    assert namespace["newer"]("2.17.0a0+git1234abc")
    assert not any(namespace["boundaries"]("2.16.0").values())  # new side of every boundary
    assert all(namespace["native"](m, "2.16.0") for m in namespace["NATIVE_FROM"])


def test_the_header_names_every_boundary_with_its_release_and_the_files_that_branch_on_it():
    table = _header_table()
    assert sorted(table) == sorted(NAMES)
    branching = _files_branching_on()
    for boundary in _releases.BOUNDARIES:
        release, files = table[boundary.name]
        assert release == boundary.last_old, boundary.name
        assert files == branching.get(boundary.name, set()), boundary.name


def test_csrc_branches_on_no_release_but_through_a_boundary():
    known = set(NAMES) | {"BUILT_FOR_TORCH"}
    assert set(_files_branching_on()) <= known
    for path in glob.glob(os.path.join(CSRC, "*")):
        assert "TORCH_VERSION_M" not in open(path).read(), path


def test_the_header_lists_the_boundaries_it_exports_in_the_order_of_the_release_facts():
    text = open(HEADER).read()
    listed = re.search(r"#define TORCH_CTXEXT_BOUNDARIES\(X\)(.*?)\n\n", text, re.S).group(1)
    assert re.findall(r"X\(([A-Z_]+)\)", listed) == NAMES


def test_setup_py_and_the_driver_read_the_releases_from_the_release_facts():
    setup = open(os.path.join(ROOT, "setup.py")).read()
    assert "_releases.requirement()" in setup and "2.16" not in setup
    for fact, expected in (
        ("releases", " ".join(_releases.RELEASES)),
        ("ci-releases", " ".join(_releases.CI_RELEASES)),
        ("reference", _releases.REFERENCE),
        ("requirement", _releases.requirement()),
    ):
        result = python(_releases.__file__, fact)
        assert result.returncode == 0 and result.stdout.strip() == expected
    for name in ("run.py", "run_jobs.py", "run_steps.py", "run_venvs.py"):
        driver = open(os.path.join(ROOT, "tools", name)).read()
        assert not re.search(r"[\"']2\.\d+\.\d+[\"']", driver), name


def test_the_members_torch_provides_natively_are_those_the_release_facts_name():
    status = torch_ctxext.features()
    for member in _releases.NATIVE_FROM:
        assert (status[member] == "native") == _releases.native(member, torch.__version__), member
    for member in set(_features.MEMBERS) - set(_releases.NATIVE_FROM):
        along_with = _releases.REPLACED_ALONG_WITH.get(member)
        replaced = along_with is not None and not _releases.native(along_with, torch.__version__)
        assert status[member] == ("torch_ctxext" if replaced else "native"), member


def test_the_extension_exports_the_boundaries_it_was_compiled_with():
    if _features.boundaries() is None:
        assert all(_releases.native(m, torch.__version__) for m in _releases.NATIVE_FROM)
        pytest.skip(f"torch {torch.__version__} provides every member: no extension is loaded")
    assert _features.boundaries() == _releases.boundaries(torch.__version__)


def test_a_build_compiled_with_other_boundaries_is_refused_naming_them():
    expected = _releases.boundaries(torch.__version__)
    flipped = dict(expected, NO_SLOT_STREAMS=not expected["NO_SLOT_STREAMS"])
    with pytest.raises(_extension.BuildMismatchError, match=r"other release boundaries .*differ: NO_SLOT_STREAMS\)"):
        _extension._check_boundaries(flipped, "/x/_C.so")
    _extension._check_boundaries(expected, "/x/_C.so")
