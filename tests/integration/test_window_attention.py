"""Windowed multi-resolution attention and block rematerialisation (tiny dims, CPU-cheap)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrat import ops
from jaxrat.models import build_model
from jaxrat.ops.portable.chunked_attention import softmax_attention
from jaxrat.ops.portable.windowed_attention import multires_attention
from jaxrat.runtime.errors import ConfigError
from model_configs import TINY_IMAGES, TINY_RAT, mean_square_and_grads, rat_model


def build(**fields):
    return build_model(rat_model(num_classes=1, **(TINY_RAT | fields)), rngs=nnx.Rngs(0), kernels=ops.resolve("auto"))


def _allowed(segments, window):
    """Dense (N, N) mask of who sees whom under the windowed rule, built independently."""
    owner, tile, large = [], [], []
    for s, (n, grid) in enumerate(segments):
        big = grid is not None and any(g > window for g in grid)
        for i in range(n):
            owner.append(s)
            large.append(big)
            tile.append(tuple(c // window for c in np.unravel_index(i, grid)) if big else None)
    n = len(owner)
    allowed = np.zeros((n, n), bool)
    for i in range(n):
        for j in range(n):
            allowed[i, j] = (not large[i]) or (not large[j]) or (owner[i] == owner[j] and tile[i] == tile[j])
    return allowed


def test_windowed_matches_a_masked_dense_attention():
    # leading tokens, a large 5x7 grid (window 3: padded tiles), a large 4x2 grid, a small 2x2 grid
    segments = [(2, None), (35, (5, 7)), (8, (4, 2)), (4, (2, 2))]
    n = sum(s[0] for s in segments)
    q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (2, n, 3, 4)) for i in range(3))
    allowed = _allowed(segments, 3)

    def dense(q, k, v):
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(jnp.where(allowed, logits, -jnp.inf), -1), v)

    windowed = lambda q, k, v: multires_attention(q, k, v, segments, 3, attend=softmax_attention)
    np.testing.assert_allclose(jax.jit(windowed)(q, k, v), dense(q, k, v), rtol=1e-5, atol=1e-5)
    g = jax.random.normal(jax.random.PRNGKey(9), q.shape)
    grads_w = jax.grad(lambda *a: jnp.sum(windowed(*a) * g), argnums=(0, 1, 2))(q, k, v)
    grads_d = jax.grad(lambda *a: jnp.sum(dense(*a) * g), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(grads_w, grads_d):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_window_covering_every_grid_equals_global():
    x = jax.random.normal(jax.random.PRNGKey(0), TINY_IMAGES)
    for extra in ({}, dict(scales=(24, 12))):
        ref_loss, ref_grads = mean_square_and_grads(build(**extra), x)
        # first grid 8x7: a window of 8 covers it, so nothing is tiled
        loss, grads = mean_square_and_grads(build(mr_attention="windowed", mr_window=8, **extra), x)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize(
    "extra", [{}, dict(scales=(24, 12)), dict(attention="sparse")], ids=["single", "pyramid", "sparse"]
)
def test_small_window_shapes_and_finite_gradients(extra):
    x = jax.random.normal(jax.random.PRNGKey(0), TINY_IMAGES)
    model = build(mr_attention="windowed", mr_window=3, **extra)
    model.eval()
    y = nnx.jit(lambda m, x: m(x))(model, x)
    assert y.shape == (2, 24, 20, 1)
    loss, grads = mean_square_and_grads(model, x)
    assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves(grads))
    ref_loss, _ = mean_square_and_grads(build(**extra), x)
    # A 3-token window really restricts the first block: the loss moves by far more than float32's noise
    # (1e-5 of it for the sparse model, measured: np.allclose's default rtol would call that equal).
    assert abs(float(loss) - float(ref_loss)) > 1e-6 * abs(float(ref_loss))


def test_windowed_imports_the_same_weights():
    glob, win = build(), build(mr_attention="windowed", mr_window=4)
    shapes = lambda m: jax.tree.map(jnp.shape, nnx.to_pure_dict(nnx.state(m, nnx.Param)))
    assert shapes(glob) == shapes(win)


def test_block_remat_changes_nothing_but_memory():
    x = jax.random.normal(jax.random.PRNGKey(0), TINY_IMAGES)
    for extra in (dict(attention="sparse", mr_attention="windowed", mr_window=3, scales=(24, 12)),):
        ref_loss, ref_grads = mean_square_and_grads(build(**extra), x)
        loss, grads = mean_square_and_grads(build(remat="blocks", **extra), x)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


def test_bad_options_are_config_errors():
    with pytest.raises(ConfigError):
        build(mr_attention="local")
    with pytest.raises(ConfigError):
        build(mr_attention="windowed", mr_window=0)
    with pytest.raises(ConfigError):
        build(remat="everything")
