"""Stride-1 convolution with its weight gradient over row strips (jaxrat.ops.cpu.strip_conv)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrat import ops
from jaxrat.models.layers import conv
from jaxrat.models.rat.heads import MultiLevelDecoderHead
from jaxrat.ops.cpu import strip_conv

CPU = ops.resolve("cpu")


@pytest.mark.parametrize(
    "shape,kernel,rows",
    [((2, 20, 17, 3), (7, 7), 6),  # the RAT's input projection, 3 full strips and a 2-row tail
     ((2, 20, 17, 3), (7, 7), 20),  # one strip
     ((2, 9, 4), (5,), 2),  # 1-D
     ((1, 7, 9, 8, 3), (3, 1, 3), 3),  # 3-D, a 1-tap axis
     ((2, 8, 8, 4), (3, 3), 1)],  # one row per strip
)
def test_values_and_gradients_match_xla(shape, kernel, rows, monkeypatch):
    x = jax.random.normal(jax.random.PRNGKey(0), shape)
    w = jax.random.normal(jax.random.PRNGKey(1), (*kernel, shape[-1], 6))
    ref = strip_conv._xla_conv(x, w)
    np.testing.assert_array_equal(strip_conv.strip_conv(x, w), ref)
    g = jax.random.normal(jax.random.PRNGKey(2), ref.shape)
    monkeypatch.setattr(strip_conv, "strip_rows", lambda dy_shape: rows)
    grads_ref = jax.grad(lambda x, w: jnp.sum(strip_conv._xla_conv(x, w) * g), (0, 1))(x, w)
    grads_got = jax.jit(jax.grad(lambda x, w: jnp.sum(strip_conv.strip_conv(x, w) * g), (0, 1)))(x, w)
    np.testing.assert_allclose(grads_got[0], grads_ref[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grads_got[1], grads_ref[1], rtol=1e-4, atol=1e-4)


def test_strips_hold_about_the_budget_of_output_gradient(monkeypatch):
    monkeypatch.setattr(strip_conv, "STRIP_BYTES", 4 << 20)
    assert strip_conv.strip_rows((2, 256, 256, 128)) == 16  # 256 KiB per row
    assert strip_conv.strip_rows((2, 1024, 1024, 128)) == 4
    assert strip_conv.strip_rows((2, 4096, 4096, 128)) == 1  # a row over budget is still one strip
    assert strip_conv.strip_rows((1, 8, 8, 4)) == 8  # never more rows than there are


def _uses_strips(fn, *args) -> bool:
    return "custom_vjp_call" in str(jax.make_jaxpr(fn)(*args))


def test_dispatch_takes_strips_for_large_odd_stride_one_convolutions_only(monkeypatch):
    x = jnp.ones((1, 16, 16, 3))
    proj = conv(3, 8, (7, 7), padding=[(3, 3), (3, 3)], dtype=jnp.float32, rngs=nnx.Rngs(0), kernels=CPU)
    assert not _uses_strips(lambda x: proj(x), x)  # 8 KiB of output: XLA's convolution
    monkeypatch.setattr(strip_conv, "MIN_STRIP_BYTES", 16 * 16 * 8 * 4)
    assert _uses_strips(lambda x: proj(x), x)
    same = conv(3, 8, (3, 3), dtype=jnp.float32, rngs=nnx.Rngs(0), kernels=CPU)  # "SAME"
    assert _uses_strips(lambda x: same(x), x)
    even = conv(3, 8, (4, 4), padding=[(1, 1), (1, 1)], dtype=jnp.float32, rngs=nnx.Rngs(0), kernels=CPU)
    assert not _uses_strips(lambda x: even(x), x)  # the output would not keep the input's grid
    plain = conv(3, 8, (7, 7), padding=[(3, 3), (3, 3)], dtype=jnp.float32, rngs=nnx.Rngs(0), kernels=ops.PORTABLE)
    assert not _uses_strips(lambda x: plain(x), x)
    np.testing.assert_allclose(proj(x), strip_conv._xla_conv(x, proj.kernel[...]) + proj.bias[...],
                               rtol=1e-6, atol=1e-6)


def test_decoder_head_gradients_are_the_same_with_strips(monkeypatch):
    grids = [(16, 16), (6, 6), (2, 2)]
    head = MultiLevelDecoderHead(8, 3, 2, decoder_dim=8, kernels=CPU, rngs=nnx.Rngs(0))
    feats = [jax.random.normal(jax.random.PRNGKey(i), (2, g[0] * g[1], 8)) for i, g in enumerate(grids)]

    def grads():
        def loss(m):
            return jnp.mean(jnp.square(m(feats, grids, (16, 16))))
        return jax.tree.leaves(nnx.state(nnx.grad(loss)(head)))

    ref = grads()
    assert not _uses_strips(lambda f: head(f, grids, (16, 16)), feats)
    monkeypatch.setattr(strip_conv, "MIN_STRIP_BYTES", 1)
    assert _uses_strips(lambda f: head(f, grids, (16, 16)), feats)
    monkeypatch.setattr(strip_conv, "STRIP_BYTES", 1)  # one row per strip
    got = grads()
    assert len(got) == len(ref) > 4
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
