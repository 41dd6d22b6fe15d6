"""docs/contract-tests.md is generated from the suite and kept current."""
import os
from support import ROOT, python


def test_the_contract_table_in_docs_is_current():
    result = python(os.path.join(ROOT, "tools", "contract_table.py"), "--check", timeout=600)
    assert result.returncode == 0, result.stdout


def test_every_member_of_the_contract_has_sentences_in_the_table():
    from torch_ctxext._features import MEMBERS

    text = open(os.path.join(ROOT, "docs", "contract-tests.md")).read()
    for member in MEMBERS:
        assert f"| `{member}` |" in text, member
