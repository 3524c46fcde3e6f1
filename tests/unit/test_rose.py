"""Rotary spatial embeddings: coordinates per scaling mode, partial rotation, relative phase."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrat import ops
from jaxrat.models.rat.rose import RotarySpatialEmbedding
from jaxrat.ops.cpu import rotate as cpu_rotate


def make(mode, **kw):
    args = dict(feature_dims=16, num_heads=2, spatial_dims=2, rotary_ratio=1.0, learnable_scale=True,
                initial_scaling=mode)
    args.update(kw)
    return RotarySpatialEmbedding(**args, rngs=nnx.Rngs(0), kernels=ops.PORTABLE)


@pytest.mark.parametrize(
    "mode,spacing,expected",
    [
        ("log", (3.0, 9.0), lambda i, s: i * np.log(s)),
        ("identity", (3.0, 0.5), lambda i, s: i * s),
        ("index", (3.0, 0.5), lambda i, s: i * np.ones_like(s)),
        ("rope", (3.0, 0.5), lambda i, s: 0 * i),
    ],
)
def test_positions_per_mode(mode, spacing, expected):
    pos = np.asarray(make(mode).positions((3, 4), spacing))
    idx = np.stack(np.unravel_index(np.arange(12), (3, 4)), -1).astype(np.float64)
    np.testing.assert_allclose(pos, expected(idx, np.asarray(spacing)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode,spacing", [("log", (1.0, 1.0)), ("rope", (2.0, 5.0))])
def test_reference_modes_start_without_rotation(mode, spacing):
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 12, 2, 8))
    np.testing.assert_allclose(make(mode)(x, (3, 4), spacing), x, atol=1e-6)


def test_partial_rotation_leaves_other_heads_untouched():
    rose = make("index", num_heads=4, rotary_ratio=0.5)
    assert rose.num_rotary_heads == 2 and rose.freqs.shape == (2, 2, 2)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 12, 4, 4))
    y = rose(x, (3, 4), (1.0, 1.0))
    np.testing.assert_array_equal(y[:, :, 2:], x[:, :, 2:])
    assert not np.allclose(y[:, :, :2], x[:, :, :2])
    # rotation preserves each plane's norm
    np.testing.assert_allclose(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-5)


def test_dot_products_depend_only_on_relative_position():
    rose = make("index")
    vec = jax.random.normal(jax.random.PRNGKey(1), (1, 1, 2, 8))
    x = jnp.broadcast_to(vec, (1, 30, 2, 8))
    y = np.asarray(rose(x, (5, 6), (1.0, 1.0)))[0]
    dots = np.einsum("nhd,mhd->hnm", y, y)
    # tokens (0,0)-(1,2) and (2,3)-(3,5) have the same offset (1, 2)
    np.testing.assert_allclose(dots[:, 0, 1 * 6 + 2], dots[:, 2 * 6 + 3, 3 * 6 + 5], rtol=1e-5)


def test_frozen_variant_has_no_trainable_parameters():
    rose = make("log", learnable=False, learnable_scale=False)
    assert not jax.tree.leaves(nnx.state(rose))  # constants, not model state
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 12, 2, 8))
    assert not np.allclose(rose(x, (3, 4), (2.0, 2.0)), x)  # still rotates (log 2 != 0)


def test_no_rotary_heads_is_identity():
    rose = make("identity", rotary_ratio=0.0)
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 12, 2, 8))
    np.testing.assert_array_equal(rose(x, (3, 4), (1.0, 1.0)), x)
    assert rose.freqs is None


def test_unknown_mode_is_rejected():
    with pytest.raises(ValueError, match="initial_scaling"):
        make("bogus")


@pytest.mark.parametrize("heads", [2, 3])  # all heads rotated, or the first 2 of 3
@pytest.mark.parametrize("batch", [1, 2, cpu_rotate.UNROLLED_BATCH_SUM + 4])
def test_rotation_gradients_match_autodiff_of_the_plain_product(batch, heads):
    """The custom VJP sums the angle gradients over the batch image by image (or as one reduction
    above UNROLLED_BATCH_SUM); every gradient must equal autodiff of the plain complex product."""
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    x = jax.random.normal(k[0], (batch, 30, heads, 8))
    phase = jax.random.normal(k[1], (30, 2, 4))
    cos, sin = jnp.cos(phase), jnp.sin(phase)
    g = jax.random.normal(k[2], x.shape)

    def plain(x, cos, sin):
        p = x[:, :, :2].reshape(batch, 30, 2, 4, 2)
        re, im = p[..., 0], p[..., 1]
        rot = jnp.stack([re * cos - im * sin, re * sin + im * cos], -1).reshape(batch, 30, 2, 8)
        return jnp.concatenate([rot, x[:, :, 2:]], axis=2)

    out, vjp = jax.vjp(lambda *a: cpu_rotate.rotate_heads(*a, 2), x, cos, sin)
    want_out, want_vjp = jax.vjp(plain, x, cos, sin)
    np.testing.assert_array_equal(out, want_out)
    for a, b in zip(jax.jit(vjp)(g), want_vjp(g)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("heads", [3, 1])  # all heads rotated, or the first of 3
def test_gpu_rotation_without_concatenates_gives_the_complex_product_and_its_gradients(heads, dtype):
    """The gpu form (tables over every head, a flip of the pairs) is the same arithmetic as the
    complex product: equal values in float32 and in bfloat16. Its gradients match autodiff of the
    portable form through the tables' cosines and sines, up to rounding: the inverse turn's products
    in another order, and the angles' gradient summed in float32 (autodiff rounds the tables' own
    gradients to their dtype first)."""
    from jaxrat.ops.rotate import rotate_heads

    k = jax.random.split(jax.random.PRNGKey(1), 3)
    x = jax.random.normal(k[0], (4, 30, 3, 8)).astype(dtype)
    phase = jax.random.normal(k[1], (30, heads, 4)) * 3
    g = jax.random.normal(k[2], x.shape).astype(dtype)
    out, vjp = jax.vjp(lambda *a: rotate_heads(*a, heads, ops.resolve("gpu", gpu_forms="all")), x, phase)
    want_out, want_vjp = jax.vjp(lambda *a: rotate_heads(*a, heads, ops.PORTABLE), x, phase)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want_out, np.float32))
    got, want = jax.jit(vjp)(g), want_vjp(g)
    tol = 1e-5 if dtype == jnp.float32 else 2 ** -6  # relative: a bfloat16 rounding or two
    for a, b in zip(got, want):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * np.max(np.abs(b)))


@pytest.mark.parametrize("copies", [0, 3])
def test_the_phase_s_backward_is_autodiff_of_its_sums(copies):
    """The angles <pos, omega> are sums of products forward and two matrix products backward
    (ops.rotate._phase): the gradients of positions and frequencies as autodiff of the plain sums
    gives, also for per-device copies of the positions (a leading axis, summed over by the
    frequencies' gradient)."""
    from jaxrat.ops import rotate

    k = jax.random.split(jax.random.PRNGKey(2), 3)
    lead = (copies,) if copies else ()
    pos, freqs = jax.random.normal(k[0], (*lead, 50, 2)) * 9, jax.random.uniform(k[1], (3, 4, 2))
    g = jax.random.normal(k[2], (*lead, 50, 3, 4))
    plain = lambda p, f: jnp.sum(p[..., None, None, :] * f, -1)
    got = jax.vjp(rotate._phase, pos, freqs)[1](g)
    want = jax.vjp(plain, pos, freqs)[1](g)
    np.testing.assert_allclose(rotate._phase(pos, freqs), plain(pos, freqs), rtol=1e-6, atol=1e-5)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)
