"""Differential scenarios on an accelerator (the test device in CI).

Run with ``run.py --device testdevice``: the device's module is imported
before anything else (the engine starts its device threads once), and these
scenarios run instead of the CPU ones. Each returns what a user would
observe: which ``ctx.input_grad_buffers`` entries are exposed (and on which
device, with which dtype), the gradients, the dtypes backward receives, and
the exact error texts. Only the public torch 2.15 API is used, so the same
file runs on native 2.15 and on older torch + torch_ctxext.

The scenarios are a table: a place (where the forward runs), a graph (what
reaches the Function's inputs) and a dtype, as PyTorch's OpInfo states its
samples.
"""
import threading

import torch
from torch.autograd import Function

DEVICE = None  # set by run.py: torch.device("testdevice", 0)
DEVICE_SCENARIOS = []


def _module():
    return getattr(torch, DEVICE.type)


def _second():
    return torch.device(DEVICE.type, 1) if _module().device_count() > 1 else DEVICE


def values(t):
    return None if t is None else [round(v, 4) for v in t.detach().cpu().double().flatten().tolist()]


def describe_entries(entries):
    if isinstance(entries, str):
        return {"error": entries}
    return {
        "exposed": sum(e is not None for e in entries),
        "entries": [None if e is None else {"device": str(e.device), "dtype": str(e.dtype)} for e in entries],
    }


def read(ctx):
    try:
        return ctx.input_grad_buffers
    except RuntimeError as e:
        return str(e)


def fused_scale(record):
    """x * w; backward fuses grad_x (and grad_w) into exposed buffers."""

    class Scale(Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x * w

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            entries = read(ctx)
            record.append(describe_entries(entries))
            if isinstance(entries, str):
                raise RuntimeError(entries)
            gx, gw = g * w, g * x
            if entries[0] is not None:
                entries[0].add_(gx)
                gx = None
            if entries[1] is not None:
                entries[1].add_(gw.to(entries[1].dtype))
                gw = None
            return gx, gw

    return Scale


def observe(body):
    """Run ``body`` -> (x, w); observe grads, entries and any error."""
    record = []
    out = {}
    try:
        x, w = body(fused_scale(record))
        out["x_grad"], out["w_grad"] = values(x.grad), values(w.grad)
    except RuntimeError as e:
        out["error"] = str(e)
    out["reads"] = record
    return out


def leaves(device, dtype):
    x = torch.tensor([1.0, 2.0, 3.0], dtype=dtype, device=device, requires_grad=True)
    w = torch.tensor([4.0, 5.0, 6.0], dtype=dtype, device=device, requires_grad=True)
    return x, w


def on(stream, fn):
    if stream is None:
        return fn()
    with _module().stream(stream):
        return fn()


# Places: (device, stream) where the Function's forward runs.
def place(name):
    if name == "default":
        return DEVICE, None
    if name == "side_stream":
        return DEVICE, _module().Stream(DEVICE)
    if name == "second_device":
        return _second(), None
    raise ValueError(name)


# Graphs: what else reaches x and w, built around Scale.
def graph_other_producer_first(Scale, x, w):  # x * 5 created after Scale: runs first
    return Scale.apply(x, w).sum() + (x * 5).sum()


def graph_both_inputs(Scale, x, w):
    return Scale.apply(x, w).sum() + (x * 5).sum() + (w * 2).sum()


def graph_later_producer(Scale, x, w):  # x * 3 created first: runs after Scale
    return (x * 3).sum() + Scale.apply(x, w).sum() + (x * 5).sum()


def graph_alone(Scale, x, w):
    return Scale.apply(x, w).sum()


def graph_aliased(Scale, x, w):  # the gradient reaches x through add's two branches
    y = x + 0
    return Scale.apply(x, w).sum() + (y + y).sum()


GRAPHS = {
    "other_producer_first": graph_other_producer_first,
    "both_inputs": graph_both_inputs,
    "later_producer": graph_later_producer,
    "alone": graph_alone,
    "aliased": graph_aliased,
}

TABLE = [
    (place_name, graph_name, dtype)
    for place_name in ("default", "side_stream", "second_device")
    for graph_name in GRAPHS
    for dtype in (torch.float32,)
] + [
    ("default", "other_producer_first", torch.float64),
    ("default", "other_producer_first", torch.float16),
    ("side_stream", "both_inputs", torch.bfloat16),
]


def _table_scenario(place_name, graph_name, dtype):
    def run():
        device, stream = place(place_name)
        x, w = leaves(device, dtype)

        def body(Scale):
            on(stream, lambda: GRAPHS[graph_name](Scale, x, w).backward())
            _module().synchronize()
            return x, w

        return observe(body)

    name = f"device_{place_name}_{graph_name}_{str(dtype).replace('torch.', '')}"
    DEVICE_SCENARIOS.append((name, run))


for _row in TABLE:
    _table_scenario(*_row)


def device_scenario(fn):
    DEVICE_SCENARIOS.append((f"device_{fn.__name__}", fn))
    return fn


@device_scenario
def two_streams_refused():
    """Forward of Scale on a side stream, x's other producer on the default
    stream: the running node's stream differs from the slot's."""
    side = _module().Stream(DEVICE)
    x, w = leaves(DEVICE, torch.float32)

    def body(Scale):
        with _module().stream(side):
            y = Scale.apply(x, w)
        _module().current_stream(DEVICE).wait_stream(side)
        (y.sum() + (x * 5).sum()).backward()
        return x, w

    return observe(body)


@device_scenario
def device_to_cpu_boundary():
    """A CPU Function fed by a device-to-CPU copy: its buffer is on the CPU."""
    x_dev = torch.tensor([1.0, 2.0], device=DEVICE, requires_grad=True)
    w = torch.tensor([3.0, 4.0], requires_grad=True)

    def body(Scale):
        x = x_dev.cpu()
        (Scale.apply(x, w).sum() + (x * 5).sum()).backward()
        return x_dev, w

    return observe(body)


@device_scenario
def cpu_buffer_on_device_thread_refused():
    """A CPU leaf whose consumer runs on the device's thread."""
    seen = {}

    class ToDevice(Function):
        @staticmethod
        def forward(ctx, x):
            return x.to(DEVICE) * 2

        @staticmethod
        def backward(ctx, g):
            (buffer,) = ctx.input_grad_buffers
            seen["exposed"] = buffer is not None
            if buffer is not None:
                buffer.add_((g * 2).cpu())
                return None
            return (g * 2).cpu()

    x = torch.ones(3, requires_grad=True)
    out = {}
    try:
        (ToDevice.apply(x).sum().cpu() + (x * 3).sum()).backward()
        out["x_grad"] = values(x.grad)
    except RuntimeError as e:
        out["error"] = str(e)
    out.update(seen)
    return out


@device_scenario
def later_producer_on_another_thread():
    """A CPU buffer exposed on the CPU thread and reached later from the
    device's thread."""
    seen = {}

    class ToDeviceOnly(Function):
        @staticmethod
        def forward(ctx, x):
            return x.to(DEVICE)

        @staticmethod
        def backward(ctx, g):
            return g.cpu()

    class CpuScale(Function):
        @staticmethod
        def forward(ctx, x, w):
            return x * 2 + w.cpu()

        @staticmethod
        def backward(ctx, g):
            buffer, _ = ctx.input_grad_buffers
            seen["exposed"] = buffer is not None
            if buffer is not None:
                buffer.add_(g * 2)
                return None, g.to(DEVICE)
            return g * 2, g.to(DEVICE)

    x = torch.ones(3, requires_grad=True)
    out = {}
    try:
        (CpuScale.apply(x, ToDeviceOnly.apply(x)).sum() + (x * 3).sum()).backward()
        out["x_grad"] = values(x.grad)
    except RuntimeError as e:
        out["error"] = str(e)[:80]  # the thread ids in the text differ run to run
    out.update(seen)
    return out


@device_scenario
def two_devices():
    """Inputs on two devices, the Function on the first's thread."""
    seen = {}

    class TwoDevices(Function):
        @staticmethod
        def forward(ctx, x, w):
            return x * w.to(x.device)

        @staticmethod
        def backward(ctx, g):
            seen.update(describe_entries(read(ctx)))
            return g * 2, (g * 3).to(_second())

    x = torch.tensor([1.0, 2.0], device=DEVICE, requires_grad=True)
    w = torch.tensor([3.0, 4.0], device=_second(), requires_grad=True)
    (TwoDevices.apply(x, w).sum() + (x * 5).sum()).backward()
    _module().synchronize()
    return {"x_grad": values(x.grad), "w_grad": values(w.grad), **seen}


@device_scenario
def threads_at_once():
    """Four threads running backward on the device at once."""
    results = []

    def work():
        record = []
        x, w = leaves(DEVICE, torch.float32)
        (fused_scale(record).apply(x, w).sum() + (x * 5).sum()).backward()
        results.append((record[0]["exposed"], values(x.grad)))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"results": sorted(results)}


