"""Where torch releases differ (csrc/engine_layout.h), as far as the
conformance suite does not reach: CI runs this file on every release of its
subset (tools/run.py), the suite on the same releases.

* Up to torch 2.9 the engine casts every gradient to the output's dtype, so
  ``set_output_grad_dtype(None)`` goes through a wrapper around the engine's
  ``validate_outputs``: placed at the first None declaration only, keyed so
  that a node born at a dead declaring node's address is not taken for it,
  and back on its one-atomic-load path once the declaring nodes are gone.
* The reentrancy guard of ``input_grad_buffers`` (a subclass of
  ``torch._C._ImperativeEngine`` put in ``Variable._execution_engine``) works.
* ``features()`` and ``python -m torch_ctxext info`` say who provides each
  member and by which route on this release.

Scenarios whose outcome depends on process-wide state (whether a hook was
ever placed) run in a fresh interpreter.
"""
import textwrap

import pytest
import torch
from torch.autograd import Function
from torch.autograd.variable import Variable

import torch_ctxext
from torch_ctxext import _features
from doubling_functions import doubling
from support import python

FEATURES = torch_ctxext.features()


def extension():
    from torch_ctxext._ext import loader as _extension

    return _extension.load()


CASTS_EVERY_GRADIENT = (
    FEATURES["set_output_grad_dtype"] == "torch_ctxext" and extension().boundaries["ENGINE_CASTS_TO_OPTIONS_DTYPE"]
)
needs_uncast_wrapper = pytest.mark.skipif(
    not CASTS_EVERY_GRADIENT,
    reason="the engine of this torch leaves a None declaration uncast by itself (2.10 on)",
)
backported_buffers = pytest.mark.skipif(
    FEATURES["input_grad_buffers"] != "torch_ctxext",
    reason="input_grad_buffers is native here",
)


def run(code):
    result = python(code=code)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip()


FUNCTIONS = """
    import torch, torch_ctxext
    from torch.autograd import Function
    from torch_ctxext._ext import loader as _extension

    ext = _extension.load()
    seen = []

    def scaling(*declaration):
        class Scale(Function):
            @staticmethod
            def forward(ctx, x):
                if declaration:
                    ctx.set_output_grad_dtype(*declaration)
                return x * 2

            @staticmethod
            def backward(ctx, g):
                seen.append(str(g.dtype).replace("torch.", ""))
                return g.float() * 2
        return Scale

    Uncast, Plain, Double = scaling(None), scaling(), scaling(torch.float64)
    x = torch.ones(2, requires_grad=True)
    root = torch.ones(2, dtype=torch.float64)
"""


@needs_uncast_wrapper
def test_the_validate_outputs_wrapper_is_placed_only_by_a_none_declaration():
    """Concrete dtypes need no wrapper; the first None declaration places it."""
    out = run(
        FUNCTIONS
        + """
    Double.apply(x).backward(root.half())
    Plain.apply(x).backward(root)
    before = ext._testing.uncast_hook_placed()
    Uncast.apply(x).backward(root)
    print(before, ext._testing.uncast_hook_placed(), seen)
    """
    )
    assert out == "False True ['float64', 'float32', 'float64']"


@needs_uncast_wrapper
def test_once_the_declaring_nodes_are_gone_the_wrapper_takes_its_fast_path():
    """While a declaring node lives each node run looks its edges up; once it
    died, the first run sweeps the record and later runs only load a count."""
    out = run(
        FUNCTIONS
        + """
    y = Uncast.apply(x)
    alive = ext._testing.live_uncast_declarations()
    y.backward(root)
    del y
    def plain_backward():
        (Plain.apply(x) * 3).sum().backward()
    plain_backward()                       # sweeps the dead record
    locked = ext._testing.uncast_hook_locked_calls()
    plain_backward()
    plain_backward()
    print(alive, ext._testing.live_uncast_declarations(), ext._testing.uncast_hook_locked_calls() - locked, seen)
    """
    )
    assert out == "1 0 0 ['float64', 'float32', 'float32', 'float32']"


@needs_uncast_wrapper
def test_a_node_born_at_a_dead_declaring_nodes_address_gets_its_gradient_cast():
    """The registry is keyed by node address; a record whose node died must
    not apply to the next node at that address (the allocator hands freed
    nodes' memory to the next node of the same size)."""
    out = run(
        FUNCTIONS
        + """
    reused, declared_seen, later_seen = 0, set(), set()
    for _ in range(20):
        y = Uncast.apply(x)
        declared_at = ext.read_ctx_layout(y.grad_fn)["node_address"]
        y.backward(root)                   # uncast: float64
        declared_seen.update(seen)
        seen.clear()
        del y
        later = [Plain.apply(x) for _ in range(4)]
        reused += any(ext.read_ctx_layout(z.grad_fn)["node_address"] == declared_at for z in later)
        for z in later:
            z.backward(root)               # cast to the output's float32
        later_seen.update(seen)
        seen.clear()
        del later
    print(reused > 0, declared_seen, later_seen, ext._testing.live_uncast_declarations())
    """
    )
    assert out == "True {'float64'} {'float32'} 0"


