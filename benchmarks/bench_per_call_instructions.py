"""FusedLinear's cost per call counted in instructions: against nn.Linear
and against the least custom Function, free of the machine's noise.

    python benchmarks/bench_per_call_instructions.py [ROWS FEATURES USES STEPS] [--source DIR]

One process under valgrind's callgrind runs, for ``nn.Linear``,
bench_fused's least custom Function (``_FloorLinear``: ``F.linear``, then
``g @ W``, ``g.t() @ x``, ``g.sum(0)``, the products of ``nn.Linear``'s own
backward) and ``FusedLinear`` with the same weights, ``STEPS`` steps of
``USES`` calls on inputs of ``ROWS x FEATURES`` (a ``FEATURES x FEATURES``
layer; one backward per step), then as many forward calls alone (grad
mode on: the forward that builds the graph). Each phase ends with a call of ``getppid`` (callgrind dumps its
counters there, ``--dump-before=getppid``): a phase's count, over its calls,
is the instructions per call, with the interpreter's start, the imports and
the warm-up steps counted apart. Two rounds, the smaller count of each.
``--source DIR``: the torch_ctxext to count (default: this checkout's), to
compare two versions. BLAS and OpenMP get one thread, Python one hash seed.

Instructions are not time, but every Python-level step a Function adds per
call executes instructions: the figure to compare versions by on a noisy
machine, next to bench_fused.py's CPU time side by side.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = ("stock", "floor", "fused")

SCRIPT = """
import os, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[2])
import torch
import torch_ctxext
from torch_ctxext.nn import FusedLinear
from bench_fused import _FloorLinear
torch.set_num_threads(1)
torch.manual_seed(0)
rows, features, uses, steps = (int(a) for a in sys.argv[3:7])
stock = torch.nn.Linear(features, features)
layers = {"stock": stock, "floor": _FloorLinear(features, features), "fused": FusedLinear(features, features)}
for layer in layers.values():
    layer.load_state_dict(stock.state_dict())
xs = [torch.randn(rows, features, requires_grad=True) for _ in range(uses)]
gs = [torch.randn(rows, features) for _ in range(uses)]

def step(layer):
    torch.autograd.backward([layer(x) for x in xs], gs)

def forward(layer):
    for x in xs:
        layer(x)

for layer in layers.values():
    for _ in range(50):
        step(layer)
        forward(layer)
os.getppid()
for _ in range(2):
    for name in %r:
        for run in (step, forward):
            for _ in range(steps):
                run(layers[name])
            os.getppid()
""" % (VARIANTS,)


def available():
    """None if callgrind can run here, else why not."""
    return None if shutil.which("valgrind") else "valgrind is not installed"


def measure(rows=4, features=16, uses=1, steps=100, source=None):
    """{"step": {variant: instructions per call}, "forward": {...}}: a call's
    forward and backward (one backward per step of ``uses`` calls), and its
    forward alone (grad mode on: the graph is built)."""
    source = source or os.path.dirname(HERE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0")
    work = tempfile.mkdtemp(prefix="torch_ctxext-bench-per-call-")
    try:
        with open(os.path.join(work, "calls.py"), "w") as f:
            f.write(SCRIPT)
        out = os.path.join(work, "callgrind")
        with open(out + ".stderr", "w") as err:
            done = subprocess.run(
                ["valgrind", "--tool=callgrind", "--dump-before=getppid", f"--callgrind-out-file={out}",
                 sys.executable, os.path.join(work, "calls.py"), source, HERE,
                 str(rows), str(features), str(uses), str(steps)],
                env=env, cwd=work, stdout=subprocess.DEVNULL, stderr=err)
        if done.returncode != 0:
            with open(out + ".stderr") as err:
                raise RuntimeError(f"callgrind failed:\n{err.read()[-2000:]}")
        dumps = sorted((p for p in os.listdir(work) if re.fullmatch(r"callgrind\.\d+", p)),
                       key=lambda p: int(p.rsplit(".", 1)[1]))
        totals = []
        for name in dumps[1:]:  # the first: the start, the imports, the warm-up
            with open(os.path.join(work, name)) as f:
                totals.append(int(re.search(r"^(?:summary|totals):\s*(\d+)", f.read(), re.M).group(1)))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    phases = [(run, name) for _ in range(2) for name in VARIANTS for run in ("step", "forward")]
    result = {"step": {}, "forward": {}}
    for (run, name), total in zip(phases, totals):
        per_call = total / (steps * uses)
        result[run][name] = min(result[run].get(name, per_call), per_call)
    return result


if __name__ == "__main__":
    args = sys.argv[1:]
    source = None
    if "--source" in args:
        i = args.index("--source")
        source = args[i + 1]
        del args[i:i + 2]
    sizes = [int(a) for a in args] or [4, 16, 1, 100]
    why = available()
    if why:
        sys.exit(why)
    got = measure(*sizes, source=source)
    print(f"rows {sizes[0]}, Linear({sizes[1]}, {sizes[1]}), {sizes[2]} use(s) per step; "
          "thousands of instructions per call")
    for run in ("step", "forward"):
        c = got[run]
        print(f"{run}: nn.Linear {c['stock'] / 1e3:.1f}k, least custom Function "
              f"{(c['floor'] - c['stock']) / 1e3:+.1f}k, FusedLinear {(c['fused'] - c['stock']) / 1e3:+.1f}k "
              f"(above the least Function {(c['fused'] - c['floor']) / 1e3:+.1f}k)")
