"""The members torch_ctxext adds where the running torch lacks them, one
module per member: ``input_grad_buffers``, ``output_grad_dtype``
(``set_output_grad_dtype``) and ``boxed_grads`` (``apply_boxed``, and
``apply`` on torch 2.6 to 2.12).

Each has ``install(ext)``, given the loaded C++ extension, which patches
torch and returns a ``_features.Installed``: the members it installed, or
why it could not. ``torch_ctxext/__init__.py`` imports a module here only
for a member the running torch lacks, and records what it returns.
"""
