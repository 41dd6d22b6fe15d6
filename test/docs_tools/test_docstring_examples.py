"""Every example in the docstrings torch_ctxext adds runs as written."""
import doctest

import pytest

from torch_ctxext import _features
from torch_ctxext._backport import input_grad_buffers as _input_grad_buffers
from torch_ctxext._backport import output_grad_dtype as _output_grad_dtype
from torch_ctxext.nn import attention as _attention, embedding as _embedding, functional as _functional
from torch_ctxext.nn import gru as _gru, linear as _linear, rnn as _rnn


@pytest.mark.parametrize(
    "module", [_input_grad_buffers, _output_grad_dtype, _features, _linear, _embedding, _rnn, _gru, _attention,
               _functional],
    ids=lambda m: m.__name__,
)
def test_docstring_examples_run_as_written(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0
    assert result.failed == 0
