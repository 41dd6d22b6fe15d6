"""Write the reports shown on docs/where-fusing-pays.md from what the code prints.

    python tools/advice_page.py [--check]

Each block of the page between ``<!-- advice: ARGS -->`` and
``<!-- advice end -->`` is the output of ``python examples/where_fusing_pays.py
ARGS`` (a ``text`` code block), run in this interpreter: the reports a user
sees, as they see them; ``<!-- advice: transformers_models.py ARGS -->``
that of ``examples/transformers_models.py ARGS`` (the real models), which
needs ``transformers``: where it is missing those blocks are left as they
are and named as not checked. ``--check`` exits 1 when the page differs,
naming the blocks that do.
"""
import contextlib
import importlib.util
import io
import os
import re
import shlex
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "where-fusing-pays.md")
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
skipped = []  # the blocks of the last render() left unchecked (no transformers)
BLOCK = re.compile(r"(<!-- advice: (?P<args>[^>]*?) -->\n)(?P<body>.*?)(<!-- advice end -->)", re.S)


REAL = "transformers_models.py"


def needs_transformers(args):
    return shlex.split(args)[:1] == [REAL]


def printed(args):
    """What ``python examples/where_fusing_pays.py ARGS`` prints (or
    ``examples/transformers_models.py`` for ``transformers_models.py ARGS``)."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    words = shlex.split(args)
    if words[:1] == [REAL]:
        import transformers_models as example

        words = words[1:]
    else:
        import where_fusing_pays as example

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        example.main(words)
    return out.getvalue()


def render(text):
    """The page with every advice block replaced by what the code prints;
    and the ARGS of the blocks that changed."""
    changed = []
    skipped.clear()

    def block(match):
        if needs_transformers(match["args"]) and not HAS_TRANSFORMERS:
            skipped.append(match["args"])
            return match.group(0)
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
    for args in skipped:
        print(f"{os.path.relpath(PAGE, ROOT)}: the report of `{args}` is not checked: transformers "
              "is not installed")
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
