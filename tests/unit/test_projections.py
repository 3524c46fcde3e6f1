"""jaxrat.ops.projections: several projections of one input, their gradients as one product."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrat.ops.projections import shared_input_projections


def _operands(n: int, widths=(6, 5, 6, 3)):
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(keys[0], (2, 7, 8))
    ws = [jax.random.normal(jax.random.fold_in(keys[1], i), (8, widths[i])) for i in range(n)]
    bs = [jax.random.normal(jax.random.fold_in(keys[2], i), (widths[i],)) for i in range(n)]
    return x, ws, bs


def _loss(project):
    def loss(x, ws, bs):
        return sum(jnp.sum(jnp.sin(y.astype(jnp.float32)) * (i + 1)) for i, y in enumerate(project(x, ws, bs)))
    return loss


@pytest.mark.parametrize("n", [1, 4])
def test_values_and_every_gradient_match_separate_products(n):
    """Float32, against autodiff of each product alone (widths that differ: the split points)."""
    x, ws, bs = _operands(n)
    joint = jax.value_and_grad(_loss(shared_input_projections), argnums=(0, 1, 2))(x, ws, bs)
    alone = jax.value_and_grad(_loss(lambda x, ws, bs: [x @ w + b for w, b in zip(ws, bs)]), argnums=(0, 1, 2))(
        x, ws, bs)
    for a, b in zip(jax.tree.leaves(joint), jax.tree.leaves(alone)):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(b))))


def test_it_computes_what_nnx_linear_computes_in_its_dtype():
    """bfloat16 compute of float32 parameters, as the decoder's layers hold them: the same bits forward."""
    rngs = nnx.Rngs(0)
    layers = [nnx.Linear(8, 6, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=rngs) for _ in range(3)]
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 7, 8)).astype(jnp.bfloat16)
    got = shared_input_projections(x, [m.kernel[...] for m in layers], [m.bias[...] for m in layers],
                                   dtype=jnp.bfloat16)
    for y, m in zip(got, layers):
        assert y.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(m(x), np.float32))


def test_the_backward_is_two_products_however_many_projections():
    """Lowered: each projection is its own product forward; backward one for the input's gradient and
    one for the weights', whatever their number (autodiff of separate products takes two each)."""
    def products(n):
        x, ws, bs = _operands(n, widths=(6,) * n)
        text = jax.jit(jax.grad(_loss(shared_input_projections), argnums=(0, 1, 2))).lower(x, ws, bs).as_text()
        return len(re.findall(r"stablehlo\.dot_general", text))

    assert products(1) == 1 + 2 and products(4) == 4 + 2


def test_a_bias_per_weight_is_asked_for_in_one_sentence():
    x, ws, bs = _operands(2)
    with pytest.raises(ValueError, match="one bias per weight"):
        shared_input_projections(x, ws, bs[:1])
