"""What check_function shows when it fails: the failed rule first, and, when
your forward or backward raised, your file and line, as Python would. Under
pytest, a failure of check_function or of the ctx_contract fixture shows the
rule, what was found and your code, not the checker's own source.
"""
import gc
import importlib.metadata
import weakref

import pytest
import torch

from check_corpus import sample
from torch_ctxext.testing import ContractViolation, check_function

# WrongSigmoid: a backward that forgets (1 - y).
from test_check_function import WrongSigmoid  # noqa: E402

pytest_plugins = ["pytester"]


def line_of(text):
    """The line number of ``text`` in this file."""
    with open(__file__) as f:
        return next(n for n, line in enumerate(f, 1) if text in line and "line_of(" not in line)


class RaisesInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        raise KeyError("state freed by an earlier backward")


class RaisesInForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _helper_that_raises(x)

    @staticmethod
    def backward(ctx, g):
        return g


def _helper_that_raises(x):
    raise RuntimeError("shape mismatch in the user's helper")


def test_an_exception_in_backward_is_reported_with_the_users_file_and_line():
    report = check_function(RaisesInBackward, sample(3), raise_on_failure=False)
    (failure,) = report.results_for("gradcheck")
    line = line_of('raise KeyError("state freed by an earlier backward")')
    assert (f'KeyError: \'state freed by an earlier backward\'\n  File "{__file__}", '
            f'line {line}, in backward\n    raise KeyError(') in failure.detail, str(report)


def test_an_exception_in_a_helper_of_forward_names_the_innermost_line_of_the_users_code():
    report = check_function(RaisesInForward, sample(3), raise_on_failure=False)
    (failure,) = report.results_for("forward")
    line = line_of('raise RuntimeError("shape mismatch in the user\'s helper")')
    assert f'File "{__file__}", line {line}, in _helper_that_raises' in failure.detail, str(report)


@pytest.mark.parametrize("function, rule, where", [
    (RaisesInBackward, "gradcheck", "backward"),
    (RaisesInForward, "forward", "_helper_that_raises"),
])
def test_the_violation_is_raised_from_what_the_users_code_raised(function, rule, where):
    """``raise ContractViolation(...) from exc``: Python and pytest print the
    user's exception as the cause, its traceback starting at the user's
    code (no frame of the checker's, nor torch's frames above the user's
    code) and ending at the line that raised."""
    with pytest.raises(ContractViolation) as info:
        check_function(function, sample(3))
    cause = info.value.__cause__
    assert cause is info.value.report.cause is info.value.report.failures[0].exception
    assert isinstance(cause, (KeyError, RuntimeError))
    frames = [(f.f_code.co_filename, f.f_code.co_name) for f, _ in _walk(cause.__traceback__)]
    assert frames[0] == (__file__, "forward" if function is RaisesInForward else "backward")
    assert frames[-1] == (__file__, where)
    assert all(filename == __file__ for filename, _ in frames), frames


def test_a_violation_without_an_exception_has_no_cause():
    with pytest.raises(ContractViolation) as info:
        check_function(WrongSigmoid, sample(3))
    assert info.value.__cause__ is None and info.value.report.cause is None


def test_a_kept_exception_keeps_no_tensor_of_the_users_frames_alive():
    """The report keeps the exception for the chain, with its frames'
    locals cleared: a tensor of the user's backward dies with the check."""
    alive = []

    class KeepsALocal(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            workspace = torch.ones(3)
            alive.append(weakref.ref(workspace))
            raise ValueError("after allocating a workspace")

    report = check_function(KeepsALocal, sample(3), raise_on_failure=False)
    assert report.cause is not None and alive
    gc.collect()
    assert all(ref() is None for ref in alive)


@pytest.mark.parametrize("function, args, head", [
    (RaisesInBackward, (sample(3),),
     "gradcheck: backward raised: KeyError: 'state freed by an earlier backward'"),
    (WrongSigmoid, (sample(3),), "gradcheck [input 0 (x), output 0]: "),
])
def test_the_violation_message_starts_with_the_failed_rule(function, args, head):
    """The first line, which pytest's short summary shows, names the rule
    and what was found; the report follows."""
    with pytest.raises(ContractViolation) as info:
        check_function(function, *args)
    message = str(info.value)
    assert message.startswith(head), message
    assert message.splitlines()[1].startswith(f"check_function({function.__name__}): ")
    assert str(info.value.report) in message


def _walk(tb):
    while tb is not None:
        yield tb.tb_frame, tb.tb_lineno
        tb = tb.tb_next


# --- under pytest ----------------------------------------------------------------------

USER_TESTS = """
import torch
from torch_ctxext.testing import check_function


class Broken(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale  # forward never set it


class Wrong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 3


def test_direct():
    check_function(Broken, torch.randn(3, requires_grad=True))


def test_fixture(ctx_contract):
    ctx_contract(Broken, torch.randn(3, requires_grad=True))


def test_wrong_gradient(ctx_contract):
    ctx_contract(Wrong, torch.randn(3, requires_grad=True))


def test_no_input_requires_grad():
    check_function(Wrong, torch.randn(3))
"""

# Lines of check_function's source and docstring, and of the helpers it
# raises from, that pytest printed before (it shows the source of every
# frame down to the one that raised).
CHECKER_SOURCE = [
    "def check_function(",
    "Run ``function`` (a ``torch.autograd.Function`` subclass)",
    "raise ContractViolation(report)",
    "report = _runner.run(",
    "def refuse_samples_without_grad(",
    "def check(function, *sample_args, **options):",
    "torch_ctxext/testing/",
]


def test_a_failing_check_under_pytest_shows_the_rule_and_the_users_line_not_the_checkers_source(
        pytester, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")  # the short summary is not cut to 80 columns
    path = pytester.makepyfile(test_user=USER_TESTS)
    registered = any(
        ep.value == "torch_ctxext_pytest"
        for ep in importlib.metadata.entry_points(group="pytest11")
    )
    plugin = [] if registered else ["-p", "torch_ctxext_pytest"]
    result = pytester.runpytest("-p", "no:cacheprovider", "-o", "addopts=", *plugin, "-rf")
    result.assert_outcomes(failed=4)
    out = result.stdout.str()
    summary = "FAILED test_user.py::{} - torch_ctxext.testing.ContractViolation: {}"
    cause = "gradcheck: backward raised: AttributeError: '*' object has no attribute 'scale'"
    result.stdout.fnmatch_lines([
        summary.format("test_direct", cause),
        summary.format("test_fixture", cause),
        summary.format("test_wrong_gradient", "gradcheck [[]input 0 (x), output 0[]]: *"),
        "FAILED test_user.py::test_no_input_requires_grad - ValueError: check_function(Wrong): "
        "none of the sample arguments is a tensor that requires grad*",
    ])
    # The user's exception is shown as the cause, at the user's line, and
    # the report names that line too.
    line = next(n for n, text in enumerate(path.read_text().splitlines(), 1) if "ctx.scale" in text)
    result.stdout.fnmatch_lines([
        ">       return g * ctx.scale  # forward never set it",
        "E       AttributeError: '*' object has no attribute 'scale'",
        f"test_user.py:{line}: AttributeError",
        "The above exception was the direct cause of the following exception:",
        "    def test_direct():",
        ">       check_function(Broken, torch.randn(3, requires_grad=True))",
        "E       torch_ctxext.testing.ContractViolation: gradcheck: backward raised: *",
    ])
    assert f'File "{path}", line {line}, in backward' in out
    for line in CHECKER_SOURCE:
        assert line not in out, line
