"""Every Python example in the README and docs/ runs as written."""
import glob
import os
import re

import pytest
from support import ROOT

PAGES = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def examples():
    for page in PAGES:
        with open(page) as f:
            text = f.read()
        for i, block in enumerate(re.findall(r"```python\n(.*?)```", text, re.S)):
            if block.lstrip().startswith("import"):  # complete programs only
                yield pytest.param(block, id=f"{os.path.basename(page)}-{i}")


@pytest.mark.parametrize("code", list(examples()))
def test_documented_example_runs_as_written(code):
    exec(compile(code, "<example>", "exec"), {})
