"""The CPU differential scenarios, one module per member:

* scenarios_input_grad_buffers.py: ``ctx.input_grad_buffers`` (what is exposed)
* scenarios_refusals.py: where ``ctx.input_grad_buffers`` must refuse
* scenarios_set_output_grad_dtype.py: ``ctx.set_output_grad_dtype``
* scenarios_apply_boxed.py: Functions with ``boxed_grads_call = True``

built from the Functions of sample_functions.py and the helpers of
scenario_helpers.py. Each scenario builds a tiny custom autograd.Function
graph on the CPU, runs it and returns a JSON-serialisable dict of
observations. Only the public torch 2.15 API is used, so the same scenarios
run against native torch 2.15 and against older torch + torch_ctxext.

Scenario names are ``<member>.<concern>.<case>``; README.md maps the names
they had before (``q01_..`` .. ``q16_..``) to these.
"""

import importlib

MODULES = (
    "scenarios_input_grad_buffers",
    "scenarios_refusals",
    "scenarios_set_output_grad_dtype",
    "scenarios_apply_boxed",
)


def load():
    """Import the scenario modules; the (name, scenario) pairs they registered."""
    for name in MODULES:
        importlib.import_module(name)
    from scenario_helpers import SCENARIOS

    return SCENARIOS
