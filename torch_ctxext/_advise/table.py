"""``print(report)``: what ``advise`` saw, as a person reads it at a glance.

At most ``width`` columns (100 by default; ``report.table(width=None)`` does
not cut): a header, one "do this" line (``torch_ctxext.nn.fuse(model) saves
1.3 MiB per step: 10 x FusedLinear, 1 x FusedEmbedding``), the tensors that
fusing saves or saved, the most first, each with its producers and their
module classes, then one folded line for the tensors nothing can save, naming
the module classes that have no drop-in. ``report.as_dict()`` keeps
everything.
"""
import collections
import re
import textwrap

__all__ = ["fmt_bytes", "render", "USAGE"]

# How a block is used, for the reports that have nothing else to say: one
# that saw no backward, and an advise() never entered.
USAGE = [
    "    with torch_ctxext.advise(model) as report:",
    "        loss = model(x).sum()",
    "        loss.backward()        # inside the block: a backward after it is not watched",
    "    print(report)",
]


def fmt_bytes(n):
    if n < 1024:
        return f"{n} B"
    if n < 1024 ** 2:
        return f"{n / 1024:.1f} KiB"
    return f"{n / 1024 ** 2:.2f} MiB"


def count(n, noun):
    return f"{n} {noun}" + ("" if n == 1 else "s")


def natural(name):
    """Sort key: "cell#2" before "cell#10"."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _cut(text, width):
    if width is None or len(text) <= width:
        return text
    return text[:max(width - 3, 0)] + "..."


def shorten(text, n):
    """``text`` in at most ``n`` characters: its start and its end, the middle
    elided (a module path keeps its root and its leaf)."""
    if n is None or len(text) <= n:
        return text
    if n < 8:
        return text[:n]
    head = n // 3
    return text[:head] + "..." + text[len(text) - (n - head - 3):]


def producers_summary(producers):
    """``3 x Linear (q_proj, k_proj, v_proj)``: the producers by module class
    (their op where no module made them), with the modules' last names."""
    groups = {}
    for p in producers:
        key = p.stock or p.op
        leaf = p.module.split("#")[0].rsplit(".", 1)[-1] if p.module else None
        count_, leaves = groups.get(key, (0, []))
        if leaf and leaf not in leaves:
            leaves.append(leaf)
        groups[key] = (count_ + 1, leaves)
    return ", ".join(f"{n} x {key}" + (f" ({', '.join(leaves)})" if leaves and p_is_module(key, producers) else "")
                     for key, (n, leaves) in groups.items())


def p_is_module(key, producers):
    return any(p.stock == key for p in producers)


def _without_drop_in(slots):
    """Module classes of the producers that no drop-in replaces."""
    classes = collections.Counter()
    for s in slots:
        for p in s.producers:
            if p.stock and not p.drop_in and not p.route and not p.stock.startswith("Fused"):
                classes[p.stock] += 1
    return [name for name, _ in classes.most_common()]


# Module classes no drop-in can exist for, and why (the report says so in
# one line, with the temporaries their gradients cost): torch's convolution
# backward (on the CPU, mkldnn's and the slow path's) returns a new weight
# gradient and has no form that adds into an existing one, so a drop-in
# would allocate the same temporary.
NO_DROP_IN = {
    name: "no drop-in can exist: its backward cannot add into a buffer"
    for name in ("Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d")
}


def _left(report, slots):
    """The module classes whose gradients still cost temporaries and that
    fuse() does not swap, with those temporaries' bytes, the most first."""
    left = collections.Counter()
    for s in slots:
        if not s.temporary_bytes:
            continue
        for cls in dict.fromkeys(p.stock for p in s.producers
                                 if p.stock and not p.drop_in and not p.route and not p.stock.startswith("Fused")):
            left[cls] += s.temporary_bytes
    return left.most_common()


def _drop_in_name(name):
    """``torch_ctxext.nn.FusedLinear``; a class fuse() makes for a subclass
    (``FusedScaledEmbedding``) is not in the package: named as made."""
    from ..nn.drop_ins import DROP_INS

    if name in {cls.__name__ for cls in DROP_INS.values()} or name == "FusedConv1D":
        return f"torch_ctxext.nn.{name}"
    return f"{name} (made by fuse)"


def _do_this(report, slots):
    drop_ins = report.drop_ins.values()
    if report.avoidable_bytes:
        kinds = collections.Counter(d.drop_in for d in drop_ins if d.avoidable_bytes)
        what = ", ".join(f"{n} x {name}" for name, n in sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0])))
        return (f"do this: torch_ctxext.nn.fuse(model) saves {_per_step(report, report.avoidable_bytes)}"
                + (f": {what}" if what else ""))
    if report.route_bytes:
        return (f"do this: torch_ctxext.nn.functional.linear where the routes below say saves "
                f"{_per_step(report, report.route_bytes)}")
    left = _left(report, slots)
    named = f"no drop-in for {', '.join(cls for cls, _ in left)}" if left else "nothing more to swap"
    if report.avoided_bytes:
        return f"fused: the drop-ins avoided {_per_step(report, report.avoided_bytes)}; {named}"
    return f"nothing to do: {named}" if left else "nothing to do: no drop-in would save anything in this step"


