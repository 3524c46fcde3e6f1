"""The fused Pallas sparse SGA on a real GPU: parity with the portable kernel, then speed.

    python benchmarks/sparse_sga_gpu.py [out.json] [stage ...]

stages (default: parity speed):

1. float32 parity (matmuls at full float32 precision) at a 64 x 64 grid: the fused kernels against
   the portable ``sparse_grouping``, forward and the gradients in q, k and v, with and without
   column normalisation (max error over the largest entry);
2. bfloat16 against that float32 result, for the fused and the portable kernel;
3. the ISIC first SGA layer (batch 16, 8 heads of 16, 256 x 256 inputs, kernel 7, stride 3, bf16):
   one call forward and forward + backward, fused and portable, median of timed repeats (the fused
   call through its token-major API, so its head transposes are timed with it, as a layer pays them),
   and a layer's three iterations on keys laid out once (``fused_x3``);
4. (``tiles``) the fused kernels at that shape (head-major) for other tile sizes and warp counts;
5. (``passes``) each of its six passes alone (B3 once per layer), with the row loops rolled and unrolled,
   and the passes as matrix products (``Tiling.products``);
6. (``products``) stages 1 and 3 (parity, the fused rows) with the passes as matrix products.
"""

from __future__ import annotations

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrat.ops.gpu.sparse_sga import laid_out_update, lay_out_keys, sparse_update
from jaxrat.ops.gpu.sparse_sga import passes as sga_passes
from jaxrat.ops.gpu.sparse_sga.api import _keys, _update
from jaxrat.ops.gpu.sparse_sga.passes import group_pass, input_pass
from jaxrat.ops.gpu.sparse_sga.tiling import Tiling
from jaxrat.ops.policy import SparseSGABlocks
from jaxrat.ops.portable.sparse_sga import Geometry, sparse_blocks, sparse_grouping
from jaxrat.ops.portable.sparse_sga import sparse_update as portable_update


def inputs(geom: Geometry, b: int, h: int, dh: int, dtype, seed: int = 0):
    """Token-major (B, N, H, d) queries, keys, values and a cotangent, as the layer hands them over."""
    n_out, n_in = int(np.prod(geom.out)), int(np.prod(geom.grid))
    kq, kk, kv, kg = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = 0.7 * jax.random.normal(kq, (b, n_out, h, dh))
    k = 0.7 * jax.random.normal(kk, (b, n_in, h, dh))
    v = jax.random.normal(kv, (b, n_in, h, dh))
    g = jax.random.normal(kg, (b, n_out, h, dh))
    return [x.astype(dtype) for x in (q, k, v)], g


def heads_first(x):
    """(B, N, H, d) <-> (B, H, N, d): the portable kernel's layout."""
    return x.transpose(0, 2, 1, 3)


def value_and_vjp(f, q, k, v, g):
    def run(q, k, v, g):
        u, vjp = jax.vjp(f, q, k, v)
        return (u, *vjp(g.astype(u.dtype)))
    return [np.asarray(x, np.float32) for x in jax.jit(run)(q, k, v, g)]


def errors(got, want):
    return {n: float(np.max(np.abs(a - b)) / np.max(np.abs(b))) for n, a, b in zip(("u", "dq", "dk", "dv"), got, want)}


def fused(geom, normalise, blocks=SparseSGABlocks()):
    return lambda q, k, v: sparse_update(q, k, v, geom, normalise, blocks=blocks)


def portable(geom, normalise):
    """The portable kernel on token-major operands (transposed in and out, in the same program)."""
    def f(q, k, v):
        u = sparse_grouping(*map(heads_first, (q, k, v)), geom.grid, geom.kernel, geom.stride, normalise)[0]
        return heads_first(u)
    return f


def parity(report, prefix: str = "", blocks=SparseSGABlocks()):
    geom = Geometry((64, 64), (7, 7), (3, 3))
    (q, k, v), g = inputs(geom, 2, 8, 16, jnp.float32)
    with jax.default_matmul_precision("highest"):
        for normalise in (True, False):
            exact = value_and_vjp(portable(geom, normalise), q, k, v, g)
            key = f"{prefix}f32_err_norm{int(normalise)}"
            report[key] = errors(value_and_vjp(fused(geom, normalise, blocks), q, k, v, g), exact)
            print(prefix, "float32", normalise, report[key], flush=True)
        low = [x.astype(jnp.bfloat16) for x in (q, k, v)]
        exact = value_and_vjp(portable(geom, True), q, k, v, g)
    report[f"{prefix}bf16_err_fused"] = errors(value_and_vjp(fused(geom, True, blocks), *low, g), exact)
    report["bf16_err_portable"] = errors(value_and_vjp(portable(geom, True), *low, g), exact)
    print(prefix, "bfloat16 fused", report[f"{prefix}bf16_err_fused"], "portable", report["bf16_err_portable"],
          flush=True)


