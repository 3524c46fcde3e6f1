"""The gpu policy's layer norm (jaxrat.ops.norm: statistics kept for the backward) equals flax's, the
form every other policy takes, in values and every gradient; its parameters are flax's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrat import ops
from jaxrat.models.layers import layer_norm
from jaxrat.ops import norm as norm_ops


def _pair(dtype):
    """The same layer norm (same parameters, randomised) on the gpu and the portable policy."""
    make = lambda kernels: layer_norm(48, 1e-5, dtype=dtype, rngs=nnx.Rngs(0),  # noqa: E731
                                      kernels=ops.resolve(kernels, gpu_forms="all"))
    gpu, flax_form = make("gpu"), make("portable")
    for m in (gpu, flax_form):  # not the identity init: scale and bias must enter the gradients
        m.scale[...] = 1.0 + 0.3 * jax.random.normal(jax.random.PRNGKey(1), (48,))
        m.bias[...] = 0.2 * jax.random.normal(jax.random.PRNGKey(2), (48,))
    return gpu, flax_form


def _value_and_grads(m, x, g):
    params = nnx.state(m, nnx.Param)
    graphdef = nnx.graphdef(m)

    def f(params, x):
        y = nnx.merge(graphdef, params)(x)
        return jnp.sum(y.astype(jnp.float32) * g), y

    (_, y), (dp, dx) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(params, x)
    return {"y": y, "dx": dx, "dscale": dp["scale"][...], "dbias": dp["bias"][...]}


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-6), (jnp.bfloat16, 1e-2)], ids=["float32", "bfloat16"])
def test_the_gpu_form_equals_flax_s_in_values_and_every_gradient(dtype, tol, monkeypatch):
    """float32 to rounding; bfloat16 within 1% of the largest entry (both compute in float32 and round
    the result once; flax also rounds scale and bias to bfloat16 first)."""
    x = (3.0 + 2.0 * jax.random.normal(jax.random.PRNGKey(3), (2, 37, 48))).astype(dtype)
    g = jax.random.normal(jax.random.PRNGKey(4), (2, 37, 48))
    gpu, flax_form = _pair(dtype)
    calls = []
    real = norm_ops.layer_norm
    monkeypatch.setattr(norm_ops, "layer_norm", lambda *a: calls.append(1) or real(*a))
    got = _value_and_grads(gpu, x, g)
    assert calls, "the gpu policy's layer norm did not take jaxrat.ops.norm"
    calls.clear()
    want = _value_and_grads(flax_form, x, g)
    assert not calls
    for name in want:
        a, b = np.asarray(got[name], np.float32), np.asarray(want[name], np.float32)
        assert a.shape == b.shape and got[name].dtype == want[name].dtype, name
        err = np.max(np.abs(a - b)) / np.max(np.abs(b))
        assert err < tol, f"{name}: {err:.2e}"


def test_the_parameters_are_flax_s():
    gpu, flax_form = _pair(jnp.float32)
    shapes = lambda m: jax.tree.map(jnp.shape, nnx.state(m, nnx.Param))
    assert shapes(gpu) == shapes(flax_form)
    assert isinstance(gpu, nnx.LayerNorm)
