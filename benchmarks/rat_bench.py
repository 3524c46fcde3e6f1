"""RAT forward+backward: jaxrat (Flax) vs the PyTorch reference, side by side on this machine.

ISIC model dims (D=128, 4 blocks, 8 heads, 3 iterations, MLP ratio 4, dropout 0.1), batch 2,
input N(0, 1), train mode, loss = sum over scales of mean(tokens), as the reference's own benchmark
(docs/reference.md, "Size and cost").
Each measurement runs in its own subprocess. Peak memory = high-water RSS during the steps minus
the RSS before the first step (the same rule for both; for jaxrat, compilation happens before that
and is reported separately). jaxrat also reports ``compiled.memory_analysis()``.

    python benchmarks/rat_bench.py                      # 96 both; 128, 256 jaxrat only
    python benchmarks/rat_bench.py --sizes 64 96 --reference-sizes 64 96 --reps 5

Writes benchmarks/results/rat_bench.json. The reference needs the ``reference`` extra.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

DIMS = dict(feature_dims=128, num_blocks=4, num_heads=8, iters=3, mlp_ratio=4, mlp_dropout=0.1)


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    # Writing 5 to clear_refs resets VmHWM (the peak RSS) on Linux.
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _time_steps(step, reps: int) -> dict:
    rss0 = _rss_kb("VmRSS")
    _reset_peak()
    step()  # warm-up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return dict(times=times, median_s=statistics.median(times), peak_rss_delta_mb=(_rss_kb("VmHWM") - rss0) / 1024)


def run_ours(size: int, reps: int, pyramid: bool) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxrat import ops
    from jaxrat.models.rat import ResolutionAwareTransformer

    model = ResolutionAwareTransformer(**DIMS, rngs=nnx.Rngs(0), kernels=ops.resolve("auto"))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    sizes = [size, size // 2, size // 4] if pyramid else [size]
    xs = [jax.random.normal(jax.random.PRNGKey(i), (2, s, s, 3)) for i, s in enumerate(sizes)]

    def step(params, rest, xs):
        m = nnx.merge(graphdef, params, rest)
        loss, grads = nnx.value_and_grad(lambda m: sum(jnp.mean(o.tokens) for o in m(xs)))(m)
        return loss, grads, nnx.state(m, nnx.RngState)

    t = time.perf_counter()
    compiled = jax.jit(step).lower(params, rest, xs).compile()
    compile_s = time.perf_counter() - t
    ma = compiled.memory_analysis()

    def once():
        nonlocal rest
        loss, grads, rng = compiled(params, rest, xs)
        jax.block_until_ready(grads)
        nnx.update(rest, rng)  # advance the dropout stream like a training loop would

    out = _time_steps(once, reps)
    out.update(
        compile_s=compile_s,
        xla_temp_mb=ma.temp_size_in_bytes / 2**20,
        xla_argument_mb=ma.argument_size_in_bytes / 2**20,
        xla_output_mb=ma.output_size_in_bytes / 2**20,
        xla_peak_mb=getattr(ma, "peak_memory_in_bytes", 0) / 2**20,
    )
    return out


def run_reference(size: int, reps: int, pyramid: bool) -> dict:
    import torch

    from jaxrat.models.torch_import import import_reference_package

    torch.set_num_threads(2)
    ref = import_reference_package()
    torch.manual_seed(0)
    model = ref.ResolutionAwareTransformer(spatial_dims=2, input_features=3, **DIMS).train()
    sizes = [size, size // 2, size // 4] if pyramid else [size]
    xs = [torch.randn(2, 3, s, s) for s in sizes]

    def once():
        loss = sum(o["x_out"].mean() for o in model(xs))
        loss.backward()
        model.zero_grad(set_to_none=True)

    return _time_steps(once, reps)


def _child(args: argparse.Namespace) -> None:
    fn = run_ours if args.child == "jaxrat" else run_reference
    print(json.dumps(fn(args.size, args.reps, args.pyramid)))


def _spawn(impl: str, size: int, reps: int, pyramid: bool, timeout: int) -> dict:
    cmd = [sys.executable, __file__, "--child", impl, "--size", str(size), "--reps", str(reps)]
    cmd += ["--pyramid"] if pyramid else []
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(error=f"timeout after {timeout}s")
    if proc.returncode != 0:
        return dict(error=(proc.stderr.strip().splitlines() or ["failed"])[-1][:200])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[96, 128, 256])
    parser.add_argument("--reference-sizes", type=int, nargs="*", default=[96])
    parser.add_argument("--pyramid", action="store_true", help="3-level pyramid [S, S/2, S/4] instead of one image")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--timeout", type=int, default=3600)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "rat_bench.json"))
    parser.add_argument("--child", choices=["jaxrat", "reference"], help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return

    rows = []
    for size in args.sizes:
        reps = args.reps if size <= 128 else 1
        ref = _spawn("reference", size, reps, args.pyramid, args.timeout) if size in args.reference_sizes else None
        ours = _spawn("jaxrat", size, reps, args.pyramid, args.timeout)
        rows.append(dict(size=size, pyramid=args.pyramid, reps=reps, jaxrat=ours, reference=ref))
        _print_row(rows[-1])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(dims=DIMS, batch=2, cpu_count=os.cpu_count(), rows=rows), indent=2))
    print(f"wrote {args.out}")


def _print_row(row: dict) -> None:
    if not getattr(_print_row, "header", False):
        print(f"{'input':>12} | {'ref fwd+bwd':>11} {'ref peak':>9} | {'jaxrat fwd+bwd':>14} {'RSS peak':>9} "
              f"{'XLA temp':>9} {'XLA peak':>9} {'compile':>8} | {'speed-up':>8} {'mem ratio':>9}")
        _print_row.header = True
    ours, ref = row["jaxrat"], row["reference"]
    name = f"{row['size']}^2" + (" pyr" if row["pyramid"] else "")
    fmt_t = lambda r: f"{r['median_s']:.2f} s" if r and "median_s" in r else (r.get("error", "-")[:11] if r else "-")
    fmt_m = lambda r: f"{r['peak_rss_delta_mb'] / 1024:.2f} GB" if r and "peak_rss_delta_mb" in r else "-"
    speed = mem = "-"
    if ref and "median_s" in ref and "median_s" in ours:
        speed = f"{ref['median_s'] / ours['median_s']:.1f}x"
        mem = f"1/{ref['peak_rss_delta_mb'] / ours['peak_rss_delta_mb']:.1f}"
    xla = lambda k: f"{ours[k] / 1024:.2f} GB" if k in ours else "-"
    comp = f"{ours['compile_s']:.0f} s" if "compile_s" in ours else "-"
    print(f"{name:>12} | {fmt_t(ref):>11} {fmt_m(ref):>9} | {fmt_t(ours):>14} {fmt_m(ours):>9} "
          f"{xla('xla_temp_mb'):>9} {xla('xla_peak_mb'):>9} {comp:>8} | {speed:>8} {mem:>9}", flush=True)


if __name__ == "__main__":
    main()
