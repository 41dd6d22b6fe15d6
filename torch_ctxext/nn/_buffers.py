"""When the drop-ins of torch_ctxext.nn read ``ctx.input_grad_buffers``."""
import torch


def readable_buffers(ctx, fuse):
    """``ctx.input_grad_buffers`` where the drop-in may read it, else all None.

    Grad mode is on in backward only under ``create_graph=True`` (double
    backward), where the property raises: the fallback, which is
    differentiable, runs instead. A tracer (``torch.compile``, compiled
    autograd) gets the fallback too. ``fuse=False`` never reads.

    Where the property refuses (a post-hook on the drop-in's node, anomaly
    detection, a buffer torch 2.15's thread and stream rules do not allow
    adding into) the drop-in computes out of place, as its stock module
    does: the refusal protects the buffer, and a drop-in never fails a step
    its stock module runs.
    """
    if fuse and not torch.is_grad_enabled() and not torch.compiler.is_compiling():
        try:
            return ctx.input_grad_buffers
        except RuntimeError:
            pass
    return (None,) * len(ctx.needs_input_grad)
