"""A corpus of custom autograd Functions in the styles real projects use,
each with the verdict an expert gives it: which rules the checker must
report failed (none for a correct Function) and which it must note.

Written for torch_ctxext's own tests (test/contract/test_check_corpus.py) and the
checker's time benchmark (benchmarks/bench_check_function.py); nothing here
is copied from the projects whose style it follows.
"""
from . import dtypes, estimators, forward_mode, indexing, linear, memory, multi_output, numpy_functions
from ._case import Case, sample

CASES = [
    case
    for module in (linear, estimators, memory, indexing, numpy_functions, forward_mode, dtypes,
                   multi_output)
    for case in module.CASES
]

__all__ = ["CASES", "Case", "sample"]
