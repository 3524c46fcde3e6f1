"""The gpu policy's fused MLP (jaxrat.ops.gpu.mlp) against XLA's, in Pallas interpret mode on this CPU.

The GPU form is lowered for CUDA here, and compiled by Triton for an H100 in tests/extended/test_gpu_cost.py.
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


SEED = jnp.array([11, 22, 33, 44], jnp.uint32)


def _masks(n: int, d: int, hidden: int, rates, seed=SEED, first: int = 0):
    """The kernels' dropout masks for ``n`` tokens from global token ``first``: hidden (n, Hd), output (n, d)."""
    tokens = jnp.arange(first, first + n, dtype=jnp.uint32)[:, None]
    cols = lambda w: jnp.arange(w, dtype=jnp.uint32)[None, :]
    return (gpu_mlp.kept(seed[0], seed[1], tokens, cols(hidden), rates[0]),
            gpu_mlp.kept(seed[2], seed[3], tokens, cols(d), rates[1]))


def _xla(masks, rates):
    """XLA's MLP with the given dropout masks (None: none), on (tokens, D) or (B, N, D) inputs."""
    def f(x, w1, b1, w2, b2):
        h = jax.nn.gelu(x @ w1 + b1, approximate=False)
        if masks is not None:
            h = jnp.where(masks[0].reshape(h.shape), h / (1.0 - rates[0]), 0.0)
        y = h @ w2 + b2
        if masks is not None:
            y = jnp.where(masks[1].reshape(y.shape), y / (1.0 - rates[1]), 0.0)
        return y
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


@pytest.mark.parametrize("n,rates,cut", [(96, (0.25, 0.25), None), (64, (0.0, 0.0), None), (48, (0.1, 0.0), None),
                                         (2 * 21, (0.1, 0.1), None), (288, (0.1, 0.3), SHARES_5_4),
                                         (288, (0.0, 0.1), SHARES_3_3_3_0)],
                         ids=["3-tiles-dropout", "one-tile", "odd-tiles", "ragged", "uneven-shares", "empty-share"])
def test_float32_matches_xla_forward_and_every_gradient(n, rates, cut, monkeypatch):
    """Tokens in 3 tiles of 32, one tile of 64, 3 of 16, 42 (padded to 48), and 9 tiles of 32 that the
    weights' pass splits into shares of 5 and 4 (two hidden chunks of 128), or of 3, 3, 3 and none
    (four chunks of 64); dropout of the hidden units, the output, both or neither, against XLA's MLP
    with the masks :func:`kept` says the kernels drew."""
    if cut is not None:
        monkeypatch.setattr(gpu_mlp, "WEIGHTS", cut)
    d, hidden = 32, 256
    x = jax.random.normal(jax.random.PRNGKey(1), (2, n // 2, d))
    g = jax.random.normal(jax.random.PRNGKey(2), (2, n // 2, d))
    masks = _masks(n, d, hidden, rates) if any(rates) else None
    args = (x, *_weights(d, hidden))
    fused = lambda *a: gpu_mlp.fused_mlp(*a, SEED if any(rates) else None, rates, interpret=True)
    with jax.default_matmul_precision("highest"):
        got, want = _value_and_vjp(fused, args, g), _value_and_vjp(_xla(masks, rates), args, g)
    for name, a, b in zip(("y", "dx", "dw1", "db1", "dw2", "db2"), got, want):
        assert a.shape == b.shape, name
        err = np.max(np.abs(a - b)) / np.max(np.abs(b))
        assert err < 1e-5, f"{name}: max error {err:.2e} of the largest entry"


def test_bfloat16_is_as_close_to_float32_as_xla_in_bfloat16():
    """The fused kernels round the hidden activation to bfloat16 once (before fc2) and keep its
    pre-activation, GELU and gradients in float32; XLA rounds each of them. So the fused results must
    be at least as close to float32 as XLA's bfloat16 MLP (25% slack), and within 2% of the largest
    entry (the inputs' and weights' own rounding, 2^-9, grows through two products of 32 and 256 terms)."""
    d, hidden, rates = 32, 256, (0.1, 0.1)
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 48, d))
    g = jax.random.normal(jax.random.PRNGKey(2), (2, 48, d))
    masks = _masks(96, d, hidden, rates)
    args = (x, *_weights(d, hidden))
    low = tuple(a.astype(jnp.bfloat16) for a in args)
    with jax.default_matmul_precision("highest"):
        exact = _value_and_vjp(_xla(masks, rates), args, g)
    fused = _value_and_vjp(lambda *a: gpu_mlp.fused_mlp(*a, SEED, rates, interpret=True), low, g)
    xla = _value_and_vjp(_xla(masks, rates), low, g)
    for name, a, b, e in zip(("y", "dx", "dw1", "db1", "dw2", "db2"), fused, xla, exact):
        scale = np.max(np.abs(e))
        err, err_xla = np.max(np.abs(a - e)) / scale, np.max(np.abs(b - e)) / scale
        assert err < 1.25 * err_xla + 1e-3 and err < 2e-2, f"{name}: {err:.2e} (XLA bf16: {err_xla:.2e})"


def test_float32_weights_are_rounded_on_chip_and_their_gradients_stay_float32():
    """The layer hands the kernels its float32 parameters (no cast kernels): the forward is the one with the
    weights rounded to bfloat16 beforehand, and the weights' gradients come back in float32,
    as close to the float32 ones as the rounded weights' bfloat16 gradients, or closer."""
    d, hidden, rates = 32, 256, (0.1, 0.1)
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 48, d)).astype(jnp.bfloat16)
    g = jax.random.normal(jax.random.PRNGKey(2), (2, 48, d))
    w32 = _weights(d, hidden)
    w16 = tuple(w.astype(jnp.bfloat16) for w in w32)
    fused = lambda *a: gpu_mlp.fused_mlp(*a, SEED, rates, interpret=True)
    y32, vjp32 = jax.vjp(fused, x, *w32)
    y16, vjp16 = jax.vjp(fused, x, *w16)
    # the same forward, to a bfloat16 ulp (the float32 weights' pass takes half the hidden units a step)
    np.testing.assert_allclose(np.asarray(y32, np.float32), np.asarray(y16, np.float32), rtol=2 ** -8, atol=1e-6)
    grads32, grads16 = vjp32(g.astype(y32.dtype))[1:], vjp16(g.astype(y16.dtype))[1:]
    assert all(a.dtype == jnp.float32 for a in grads32) and all(a.dtype == jnp.bfloat16 for a in grads16)
    masks = _masks(96, d, hidden, rates)
    with jax.default_matmul_precision("highest"):
        exact = jax.vjp(_xla(masks, rates), x.astype(jnp.float32), *map(lambda w: w.astype(jnp.bfloat16)
                        .astype(jnp.float32), w32))[1](g)[1:]
    for a, b, e in zip(grads32, grads16, exact):
        err = lambda z: float(jnp.max(jnp.abs(z.astype(jnp.float32) - e)))
        assert err(a) <= err(b) * 1.01 + 1e-6, (err(a), err(b))


