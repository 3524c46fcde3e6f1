"""How RAT's fwd+bwd time and memory grow with pixels: global vs windowed MR attention, remat.

ISIC model dims (D=128, 4 blocks, 8 heads, 3 iterations, decoder head, dim 32), sparse SGA,
batch 2, train mode (dropout 0.1), loss = mean of the logits squared. For each variant and size,
in its own subprocess: the whole segmenter's compiled step (``memory_analysis``: temp and
argument bytes, no running needed) and, where asked, its time (min over reps after a warm-up);
plus the per-component split (first SGA layer, first multi-resolution block, head), each jitted
fwd+bwd on its own input shape.

    python benchmarks/rat_scaling.py --sizes 128 256 512 1024 --time-up-to 512
    python benchmarks/rat_scaling.py --variants windowed windowed+remat --sizes 1024 --time-up-to 0

Writes benchmarks/results/rat_scaling.json (rows are merged into an existing file by variant and
size, so runs can be split). Timings on a shared 2-core CPU are noisy: compare ratios taken in
one run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from jaxrat.runtime import hugepages

DIMS = dict(feature_dims=128, num_blocks=4, num_heads=8, iters=3, mlp_dropout=0.1, attention="sparse")
VARIANTS = {
    "global": dict(),
    "windowed": dict(mr_attention="windowed", mr_window=16),
    "global+remat": dict(remat="blocks"),
    "windowed+remat": dict(mr_attention="windowed", mr_window=16, remat="blocks"),
    # dense SGA (the reference's) against sparse, for the choice of configs/isic.py's default
    "dense+windowed": dict(attention="dense", mr_attention="windowed", mr_window=16),
}
COMPONENTS = ("sga1", "mr1", "head")


def _compile(module, fn, inp):
    """Jit fwd+bwd (grads of the params) of ``fn(module, inp)``; returns (compiled, args, stats)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    def step(params, rest, x):
        m = nnx.merge(graphdef, params, rest)
        return nnx.grad(lambda m: jnp.mean(jnp.square(fn(m, x).astype(jnp.float32))))(m)

    t = time.perf_counter()
    compiled = jax.jit(step).lower(params, rest, inp).compile()
    ma = compiled.memory_analysis()
    stats = dict(compile_s=time.perf_counter() - t, temp_gib=ma.temp_size_in_bytes / 2**30,
                 argument_gib=ma.argument_size_in_bytes / 2**30)
    return compiled, (params, rest, jnp.zeros(inp.shape, inp.dtype)), stats


def _time(compiled, args, reps: int) -> dict:
    import jax

    jax.block_until_ready(compiled(*args))  # warm-up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t)
    return dict(time_s=min(times), times=times)


def run_child(variant: str, size: int, reps: int, timed: bool, components: bool) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxrat import ops
    from jaxrat.models.rat import RATConfig, RATSegmenter

    model = RATSegmenter(rat=RATConfig(**{**DIMS, **VARIANTS[variant]}), decoder_dim=32, rngs=nnx.Rngs(0),
                         kernels=ops.resolve("auto"))
    model.train()
    row: dict = dict(variant=variant, size=size)
    x = jax.ShapeDtypeStruct((2, size, size, 3), jnp.float32)
    compiled, args, stats = _compile(model, lambda m, t: m(t), x)
    row["full"] = stats
    if timed:
        row["full"].update(_time(compiled, args, reps))
    del compiled, args
    if not components:
        return row
    bb = model.backbone
    g0 = (size, size)
    grids = [g0]
    for layer in bb.sga_layers:
        grids.append(layer.out_grid_shape(grids[-1]))
    n = lambda g: g[0] * g[1]
    tok = lambda g: jax.ShapeDtypeStruct((2, n(g), 128), jnp.float32)
    parts = dict(
        sga1=(bb.sga_layers[0], lambda m, t: m(t, g0, (1.0, 1.0)).x, tok(g0)),
        mr1=(bb.mr_attn_layers[0], lambda m, t: m([t], [grids[1]], [(3.0, 3.0)])[0][0], tok(grids[1])),
        head=(model.head, lambda m, t: m(_split(t, grids), grids, g0), jax.ShapeDtypeStruct(
            (2, sum(n(g) for g in grids), 128), jnp.float32)),
    )
    for name, (module, fn, inp) in parts.items():
        compiled, args, stats = _compile(module, fn, inp)
        row[name] = stats
        if timed:
            row[name].update(_time(compiled, args, reps))
    return row


def _split(t, grids):
    out, start = [], 0
    for g in grids:
        out.append(t[:, start:start + g[0] * g[1]])
        start += g[0] * g[1]
    return out


def _spawn(variant: str, size: int, reps: int, timed: bool, components: bool, timeout: int) -> dict:
    cmd = [sys.executable, __file__, "--child", variant, "--size", str(size), "--reps", str(reps)]
    cmd += (["--timed"] if timed else []) + (["--components"] if components else [])
    try:
        # the environment a training process runs in: huge pages for malloc (jaxrat/runtime/hugepages.py)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=hugepages.environ())
    except subprocess.TimeoutExpired:
        return dict(variant=variant, size=size, error=f"timeout after {timeout}s")
    if proc.returncode != 0:
        return dict(variant=variant, size=size, error=(proc.stderr.strip().splitlines() or ["failed"])[-1][:200])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _fmt(r: dict | None, key: str) -> str:
    if not r or key not in r:
        return "-"
    return f"{r[key]:.2f}"


def print_table(rows: list[dict]) -> None:
    """Markdown table: full step per variant and size, doubling ratios, components."""
    print("| variant | px | fwd+bwd s | x prev | temp GiB | x prev | arg GiB "
          "| sga1 s / GiB | mr1 s / GiB | head s / GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    prev: dict = {}
    for r in sorted(rows, key=lambda r: (list(VARIANTS).index(r["variant"]), r["size"])):
        if "error" in r:
            print(f"| {r['variant']} | {r['size']} | {r['error']} |")
            continue
        f, p = r["full"], prev.get(r["variant"])
        ratio = lambda k: f"{f[k] / p[k]:.1f}x" if p and k in p and k in f and p[k] > 0 else "-"
        comp = lambda c: f"{_fmt(r.get(c), 'time_s')} / {_fmt(r.get(c), 'temp_gib')}" if c in r else "-"
        print(f"| {r['variant']} | {r['size']} | {_fmt(f, 'time_s')} | {ratio('time_s')} | {f['temp_gib']:.2f} | "
              f"{ratio('temp_gib')} | {f['argument_gib']:.3f} | {comp('sga1')} | {comp('mr1')} | {comp('head')} |")
        prev[r["variant"]] = f


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 256, 512, 1024])
    parser.add_argument("--time-up-to", type=int, default=512, help="time sizes up to this; larger: memory only")
    parser.add_argument("--no-components", action="store_true")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=3600)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "rat_scaling.json"))
    parser.add_argument("--child", choices=list(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--timed", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--components", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_child(args.child, args.size, args.reps, args.timed, args.components)))
        return
    out = Path(args.out)
    old = json.loads(out.read_text()) if out.exists() else dict(rows=[])
    rows = {(r["variant"], r["size"]): r for r in old["rows"]}
    for variant in args.variants:
        for size in args.sizes:
            row = _spawn(variant, size, args.reps, size <= args.time_up_to, not args.no_components, args.timeout)
            row["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
            rows[(variant, size)] = row
            print(json.dumps(row), flush=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(dict(dims=DIMS, batch=2, variants=VARIANTS, rows=list(rows.values())), indent=2))
    print_table(list(rows.values()))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