def timed(f, *args, reps: int = 10) -> dict:
    f = jax.jit(f)
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    first = time.perf_counter() - t
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t)
    return {"first_s": round(first, 2), "median_ms": round(1e3 * float(np.median(times)), 3)}


def on_slices(t):
    """The kernels alone on head-major slices (B*H, N*d), keys laid out for one use."""
    def f(q, k, v):
        kf, vf, tapes = _keys(k, v, t, 1, True, False)
        return _update(q, kf, vf, tapes[0], t, True, False)
    return f


def three_iterations(geom, blocks=SparseSGABlocks()):
    """A layer's three grouping iterations through the API: keys laid out once, each call's queries
    moved by the last update, the keys' and values' gradients summed in one pass."""
    def f(q, k, v):
        keys, out = lay_out_keys(k, v, geom, 3, blocks=blocks), 0.0
        for use in range(3):
            u = laid_out_update(q, keys, use, geom, blocks=blocks)
            out, q = out + u, q + u
        return out
    return f


def speed(report):
    geom = Geometry((256, 256), (7, 7), (3, 3))
    (q, k, v), g = inputs(geom, 16, 8, 16, jnp.bfloat16)
    port = lambda q, k, v: portable_update(q, sparse_blocks(k, geom), sparse_blocks(v, geom), geom)
    tiling = Tiling.of(geom, 16, 16)
    sliced = [heads_first(x).reshape(16 * 8, -1) for x in (q, k, v, g)]
    # "fused": the API, transposes included; "kernels" and "portable": their own layouts, made outside;
    # "fused_x3": one layer's three iterations (compare with three "fused" calls)
    for name, f, (q_, k_, v_, g_) in (("fused", fused(geom, True), (q, k, v, g)),
                                      ("fused_x3", three_iterations(geom), (q, k, v, g)),
                                      ("kernels", on_slices(tiling), sliced),
                                      ("portable", port, map(heads_first, (q, k, v, g)))):
        loss = lambda q, k, v, f=f, g=g_: jnp.sum(f(q, k, v).astype(jnp.float32) * g)
        report[f"{name}_fwd"] = timed(f, q_, k_, v_)
        report[f"{name}_fwd_bwd"] = timed(jax.grad(loss, argnums=(0, 1, 2)), q_, k_, v_)
        print(name, report[f"{name}_fwd"], report[f"{name}_fwd_bwd"], flush=True)


def products(report):
    """Stage 1's parity and stage 3's one call and a layer's three, with the passes as matrix products."""
    blocks = SparseSGABlocks(products=True)
    parity(report, "products_", blocks)
    geom = Geometry((256, 256), (7, 7), (3, 3))
    (q, k, v), g = inputs(geom, 16, 8, 16, jnp.bfloat16)
    for name, f in (("products", fused(geom, True, blocks)), ("products_x3", three_iterations(geom, blocks))):
        loss = lambda q, k, v, f=f: jnp.sum(f(q, k, v).astype(jnp.float32) * g)
        report[f"{name}_fwd"] = timed(f, q, k, v)
        report[f"{name}_fwd_bwd"] = timed(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)
        print(name, report[f"{name}_fwd"], report[f"{name}_fwd_bwd"], flush=True)


def tiles(report):
    geom = Geometry((256, 256), (7, 7), (3, 3))
    (q, k, v), g = inputs(geom, 16, 8, 16, jnp.bfloat16)
    q, k, v, g = (heads_first(x).reshape(16 * 8, -1) for x in (q, k, v, g))
    for tw, tx, warps in ((32, 64, 4), (32, 64, 2), (16, 32, 2), (64, 128, 4), (64, 128, 8), (32, 128, 4)):
        t = Tiling.of(geom, 16, 16, tw, tx, warps)
        f = on_slices(t)
        loss = lambda q, k, v, f=f: jnp.sum(f(q, k, v).astype(jnp.float32) * g)
        name = f"tiles_{tw}_{tx}_{warps}"
        report[name] = {"fwd": timed(f, q, k, v), "fwd_bwd": timed(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)}
        print(name, report[name], flush=True)


