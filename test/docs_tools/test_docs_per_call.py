"""docs/benchmarks.md's "FusedLinear's cost per call" is what benchmarks/page.py
renders from docs/benchmarks.json, and where-fusing-pays.md quotes its figure."""
import json
import os
import re

from support import ROOT

import page

DOCS = os.path.join(ROOT, "docs")


def read(name):
    with open(os.path.join(DOCS, name)) as f:
        return f.read()


def per_call():
    with open(os.path.join(DOCS, "benchmarks.json")) as f:
        return json.load(f)["per_call"]


def test_the_section_on_the_page_is_what_page_py_renders_from_the_raw_results():
    section = "\n".join(page.per_call_section(per_call()))
    assert section.startswith("## FusedLinear's cost per call\n")
    assert section in read("benchmarks.md")


def test_where_fusing_pays_links_the_section_and_quotes_its_measured_figure():
    text = read("where-fusing-pays.md")
    assert "benchmarks.md#fusedlinears-cost-per-call" in text
    quoted = re.search(r"about (\d+) us over `nn.Linear` where FusedLinear\s+runs its C\+\+ Function, (\d+) us "
                       r"where it runs its Python one", text)
    assert quoted, "the sentence quoting the cost per call is gone"
    smallest = per_call()["cpu"][0]  # the smallest layer, used once
    assert abs(int(quoted.group(1)) - smallest["step_cpu_extra_us"]) <= 1
    assert abs(int(quoted.group(2)) - smallest["step_cpu_python_us"]) <= 1
