"""Strided convolution as stride-block matmuls (jaxrat.ops.cpu.strided_conv) against XLA's own."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrat import ops
from jaxrat.models.layers import conv
from jaxrat.models.rat.config import RATConfig
from jaxrat.models.rat.sga import SpatialGroupingAttention
from jaxrat.ops.cpu import strided_conv

CPU = ops.resolve("cpu")


def _xla_conv(x, w, stride):
    sd = len(stride)
    dn = jax.lax.ConvDimensionNumbers((0, sd + 1, *range(1, sd + 1)), (sd + 1, sd, *range(sd)),
                                      (0, sd + 1, *range(1, sd + 1)))
    pad = [((k - 1) // 2, (k - 1) // 2) for k in w.shape[:-2]]
    return jax.lax.conv_general_dilated(x, w, stride, pad, dimension_numbers=dn)


@pytest.mark.parametrize(
    "shape,kernel,stride",
    [((2, 20, 17, 5), (7, 7), (3, 3)),  # the SGA strider's layout, borders cropped and padded
     ((2, 10, 4), (5,), (2,)),
     ((1, 7, 9, 8, 3), (3, 4, 3), (2, 3, 1)),  # 3-D, an even kernel, a stride-1 axis
     ((2, 11, 11, 4), (4, 2), (2, 2))],
)
def test_blocked_conv_matches_xla_values_and_gradients(shape, kernel, stride):
    x = jax.random.normal(jax.random.PRNGKey(0), shape)
    w = jax.random.normal(jax.random.PRNGKey(1), (*kernel, shape[-1], 6))
    ref = _xla_conv(x, w, stride)
    got = strided_conv.blocked_strided_conv(x, w, stride)
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=2e-5)
    g = jax.random.normal(jax.random.PRNGKey(2), ref.shape)
    grads_ref = jax.grad(lambda x, w: jnp.sum(_xla_conv(x, w, stride) * g), (0, 1))(x, w)
    grads_got = jax.grad(lambda x, w: jnp.sum(strided_conv.blocked_strided_conv(x, w, stride) * g), (0, 1))(x, w)
    for a, b in zip(grads_got, grads_ref):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def _has_conv(fn, *args) -> bool:
    return "conv_general_dilated" in str(jax.make_jaxpr(fn)(*args))


def test_dispatch_takes_the_blocked_form_only_for_large_strided_inputs(monkeypatch):
    layer = conv(4, 4, (7, 7), strides=(3, 3), padding=[(3, 3), (3, 3)], dtype=jnp.float32, rngs=nnx.Rngs(0),
                 kernels=CPU)
    small = jnp.ones((1, 16, 16, 4))
    assert _has_conv(lambda x: layer(x), small)  # below the crossover: XLA's convolution
    monkeypatch.setattr(strided_conv, "MIN_BLOCKED_POSITIONS", 16 * 16)
    assert not _has_conv(lambda x: layer(x), small)
    np.testing.assert_allclose(layer(small), _xla_conv(small, layer.kernel[...], (3, 3)) + layer.bias[...],
                               rtol=1e-5, atol=1e-5)
    # stride 1, "SAME" padding or a plain conv() keep XLA's convolution at any size
    same = conv(4, 4, (3, 3), strides=(1, 1), dtype=jnp.float32, rngs=nnx.Rngs(0), kernels=CPU)
    assert _has_conv(lambda x: same(x), small)
    plain = conv(4, 4, (7, 7), strides=(3, 3), padding=[(3, 3), (3, 3)], dtype=jnp.float32, rngs=nnx.Rngs(0),
                 kernels=ops.PORTABLE)
    assert _has_conv(lambda x: plain(x), small)


def test_sga_layer_is_the_same_with_the_blocked_strider(monkeypatch):
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 20 * 17, 16))
    layer = SpatialGroupingAttention(RATConfig(feature_dims=16, num_heads=4, iters=2), "sparse", kernels=CPU,
                                     rngs=nnx.Rngs(0))
    ref = layer(x, (20, 17), (1.0, 1.0)).x
    monkeypatch.setattr(strided_conv, "MIN_BLOCKED_POSITIONS", 1)
    np.testing.assert_allclose(layer(x, (20, 17), (1.0, 1.0)).x, ref, rtol=1e-4, atol=1e-4)
