"""What :func:`~torch_ctxext.testing.check_function` returns: one
:class:`CheckResult` per rule checked, gathered in a :class:`FunctionReport`.

A result has one of five statuses:

``passed``   the Function keeps the rule;
``failed``   it breaks it (the report then fails: ``report.passed`` is False);
``skipped``  the rule does not apply, or could not be checked, or you opted
             out (the reason is given, yours where you gave one);
``noted``    something true of the Function that is not a breach of the
             contract but limits how it can be used (a backward that can run
             only once per graph), or a fact worth knowing;
``error``    the checker itself raised: a bug in torch_ctxext, never in your
             Function. The rule it was checking is unchecked; the report does
             not fail because of it.
"""
from dataclasses import dataclass, field

from ._common import kept_exception

PASSED, FAILED, SKIPPED, NOTED, ERROR = "passed", "failed", "skipped", "noted", "error"
STATUSES = (PASSED, FAILED, SKIPPED, NOTED, ERROR)
_TAGS = {PASSED: "PASS", FAILED: "FAIL", SKIPPED: "SKIP", NOTED: "NOTE", ERROR: "ERROR"}

# name -> the rule in one sentence; each rule family module adds its own.
RULES = {}


def register(rules):
    """Add a family's ``{name: rule}``; a name is registered once."""
    for name, text in rules.items():
        if name in RULES and RULES[name] != text:
            raise ValueError(f"rule {name!r} registered twice")
        RULES[name] = text
    return rules


@dataclass
class CheckResult:
    """One check: which rule, its status, about what (``subject``), what was
    found (``detail``) and how to fix it (``fix``). ``exception`` is what the
    Function (or the reference) raised when that is what was found: its
    traceback starts at your code (the frame ``detail`` names) and keeps no
    locals."""

    name: str
    status: str
    detail: str = ""
    subject: str | None = None  # "input 0 (x)", "output 1", "input 0 (x), output 0"
    fix: str | None = None
    exception: BaseException | None = field(default=None, repr=False, compare=False)

    @property
    def rule(self):
        return RULES.get(self.name, self.name)

    @property
    def failed(self):
        return self.status == FAILED

    def __str__(self):
        head = f"{_TAGS[self.status]:<5} {self.name}"
        if self.subject:
            head += f" [{self.subject}]"
        if self.status == PASSED:
            return head + (f": {self.detail}" if self.detail else "")
        lines = [head]
        if self.status in (FAILED, ERROR):
            lines.append(f"      rule:  {self.rule}")
        for i, text in enumerate(self.detail.splitlines() or [""]):
            lines.append(("      found: " if i == 0 else "             ") + text)
        if self.fix:
            lines.append(f"      fix:   {self.fix}")
        return "\n".join(lines)


@dataclass
class OptOut:
    """A check you turned off or replaced, with your reason."""

    option: str  # "gradcheck", "reference", ...
    what: str  # what it changes, in words
    reason: str | None  # yours; None when you gave none

    def __str__(self):
        why = f'"{self.reason}"' if self.reason else "no reason given"
        return f"{self.option}: {self.what} ({why})"


