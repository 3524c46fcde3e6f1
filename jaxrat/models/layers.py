"""Small building blocks shared by the RAT modules: initialisers, linear, conv, MLP."""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrat import ops
from jaxrat.ops import mlp as mlp_ops
from jaxrat.ops import norm as norm_ops
from jaxrat.ops.conv import conv_general_dilated

Array = jax.Array
Dtype = Any


def trunc_normal_init(std: float = 0.02):
    """Normal(0, std) truncated at +-2 std, as ``torch.nn.init.trunc_normal_(std, a=-2std, b=2std)``.

    (``jax.nn.initializers.truncated_normal`` rescales to unit variance after truncation, which the
    reference does not.)
    """

    def init(key: Array, shape: Sequence[int], dtype: Dtype = jnp.float32) -> Array:
        return (std * jax.random.truncated_normal(key, -2.0, 2.0, shape, jnp.float32)).astype(dtype)

    return init


def torch_default_uniform(fan_in: int):
    """U(-1/sqrt(fan_in), 1/sqrt(fan_in)): PyTorch's default for conv/linear weights and biases."""
    bound = 1.0 / math.sqrt(fan_in)

    def init(key: Array, shape: Sequence[int], dtype: Dtype = jnp.float32) -> Array:
        return jax.random.uniform(key, shape, jnp.float32, -bound, bound).astype(dtype)

    return init


def linear(din: int, dout: int, *, use_bias: bool = True, dtype: Dtype, rngs: nnx.Rngs,
           init: str = "trunc") -> nnx.Linear:
    """Dense layer with the reference's transformer init ("trunc"), PyTorch's default ("torch"), or
    Glorot-uniform weights with zero bias ("xavier", DETR's decoder init)."""
    if init == "xavier":
        kernel_init, bias_init = nnx.initializers.xavier_uniform(), nnx.initializers.zeros_init()
    else:
        kernel_init = trunc_normal_init() if init == "trunc" else torch_default_uniform(din)
        bias_init = nnx.initializers.zeros_init() if init == "trunc" else torch_default_uniform(din)
    return nnx.Linear(din, dout, use_bias=use_bias, kernel_init=kernel_init, bias_init=bias_init,
                      dtype=dtype, param_dtype=jnp.float32, rngs=rngs)


def conv(
    din: int,
    dout: int,
    kernel_size: Sequence[int],
    *,
    strides: Sequence[int] | int = 1,
    padding: Any = "SAME",
    dtype: Dtype,
    rngs: nnx.Rngs,
    kernels: ops.KernelPolicy,
) -> nnx.Conv:
    """Channels-last convolution with PyTorch's default init (the reference's convs keep it).

    ``kernels``: the policy whose convolution form to take (:func:`jaxrat.ops.conv.
    conv_general_dilated`; same parameters, same values up to rounding).
    """
    fan_in = din * int(math.prod(kernel_size))
    form = conv_general_dilated(kernels)
    extra = dict(conv_general_dilated=form) if form is not None else {}
    return nnx.Conv(din, dout, tuple(kernel_size), strides=strides, padding=padding,
                    kernel_init=torch_default_uniform(fan_in), bias_init=torch_default_uniform(fan_in),
                    dtype=dtype, param_dtype=jnp.float32, rngs=rngs, **extra)


class LayerNorm(nnx.LayerNorm):
    """nnx.LayerNorm (the same parameters) computed by the kernel policy's form
    (:func:`jaxrat.ops.norm.normalise`), with an optional residual added (a post-norm block's sum)."""

    def __init__(self, *args: Any, kernels: Optional[ops.KernelPolicy] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kernels = kernels

    def __call__(self, x: Array, *, mask: Optional[Array] = None, residual: Optional[Array] = None) -> Array:
        """``residual + norm(x)`` (``norm(x)`` without a residual)."""
        return norm_ops.normalise(x, self.scale, self.bias, self.epsilon, self.dtype or x.dtype, self.kernels,
                                  mask=mask, residual=residual, flax_form=super().__call__)


def layer_norm(dim: int, eps: float, *, dtype: Dtype, rngs: nnx.Rngs,
               kernels: Optional[ops.KernelPolicy] = None) -> LayerNorm:
    # use_fast_variance=False: E[(x-mu)^2] like PyTorch, not E[x^2]-mu^2.
    return LayerNorm(dim, epsilon=eps, use_fast_variance=False, dtype=dtype, param_dtype=jnp.float32, rngs=rngs,
                     kernels=kernels)


class Mlp(nnx.Module):
    """timm ``Mlp``: fc1 -> exact GELU -> dropout -> fc2 -> dropout, in the kernel policy's form
    (:func:`jaxrat.ops.mlp.mlp`: one fused kernel, token chunks or the plain layers; same values)."""

    def __init__(self, dim: int, hidden: int, *, dropout: float = 0.0, bias: bool = True, dtype: Dtype,
                 rngs: nnx.Rngs, kernels: ops.KernelPolicy) -> None:
        self.fc1 = linear(dim, hidden, use_bias=bias, dtype=dtype, rngs=rngs)
        self.fc2 = linear(hidden, dim, use_bias=bias, dtype=dtype, rngs=rngs)
        self.drop1 = nnx.Dropout(dropout, rngs=rngs)
        self.drop2 = nnx.Dropout(dropout, rngs=rngs)
        self.kernels = kernels

    def __call__(self, x: Array) -> Array:
        return mlp_ops.mlp(x, mlp_ops.Layers(self.fc1, self.fc2, self.drop1, self.drop2), self.kernels)
