"""Run by tests/extended/test_gpu_cost.py in a process of its own: small programs compiled for an H100 by
benchmarks/gpu_cost.py, their kernels printed as one JSON object.

Its own process because jax must start with the CUDA compiler on its path (gpu_cost puts it there when
imported first), and the test processes' jax must not: there it would print its driver lines on stderr.
"""

import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu_cost  # noqa: E402  (before jax)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

M, K, N = 256, 512, 1024


def matmul_softmax(x, w):
    with jax.named_scope("head"):
        return jax.nn.softmax(x @ w, axis=-1)


def loop(x, w):
    return jax.lax.fori_loop(0, 5, lambda i, x: jnp.tanh(x @ w), x)


def sparse_sga(q, k, v, products: bool = False):
    """The fused sparse SGA kernels forward and backward as a layer of two grouping iterations calls
    them (ISIC's kernel and stride): token-major queries, keys and values laid out once."""
    from jaxrat.ops.gpu.sparse_sga import laid_out_update, lay_out_keys
    from jaxrat.ops.policy import SparseSGABlocks
    from jaxrat.ops.portable.sparse_sga import Geometry

    geom = Geometry((64, 64), (7, 7), (3, 3))
    blocks = SparseSGABlocks(products=products)

    def loss(q, k, v):
        keys = lay_out_keys(k, v, geom, 2, blocks=blocks)
        u = laid_out_update(q, keys, 0, geom, blocks=blocks)
        return jnp.sum(laid_out_update(q + u, keys, 1, geom, blocks=blocks).astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def sparse_sga_products(q, k, v):
    """:func:`sparse_sga` with the passes as matrix products (SparseSGABlocks.products)."""
    return sparse_sga(q, k, v, products=True)


def fused_mlp(x, w1, b1, w2, b2):
    """The gpu policy's fused MLP forward and backward with dropout, at an SGA layer's width (128, 512)."""
    from jaxrat.ops.gpu.mlp import fused_mlp as mlp

    seed = jax.random.bits(jax.random.key(0), (4,), jnp.uint32)
    loss = lambda *a: jnp.sum(mlp(*a, seed, (0.1, 0.1)).astype(jnp.float32) ** 2)
    return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(x, w1, b1, w2, b2)


LEAVES = [(128, 128), (128,), (512, 128)] * 20  # parameter leaves of the global-norm probe


def clipped(*grads):
    """The step's gradient norm and the optimizer's global-norm clip, each over all leaves concatenated."""
    from jaxrat.trainer.optimizer import clip_by_global_norm, global_norm

    updates, _ = clip_by_global_norm(1.0, concatenate=True).update(list(grads), None)
    return global_norm(list(grads), concatenate=True), updates


def resized(x, g):
    """The decoder's last upsampling (86 -> 256 px, 32 channels, bf16) and its gradient, on the gpu policy."""
    from jaxrat import ops
    from jaxrat.ops.resize import resize_linear

    f = lambda x: jnp.sum(resize_linear(x, (256, 256), ops.KernelPolicy("gpu")).astype(jnp.float32) * g)
    return jax.value_and_grad(f)(x)


def main() -> None:
    why = gpu_cost.plugin_missing()
    if why:
        print(json.dumps({"missing": why}))
        return
    gpu = gpu_cost.load_gpu("h100_sxm")
    device = gpu_cost.target_device(gpu)
    bf16 = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)  # noqa: E731
    programs = {
        "matmul_softmax": (matmul_softmax, bf16(M, K), bf16(K, N)),
        "elementwise": (lambda x: x * 2.0 + 1.0, jax.ShapeDtypeStruct((1024, 1024), jnp.float32)),
        "loop": (loop, bf16(128, 256), bf16(256, 256)),
        "fused_mlp": (fused_mlp, bf16(2, 4096, 128), bf16(128, 512), bf16(512), bf16(512, 128), bf16(128)),
        "clipped": (clipped, *[jax.ShapeDtypeStruct(s, jnp.float32) for s in LEAVES]),
        "resized": (resized, bf16(16, 86, 86, 32), jax.ShapeDtypeStruct((16, 256, 256, 32), jnp.float32)),
        "sparse_sga": (sparse_sga, bf16(2, 22 * 22, 8, 16), bf16(2, 64 * 64, 8, 16), bf16(2, 64 * 64, 8, 16)),
        "sparse_sga_products": (sparse_sga_products, bf16(2, 22 * 22, 8, 16), bf16(2, 64 * 64, 8, 16),
                                bf16(2, 64 * 64, 8, 16)),
    }
    out = {"device_kind": device.device_kind, "roofline": dataclasses.asdict(gpu.roofline)}
    for name, (fn, *args) in programs.items():
        compiled, _ = gpu_cost.compile_for(fn, *args, device=device)
        kernels = gpu_cost.kernels_of(compiled.as_text(), gpu.roofline)
        out[name] = {"kernels": [{**dataclasses.asdict(k), "scope": k.scope} for k in kernels],
                     "summary": gpu_cost.summarize(kernels, gpu.roofline),
                     "dot_generals": str(jax.make_jaxpr(fn)(*args)).count("dot_general")}  # kernels' too
    print(json.dumps(out))


if __name__ == "__main__":
    main()
