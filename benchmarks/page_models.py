"""The benchmarks page's sections on whole models (written by page.py):
the shared-layer model of bench_model.py, and advise()'s prediction against
fuse(model)'s saving of bench_advise.py."""
import bench_advise
import bench_model


def _model_versions(results):
    w = results["workers"]
    out = []
    if "backport" in w:
        b = w["backport"]
        out.append(f"torch {b['torch']} + torch_ctxext {b.get('torch_ctxext', '?')}")
    if "native" in w:
        n = w["native"]
        watch = f"; advise() watches in {n['advise_watch']}" if n.get("advise_watch") else ""
        out.append(f"native torch {n['torch']} " + (
            f"(torch_ctxext imported: it patches nothing there{watch})" if n.get("plugin")
            else "(torch_ctxext not imported)"))
    return "; ".join(out)


def _measured_by(module, part, results):
    """The sentence naming the run that measured a model section."""
    m = results["machine"]
    la0, la1 = m.get("load_average_at_start"), m.get("load_average_at_end")
    load = f"{la0[0]:.2f} / {la1[0]:.2f}" if la0 and la1 else "unknown"
    return (
        f"Measured by `benchmarks/{module.__name__}.py` (`python benchmarks/run_all.py --from-json "
        f"docs/benchmarks.json --remeasure {part} --torch-2-15 PYTHON_OF_TORCH_2.15`"
        + (" --quick" if results["quick"] else "")
        + f"; its own run: {results['date']}, {results['seconds']:.0f} s, checkout "
        f"{m.get('git_commit', '?')}, load average at start / end {load}; {_model_versions(results)}; "
        "1 intra-op thread per worker)."
    )


def _how(module):
    return [f"How it is measured (from `benchmarks/{module.__name__}.py`):", "",
            module.__doc__.split("\n\n", 2)[2].strip(), ""]


def model_section(results, figure):
    """The section on the shared-layer model (Markdown)."""
    lines = [
        "## A model that shows the gain: one block shared across depth",
        "",
        _measured_by(bench_model, "model", results),
        "",
        f"![Training step of the shared-layer model, fused / unfused]({figure})",
        "",
        "Training step time (ms: median over rounds of each variant's fastest step) and the "
        "ratios (median over rounds, range over rounds); lower is better:",
        "",
        bench_model.tables(results).split("\n\n")[0],
        "",
        "Peak of a whole training step above what was live before it (allocator events):",
        "",
        bench_model.tables(results).split("\n\n")[1],
        "",
        f"Loss curves ({results['losses']['steps']} SGD steps, lr 0.05, same initial weights and "
        "batches; the largest difference between two curves):",
        "",
        bench_model.loss_table(results),
        "",
    ]
    explained = results["losses"].get("backport", {}).get("explain")
    if explained:
        depth = results["losses"]["config"]["depth"]
        lines += [
            f"`torch_ctxext.explain()` over one fused backward (depth {depth}): "
            f"{explained['reads']} reads of `ctx.input_grad_buffers`, {explained['exposed']} "
            f"buffers exposed (weight and bias of fc1 and fc2 at {depth - 1} of their {depth} "
            f"uses); {explained['fell_back']} tensor entries were None (each Linear's input, "
            "used once, and each weight and bias at the use that runs backward first: no "
            "earlier producer).",
            "",
        ]
    return "\n".join(lines + _how(bench_model))


def advise_section(results, figure):
    """The section on advise()'s prediction against fuse(model)'s saving (Markdown)."""
    lines = [
        "## Where fusing pays: the advice against the measurement",
        "",
        _measured_by(bench_advise, "advise", results)[:-1]
        + ". The models are those of [Where fusing pays](where-fusing-pays.md), at these sizes:",
        "",
        bench_advise.sizes_table(results),
        "",
        f"![advise()'s predicted saving against the measured one, per model]({figure})",
        "",
        "One backward of the stock model against `torch_ctxext.nn.fuse(model)`, from the CPU "
        "allocator's events; the difference is (measured − predicted) in units of the largest "
        "gradient the drop-ins fuse:",
        "",
        bench_advise.memory_table(results),
        "",
        "A training step (forward and backward) of the stock model, of the stock model inside "
        "`advise(model)` (the cost of watching), and of the fused model; lower is better:",
        "",
        bench_advise.time_table(results),
        "",
    ]
    if "device" in results:
        lines += [
            "On the test device (`testdevice`, sampled: its allocator counts live bytes only):",
            "",
            bench_advise.device_table(results),
            "",
        ]
    return "\n".join(lines + _how(bench_advise))
