"""The gpu policy's linear upsampling (jaxrat/ops/resize.py) is jax.image.resize's "linear", value and gradient.

How it compiles for an H100 (gathers, no matrix products, no scatter) is tests/extended/test_gpu_cost.py's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrat import ops
from jaxrat.ops.resize import resize_linear

GPU = ops.KernelPolicy("gpu")
CASES = [((4, 4), (10, 10)), ((29, 29), (86, 86)), ((86, 86), (256, 256)), ((3, 5), (7, 5)), ((5, 3), (5, 13)),
         ((1, 2), (4, 4)), ((7,), (19,)), ((2, 3, 4), (5, 3, 9))]


def _jax(x, grid):
    return jax.image.resize(x, (x.shape[0], *grid, x.shape[-1]), "linear")


@pytest.mark.parametrize("grid_in, grid_out", CASES)
def test_upsampling_is_jax_s_linear_resize_in_value_and_gradient(grid_in, grid_out):
    """Integer and non-integer factors, one axis left alone, 1, 2 and 3 spatial axes, a single-pixel axis."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, *grid_in, 3)), jnp.float32)
    g = jnp.asarray(rng.normal(size=(2, *grid_out, 3)), jnp.float32)
    ours, want = resize_linear(x, grid_out, GPU), _jax(x, grid_out)
    assert ours.shape == want.shape and ours.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(ours), np.asarray(want), rtol=1e-5, atol=2e-5)
    grad = lambda f: jax.grad(lambda x: jnp.sum(f(x) * g))(x)
    np.testing.assert_allclose(np.asarray(grad(lambda x: resize_linear(x, grid_out, GPU))),
                               np.asarray(grad(lambda x: _jax(x, grid_out))), rtol=1e-5, atol=5e-5)


def test_bfloat16_stays_bfloat16_and_close():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(2, 29, 29, 8)), jnp.bfloat16)
    ours = resize_linear(x, (86, 86), GPU)
    assert ours.dtype == jnp.bfloat16
    want = _jax(x.astype(jnp.float32), (86, 86))
    np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(want), atol=2e-2)  # bf16's 8 bits
    dx = jax.grad(lambda x: jnp.sum(resize_linear(x, (86, 86), GPU).astype(jnp.float32)))(x)
    assert dx.dtype == jnp.bfloat16


@pytest.mark.parametrize("policy", ["gpu", "portable", "cpu"])
def test_downsampling_and_other_policies_are_jax_s_own(policy):
    """Shrinking (jax antialiases it) and every other policy take jax.image.resize itself, bit for bit."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(1, 12, 9, 2)), jnp.float32)
    grids = [(5, 4), (5, 20)] if policy == "gpu" else [(5, 4), (30, 20)]
    for grid in grids:
        np.testing.assert_array_equal(np.asarray(resize_linear(x, grid, ops.KernelPolicy(policy))),
                                      np.asarray(_jax(x, grid)))
    assert resize_linear(x, (12, 9), GPU) is x
