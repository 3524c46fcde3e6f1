"""Where a GPU's time goes in the trainer's ISIC step: measured kernel time per named scope, per kernel
kind and per kernel, beside what the cost model (benchmarks/hlo_cost.py) expects of each.

    python benchmarks/gpu_profile.py                       # on a GPU node: ISIC sparse step, 256 px, batch 16
    python benchmarks/gpu_profile.py --attention dense --steps 2 --out DIR

Compiles the trainer's own step (as ``gpu_bench.py`` builds it), runs ``--steps`` steps back to back
under ``jax.profiler``, and joins each GPU kernel event to the HLO instruction it ran (the event's
``hlo_op``) and so to the model's named scope (sga, mr_blocks, head, loss, optimizer). XLA groups
runs of kernels into CUDA graphs ("command buffers") whose events name only the graph, so this
script turns them off (``--xla_gpu_enable_command_buffer=``) unless ``--keep-command-buffers``:
each kernel is then its own launch, which costs some microseconds a kernel that a graph saves — the
tables are for finding the costly kernels, the step time is gpu_bench's. A Pallas kernel's estimate
counts only its operands and results, so a measured/estimated ratio far above 1 there is what it
re-reads; for XLA's own kernels it is how far they are from the roofline.

Prints the tables; writes ``--out``/profile.json (every op: measured us a step, launches, scope,
kind, estimated us and bytes) and the compiled module's text (``step.hlo.gz``).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and "--keep-command-buffers" not in sys.argv:
    # before jax is imported: one launch per HLO op, so every kernel event names its op
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import glob  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import hlo_cost  # noqa: E402

H100 = hlo_cost.Roofline(662e12, 3.35e12, 2e-6)  # the cost model's H100 (bf16 matmul as measured there)


def device_events(trace: dict) -> list[dict]:
    """The complete ("X") events of a Chrome trace that ran on a GPU (kernels, copies, memsets)."""
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in trace.get("traceEvents", [])
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    return [e for e in trace.get("traceEvents", [])
            if e.get("ph") == "X" and "dur" in e and "GPU" in names.get(e.get("pid"), "")]


def attribute(events: list[dict], kernels: list[hlo_cost.Kernel], steps: int,
              roofline: hlo_cost.Roofline = H100) -> dict[str, Any]:
    """Per step: busy and span ms, launches, and measured against estimated time per scope, per kind
    and per op (``events`` from :func:`device_events` over ``steps`` steps; ``kernels`` from
    :func:`hlo_cost.kernels_of` of the same compiled module)."""
    known = {k.name: k for k in kernels}
    ops: dict[str, dict[str, Any]] = {}
    for e in events:
        op = e.get("args", {}).get("hlo_op") or e["name"]
        row = ops.setdefault(op, {"op": op, "us": 0.0, "launches": 0.0, "kernel": e["name"][:100]})
        row["us"] += e["dur"] / steps
        row["launches"] += 1 / steps
    scopes: dict[str, dict[str, float]] = defaultdict(lambda: {"ms": 0.0, "launches": 0.0, "est_ms": 0.0, "gb": 0.0})
    kinds: dict[str, dict[str, float]] = defaultdict(lambda: {"ms": 0.0, "launches": 0.0, "est_ms": 0.0, "gb": 0.0})
    for row in ops.values():
        k = known.get(row["op"])
        if k is not None:
            est = k.launches * roofline.seconds(k.flops, k.bytes) * 1e6
            row.update(scope=k.scope, kind=k.kind, est_us=est, gb=k.launches * k.bytes / 1e9)
        elif row["op"].startswith("command_buffer"):
            row.update(scope="(command buffer)", kind="(command buffer)", est_us=0.0, gb=0.0)
        else:  # copies and memsets XLA adds, ops of another module
            row.update(scope="(not in the module)", kind=row["kernel"][:40], est_us=0.0, gb=0.0)
        for table, key in ((scopes, row["scope"]), (kinds, row["kind"])):
            table[key]["ms"] += row["us"] / 1e3
            table[key]["launches"] += row["launches"]
            table[key]["est_ms"] += row["est_us"] / 1e3
            table[key]["gb"] += row["gb"]
    busy = sum(e["dur"] for e in events) / steps
    span = (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) / steps if events else 0.0
    return {"busy_ms": busy / 1e3, "span_ms": span / 1e3, "launches": len(events) / steps,
            "scopes": dict(scopes), "kinds": dict(kinds), "ops": sorted(ops.values(), key=lambda r: -r["us"])}


def tables(result: dict[str, Any], top: int = 30) -> str:
    """The scopes, the costliest kinds and ops as markdown."""
    def ratio(ms: float, est: float) -> str:
        return f"{ms / est:.1f}" if est > 0 else "-"

    lines = [f"GPU busy {result['busy_ms']:.2f} ms a step over a span of {result['span_ms']:.2f} ms, "
             f"{result['launches']:.0f} launches a step", "",
             "| scope | measured ms | launches | estimated ms | GB (est.) | measured / est. |",
             "|---|---|---|---|---|---|"]
    for name, r in sorted(result["scopes"].items(), key=lambda kv: -kv[1]["ms"]):
        lines.append(f"| {name} | {r['ms']:.2f} | {r['launches']:.0f} | {r['est_ms']:.2f} | {r['gb']:.2f} | "
                     f"{ratio(r['ms'], r['est_ms'])} |")
    lines += ["", "| kind | measured ms | launches | estimated ms | GB (est.) | measured / est. |",
              "|---|---|---|---|---|---|"]
    for name, r in sorted(result["kinds"].items(), key=lambda kv: -kv[1]["ms"])[:top]:
        lines.append(f"| {name} | {r['ms']:.2f} | {r['launches']:.0f} | {r['est_ms']:.2f} | {r['gb']:.2f} | "
                     f"{ratio(r['ms'], r['est_ms'])} |")
    lines += ["", "| op | scope | kind | measured us | launches | estimated us | measured / est. | kernel |",
              "|---|---|---|---|---|---|---|---|"]
    for r in result["ops"][:top]:
        lines.append(f"| {r['op']} | {r['scope']} | {r['kind']} | {r['us']:.1f} | {r['launches']:.0f} | "
                     f"{r['est_us']:.1f} | {ratio(r['us'], r['est_us'])} | {r['kernel'][:60]} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/isic.py")
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16, help="global batch")
    parser.add_argument("--attention", default="sparse", help="the SGA form (sparse or dense)")
    parser.add_argument("--kernels", default="gpu", help="model.kernels (portable where no GPU is)")
    parser.add_argument("--gpu-forms", default="all", help="model.gpu_forms: validated, all, or form names")
    parser.add_argument("--steps", type=int, default=3, help="steps traced, back to back")
    parser.add_argument("--top", type=int, default=30, help="rows of the kind and op tables")
    parser.add_argument("--sparse-products", action="store_true",
                        help="sparse SGA's group passes as matrix products (SparseSGABlocks.products)")
    parser.add_argument("--input-grad-by-xla", action="store_true",
                        help="the first SGA layer's input gradient as XLA's product of the projection's gradient, "
                             "not in the keys' pass (SparseSGABlocks.input_grad_features = 0)")
    parser.add_argument("--passes-apart", action="store_true",
                        help="sparse SGA's column sums and update, and d's gradient and the queries', as separate "
                             "passes, not one sweep each (SparseSGABlocks.sweep_rows = 0)")
    parser.add_argument("--keep-command-buffers", action="store_true",
                        help="profile the program as it trains (its CUDA graphs' kernels stay unattributed)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "gpu_profile"))
    return parser.parse_args(argv)


def policy_of(args: argparse.Namespace, kernels: str) -> Any:
    """The kernel policy the flags ask for: ``kernels`` and ``--gpu-forms`` resolved, sparse SGA's
    switches (:class:`jaxrat.ops.policy.SparseSGABlocks`) as the flags set them."""
    from jaxrat import ops

    policy = ops.resolve(kernels, "gpu" if kernels == "gpu" else None, gpu_forms=args.gpu_forms)
    changes = {"products": True} if args.sparse_products else {}
    changes.update({"input_grad_features": 0} if args.input_grad_by_xla else {})
    changes.update({"sweep_rows": 0} if args.passes_apart else {})
    return dataclasses.replace(policy, sparse_sga=dataclasses.replace(policy.sparse_sga, **changes))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import gpu_bench
    import jax

    from jaxrat.trainer.step import make_train_step

    args = parse_args(argv)
    os.chdir(REPO)
    kernels = args.kernels if gpu_bench.on_gpu() else "portable"
    policy = policy_of(args, kernels)
    spec, state, batch, row = gpu_bench.isic_setup(args.config, args.size, args.batch, kernels, args.attention,
                                                   args.gpu_forms, policy)
    t = time.perf_counter()
    step = make_train_step(spec).lower(state, batch).compile()
    row["compile_s"] = time.perf_counter() - t
    text = step.as_text()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with gzip.open(out / "step.hlo.gz", "wt") as f:
        f.write(text)
    for _ in range(2):
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t)
    row["latency_s"] = statistics.median(times)
    with tempfile.TemporaryDirectory(prefix="jaxrat-gpu-profile-") as d:
        with jax.profiler.trace(d):
            for _ in range(args.steps):
                state, metrics = step(state, batch)
            jax.block_until_ready((state, metrics))
        trace = json.load(gzip.open(glob.glob(f"{d}/plugins/profile/*/*.trace.json.gz")[0]))
    result = attribute(device_events(trace), hlo_cost.kernels_of(text, H100), args.steps)
    result.update(row, command_buffers=args.keep_command_buffers, sparse_products=args.sparse_products,
                  sparse_sga_blocks=dataclasses.asdict(policy.sparse_sga),
                  input_grad_by_xla=args.input_grad_by_xla, passes_apart=args.passes_apart,
                  device=jax.devices()[0].device_kind, jax=jax.__version__,
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    print(f"{row['step']} ({row['attention']}) {row['px']} px, batch {row['global_batch']}, {result['device']}: "
          f"compiled in {row['compile_s']:.1f} s, one step {row['latency_s'] * 1e3:.2f} ms waited for")
    if not result["launches"]:
        print("no GPU kernels in the trace: this profile needs a GPU")
    print(tables(result, args.top))
    (out / "profile.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {out / 'profile.json'} and {out / 'step.hlo.gz'}")
    return result


if __name__ == "__main__":
    main()
