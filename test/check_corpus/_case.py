"""One entry of the corpus: a Function, how to call it, and the verdict an
expert gives it."""
from dataclasses import dataclass, field

import torch

import torch_ctxext


@dataclass
class Case:
    """``failing``: the rules the checker must report failed (empty: the
    Function is correct), or a callable of ``torch_ctxext.features()`` for a
    verdict that depends on who provides a member. ``noted``: the rules it
    must note. ``subjects``: rule -> subject of its first failure.
    ``skipped``: rule -> a text its skip reason contains. ``needs``: members
    of the contract the case needs (skipped where unavailable)."""

    id: str
    style: str
    function: type
    args: object  # () -> tuple: fresh sample arguments
    why: str  # the expert's verdict, in one sentence
    failing: object = frozenset()
    noted: frozenset = frozenset()
    options: dict = field(default_factory=dict)
    subjects: dict = field(default_factory=dict)
    skipped: dict = field(default_factory=dict)
    needs: tuple = ()

    def expected_failures(self):
        if callable(self.failing):
            return frozenset(self.failing(torch_ctxext.features()))
        return frozenset(self.failing)

    @property
    def verdict(self):
        return "fail" if self.expected_failures() else "pass"

    def missing(self):
        """The first member this case needs that the running torch lacks."""
        features = torch_ctxext.features()
        for member in self.needs:
            if features[member].startswith("unavailable"):
                return member
        return None


def sample(*shape, dtype=torch.float32, seed=0, scale=1.0, requires_grad=True):
    """Uniform in [-scale, scale), reproducible."""
    gen = torch.Generator().manual_seed(seed)
    t = (torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1) * scale
    return t.to(dtype).requires_grad_(requires_grad)
