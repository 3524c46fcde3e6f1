"""The gpu policy's layer norm kernels (jaxrat.ops.gpu.layer_norm) against XLA's form, in Pallas
interpret mode on this CPU; compiled for an H100 in tests/extended/test_gpu_registers.py and
tests/extended/test_gpu_cost.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrat import ops
from jaxrat.ops import norm as norm_ops
from jaxrat.ops.gpu import layer_norm as gpu_norm

TRITON = "custom_call @__gpu$xla.gpu.triton("


def _inputs(shape, dtype, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 5)
    x = (3.0 * jax.random.normal(k[0], shape) + 2.0).astype(dtype)  # an offset: the variance about the mean
    residual = jax.random.normal(k[1], shape).astype(dtype)
    scale = 1.0 + 0.3 * jax.random.normal(k[2], shape[-1:])
    bias = 0.2 * jax.random.normal(k[3], shape[-1:])
    g = jax.random.normal(k[4], shape).astype(dtype)
    return x, residual, scale, bias, g


def _value_and_grads(f, args, g):
    y, vjp = jax.vjp(f, *args)
    return [np.asarray(a, np.float32) for a in (y, *vjp(g.astype(y.dtype)))]


def _xla(with_residual: bool):
    def f(x, residual, scale, bias):
        y = norm_ops._norm(x, scale, bias, 1e-5, jnp.dtype(x.dtype))
        return residual + y if with_residual else y
    return f


def _kernels(with_residual: bool):
    return lambda x, r, s, b: gpu_norm.layer_norm(x, s, b, 1e-5, r if with_residual else None, interpret=True)


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("shape,runs", [((2, 37, 128), None), ((300, 16), 2), ((3, 64), None)])
def test_float32_matches_xla_forward_and_every_gradient(shape, runs, with_residual, monkeypatch):
    """Rows not a multiple of the tile, several tiles a backward run (MAX_RUNS cut to 2), one tile."""
    if runs:
        monkeypatch.setattr(gpu_norm, "MAX_RUNS", runs)
    x, r, s, b, g = _inputs(shape, jnp.float32)
    got = _value_and_grads(_kernels(with_residual), (x, r, s, b), g)
    want = _value_and_grads(_xla(with_residual), (x, r, s, b), g)
    for name, a, w in zip(("y", "dx", "dresidual", "dscale", "dbias"), got, want):
        np.testing.assert_allclose(a, w, rtol=1e-5, atol=1e-5 * np.max(np.abs(w)), err_msg=name)


def test_bfloat16_rounds_once_and_is_as_close_to_float32_as_xla_in_bfloat16():
    """The residual is added in float32 before the one rounding; XLA's form rounds the norm, then the
    sum. Against float32 both are within a few bfloat16 roundings; the kernels' output no further."""
    x, r, s, b, g = _inputs((4, 50, 128), jnp.bfloat16)
    exact = _value_and_grads(_xla(True), [a.astype(jnp.float32) for a in (x, r)] + [s, b], g.astype(jnp.float32))
    got = _value_and_grads(_kernels(True), (x, r, s, b), g)
    xla = _value_and_grads(_xla(True), (x, r, s, b), g)
    for name, a, xl, w in zip(("y", "dx", "dresidual", "dscale", "dbias"), got, xla, exact):
        err = lambda v: float(np.max(np.abs(v - w)) / np.max(np.abs(w)))
        assert err(a) <= max(1.01 * err(xl), 2 ** -8), (name, err(a), err(xl))


def test_supports_says_why_not_in_one_sentence():
    assert gpu_norm.supports(118336, 128, jnp.bfloat16) is None
    assert "power of two" in gpu_norm.supports(64, 96, jnp.bfloat16)
    assert "float16" in gpu_norm.supports(64, 128, jnp.float16)
    assert "int32" in gpu_norm.supports(2**24, 256, jnp.bfloat16)
    with pytest.raises(ValueError, match="power of two"):
        gpu_norm.layer_norm(jnp.zeros((5, 96)), jnp.ones(96), jnp.zeros(96), 1e-5)


def test_the_gpu_policy_takes_bfloat16_to_the_kernels_and_float32_to_xla():
    """On the gpu policy the model's LayerNorm lowers to the two kernels in bfloat16, the residual in
    the same forward kernel (no other arithmetic on the activation); a float32 model (a parity run)
    keeps XLA's form, as do other policies, and all of them add the residual the same way."""
    from jaxrat.models.layers import layer_norm

    def lowered(policy, dtype):
        norm = layer_norm(128, 1e-5, dtype=dtype, rngs=nnx.Rngs(0), kernels=ops.resolve(policy, gpu_forms="all"))
        graphdef, params = nnx.split(norm, nnx.Param)
        x = jax.ShapeDtypeStruct((4, 300, 128), dtype)

        def loss(p, x, r):
            return jnp.sum(nnx.merge(graphdef, p)(x, residual=r).astype(jnp.float32) ** 2)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(params, x, x).lower(
            lowering_platforms=("cuda",)).as_text()

    text = lowered("gpu", jnp.bfloat16)
    assert text.count(TRITON) == 2 and "layer_norm_forward" in text and "layer_norm_backward" in text
    for policy, dtype in (("gpu", jnp.float32), ("portable", jnp.bfloat16)):
        assert TRITON not in lowered(policy, dtype)

    x, r, _, _, _ = _inputs((2, 9, 128), jnp.float32)
    outs = []
    for policy in ("gpu", "portable", "cpu"):
        norm = layer_norm(128, 1e-5, dtype=jnp.float32, rngs=nnx.Rngs(0), kernels=ops.resolve(policy, gpu_forms="all"))
        outs.append(np.asarray(norm(x, residual=r)))
        np.testing.assert_allclose(np.asarray(norm(x)) + np.asarray(r), outs[-1], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_on_a_mesh_each_device_normalises_its_share_and_the_weight_gradients_add_up(monkeypatch):
    """8 simulated devices: the kernels run per device (shard_map, scale and bias whole) and the
    outputs and gradients equal one device's, the scale's and bias's summed over the devices."""
    real = gpu_norm.layer_norm
    monkeypatch.setattr(gpu_norm, "layer_norm", lambda *a, **k: real(*a, **{**k, "interpret": True}))
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    x, r, s, b, _ = _inputs((8, 12, 32), jnp.bfloat16)

    def loss(x, r, s, b):
        y = norm_ops.layer_norm(x, s, b, 1e-5, jnp.bfloat16, r)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    single = grads(x, r, s, b)
    with jax.set_mesh(mesh):
        shard = lambda a: jax.device_put(a, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
        text = grads.lower(shard(x), shard(r), s, b).as_text()
        sharded = grads(shard(x), shard(r), s, b)
    assert "manual_computation" in text or "shard_map" in text
    for name, a, w in zip(("dx", "dresidual", "dscale", "dbias"), sharded, single):
        a, w = np.asarray(a, np.float32), np.asarray(w, np.float32)
        assert float(np.max(np.abs(a - w)) / np.max(np.abs(w))) < 1e-5, name