def test_the_dropout_draw_keeps_one_minus_rate_of_the_units_independently():
    """2^20 draws (1024 tokens x 1024 units): the kept fraction is 1 - rate within 5 standard errors,
    for every rate; neighbouring tokens, neighbouring units and the two seeds' masks agree as often as
    independent draws do; another seed, or the same tokens numbered from elsewhere, is another mask."""
    tokens = jnp.arange(1024, dtype=jnp.uint32)[:, None]
    units = jnp.arange(1024, dtype=jnp.uint32)[None, :]
    n = 1024 * 1024
    for rate in (0.05, 0.1, 0.5, 0.9):
        keep = np.asarray(gpu_mlp.kept(SEED[0], SEED[1], tokens, units, rate))
        p = 1.0 - rate
        se = np.sqrt(p * (1 - p) / n)
        assert abs(keep.mean() - p) < 5 * se, (rate, keep.mean())
        both = p * p  # independent: P(both kept)
        for a, b in ((keep[1:], keep[:-1]), (keep[:, 1:], keep[:, :-1])):
            assert abs((a & b).mean() - both) < 5 * np.sqrt(both * (1 - both) / a.size), rate
        other = np.asarray(gpu_mlp.kept(SEED[2], SEED[3], tokens, units, rate))
        assert abs((keep & other).mean() - both) < 5 * np.sqrt(both * (1 - both) / n), rate
    shifted = np.asarray(gpu_mlp.kept(SEED[0], SEED[1], tokens + 1024, units, 0.5))
    assert abs((keep == shifted).mean() - 0.5) < 0.01
    assert np.asarray(gpu_mlp.kept(SEED[0], SEED[1], tokens, units, 0.0)).all()


def test_supports_says_why_not_in_one_sentence():
    assert gpu_mlp.supports(118336, 128, 512, jnp.bfloat16) is None
    assert "multiple of 128" in gpu_mlp.supports(64, 128, 200, jnp.bfloat16)
    assert "power of two" in gpu_mlp.supports(64, 96, 512, jnp.bfloat16)
    assert "float16" in gpu_mlp.supports(64, 128, 512, jnp.float16)
    with pytest.raises(ValueError, match="multiple of 128"):
        gpu_mlp.fused_mlp(jnp.zeros((5, 128)), *_weights(128, 200))


def test_the_policy_fuses_bfloat16_calls_on_the_gpu_only():
    gpu, cpu = ops.resolve("gpu", gpu_forms="all"), ops.resolve("cpu")
    assert mlp_ops.fused(gpu, (16, 7396, 128), 512, jnp.bfloat16, 0.1)
    assert mlp_ops.fused(gpu, (16, 841, 128), 512, jnp.bfloat16, 0.1)  # 13.8 MB of hidden activation
    assert mlp_ops.fused(gpu, (16, 16, 128), 512, jnp.bfloat16, 0.1)  # 0.3 MB: the small layers' too
    assert not mlp_ops.fused(gpu, (16, 7396, 128), 512, jnp.float32, 0.1)  # float32: a parity run, XLA's
    assert not mlp_ops.fused(gpu, (16, 7396, 128), 512, jnp.bfloat16, 1.0)  # all dropped: nnx's zeros
    assert not mlp_ops.fused(cpu, (16, 7396, 128), 512, jnp.bfloat16, 0.1)


