"""Write the reports shown on docs/where-fusing-pays.md from what the code prints.

    python tools/advice_page.py [--check]

Each block of the page between ``<!-- advice: ARGS -->`` and
``<!-- advice end -->`` is the output of ``python examples/where_fusing_pays.py
ARGS`` (a ``text`` code block), run in this interpreter: the reports a user
sees, as they see them. ``--check`` exits 1 when the page differs, naming the
blocks that do.
"""
import contextlib
import io
import os
import re
import shlex
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "where-fusing-pays.md")
BLOCK = re.compile(r"(<!-- advice: (?P<args>[^>]*?) -->\n)(?P<body>.*?)(<!-- advice end -->)", re.S)


def printed(args):
    """What ``python examples/where_fusing_pays.py ARGS`` prints."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import where_fusing_pays

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        where_fusing_pays.main(shlex.split(args))
    return out.getvalue()


def render(text):
    """The page with every advice block replaced by what the code prints;
    and the ARGS of the blocks that changed."""
    changed = []

    def block(match):
        body = "```text\n" + printed(match["args"]) + "```\n"
        if body != match["body"]:
            changed.append(match["args"])
        return match.group(1) + body + match.group(4)

    return BLOCK.sub(block, text), changed


def main(argv=None):
    check = "--check" in (argv if argv is not None else sys.argv[1:])
    with open(PAGE) as f:
        text = f.read()
    new, changed = render(text)
    if not BLOCK.search(text):
        print(f"{PAGE}: no <!-- advice: ... --> block")
        return 1
    if check:
        for args in changed:
            print(f"{os.path.relpath(PAGE, ROOT)}: the report of `{args}` is not what the code prints; "
                  "run python tools/advice_page.py")
        return 1 if changed else 0
    with open(PAGE, "w") as f:
        f.write(new)
    print(f"wrote {os.path.relpath(PAGE, ROOT)} ({len(changed)} block(s) changed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
