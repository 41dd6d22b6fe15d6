"""``python -m torch_ctxext``: exit status 0 done (check: conforms), 1 does
not conform, 2 a usage or environment error, said in a line or two, without
a traceback, and found before the suite runs where it can be."""
import json
import os

import pytest
import torch

import torch_ctxext
from torch_ctxext import _releases
from support import ROOT, python


needs_extension = pytest.mark.skipif(
    all(status == "native" for status in torch_ctxext.features().values()),
    reason="the running torch needs no extension",
)


def cli(*args, **env):
    return python("-m", "torch_ctxext", *args, timeout=600, path=[ROOT], **env)


def without_a_build(tmp_path):
    """No build anywhere (an empty cache; a checkout carries none) and none
    allowed at import: the import of torch_ctxext refuses."""
    return {"TORCH_CTXEXT_JIT": "0", "TORCH_CTXEXT_CACHE": str(tmp_path / "cache")}


def on_an_older_torch(tmp_path):
    """torch says it is 2.5.0, older than any supported release, from the
    start of the interpreter (sitecustomize), as an installed one would."""
    (tmp_path / "sitecustomize.py").write_text("import torch\ntorch.__version__ = '2.5.0'\n")
    return {"PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT, os.environ.get("PYTHONPATH", "")])}


def test_check_refuses_a_json_file_it_cannot_write_before_running_the_suite(tmp_path):
    path = tmp_path / "no-such-directory" / "report.json"
    done = cli("check", "--json", str(path), "-k", "apply_jvp")
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == ""  # nothing ran
    assert done.stderr.splitlines() == [
        f"torch-ctxext check: --json {path}: cannot write the report there: "
        f"its directory {path.parent} does not exist"
    ]


def test_check_says_that_no_test_matched_its_k_expression():
    done = cli("check", "-k", "no_test_is_named_this")
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout.rstrip().endswith("verdict: could not run the suite: no test matched -k no_test_is_named_this")
    assert "Traceback" not in done.stderr


@needs_extension
def test_info_without_a_build_says_why_and_what_to_do_without_a_traceback(tmp_path):
    done = cli("info", **without_a_build(tmp_path))
    assert done.returncode == 2
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
    assert f"torch          {torch.__version__}" in done.stdout
    assert "torch_ctxext   cannot be imported: torch_ctxext's C++ extension has not been built" in done.stdout
    assert "python -m torch_ctxext build" in done.stdout


@needs_extension
def test_check_without_a_build_exits_2_with_the_reason_on_one_line(tmp_path):
    done = cli("check", "-k", "apply_jvp", **without_a_build(tmp_path))
    assert done.returncode == 2
    assert done.stdout == ""
    [line] = done.stderr.splitlines()
    assert line.startswith("torch-ctxext check: torch_ctxext cannot be imported here: ")
    assert "TORCH_CTXEXT_JIT=0 forbids building it" in line


def test_info_and_check_on_an_older_torch_say_which_torch_to_install(tmp_path):
    env = on_an_older_torch(tmp_path)
    info = cli("info", **env)
    assert info.returncode == 2 and "Traceback" not in info.stdout + info.stderr, info.stderr
    assert "torch          2.5.0" in info.stdout
    assert "cannot be imported: torch_ctxext supports torch" in info.stdout
    assert "but torch 2.5.0 is installed" in info.stdout and "pip install" in info.stdout
    check = cli("check", "-k", "apply_jvp", **env)
    assert check.returncode == 2 and "Traceback" not in check.stderr, check.stderr
    [line] = check.stderr.splitlines()
    assert "but torch 2.5.0 is installed" in line
    as_json = cli("info", "--json", **env)
    assert as_json.returncode == 2
    facts = json.loads(as_json.stdout)
    assert facts["importable"] is False and facts["torch"]["version"] == "2.5.0"
    assert "but torch 2.5.0 is installed" in facts["error"]


@needs_extension
def test_info_gives_the_reason_a_build_failed_once(tmp_path):
    """Each member that needs the extension says "see extension above"; the
    import's warning (the same message again) is not printed."""
    done = cli("info", CXX="false", TORCH_CTXEXT_CACHE=str(tmp_path / "cache"))
    assert done.returncode == 0, done.stderr
    out = done.stdout + done.stderr
    assert out.count("could not build its C++ extension") == 1, out
    assert "extension      not loaded: torch_ctxext could not build its C++ extension" in done.stdout
    for member, status in torch_ctxext.features().items():
        # A native member replaced along with another (apply, with apply_boxed
        # before 2.13) stays native where the build failed.
        if status == "torch_ctxext" and member not in _releases.REPLACED_ALONG_WITH:
            assert f"{member:<26}unavailable (see extension above)" in done.stdout.splitlines(), done.stdout


def test_version_names_torch_ctxext_and_torch_and_needs_no_build(tmp_path):
    expected = [f"torch_ctxext {torch_ctxext.__version__} (torch {torch.__version__})"]
    done = cli("--version", **without_a_build(tmp_path))
    assert done.returncode == 0 and done.stdout.splitlines() == expected, done.stdout + done.stderr
    older = cli("--version", **on_an_older_torch(tmp_path))
    assert older.stdout.splitlines() == [f"torch_ctxext {torch_ctxext.__version__} (torch 2.5.0)"], older.stderr


def test_no_command_prints_the_help_and_exits_2_like_a_usage_error():
    done = cli()
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.startswith("usage: torch-ctxext")
    for command in ("info", "check", "build", "--version"):
        assert command in done.stderr


def test_info_json_states_the_facts_of_info():
    done = cli("info", "--json")
    assert done.returncode == 0, done.stderr
    facts = json.loads(done.stdout)
    assert facts["importable"] is True and facts["torch_ctxext"] == torch_ctxext.__version__
    assert facts["torch"] == {"version": torch.__version__, "git_version": torch.version.git_version}
    routes = torch_ctxext._features.routes()
    for member, status in torch_ctxext.features().items():
        assert facts["members"][member] == {
            "provider": status.partition(":")[0], "route": routes[member], "reason": status.partition(": ")[2] or None,
        }
    extension = facts["extension"]
    if any(status == "torch_ctxext" for status in torch_ctxext.features().values()):
        assert extension["status"] == "loaded" and os.path.isfile(extension["path"])
        assert extension["built_for"]["version"] == torch.__version__
    else:
        assert extension["status"] == "not needed" and extension["path"] is None
