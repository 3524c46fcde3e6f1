"""The attention kernels' block size, chosen from a measurement against the machine's matmul (issue 14).

    python benchmarks/attention_blocks.py                    # ISIC shapes at 128 px, this device
    python benchmarks/attention_blocks.py --size 256 --dtype bfloat16   # e.g. on a GPU

``jaxrat/ops/portable/chunked_attention.py`` streams each (batch x head) slice's keys in chunks so that one
(queries x key-chunk) block holds at most ``max_block_elements`` values; small slices (the windowed
multi-resolution attention's tiles) are batched until a block holds that many. That one number
trades cache locality (small blocks) against loop overhead and parallelism (large blocks), and its
best value depends on the device. This script times fwd+bwd of the kernels at the RAT's real shapes
for every candidate block size and sets each against a large matmul measured in the same process:

- **dense SGA, layer 1**: grouping attention of the first layer's groups over every pixel (ISIC
  dims: batch 2 x 8 heads, head dim 16, 7x7 stride 3: 43x43 groups x 128x128 pixels at 128 px);
- **global MR, block 1**: softmax attention over the first grid's tokens (43x43 at 128 px);
- **windowed MR, block 1**: 16x16-token tiles of that grid, as ``model.rat.mr_attention="windowed"``.

**GFLOP/s** counts the matmul work of plain attention fwd+bwd, 12 x queries x keys x head dim per
slice (2 products forward, 4 backward), not the recomputation the memory-efficient kernel adds, so
it is the useful rate; **ratio** is that over the matmul's FLOP/s (``--matmul`` x ``--matmul``,
same dtype, min of reps). The table marks each shape's fastest block and the library default
(``attention.default_block_elements()``: on a CPU sized from its last-level cache) with its time
relative to that best; **chosen** is the block with the least geometric-mean slowdown over the
shapes, i.e. the one the default should be on this device. A busy machine makes these timings
worthless: the JSON records the load average.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
from step_profile import matmul_flops_per_s

from jaxrat import ops
from jaxrat.ops.cpu import cache as cpu_cache
from jaxrat.ops.portable import chunked_attention as C

REPO = Path(__file__).resolve().parents[1]


def best_time(f: Callable, args: tuple, reps: int) -> float:
    """Min wall time of ``f(*args)`` over ``reps`` calls after one warm-up (compilation) call."""
    jax.block_until_ready(f(*args))
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        best = min(best, time.perf_counter() - t)
    return best


def shapes(size: int, batch: int, heads: int, head_dim: int, window: int) -> dict[str, dict]:
    """The RAT's attention shapes at ``size`` px: (slices, queries, keys) and the kernel."""
    grid = math.ceil(size / 3)  # the first SGA layer: 7x7 kernel, stride 3, padding 3
    window = min(window, grid)  # a tile covering the whole grid is the global form
    tiles = math.ceil(grid / window) ** 2
    s = batch * heads
    return {
        "dense SGA, layer 1": dict(slices=s, queries=grid * grid, keys=size * size, grouping=True),
        "global MR, block 1": dict(slices=s, queries=grid * grid, keys=grid * grid, grouping=False),
        "windowed MR, block 1": dict(slices=s * tiles, queries=window * window, keys=window * window, grouping=False),
    }


def time_kernel(shape: dict, head_dim: int, dtype: Any, block: int, reps: int) -> float:
    """Min fwd+bwd seconds of the kernel at ``shape`` with ``max_block_elements=block``."""
    kernel = C.grouping_attention if shape["grouping"] else C.softmax_attention
    keys = jax.random.split(jax.random.key(0), 4)
    s, nq, nk = shape["slices"], shape["queries"], shape["keys"]
    q = jax.random.normal(keys[0], (s, nq, head_dim), dtype) / math.sqrt(head_dim)
    k = jax.random.normal(keys[1], (s, nk, head_dim), dtype)
    v = jax.random.normal(keys[2], (s, nk, head_dim), dtype)
    g = jax.random.normal(keys[3], (s, nq, head_dim), jnp.float32)

    def loss(q, k, v):
        # The cpu policy's form: large slices unbatched (jaxrat.ops.cpu.cache).
        out = kernel(q, k, v, max_block_elements=block, unbatched_from=cpu_cache.UNBATCHED_SLICE_ELEMENTS)
        return jnp.sum(out.astype(jnp.float32) * g)

    return best_time(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), (q, k, v), reps)


def choose(rows: list[dict]) -> int:
    """The block with the least geometric-mean slowdown against each shape's fastest block."""
    best = {}
    for r in rows:
        best[r["shape"]] = min(best.get(r["shape"], float("inf")), r["seconds"])
    blocks = sorted({r["block"] for r in rows})
    complete = [b for b in blocks if all(any(r["block"] == b and r["shape"] == s for r in rows) for s in best)]

    def slowdown(b: int) -> float:
        logs = [math.log(r["seconds"] / best[r["shape"]]) for r in rows if r["block"] == b]
        return math.exp(sum(logs) / len(logs))

    return min(complete, key=slowdown)


def run(args: argparse.Namespace) -> dict:
    dtype = jnp.dtype(args.dtype)
    matmul = matmul_flops_per_s(dtype, n=args.matmul, reps=args.reps)
    rows = []
    for name, shape in shapes(args.size, args.batch, args.heads, args.head_dim, args.window).items():
        flops = 12.0 * shape["slices"] * shape["queries"] * shape["keys"] * args.head_dim
        for block in args.blocks:
            seconds = time_kernel(shape, args.head_dim, dtype, block, args.reps)
            rows.append(dict(shape=name, block=block, seconds=seconds, gflop_s=flops / seconds / 1e9,
                             ratio=flops / seconds / matmul, **{k: v for k, v in shape.items() if k != "grouping"}))
            print(json.dumps(rows[-1]), flush=True)
    for r in rows:
        r["vs_best"] = r["seconds"] / min(x["seconds"] for x in rows if x["shape"] == r["shape"])
    default = ops.resolve("cpu").block_elements
    chosen = choose(rows)
    return dict(rows=rows, chosen_block=chosen, default_block=default, matmul_gflop_s=matmul / 1e9,
                last_level_cache_bytes=cpu_cache.last_level_cache_bytes(),
                dtype=str(dtype), size=args.size, backend=jax.default_backend(), device=str(jax.devices()[0]),
                platform=platform.platform(), cpu_count=os.cpu_count(), load_avg=os.getloadavg(), jax=jax.__version__)


def print_table(result: dict) -> None:
    print(f"\nmatmul {result['matmul_gflop_s']:.1f} GFLOP/s ({result['dtype']}); {result['size']} px; "
          f"default block {result['default_block']}, chosen {result['chosen_block']}\n")
    print("| shape | slices x queries x keys | block | fwd+bwd s | GFLOP/s | ratio | vs best |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in result["rows"]:
        marks = (" (best)" if r["vs_best"] == 1.0 else "") + (" (default)" if r["block"] == result["default_block"]
                                                             else "")
        print(f"| {r['shape']} | {r['slices']} x {r['queries']} x {r['keys']} | {r['block']}{marks} | "
              f"{r['seconds']:.3f} | {r['gflop_s']:.1f} | {r['ratio']:.3f} | {r['vs_best']:.2f}x |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=128, help="image side in px")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--window", type=int, default=16, help="tile side of the windowed MR attention")
    parser.add_argument("--blocks", type=int, nargs="+", default=[1 << p for p in range(15, 24)],
                        help="candidate max_block_elements")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--matmul", type=int, default=2048, help="side of the reference matmul")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "attention_blocks.json"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    result["args"] = vars(args)
    print_table(result)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
