"""The conformance suite for the ctx contract of torch.autograd.Function.

One test module per member of the contract; each test is named after the
sentence of the documentation it checks. Run it against the installed torch
with ``python -m torch_ctxext check`` (a report) or
``pytest --pyargs torch_ctxext.conformance`` (plain pytest).
"""
