"""The install story a newcomer reads: one, the same on every page, true today.

The package is not on a package index yet: no page tells a user to run
``pip install torch_ctxext`` as if it were; the README says what it is,
how to install it and its main command before any figure; the compiler a
source install needs is the one torch's headers need (C++20 from 2.12); and
the API page names everything a user calls.
"""
import glob
import os
import re
from support import ROOT

PAGES = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def _read(path):
    with open(path) as f:
        return f.read()


def _code_lines(text):
    for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            yield line.split("#", 1)[0].strip()


def test_no_page_tells_users_to_install_from_an_index_the_package_is_not_on():
    for page in PAGES:
        commands = [line for line in _code_lines(_read(page)) if re.fullmatch(r"pip install torch_ctxext(\s.*)?", line)]
        assert commands == [], f"{os.path.relpath(page, ROOT)}: {commands}"


def test_the_readme_says_how_to_install_and_the_main_command_before_any_figure():
    readme = _read(os.path.join(ROOT, "README.md"))
    install, commands, figures = (readme.index(s) for s in ("## Install", "## The commands", "**Headline figures**"))
    assert install < commands < figures
    section = readme[install:commands]
    assert "not on a package index yet" in section
    assert "python3 tools/run.py wheels" in section and "pip install ." in section
    assert "C++20" in section and "C++17" in section


def test_the_source_install_asks_for_the_compiler_torchs_headers_need():
    for page in ("README.md", "docs/install.md", "docs/index.md"):
        text = _read(os.path.join(ROOT, page))
        assert "C++20" in text, page
        assert "a C++17 compiler" not in text, page


def test_the_api_page_names_everything_a_user_calls():
    api = _read(os.path.join(ROOT, "docs", "api.md"))
    for name in ("check_function", "ctx_contract", "FunctionReport", "ContractViolation",
                 "build [--force]", "--device", "-v", "--version", "info [--json]",
                 "torch_ctxext.advise", "torch_ctxext.nn"):
        assert name in api, name
