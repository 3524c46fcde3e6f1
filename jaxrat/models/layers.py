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
    """nnx.LayerNorm (the same parameters) computed by the kernel policy's form (:mod:`jaxrat.ops.norm`
    on the gpu policy, flax's own elsewhere)."""

    def __init__(self, *args: Any, kernels: Optional[ops.KernelPolicy] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kernels = kernels

    def __call__(self, x: Array, *, mask: Optional[Array] = None, residual: Optional[Array] = None) -> Array:
        """The normalised ``x``, plus ``residual`` when given (a post-norm block's sum: on the gpu policy
        one kernel)."""
        if (self.kernels is None or not self.kernels.uses("layer_norm") or mask is not None or self.scale is None
                or self.bias is None):
            y = super().__call__(x, mask=mask)
            return y if residual is None else residual + y
        return norm_ops.layer_norm(x, self.scale[...], self.bias[...], self.epsilon, self.dtype or x.dtype, residual)


def layer_norm(dim: int, eps: float, *, dtype: Dtype, rngs: nnx.Rngs,
               kernels: Optional[ops.KernelPolicy] = None) -> LayerNorm:
    # use_fast_variance=False: E[(x-mu)^2] like PyTorch, not E[x^2]-mu^2.
    return LayerNorm(dim, epsilon=eps, use_fast_variance=False, dtype=dtype, param_dtype=jnp.float32, rngs=rngs,
                     kernels=kernels)


class Mlp(nnx.Module):
    """timm ``Mlp``: fc1 -> exact GELU -> dropout -> fc2 -> dropout.

    On the gpu policy, one fused kernel where it takes the call; elsewhere large calls run over token
    chunks (:mod:`jaxrat.ops.mlp`: same values; in training, other dropout draws), as the memory and
    the kernel policy ask.
    """

    def __init__(self, dim: int, hidden: int, *, dropout: float = 0.0, bias: bool = True, dtype: Dtype,
                 rngs: nnx.Rngs, kernels: ops.KernelPolicy) -> None:
        self.fc1 = linear(dim, hidden, use_bias=bias, dtype=dtype, rngs=rngs)
        self.fc2 = linear(hidden, dim, use_bias=bias, dtype=dtype, rngs=rngs)
        self.drop1 = nnx.Dropout(dropout, rngs=rngs)
        self.drop2 = nnx.Dropout(dropout, rngs=rngs)
        self.kernels = kernels

    def __call__(self, x: Array) -> Array:
        dtype = self.fc1.dtype or x.dtype
        rate = self.drop1.rate
        if mlp_ops.fused(self.kernels, x.shape, self.fc1.out_features, dtype, rate):
            bias = lambda fc: fc.bias[...] if fc.bias is not None else jnp.zeros((fc.out_features,), jnp.float32)
            w = (self.fc1.kernel[...], bias(self.fc1), self.fc2.kernel[...], bias(self.fc2))
            key = self._dropout_key()
            # drop2's mask is drawn in the kernels too (from drop1's key: one draw from the stream);
            # without a key drop2 is off as well, or runs as itself.
            out_rate = self.drop2.rate if key is not None and not self.drop2.deterministic else 0.0
            # float32 weights as they are: the kernels round them on chip (no cast kernels), and their
            # gradients stay float32
            y = mlp_ops.fused_mlp(x.astype(dtype), *w, dropout_rate=rate, dropout_key=key, output_rate=out_rate)
            return y if key is not None else self.drop2(y)
        itemsize = jnp.dtype(dtype).itemsize
        hidden_bytes = math.prod(x.shape[:-1]) * self.fc1.out_features * itemsize
        chunks = mlp_ops.chunking(hidden_bytes, self.kernels) if x.ndim >= 2 else None
        if chunks is None:
            x = self.drop1(jax.nn.gelu(self.fc1(x), approximate=False))
            return self.drop2(self.fc2(x))
        y = mlp_ops.chunked_mlp(x, self.fc1, self.fc2, hidden_bytes=hidden_bytes, chunks=chunks, dropout_rate=rate,
                                dropout_key=self._dropout_key())
        return self.drop2(y)

    def _dropout_key(self) -> Array | None:
        """The key ``drop1`` would draw its mask with (advancing its stream as it does), None when it
        would not draw: for the forms that apply the dropout themselves."""
        return self.drop1.rngs() if not self.drop1.deterministic and self.drop1.rate > 0.0 else None
