"""``python -m torch_ctxext check`` reads like a report: a progress line per
member, the table and the verdict, nothing of pytest's internals unless
``-v``; exit status 0 conforms, 1 does not conform, 2 could not run."""
import re
import textwrap
from support import python

SUBSET = "test_save_for_forward"  # one member, fast


def check(*args, path=()):
    return python("-m", "torch_ctxext", "check", *args, timeout=600, path=path)


def test_check_prints_progress_per_member_then_the_table_and_the_verdict_only():
    done = check("-k", SUBSET)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert re.search(r"^\[ 1/\d+\] save_for_forward +6 passed$", out, re.M), out
    assert "ctx contract conformance on torch" in out and out.rstrip().endswith("verdict: conforms")
    for internal in ("warnings summary", "PytestAssertRewriteWarning", "passed in", "=====", "....."):
        assert internal not in out + done.stderr, internal


def test_check_verbose_shows_pytests_own_output():
    done = check("-v", "-k", SUBSET)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"test_save_for_forward\.py::\w+ PASSED", done.stdout), done.stdout


def test_check_exits_1_when_the_contract_is_broken(tmp_path):
    """A plugin that breaks save_for_forward (its tests then fail): the
    failing tests are named with their reason, and the status is 1."""
    (tmp_path / "break_it.py").write_text(textwrap.dedent("""
        import torch.autograd.function as f
        def save_for_forward(self, *tensors):
            raise RuntimeError("broken on purpose")
        f.FunctionCtx.save_for_forward = save_for_forward
    """))
    done = check("-k", SUBSET, "--", "-p", "break_it", path=[tmp_path])
    assert done.returncode == 1, done.stdout + done.stderr
    assert re.search(r"^FAILED \S*test_save_for_forward\.py::\w+.* - RuntimeError: broken on purpose", done.stdout, re.M), done.stdout
    assert done.stdout.rstrip().endswith("verdict: does not conform")


def test_check_exits_2_when_the_suite_cannot_run():
    done = check("--", "--no-such-pytest-option")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--no-such-pytest-option" in done.stderr
    assert done.stdout.rstrip().endswith("verdict: could not run the suite")
