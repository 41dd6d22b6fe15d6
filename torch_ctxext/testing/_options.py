"""check_function's options: validated once, with every opt-out and its reason."""
from dataclasses import dataclass, field

from .report import OptOut

DEFAULT_TIME_BUDGET = 5.0  # seconds; a cap, well above a typical check (~0.1 s)

# Checks you can turn off: the option, and what turning it off skips.
_SWITCHES = {
    "gradcheck": "backward's gradients are not compared with finite differences",
    "double_backward": "double backward is not checked",
    "forward_ad": "jvp is not checked",
    "vmap": "the vmap rule is not checked",
}


def _switch(name, value):
    """(on, reason): True -> on; False -> off, no reason; 'text' -> off, reason."""
    if value is True or value is None:
        return True, None
    if value is False:
        return False, None
    if isinstance(value, str) and value.strip():
        return False, value.strip()
    raise TypeError(
        f"check_function(): {name}= takes True, False or a reason (a non-empty str "
        f"saying why the check does not apply), got {value!r}"
    )


@dataclass
class Options:
    atol: float | None = None
    rtol: float | None = None
    eps: float | None = None
    fast_mode: bool | None = None  # None: chosen by size
    seed: int = 0
    time_budget: float | None = DEFAULT_TIME_BUDGET
    reference: object = None
    reason: str | None = None
    switches: dict = field(default_factory=dict)  # name -> (on, reason)

    def on(self, name):
        return self.switches[name][0]

    def off_reason(self, name):
        """'disabled (gradcheck=False, no reason given)' or with the reason."""
        on, reason = self.switches[name]
        if on:
            return None
        return f'disabled by you: "{reason}"' if reason else f"disabled ({name}=False, no reason given)"

    def opt_outs(self):
        result = []
        if self.reference is not None:
            result.append(OptOut(
                "reference",
                f"gradients are compared with those of {reference_name(self.reference)} "
                "instead of finite differences",
                self.reason,
            ))
        for name, what in _SWITCHES.items():
            on, reason = self.switches[name]
            if not on:
                result.append(OptOut(name, what, reason))
        return result


def reference_name(ref):
    """'the reference NAME', or 'the reference' for a lambda."""
    if getattr(ref, "__name__", None) == "<lambda>":
        return "the reference"
    name = getattr(ref, "__qualname__", None) or getattr(ref, "__name__", None) or repr(ref)
    return f"the reference {name}"


def parse(options):
    """Options from check_function's keyword arguments; TypeError for
    unknown or ill-typed ones (the checker's only exceptions besides
    ContractViolation)."""
    __tracebackhide__ = True  # pytest shows the caller's line and the message
    options = dict(options)
    result = Options()
    for name in ("atol", "rtol", "eps"):
        value = options.pop(name, None)
        if value is not None and not (isinstance(value, (int, float)) and value >= 0):
            raise TypeError(f"check_function(): {name}= must be a non-negative number, got {value!r}")
        setattr(result, name, None if value is None else float(value))
    fast_mode = options.pop("fast_mode", None)
    if fast_mode not in (None, True, False, "auto"):
        raise TypeError(f"check_function(): fast_mode= takes True, False or 'auto', got {fast_mode!r}")
    result.fast_mode = None if fast_mode == "auto" else fast_mode
    result.seed = options.pop("seed", 0)
    if not isinstance(result.seed, int):
        raise TypeError(f"check_function(): seed= must be an int, got {result.seed!r}")
    budget = options.pop("time_budget", DEFAULT_TIME_BUDGET)
    if budget is not None and not (isinstance(budget, (int, float)) and budget > 0):
        raise TypeError(f"check_function(): time_budget= must be seconds > 0 or None, got {budget!r}")
    result.time_budget = None if budget is None else float(budget)
    result.reference = options.pop("reference", None)
    if result.reference is not None and not callable(result.reference):
        raise TypeError(
            "check_function(): reference= must be a callable taking the same arguments as "
            f"apply, got {result.reference!r}"
        )
    result.reason = options.pop("reason", None)
    if result.reason is not None:
        if result.reference is None:
            raise TypeError(
                "check_function(): reason= says why backward differs from the derivative and "
                "goes with reference=; to turn a check off with a reason, pass the reason as "
                "that check's value (for example gradcheck='why')"
            )
        if not isinstance(result.reason, str) or not result.reason.strip():
            raise TypeError(f"check_function(): reason= must be a non-empty str, got {result.reason!r}")
        result.reason = result.reason.strip()
    for name in _SWITCHES:
        result.switches[name] = _switch(name, options.pop(name, True))
    if options:
        raise TypeError(f"check_function() got unknown options: {sorted(options)}")
    return result