def _per_step(report, nbytes):
    """Bytes of one backward ("per step"), or of a block's several backwards
    (a block kept open over many steps, or micro-batches each with its own
    backward): the total, and what each backward saves on average."""
    if report.backwards <= 1:
        return f"{fmt_bytes(nbytes)} per step"
    return (f"{fmt_bytes(nbytes)} over {report.backwards} backwards "
            f"({fmt_bytes(nbytes // report.backwards)} per backward)")


MAX_ROWS = 12  # tensors listed at a width; the others are summed in one line


def _tensor(slot, lead, width):
    """``name (tied: ...) <- producers`` after ``lead``: on one line where it
    fits in ``width`` columns, else the producers on a line of their own
    under the name, each shortened in the middle to fit."""
    tied = f" (tied: {', '.join(slot.tied)})" if slot.tied else ""
    producers = "<- " + producers_summary(slot.producers)
    one = f"{lead}{slot.name}{tied} {producers}"
    if width is None or len(one) <= width:
        return [one]
    room = width - len(lead)
    # The row's own name whole (what report[name] takes); the tied names
    # share what room is left, each shortened in the middle. A name longer
    # than the room after the figures has a line of its own under them.
    if len(slot.name) <= room:
        return [lead + slot.name + _tied(slot.tied, room - len(slot.name)),
                " " * len(lead) + _cut(producers, room)]
    indent = "    "
    if len(indent) + len(slot.name) <= width:
        return [lead + _cut(producers, room),
                indent + slot.name + _tied(slot.tied, width - len(indent) - len(slot.name))]
    return [lead + _cut(producers, room)] + _wrap_name(slot.name, width, indent)


def _wrap_name(name, width, indent):
    """``name`` whole on lines of at most ``width`` columns, broken after a
    "." or a space (anywhere where a part has neither), continued two
    columns further in."""
    lines, line, prefix = [], "", indent
    for part in re.findall(r"[^. ]*[. ]?", name):
        if not part:
            continue
        while len(prefix) + len(line) + len(part) > width and (line or len(prefix) + len(part) > width):
            if line:
                lines.append(prefix + line)
                line, prefix = "", indent + "  "
            else:  # one part longer than a line
                room = width - len(prefix)
                lines.append(prefix + part[:room])
                part, prefix = part[room:], indent + "  "
        line += part
    if line:
        lines.append(prefix + line)
    return lines


def _tied(names, room):
    """`` (tied: a, b)`` in at most ``room`` columns: each name shortened in
    the middle (to no less than 24 characters while several are shown), the
    last ones left out (``+ 2 more``) where even that does not fit; "" where
    nothing fits."""
    for shown in range(len(names), 0, -1):
        more = f", + {len(names) - shown} more" if shown < len(names) else ""
        fixed = len(" (tied: ") + len(more) + 1 + 2 * (shown - 1)
        each = (room - fixed) // shown
        if each >= (24 if shown > 1 else 8) or all(len(n) <= each for n in names[:shown]):
            return f" (tied: {', '.join(shorten(n, each) for n in names[:shown])}{more})"
    return ""


def _nothing_watched(report, width):
    """The report of a block that observed no backward: every count would
    be 0 and "nothing to do" would read as a verdict on the model, when the
    block simply measured nothing. It says so, and how to use it."""
    model = f"{report.model}: " if report.model else ""
    if report.failures:
        what = "no backward inside this block could be observed (the notes say why)"
    elif report.closed:
        what = "no backward ran inside this block, so it measured nothing"
    else:
        what = "no backward has run inside this block yet, so it has measured nothing"
    lines = [f"torch_ctxext.advise: {model}{what}",
             "do this: run the backward inside the block, then print the report:"]
    if width is not None:
        lines = [part for line in lines for part in
                 textwrap.wrap(line, width=width, subsequent_indent="    ", break_on_hyphens=False)]
    lines += USAGE
    if report.notes:
        lines.append("")
        for n in report.notes:
            lines += textwrap.wrap(f"note: {n}", width=width or 10 ** 6, subsequent_indent="  ")
    return "\n".join(lines)