def test_an_uncast_gradient_is_reduced_to_the_output_shape_like_a_cast_one():
    """validate_outputs sums a broadcast gradient down to the output's shape
    before casting; the uncast gradient gets the same reduction."""
    seen = {}

    def backward(ctx, g):
        seen["uncast"] = (g.dtype, tuple(g.shape), g.tolist())
        return g.float() * 2

    Uncast = doubling(backward, in_forward=lambda ctx: ctx.set_output_grad_dtype(None))

    class Broadcast(Function):  # hands back a (2, 3) gradient for a (3,) input
        @staticmethod
        def forward(ctx, y):
            return y * 1

        @staticmethod
        def backward(ctx, g):
            return g.double().expand(2, 3)

    x = torch.ones(3, requires_grad=True)
    Broadcast.apply(Uncast.apply(x)).sum().backward()
    assert seen["uncast"] == (torch.float64, (3,), [2.0, 2.0, 2.0])
    assert x.grad.tolist() == [4.0, 4.0, 4.0]


@backported_buffers
def test_the_reentrancy_guard_engine_works_on_this_torch():
    """After a buffer was handed out, Variable._execution_engine is the
    guarded subclass of torch._C._ImperativeEngine: backward() runs through
    it, and a backward() from the backward that holds a buffer is refused."""
    events = []

    def fuse_then_reenter(ctx, g):
        (buffer,) = ctx.input_grad_buffers
        events.append(buffer is not None)
        if buffer is None:
            return g * 2
        buffer.add_(g * 2)
        try:
            torch.ones(1, requires_grad=True).sum().backward()
        except RuntimeError as e:
            events.append(str(e))
        return None

    x = torch.ones(2, requires_grad=True)
    (doubling(fuse_then_reenter).apply(x).sum() + (x * 3).sum()).backward()
    engine = Variable._execution_engine
    assert isinstance(engine, torch._C._ImperativeEngine)
    assert type(engine).__name__ == "_GuardedEngine"
    assert events == [
        True,
        "Calling backward or grad reentrantly after accessing a non-None "
        "ctx.input_grad_buffers entry is not supported",
    ]
    assert x.grad.tolist() == [5.0, 5.0]
    y = torch.ones(2, requires_grad=True)
    (y * 4).sum().backward()  # through the guarded engine, outside any backward
    assert y.grad.tolist() == [4.0, 4.0]


def test_features_and_routes_say_who_provides_each_member_and_how():
    routes = _features.routes()
    assert list(routes) == list(_features.MEMBERS)
    for member, status in FEATURES.items():
        assert status in ("native", "torch_ctxext"), (member, status)
        assert (routes[member] == "native") == (status == "native"), (member, routes[member])
    if FEATURES["set_output_grad_dtype"] == "torch_ctxext":
        expected = "validate_outputs hook" if CASTS_EVERY_GRADIENT else "InputMetadata grad_dtype"
        assert expected in routes["set_output_grad_dtype"]
    info = python("-m", "torch_ctxext", "info")
    assert info.returncode == 0, info.stderr
    for member, route in routes.items():
        if route != "native":
            assert f"route: {route}" in info.stdout, (member, info.stdout)


@pytest.mark.parametrize("mode", ["torch.no_grad()", "torch.inference_mode()"])
def test_an_import_under_no_grad_installs_every_member_this_release_backports(mode):
    """The import depends on no mode of the caller's (it runs nothing of
    autograd; the boxed-grads path of torch 2.6 to 2.12 is found where the
    layout probe, in its child process, saw PyNode's vtable): an import
    under the caller's no_grad or inference_mode installs the same members as
    a plain import, on every release (test_import_modes.py runs the whole
    list of modes on the main release only)."""
    code = textwrap.dedent(f"""
        import json, torch
        with {mode}:
            import torch_ctxext
        print(json.dumps(torch_ctxext.features()))
    """)
    done = python(code=code, timeout=600)
    assert done.returncode == 0, done.stderr
    import json

    assert json.loads(done.stdout.strip().splitlines()[-1]) == FEATURES
