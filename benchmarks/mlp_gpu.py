"""The gpu policy's fused MLP on a real GPU: parity with XLA's MLP, then speed side by side.

    python benchmarks/mlp_gpu.py [out.json] [stage ...]

stages (default: parity speed):

1. ``parity``: float32 (matmuls at full precision) at 2 x 1,024 tokens, 128 -> 512 -> 128, dropout
   0.1: the fused kernels against XLA's MLP, output and the gradients of x and every weight (max error
   over the largest entry); then bfloat16 against that float32 result, fused and XLA's;
2. ``speed``: the ISIC first SGA layer's MLP (16 x 7,396 groups, 128 -> 512 -> 128, dropout 0.1,
   bfloat16), forward and forward + backward, fused and XLA's, median of timed repeats (XLA's is
   handed its mask; the fused kernels draw theirs, as in training);
3. ``cuts``: that forward + backward for each way of cutting the weight-gradient pass
   (:class:`jaxrat.ops.gpu.mlp.WeightsPass`), each with its weight gradients' error against XLA's
   bfloat16 ones, and the fastest; the default is what such a run chose.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from sparse_sga_gpu import timed

from jaxrat.ops.gpu import mlp as gpu_mlp
from jaxrat.ops.gpu.mlp import WeightsPass, fused_mlp

RATE = 0.1


def inputs(n: int, d: int = 128, hidden: int = 512, dtype=jnp.float32, seed: int = 0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 7)
    x = jax.random.normal(ks[0], (n, d))
    w = (0.05 * jax.random.normal(ks[1], (d, hidden)), 0.1 * jax.random.normal(ks[2], (hidden,)),
         0.05 * jax.random.normal(ks[3], (hidden, d)), 0.1 * jax.random.normal(ks[4], (d,)))
    seed = jax.random.bits(ks[5], (4,), jnp.uint32)
    keep = gpu_mlp.kept(seed[0], seed[1], jnp.arange(n, dtype=jnp.uint32)[:, None],
                        jnp.arange(hidden, dtype=jnp.uint32)[None, :], RATE)  # the kernels' own draw
    g = jax.random.normal(ks[6], (n, d))
    return [a.astype(dtype) for a in (x, *w)], (seed, keep), g


def xla(drawn):
    keep = drawn[1]

    def f(x, w1, b1, w2, b2):
        h = jax.nn.gelu(x @ w1 + b1, approximate=False)
        return jnp.where(keep, h / (1.0 - RATE), 0.0).astype(x.dtype) @ w2 + b2
    return f


def fused(drawn):
    return lambda *a: fused_mlp(*a, drawn[0], (RATE, 0.0))


def vjp_program(f):
    """One jitted program: (args, g) -> (f(*args), and its gradients for the cotangent g)."""
    def run(args, g):
        y, vjp = jax.vjp(f, *args)
        return (y, *vjp(g.astype(y.dtype)))
    return jax.jit(run)


def value_and_vjp(f, args, g, program=None):
    return [np.asarray(a, np.float32) for a in (program or vjp_program(f))(args, g)]


def errors(got, want):
    names = ("y", "dx", "dw1", "db1", "dw2", "db2")
    return {n: float(np.max(np.abs(a - b)) / np.max(np.abs(b))) for n, a, b in zip(names, got, want)}


def parity(report):
    args, keep, g = inputs(2048)
    with jax.default_matmul_precision("highest"):
        exact = value_and_vjp(xla(keep), args, g)
    low = [a.astype(jnp.bfloat16) for a in args]
    report["bf16_err_fused"] = errors(value_and_vjp(fused(keep), low, g), exact)
    report["bf16_err_xla"] = errors(value_and_vjp(xla(keep), low, g), exact)
    with jax.default_matmul_precision("highest"):
        report["f32_err_fused"] = errors(value_and_vjp(fused(keep), args, g), exact)
    print("float32", report["f32_err_fused"], "bfloat16 fused", report["bf16_err_fused"], "xla",
          report["bf16_err_xla"], flush=True)


def speed(report):
    args, keep, g = inputs(16 * 7396, dtype=jnp.bfloat16)
    for name, make in (("fused", fused), ("xla", xla)):
        f = make(keep)
        loss = lambda *a, f=f: jnp.sum(f(*a).astype(jnp.float32) * g)
        report[f"{name}_fwd"] = timed(f, *args)
        report[f"{name}_fwd_bwd"] = timed(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), *args)
        print(name, report[f"{name}_fwd"], report[f"{name}_fwd_bwd"], flush=True)


# the default first (2026-11-27 on an H100: 128 x 16 at 8 warps 3.22 ms, 64 x 16 at 4 warps 1.36 ms), then
# the default before dropout was drawn in the kernels (64 tokens a step: 460 bytes of spills since)
CUTS = [WeightsPass(), WeightsPass(tile=64), WeightsPass(64, 64, 4, 2), WeightsPass(64, 128, 4, 1),
        WeightsPass(32, 128, 4, 1), WeightsPass(64, 64, 8, 1), WeightsPass(128, 64, 8, 1), WeightsPass(32, 64, 4, 2),
        WeightsPass(64, 64, 4, 3), WeightsPass(32, 64, 4, 1, tile=64)]


def cuts(report):
    args, keep, g = inputs(16 * 7396, dtype=jnp.bfloat16)
    want = value_and_vjp(xla(keep), args, g)
    default, results = gpu_mlp.WEIGHTS, {}
    try:
        for cut in CUTS:
            gpu_mlp.WEIGHTS = cut
            name = f"chunk{cut.chunk}_splits{cut.max_splits}_warps{cut.warps}_stages{cut.stages}_tile{cut.tile}"
            try:
                f = fused(keep)  # a new function: traced again under this cut
                run = vjp_program(f)
                err = errors(value_and_vjp(f, args, g, run), want)  # compiles it, timed below
                results[name] = {**timed(run, args, g), "err_vs_xla_bf16": max(err[k] for k in ("dw1", "db1", "dw2"))}
            except Exception as e:  # a cut Triton cannot compile (shared memory, registers) is reported
                results[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
            print(name, results[name], flush=True)
            report["cuts"] = results
            if len(sys.argv) > 1:  # each cut compiles for seconds: keep what ran if a deadline stops the sweep
                json.dump(report, open(sys.argv[1], "w"), indent=1)
    finally:
        gpu_mlp.WEIGHTS = default
    ok = {k: v for k, v in results.items() if "median_ms" in v and v["err_vs_xla_bf16"] < 0.05}
    report["cuts"] = results
    report["fastest_cut"] = min(ok, key=lambda k: ok[k]["median_ms"]) if ok else None
    print("fastest", report["fastest_cut"], flush=True)


def main():
    report = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__}
    print(report, flush=True)
    chosen = sys.argv[2:] or ["parity", "speed"]
    for stage in [s for s in (parity, speed, cuts) if s.__name__ in chosen]:
        try:
            stage(report)
        except Exception as e:  # report what ran, then the failure
            report[f"{stage.__name__}_error"] = f"{type(e).__name__}: {e}"[:2000]
            print(report[f"{stage.__name__}_error"], flush=True)
        if len(sys.argv) > 1:
            json.dump(report, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
