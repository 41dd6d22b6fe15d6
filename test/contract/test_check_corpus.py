"""check_function agrees with an expert's verdict on every Function of the
corpus (test/check_corpus/: Functions in the styles real projects use, and
broken variants of them), and never raises on any of them."""
import pytest
import torch
from check_corpus import CASES

from torch_ctxext.testing import ContractViolation, check_function

STYLES = (
    "tensor-parallel", "ZeRO-3", "straight-through", "gradient reversal", "gradient scaling",
    "checkpointing", "vector quantization", "scatter-max", "in-place quantizer", "sparsemax",
    "NumPy-backed", "once-only backward", "integer outputs", "non-tensor values",
    "setup_context", "jvp", "vmap", "gradient-accumulation fusion", "declared dtypes",
    "boxed_grads_call",
)


def run_case(case, **options):
    missing = case.missing()
    if missing:
        pytest.skip(f"needs ctx.{missing}, which torch {torch.__version__} lacks here")
    return check_function(case.function, *case.args(), **case.options, **options)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_checker_gives_the_experts_verdict(case):
    report = run_case(case, raise_on_failure=False)
    assert not report.errors, str(report)  # the checker's own exceptions
    assert {r.name for r in report.failures} == case.expected_failures(), str(report)
    assert {r.name for r in report.notes} == set(case.noted), str(report)
    for rule, subject in case.subjects.items():
        first = next(r for r in report.failures if r.name == rule)
        assert first.subject == subject, str(report)
    for rule, text in case.skipped.items():
        assert any(r.status == "skipped" and text in r.detail
                   for r in report.results_for(rule)), str(report)
    assert all(r.fix for r in report.failures), str(report)


@pytest.mark.parametrize("case", [c for c in CASES if c.id in (
    "zero3_linear_moderate_size", "zero3_linear_averages_bias_grad",
    "fused_cross_entropy_once_only", "sparsemax_jvp_without_mean",
)], ids=lambda case: case.id)
def test_raising_mode_raises_exactly_for_a_failing_verdict(case):
    if case.verdict == "pass":
        assert run_case(case).passed
    else:
        with pytest.raises(ContractViolation):
            run_case(case)


def test_corpus_covers_the_styles_real_projects_use_with_both_verdicts():
    assert len(CASES) >= 20
    assert len({case.id for case in CASES}) == len(CASES)
    styles = " ".join(case.style for case in CASES)
    assert [s for s in STYLES if s not in styles] == []
    verdicts = [case.verdict for case in CASES]
    assert verdicts.count("pass") >= 10 and verdicts.count("fail") >= 10
