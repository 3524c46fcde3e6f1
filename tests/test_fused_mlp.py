"""The gpu policy's fused MLP (jaxrat.ops.gpu.mlp) against XLA's, in Pallas interpret mode on this CPU.

The GPU form is lowered for CUDA here, and compiled by Triton for an H100 in tests/test_gpu_cost.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrat import ops
from jaxrat.ops import mlp as mlp_ops
from jaxrat.ops.gpu import mlp as gpu_mlp

TRITON = "custom_call @__gpu$xla.gpu.triton("


def _weights(d: int, hidden: int, seed: int = 0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    return (0.2 * jax.random.normal(ks[0], (d, hidden)), 0.1 * jax.random.normal(ks[1], (hidden,)),
            0.2 * jax.random.normal(ks[2], (hidden, d)), 0.1 * jax.random.normal(ks[3], (d,)))


def _xla(keep, rate):
    def f(x, w1, b1, w2, b2):
        h = jax.nn.gelu(x @ w1 + b1, approximate=False)
        if keep is not None:
            h = jnp.where(keep, h / (1.0 - rate), 0.0)
        return h @ w2 + b2
    return f


def _value_and_vjp(f, args, g):
    def run(args, g):
        y, vjp = jax.vjp(f, *args)
        return (y, *vjp(g.astype(y.dtype)))
    return [np.asarray(a, np.float32) for a in jax.jit(run)(args, g)]


def test_erf_is_xla_s_to_float32_rounding():
    x = jnp.linspace(-7.0, 7.0, 20001)
    assert float(jnp.max(jnp.abs(gpu_mlp.erf(x) - jax.lax.erf(x)))) < 1e-6


SHARES_5_4 = gpu_mlp.WeightsPass(chunk=128, min_share=4)
SHARES_3_3_3_0 = gpu_mlp.WeightsPass(chunk=64, min_share=2)


@pytest.mark.parametrize("n,rate,cut", [(96, 0.25, None), (64, 0.0, None), (48, 0.1, None), (2 * 21, 0.1, None),
                                        (288, 0.1, SHARES_5_4), (288, 0.1, SHARES_3_3_3_0)],
                         ids=["3-tiles-dropout", "one-tile", "odd-tiles", "ragged", "uneven-shares", "empty-share"])
def test_float32_matches_xla_forward_and_every_gradient(n, rate, cut, monkeypatch):
    """Tokens in 3 tiles of 32, one tile of 64, 3 of 16, 42 (padded to 48), and 9 tiles of 32 that the
    weights' pass splits into shares of 5 and 4 (two hidden chunks of 128), or of 3, 3, 3 and none
    (four chunks of 64)."""
    if cut is not None:
        monkeypatch.setattr(gpu_mlp, "WEIGHTS", cut)
    d, hidden = 32, 256
    x = jax.random.normal(jax.random.PRNGKey(1), (2, n // 2, d))
    g = jax.random.normal(jax.random.PRNGKey(2), (2, n // 2, d))
    keep = jax.random.bernoulli(jax.random.PRNGKey(3), 1.0 - rate, (2, n // 2, hidden)) if rate else None
    args = (x, *_weights(d, hidden))
    fused = lambda *a: gpu_mlp.fused_mlp(*a, keep, rate, interpret=True)
    with jax.default_matmul_precision("highest"):
        got, want = _value_and_vjp(fused, args, g), _value_and_vjp(_xla(keep, rate), args, g)
    for name, a, b in zip(("y", "dx", "dw1", "db1", "dw2", "db2"), got, want):
        assert a.shape == b.shape, name
        err = np.max(np.abs(a - b)) / np.max(np.abs(b))
        assert err < 1e-5, f"{name}: max error {err:.2e} of the largest entry"


def test_bfloat16_is_as_close_to_float32_as_xla_in_bfloat16():
    """The fused kernels round the hidden activation to bfloat16 once (before fc2) and keep its
    pre-activation, GELU and gradients in float32; XLA rounds each of them. So the fused results must
    be at least as close to float32 as XLA's bfloat16 MLP (25% slack), and within 2% of the largest
    entry (the inputs' and weights' own rounding, 2^-9, grows through two products of 32 and 256 terms)."""
    d, hidden, rate = 32, 256, 0.1
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 48, d))
    g = jax.random.normal(jax.random.PRNGKey(2), (2, 48, d))
    keep = jax.random.bernoulli(jax.random.PRNGKey(3), 1.0 - rate, (2, 48, hidden))
    args = (x, *_weights(d, hidden))
    low = tuple(a.astype(jnp.bfloat16) for a in args)
    with jax.default_matmul_precision("highest"):
        exact = _value_and_vjp(_xla(keep, rate), args, g)
    fused = _value_and_vjp(lambda *a: gpu_mlp.fused_mlp(*a, keep, rate, interpret=True), low, g)
    xla = _value_and_vjp(_xla(keep, rate), low, g)
    for name, a, b, e in zip(("y", "dx", "dw1", "db1", "dw2", "db2"), fused, xla, exact):
        scale = np.max(np.abs(e))
        err, err_xla = np.max(np.abs(a - e)) / scale, np.max(np.abs(b - e)) / scale
        assert err < 1.25 * err_xla + 1e-3 and err < 2e-2, f"{name}: {err:.2e} (XLA bf16: {err_xla:.2e})"


def test_supports_says_why_not_in_one_sentence():
    assert gpu_mlp.supports(118336, 128, 512, jnp.bfloat16) is None
    assert "multiple of 128" in gpu_mlp.supports(64, 128, 200, jnp.bfloat16)
    assert "power of two" in gpu_mlp.supports(64, 96, 512, jnp.bfloat16)
    assert "float16" in gpu_mlp.supports(64, 128, 512, jnp.float16)
    with pytest.raises(ValueError, match="multiple of 128"):
        gpu_mlp.fused_mlp(jnp.zeros((5, 128)), *_weights(128, 200))


def test_the_policy_fuses_large_bfloat16_calls_on_the_gpu_only():
    gpu, cpu = ops.resolve("gpu"), ops.resolve("cpu")
    assert mlp_ops.fused(gpu, (16, 7396, 128), 512, jnp.bfloat16, 0.1)
    assert mlp_ops.fused(gpu, (16, 841, 128), 512, jnp.bfloat16, 0.1)  # 13.8 MB of hidden activation
    assert not mlp_ops.fused(gpu, (16, 100, 128), 512, jnp.bfloat16, 0.1)  # 1.6 MB: XLA's, no compile
    assert not mlp_ops.fused(gpu, (16, 7396, 128), 512, jnp.float32, 0.1)  # float32: a parity run, XLA's
    assert not mlp_ops.fused(gpu, (16, 7396, 128), 512, jnp.bfloat16, 1.0)  # all dropped: nnx's zeros
    assert not mlp_ops.fused(cpu, (16, 7396, 128), 512, jnp.bfloat16, 0.1)


def _mlp_module(kernels: str, rate: float):
    from jaxrat.models.layers import Mlp

    return Mlp(32, 128, dropout=rate, dtype=jnp.bfloat16, rngs=nnx.Rngs(0, dropout=7), kernels=ops.resolve(kernels))


def test_the_layer_on_the_gpu_policy_is_three_triton_kernels_and_draws_nnx_s_mask(monkeypatch):
    """The model's Mlp on the gpu policy lowers to the fused kernels (one forward, two backward, no
    cuBLAS product); in interpret mode it equals the portable Mlp with the same dropout stream."""
    monkeypatch.setattr(mlp_ops, "FUSED_HIDDEN_BYTES", 0)  # a small call, fused all the same
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 24, 32)).astype(jnp.bfloat16)

    def loss(module, x):
        return jnp.sum(module(x).astype(jnp.float32) ** 2)

    gpu = _mlp_module("gpu", 0.2)
    graphdef, params, rest = nnx.split(gpu, nnx.Param, ...)
    # the dropout stream's state rebuilt inside the traced function, as the trainer does (state.fresh_rest)
    grads = jax.grad(lambda p, x: loss(nnx.merge(graphdef, p, jax.tree.map(lambda a: a, rest)), x))
    text = jax.jit(grads).trace(params, x).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(TRITON) == 3 and "stablehlo.dot_general" not in text

    # the same module computed in interpret mode against the portable one: the same mask is drawn
    import jaxrat.ops.gpu.mlp as m

    real = m.fused_mlp
    m.fused_mlp = lambda *a, **k: real(*a, interpret=True, **k)
    try:
        got = gpu(x)
    finally:
        m.fused_mlp = real
    want = _mlp_module("portable", 0.2)(x)
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    # bfloat16 both: 0.4% apart; with another dropout mask (a folded key, tried) 69% apart
    assert np.mean(np.abs(got - want)) / np.mean(np.abs(want)) < 0.02


def test_on_a_mesh_each_device_runs_its_share_and_the_weight_gradients_add_up():
    """8 simulated devices: under the mesh the fused MLP runs per device (shard_map, weights whole)
    and its gradients equal the single-device ones, the weights' summed over the devices."""
    from jaxrat.ops.gpu import mlp as m

    d, hidden = 32, 256
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    x = jax.random.normal(jax.random.PRNGKey(1), (8, 16, d))
    w = _weights(d, hidden)
    real = m.fused_mlp
    m.fused_mlp = lambda *a, **k: real(*a, interpret=True, **k)
    try:
        loss = lambda x, *w: jnp.sum(mlp_ops.fused_mlp(x, *w, dropout_rate=0.0, dropout_key=None) ** 2)
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
        single = grads(x, *w)
        with jax.set_mesh(mesh):
            xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
            text = grads.lower(xs, *w).as_text()
            sharded = grads(xs, *w)
    finally:
        m.fused_mlp = real
    assert "manual_computation" in text or "shard_map" in text
    for name, a, b in zip(("dx", "dw1", "db1", "dw2", "db2"), sharded, single):
        err = float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))  # tiles differ per device: sums' order
        assert err < 1e-5, f"{name}: {err:.2e}"