@dataclass
class FunctionReport:
    """What :func:`check_function` found; ``str()`` is the readable report.

    ``precision`` says in which dtypes gradients were checked and why,
    ``gradient_mode`` which gradcheck mode ran (slow: exact Jacobians; fast:
    random projections) and why, ``opt_outs`` every check you turned off or
    replaced with your reason, ``seconds`` the checker's own time,
    ``warm_up_seconds`` what torch's one-time warm-ups took on top (the
    first backward with explicit gradients and the first forward-mode
    operation in a process; neither counts against the budget) and
    ``time_budget`` the budget it kept to.
    """

    function: str
    torch_version: str
    providers: dict
    precision: str = ""
    gradient_mode: str = ""
    opt_outs: list = field(default_factory=list)
    seconds: float = 0.0
    warm_up_seconds: float = 0.0
    time_budget: float | None = None
    results: list = field(default_factory=list)

    @property
    def passed(self):
        """No rule failed (checker errors and notes do not fail a report)."""
        return not self.failures

    @property
    def failures(self):
        return self.with_status(FAILED)

    @property
    def notes(self):
        return self.with_status(NOTED)

    @property
    def cause(self):
        """What your code raised in the first failed check that failed
        because it raised, or None: the ``__cause__`` of the
        :class:`ContractViolation`."""
        return next((r.exception for r in self.failures if r.exception is not None), None)

    @property
    def errors(self):
        """Checks the checker itself could not complete (bugs in torch_ctxext)."""
        return self.with_status(ERROR)

    def with_status(self, status):
        return [r for r in self.results if r.status == status]

    def results_for(self, name):
        """Results of rule ``name``, or of every rule of family ``name``."""
        return [r for r in self.results if r.name == name or r.name.startswith(name + ".")]

    def add(self, name, status, detail="", subject=None, fix=None, exception=None):
        """Add a result; ``exception``: what the user's code raised, if that
        is what ``detail`` reports."""
        if status not in STATUSES:
            raise ValueError(f"unknown status {status!r}")
        if exception is not None:
            exception = kept_exception(exception)
        result = CheckResult(name, status, detail, subject, fix, exception)
        self.results.append(result)
        return result

    def __str__(self):
        counts = {s: sum(r.status == s for r in self.results) for s in STATUSES}
        head = (
            f"check_function({self.function}): {counts[PASSED]} passed, "
            f"{counts[FAILED]} failed, {counts[SKIPPED]} skipped"
        )
        if counts[NOTED]:
            head += f", {counts[NOTED]} noted"
        if counts[ERROR]:
            head += f", {counts[ERROR]} checker error(s)"
        head += f" in {self.seconds:.2f} s"
        if self.warm_up_seconds >= 0.01:
            head += f" (+ {self.warm_up_seconds:.2f} s of torch's one-time warm-up)"
        if self.time_budget:
            head += f" (budget {self.time_budget:g} s)"
        info = (
            f"  torch {self.torch_version}; input_grad_buffers: "
            f"{self.providers.get('input_grad_buffers')}, set_output_grad_dtype: "
            f"{self.providers.get('set_output_grad_dtype')}"
        )
        lines = [head, info]
        if self.precision:
            lines.append(f"  precision: {self.precision}")
        if self.gradient_mode:
            lines.append(f"  gradcheck mode: {self.gradient_mode}")
        for opt_out in self.opt_outs:
            lines.append(f"  opted out: {opt_out}")
        lines += ["  " + line for r in self.results for line in str(r).splitlines()]
        return "\n".join(lines)


class ContractViolation(AssertionError):
    """A check failed; ``.report`` is the :class:`FunctionReport`.

    The message starts with the first failed rule and what was found
    (``gradcheck: backward raised: ValueError: ...``), the line pytest's
    short summary shows, followed by the whole report. When a rule failed
    because your forward or backward raised, check_function raises this
    ``from`` that exception (the first such; ``__cause__`` and
    :attr:`FunctionReport.cause`), whose traceback ends at the line of your
    code that raised.
    """

    # Where it is documented and imported from: the name exception
    # messages and pytest's summary show, torch_ctxext.testing.ContractViolation.
    __module__ = "torch_ctxext.testing"

    def __init__(self, report):
        super().__init__(_headline(report) + "\n" + str(report))
        self.report = report


def _headline(report):
    """'rule [subject]: what was found (first line)', and how many other
    checks failed."""
    failures = report.failures
    if not failures:
        return f"check_function({report.function}): no rule failed"
    first = failures[0]
    head = first.name + (f" [{first.subject}]" if first.subject else "")
    found = (first.detail.strip().splitlines() or [""])[0]
    head += f": {found}" if found else ""
    others = failures[1:]
    if others:
        names = ", ".join(dict.fromkeys(r.name for r in others))
        head += f" (and {len(others)} more failed: {names})"
    return head