def _mlp_module(kernels: str, rate: float):
    from jaxrat.models.layers import Mlp

    return Mlp(32, 128, dropout=rate, dtype=jnp.bfloat16, rngs=nnx.Rngs(0, dropout=7),
               kernels=ops.resolve(kernels, gpu_forms="all"))


def test_the_layer_on_the_gpu_policy_is_three_triton_kernels_and_draws_no_mask_outside():
    """The model's Mlp on the gpu policy lowers to the fused kernels (one forward, two backward, no
    cuBLAS product, no hidden-sized mask drawn by XLA); in interpret mode it equals XLA's MLP with the
    masks :func:`kept` draws from the key its first dropout takes from the stream, both dropouts."""
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 24, 32)).astype(jnp.bfloat16)

    def loss(module, x):
        return jnp.sum(module(x).astype(jnp.float32) ** 2)

    gpu = _mlp_module("gpu", 0.2)
    graphdef, params, rest = nnx.split(gpu, nnx.Param, ...)
    # the dropout stream's state rebuilt inside the traced function, as the trainer does (state.fresh_rest)
    grads = jax.grad(lambda p, x: loss(nnx.merge(graphdef, p, jax.tree.map(lambda a: a, rest)), x))
    text = jax.jit(grads).trace(params, x).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(TRITON) == 3 and "stablehlo.dot_general" not in text
    assert "x128xi1>" not in text and "x128xui32>" not in text  # hidden-sized masks or random bits

    import jaxrat.ops.gpu.mlp as m

    real = m.fused_mlp
    m.fused_mlp = lambda *a, **k: real(*a, interpret=True, **k)
    try:
        got = np.asarray(gpu(x), np.float32)
    finally:
        m.fused_mlp = real
    twin = _mlp_module("gpu", 0.2)  # the same weights and stream: its first draw is the key gpu took
    seed = jax.random.bits(twin.drop1.rngs(), (4,), jnp.uint32)
    w = (twin.fc1.kernel[...], twin.fc1.bias[...], twin.fc2.kernel[...], twin.fc2.bias[...])
    f32 = lambda a: jnp.asarray(a, jnp.bfloat16).astype(jnp.float32)
    want = np.asarray(_xla(_masks(48, 32, 128, (0.2, 0.2), seed), (0.2, 0.2))(f32(x), *map(f32, w)))
    other = np.asarray(_xla(_masks(48, 32, 128, (0.2, 0.2), seed[::-1]), (0.2, 0.2))(f32(x), *map(f32, w)))
    rel = lambda a: np.mean(np.abs(a - want)) / np.mean(np.abs(want))
    assert rel(got) < 0.02 and rel(other) > 0.3, (rel(got), rel(other))


@pytest.mark.parametrize("rate", [0.0, 0.25], ids=["no-dropout", "dropout"])
def test_on_a_mesh_each_device_runs_its_share_and_the_weight_gradients_add_up(rate):
    """8 simulated devices: under the mesh the fused MLP runs per device (shard_map, weights whole)
    and its output and gradients equal the single-device ones, the weights' summed over the devices;
    with dropout each device draws its own tokens' masks, the ones one device draws for the batch."""
    from jaxrat.ops.gpu import mlp as m

    d, hidden = 32, 256
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    x = jax.random.normal(jax.random.PRNGKey(1), (8, 16, d))
    w = _weights(d, hidden)
    key = jax.random.PRNGKey(5) if rate else None
    real = m.fused_mlp
    m.fused_mlp = lambda *a, **k: real(*a, interpret=True, **k)
    try:
        def loss(x, *w):
            y = mlp_ops.fused_mlp(x, *w, dropout_rate=rate, dropout_key=key, output_rate=rate)
            return jnp.sum(y ** 2), y

        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))
        single = grads(x, *w)
        with jax.set_mesh(mesh):
            xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
            text = grads.lower(xs, *w).as_text()
            sharded = grads(xs, *w)
    finally:
        m.fused_mlp = real
    assert "manual_computation" in text or "shard_map" in text
    (g_sharded, y_sharded), (g_single, y_single) = sharded, single
    if rate:
        assert 0.2 < float(jnp.mean(y_single == 0)) < 0.3  # the output's dropout ran
    for name, a, b in zip(("y", "dx", "dw1", "db1", "dw2", "db2"), (y_sharded, *g_sharded), (y_single, *g_single)):
        err = float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))  # tiles differ per device: sums' order
        assert err < 1e-5, f"{name}: {err:.2e}"
