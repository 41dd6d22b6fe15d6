"""docs/contract-tests.md is generated from the suite and kept current."""
import os
import subprocess
import sys
from support import ROOT



def test_the_contract_table_in_docs_is_current():
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "contract_table.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout


def test_every_member_of_the_contract_has_sentences_in_the_table():
    from torch_ctxext._features import MEMBERS

    text = open(os.path.join(ROOT, "docs", "contract-tests.md")).read()
    for member in MEMBERS:
        assert f"| `{member}` |" in text, member
