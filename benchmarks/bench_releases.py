"""Idle and read cost on each supported torch release, one release after another.

    python benchmarks/run_all.py --from-json FILE --remeasure releases --torch-2-15 PY215 \\
                                 --other-releases PYTHON[:BUILT_TREE]...

The idle and read measurements of benchmarks/bench_overhead.py, on each
release with the torch_ctxext of its environment (``python3 tools/run.py matrix
--bench`` runs it for every supported release); see collect_idle_releases().
"""
import statistics

from bench import Worker, alternate, log, ratio_stats, release_key, spread
from bench_overhead import alternate_read, read_results

# The workers serve the idle and read measurements.
MODULES = ["bench_overhead"]


def collect_idle_releases(pythons, plan, native=None):
    """Idle and read cost on each torch release, with the torch_ctxext of that
    environment: its installed one, or, for ``PYTHON:DIR``, the copy of the
    tree built in place in DIR (first on PYTHONPATH).

    Per release, alternated side by side: forward+backward of a Function that
    uses nothing new in a process with ``import torch_ctxext`` against one
    without; where torch_ctxext wraps the engine's validate_outputs (torch <=
    2.9), a third process in which a None declaration placed that wrapper;
    and reading ctx.input_grad_buffers against native torch 2.15 (``native``,
    its python), where torch_ctxext provides it. Returns {torch version:
    {"us": ..., "with_import": ratio stats, ["with_uncast_hook": ...],
    ["read_us": ..., "read_over_native": ...], "features": ...}}."""
    results = {}
    for entry in pythons:
        python, _, path = entry.partition(":")
        workers = [Worker(python, "without", False, MODULES, source_tree=False, path=path or None),
                   Worker(python, "with", True, MODULES, source_tree=False, path=path or None)]
        try:
            info = workers[1].ready()
            version = workers[0].ready()["torch"]
            features = info.get("features", {})
            if features.get("set_output_grad_dtype") == "torch_ctxext":
                hooked = Worker(python, "with-uncast-hook", True, MODULES, source_tree=False, path=path or None)
                workers.append(hooked)
                if not hooked.call("declare_none_once")["uncast_hook_placed"]:
                    workers.pop().close()  # the engine leaves None uncast: no wrapper
            _, per_round = alternate(
                workers, plan["idle_rounds"], "idle", "fwd_bwd_us",
                n=plan["idle_n"], samples=plan["idle_samples"], warmup=plan["idle_warmup"],
            )
            row = {
                "features": features,
                "us": {k: statistics.median(v) for k, v in per_round.items()},
                "with_import": ratio_stats(
                    [a / b for a, b in zip(per_round["with"], per_round["without"])]
                ),
            }
            if "with-uncast-hook" in per_round:
                row["with_uncast_hook"] = ratio_stats(
                    [a / b for a, b in zip(per_round["with-uncast-hook"], per_round["without"])]
                )
            if native and features.get("input_grad_buffers") == "torch_ctxext":
                reference = Worker(native, "native", False, MODULES, source_tree=False)
                workers.append(reference)
                pair = [workers[1], reference]
                reads = read_results(
                    alternate_read(pair, plan["read_rounds"], plan["read_n"], plan["read_samples"]),
                    "with", "native",
                )
                row["read_us"] = reads["us"]
                row["read_excess_us"] = reads["excess_us"]
                row["read_over_native"] = reads["backport_over_native"]
                row["read_excess_over_native"] = reads["excess_over_native"]
        finally:
            for w in workers:
                w.close()
        results[version] = row
        log(f"idle and read on torch {version} done")
    return results


def idle_releases_table(results):
    out = [
        "| torch | provided by torch_ctxext | idle: with `import torch_ctxext` / without "
        "(10th–90th pct.) | idle after a `None` declaration (torch ≤ 2.9) | "
        "reading `ctx.input_grad_buffers` (excess over a baseline read) | read / native 2.15 "
        "| excess / native 2.15 (target ≤ 1.1) |",
        "|---|---|---|---|---|---|---|",
    ]
    for version, r in sorted(results["idle_releases"].items(), key=lambda kv: release_key(kv[0])):
        provided = ", ".join(
            f"`{m}`" for m, how in sorted(r.get("features", {}).items()) if how == "torch_ctxext"
        ) or "nothing"
        hook = spread(r["with_uncast_hook"]) if "with_uncast_hook" in r else "–"
        read = f"{r['read_us']['with']:.2f} us" if "read_us" in r else "native"
        if "read_excess_us" in r:
            read += f" ({r['read_excess_us']['with'] * 1e3:.0f} ns; native {r['read_excess_us']['native'] * 1e3:.0f} ns)"
        over = spread(r["read_over_native"]) if "read_over_native" in r else "–"
        excess = spread(r["read_excess_over_native"]) if "read_excess_over_native" in r else "–"
        out.append(
            f"| {version} | {provided} | {spread(r['with_import'])} "
            f"({r['us']['with']:.1f} / {r['us']['without']:.1f} us) | {hook} | {read} | {over} | {excess} |"
        )
    return "\n".join(out)
