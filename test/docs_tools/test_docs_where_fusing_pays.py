"""docs/where-fusing-pays.md shows each model's report as a user sees it:
what examples/where_fusing_pays.py prints (tools/advice_page.py)."""
import os

import pytest

import torch_ctxext
from support import ROOT, python

import advice_page
from where_fusing_pays import MODELS


@pytest.mark.skipif(
    torch_ctxext.features()["input_grad_buffers"] == "native",
    reason="the page shows torch 2.13 + torch_ctxext; without the extension (native 2.15) a "
    "None whose buffer is shared reads 'reason needs torch_ctxext's extension' "
    "(docs/checking-your-function.md), so ALBERT's fused report differs there in that one reason")
def test_the_reports_shown_on_where_fusing_pays_are_what_the_code_prints():
    result = python(os.path.join(ROOT, "tools", "advice_page.py"), "--check", timeout=1800)
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]


def test_the_page_shows_a_report_of_each_model():
    with open(advice_page.PAGE) as f:
        shown = {m["args"] for m in advice_page.BLOCK.finditer(f.read())}
    assert set(MODELS) <= shown


def test_a_stale_report_is_found(tmp_path, monkeypatch):
    with open(advice_page.PAGE) as f:
        text = f.read()
    stale = tmp_path / "page.md"
    stale.write_text(text.replace("received more than one gradient", "received several gradients", 1))
    monkeypatch.setattr(advice_page, "PAGE", str(stale))
    assert advice_page.main(["--check"]) == 1


@pytest.mark.skipif(not advice_page.HAS_TRANSFORMERS,
                    reason="transformers is not installed (a test-only dependency: tools/run.py installs it for CI)")
def test_the_real_models_reports_are_checked_and_shown():
    result = python(os.path.join(ROOT, "tools", "advice_page.py"), "--check", timeout=1800)
    assert "not checked" not in result.stdout
    with open(advice_page.PAGE) as f:
        shown = {m["args"] for m in advice_page.BLOCK.finditer(f.read())}
    assert {"transformers_models.py llama", "transformers_models.py gpt2-micro"} <= shown