def render(report, width=100):
    if not report.backwards:
        return _nothing_watched(report, width)
    slots = report.slots
    temporaries = sum(s.temporaries + s.summed_out_of_place for s in slots)
    lines = [
        f"torch_ctxext.advise: {report.model + ', ' if report.model else ''}"
        f"{count(report.backwards, 'backward')}; {count(len(slots), 'tensor')} received more than one gradient",
        f"  temporaries allocated to accumulate them: {count(temporaries, 'gradient')}, "
        f"{fmt_bytes(report.temporary_bytes)}",
        f"  fusing avoided {fmt_bytes(report.avoided_bytes)}; the drop-ins would save "
        f"{fmt_bytes(report.avoidable_bytes)} more (at most {fmt_bytes(report.avoidable_peak_bytes)} "
        "of it at one time)",
        _do_this(report, slots),
    ]
    saving = [s for s in slots if s.avoidable_bytes or s.avoided_bytes]
    rows_shown = len(saving) if width is None else MAX_ROWS
    shown, more = saving[:rows_shown], saving[rows_shown:]
    folded = [s for s in slots if not (s.avoidable_bytes or s.avoided_bytes)]
    if shown:
        rows = [("saves", "avoided", "temporaries", "gradient", None)]
        for s in shown:
            temps = f"{s.temporaries}" + (f" + {s.summed_out_of_place} sum" if s.summed_out_of_place else "")
            rows.append((fmt_bytes(s.avoidable_bytes) if s.avoidable_bytes else "-",
                         fmt_bytes(s.avoided_bytes) if s.avoided_bytes else "-",
                         temps, fmt_bytes(s.grad_bytes), s))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines.append("")
        for r in rows:
            lead = "  " + "  ".join(r[i].rjust(widths[i]) for i in range(4)) + "  "
            lines += [lead + "tensor <- producers"] if r[4] is None else _tensor(r[4], lead, width)
        if more:
            saves, avoided = sum(s.avoidable_bytes for s in more), sum(s.avoided_bytes for s in more)
            lines.append(f"  + {count(len(more), 'more tensor')}: "
                         + ", ".join(([f"the drop-ins save {fmt_bytes(saves)}"] if saves else [])
                                     + ([f"fusing avoided {fmt_bytes(avoided)}"] if avoided else []))
                         + " (report.as_dict()['slots'])")
    if folded:
        classes = _without_drop_in(folded)
        temporary = fmt_bytes(sum(s.temporary_bytes for s in folded))
        text = (f"+ {count(len(folded), 'tensor')} that no drop-in saves ({temporary} of temporaries)"
                + (f": no drop-in for {', '.join(classes)}" if classes else ""))
        lines.append("")
        lines += textwrap.wrap(text, width=width or 10 ** 6, initial_indent="  ", subsequent_indent="    ")
    if report.drop_ins:
        ranked = report._drop_ins_sorted()
        lines += ["", "drop-ins (torch_ctxext.nn.fuse(model) swaps them all in):"]
        limit = len(ranked) if width is None else MAX_ROWS // 2
        for d in ranked[:limit]:
            tail = f": {d.stock} -> {_drop_in_name(d.drop_in)}, saves {fmt_bytes(d.avoidable_bytes)}"
            if width is None or 2 + len(d.module) + len(tail) <= width:
                lines.append("  " + d.module + tail)
            else:  # the module's path whole (what to look for), the rest under it
                lines += ["  " + d.module + ":", "    " + tail[2:]]
        if len(ranked) > limit:
            rest = ranked[limit:]
            lines.append(f"  ... and {count(len(rest), 'module')} more, "
                         f"{fmt_bytes(sum(d.avoidable_bytes for d in rest))} (report.as_dict()['drop_ins'])")
    if report.routes:
        lines += ["", "routes (code to change: a parameter applied through F.linear outside its module):"]
        for r in report._routes_sorted():
            text = (f"{r.module}.forward: F.linear(..., {r.attribute}) -> torch_ctxext.nn.functional.linear"
                    f"(..., {r.attribute}), saves {fmt_bytes(r.avoidable_bytes)} with fuse(model)")
            lines += textwrap.wrap(text, width=width or 10 ** 6, initial_indent="  ", subsequent_indent="    ")
    cannot = [(cls, nbytes) for cls, nbytes in _left(report, slots)
              if cls in NO_DROP_IN or cls in report.cannot_swap]
    if cannot:
        lines += ["", "cannot be fused:"]
        for cls, nbytes in cannot:
            why = NO_DROP_IN.get(cls) or report.cannot_swap[cls]
            text = f"{cls}: {fmt_bytes(nbytes)} of temporaries; {why}"
            lines += textwrap.wrap(text, width=width or 10 ** 6, initial_indent="  ", subsequent_indent="    ")
    if report.functions:
        lines += ["", "custom Functions that read ctx.input_grad_buffers:"]
        for _, f in sorted(report.functions.items()):
            lines += textwrap.wrap(str(f), width=width or 10 ** 6, initial_indent="  ", subsequent_indent="    ")
    if report.notes:
        lines.append("")
        for n in report.notes:
            lines += textwrap.wrap(f"note: {n}", width=width or 10 ** 6, subsequent_indent="  ")
    if width is not None:  # the header and the "do this" line, wrapped
        lines[:4] = [part for line in lines[:4] for part in
                     textwrap.wrap(line, width=width, subsequent_indent="    ", break_on_hyphens=False)]
    return "\n".join(lines)