def pass_calls(t, bh: int, n_out: int, n_in: int) -> dict:
    """Each Triton pass alone, as a function of (q, k, v, g, r, d, gd, delta, u)."""
    stats = lambda n: sga_passes.stats(bh, n)
    values = lambda n: sga_passes.flat_like(bh, n, 16, jnp.bfloat16)
    return {
        "F1": lambda q, k, v, g, r, d, gd, delta, u: group_pass("lse", t, dict(q=q, k=k), dict(r=stats(n_out)), False),
        "F2": lambda q, k, v, g, r, d, gd, delta, u: input_pass("colsum", t, dict(q=q, k=k, r=r),
                                                                dict(d=stats(n_in)), 1e-7, False),
        "F3": lambda q, k, v, g, r, d, gd, delta, u: group_pass("update", t, dict(q=q, k=k, v=v, r=r, d=d),
                                                                dict(u=values(n_out)), False),
        "B1": lambda q, k, v, g, r, d, gd, delta, u: input_pass("gd", t, dict(q=q, k=k, v=v, r=r, g=g, d=d),
                                                                dict(gd=stats(n_in)), 1e-7, False),
        "B2": lambda q, k, v, g, r, d, gd, delta, u: group_pass(
            "grad", t, dict(q=q, k=k, v=v, r=r, g=g, d=d, gd=gd, u=u), dict(dq=values(n_out), delta=stats(n_out)),
            False),
        "B3": lambda q, k, v, g, r, d, gd, delta, u: input_pass(  # once per layer: keys' and values' grads
            "keys", t, dict(k=k, v=v, q0=q, g0=g, r0=r, delta0=delta, d0=d, gd0=gd),
            dict(dk=values(n_in), dv=values(n_in)), 1e-7, False),
    }


def passes(report):
    """Each pass alone at the ISIC shape: tap by tap with rolled and unrolled row loops, and as
    matrix products over row segments (16 or 32 groups a group tile, 64 or 128 inputs an input tile)."""
    geom = Geometry((256, 256), (7, 7), (3, 3))
    (q, k, v), g = inputs(geom, 16, 8, 16, jnp.bfloat16)
    q, k, v, g = (heads_first(x).reshape(16 * 8, -1) for x in (q, k, v, g))
    bh, n_out, n_in = 128, int(np.prod(geom.out)), int(np.prod(geom.grid))
    forms = {"passes_unroll0": dict(unroll=False, products=False), "passes_unroll1": dict(unroll=True, products=False),
             "passes_products": dict(products=True), "passes_products_tw32": dict(products=True, tw=32),
             "passes_products_tx128": dict(products=True, tx=128)}
    for name, form in forms.items():
        t = Tiling.of(geom, 16, 16, **form)
        calls = pass_calls(t, bh, n_out, n_in)
        r = calls["F1"](q, k, v, g, *[None] * 5)["r"]
        d = calls["F2"](q, k, v, g, r, *[None] * 4)["d"]
        u = calls["F3"](q, k, v, g, r, d, *[None] * 3)["u"]
        gd = calls["B1"](q, k, v, g, r, d, *[None] * 3)["gd"]
        delta = calls["B2"](q, k, v, g, r, d, gd, None, u)["delta"]
        args = (q, k, v, g, r, d, gd, delta, u)
        report[name] = {n: timed(c, *args)["median_ms"] for n, c in calls.items()}
        print(name, report[name], flush=True)


def main():
    report = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__}
    print(report, flush=True)
    chosen = sys.argv[2:] or ["parity", "speed"]
    for stage in [s for s in (parity, speed, products, tiles, passes) if s.__name__ in chosen]:
        try:
            stage(report)
        except Exception as e:  # report what ran, then the failure
            report[f"{stage.__name__}_error"] = f"{type(e).__name__}: {e}"[:2000]
            print(report[f"{stage.__name__}_error"], flush=True)
        if len(sys.argv) > 1:  # after every stage, so a run stopped at a deadline keeps what it measured
            json.dump(report, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