def _declared(declared, stream_name):
    def run():
        device, stream = place(stream_name)
        seen = {}

        class Declared(Function):
            @staticmethod
            def forward(ctx, x):
                ctx.set_output_grad_dtype(declared)
                return x * 2

            @staticmethod
            def backward(ctx, g):
                seen["dtype"], seen["device"] = str(g.dtype), str(g.device)
                return (g * 2).to(torch.float32)

        x = torch.tensor([1.0, 2.0], device=device, requires_grad=True)
        y = on(stream, lambda: Declared.apply(x))
        root = torch.float64 if declared is None else torch.float32
        torch.autograd.backward(y, torch.ones(2, dtype=root, device=device))
        _module().synchronize()
        return {"x_grad": values(x.grad), **seen}

    name = f"device_declared_{str(declared).replace('torch.', '')}_{stream_name}"
    DEVICE_SCENARIOS.append((name, run))


for _declared_dtype, _stream_name in (
    (torch.float64, "default"),
    (torch.float16, "side_stream"),
    (torch.bfloat16, "second_device"),
    (None, "default"),
):
    _declared(_declared_dtype, _stream_name)


@device_scenario
def boxed_grads():
    seen = {}

    class Fanout(Function):
        boxed_grads_call = True

        @staticmethod
        def forward(ctx, x):
            return x * 1, x * 2

        @staticmethod
        def backward(ctx, grads):
            seen["list"] = type(grads).__name__
            seen["devices"] = [str(g.device) for g in grads]
            total = grads[0] + 2 * grads[1]
            grads.clear()
            return total

    x = torch.tensor([1.0, 2.0], device=DEVICE, requires_grad=True)
    a, b = Fanout.apply(x)
    ((a * 3).sum() + (b * 5).sum()).backward()
    return {"x_grad": values(x.grad), **seen}
