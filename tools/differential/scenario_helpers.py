"""The registry of the CPU differential scenarios and the helpers that turn
what a scenario saw into JSON-comparable observations.

A scenario is registered under a dotted name ``<member>.<concern>.<case>``
(``input_grad_buffers.engine_order.leaf_consumer_after``), through the
:class:`Section` of its member and concern::

    ORDER = Section("input_grad_buffers.engine_order")

    @ORDER.scenario
    def only_consumer_is_fn(): ...

    ORDER.table(build_order_case, {"leaf_consumer_after": dict(leaf_x=True, after=True), ...})

A table states a family of alike scenarios as rows of parameters for one
builder, as PyTorch's OpInfo states its samples.
"""

import torch

SCENARIOS = []  # (name, zero-argument callable) in registration order
_NAMES = set()


def register(name, fn):
    if name in _NAMES:
        raise ValueError(f"two scenarios are named {name!r}")
    _NAMES.add(name)
    SCENARIOS.append((name, fn))
    return fn


class Section:
    """The scenarios of one member and concern: names ``<prefix>.<case>``."""

    def __init__(self, prefix):
        self.prefix = prefix

    def scenario(self, fn):
        """Decorator: register ``fn`` as ``<prefix>.<fn.__name__>``."""
        return register(f"{self.prefix}.{fn.__name__}", fn)

    def table(self, build, rows):
        """Register one scenario per row: ``build(**row)`` named ``<prefix>.<case>``."""
        for case, params in rows.items():
            register(f"{self.prefix}.{case}", lambda build=build, params=params: build(**params))


# ------------------------------------------------------------ observations


def tensor_values(t, digits=4):
    """A tensor as a rounded (nested) list; complex as [re, im] pairs, bool as is.
    None stays None; anything else is its repr."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        return repr(t)
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    if t.dtype == torch.bool:
        return t.tolist()

    def rounded(v):
        if isinstance(v, list):
            return [rounded(i) for i in v]
        return round(v, digits)

    return rounded(t.to(torch.float64).tolist())


def grad_values(**tensors):
    """{"x.grad": values of x.grad, ...} for the tensors named."""
    return {f"{name}.grad": tensor_values(t.grad) for name, t in tensors.items()}


def error_of(e):
    """An exception as its type name and message."""
    return {"exc_type": type(e).__name__, "msg": str(e)}


def dtype_name(t):
    """A tensor's dtype as a string (None for None)."""
    return None if t is None else str(t.dtype)


def outcome_of(f):
    """{"ok": f()} or {"error": error_of(the exception f raised)}."""
    try:
        return {"ok": f()}
    except Exception as e:  # noqa: BLE001
        return {"error": error_of(e)}


def describe_buffers(buffers):
    """A tuple returned by ctx.input_grad_buffers: its length and, per entry,
    None or the tensor's type, dtype, shape and values."""
    if not isinstance(buffers, tuple):
        return {"not_tuple": type(buffers).__name__}
    entries = [
        None
        if b is None
        else {"type": type(b).__name__, "dtype": str(b.dtype), "shape": list(b.shape), "values": tensor_values(b)}
        for b in buffers
    ]
    return {"len": len(buffers), "entries": entries}


def read_buffers(ctx):
    """(describe_buffers(ctx.input_grad_buffers), None), or (None, error) where reading raises."""
    try:
        return describe_buffers(ctx.input_grad_buffers), None
    except Exception as e:  # noqa: BLE001
        return None, error_of(e)


def fuse_into(buffer, grad):
    """What a fusing backward returns for one input: where ``buffer`` (its
    entry of ctx.input_grad_buffers) is exposed, ``grad`` is added into it and
    None is returned, so the engine adds nothing more; where it is None,
    ``grad`` itself."""
    if buffer is None:
        return grad
    buffer.add_(grad)
    return None


def leaf(vals, dtype=torch.float32):
    """A leaf tensor that requires grad."""
    return torch.tensor(vals, dtype=dtype, requires_grad=True)


def backward_with_later_consumer(F):
    """x = leaf([1, 2]) reaches F and then x*3 (created after F, so its
    gradient is pending when F's backward runs); backward of the sum of both.
    Returns x."""
    x = leaf([1.0, 2.0])
    y = F.apply(x)
    (y.sum() + (x * 3.0).sum()).backward()
    return x
