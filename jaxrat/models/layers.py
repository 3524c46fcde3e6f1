"""Small building blocks shared by the RAT modules: initialisers, linear, conv, MLP."""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxrat.models.strided_conv import conv_general_dilated as cpu_fast_conv

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
    cpu_fast_forms: bool = False,
) -> nnx.Conv:
    """Channels-last convolution with PyTorch's default init (the reference's convs keep it).

    ``cpu_fast_forms``: on CPU, compute large strided convolutions as stride-block matmuls and
    large stride-1 ones' weight gradients over row strips (:func:`jaxrat.models.strided_conv.
    conv_general_dilated`; same parameters, same values up to rounding).
    """
    fan_in = din * int(math.prod(kernel_size))
    extra = dict(conv_general_dilated=cpu_fast_conv) if cpu_fast_forms else {}
    return nnx.Conv(din, dout, tuple(kernel_size), strides=strides, padding=padding,
                    kernel_init=torch_default_uniform(fan_in), bias_init=torch_default_uniform(fan_in),
                    dtype=dtype, param_dtype=jnp.float32, rngs=rngs, **extra)


def layer_norm(dim: int, eps: float, *, dtype: Dtype, rngs: nnx.Rngs) -> nnx.LayerNorm:
    # use_fast_variance=False: E[(x-mu)^2] like PyTorch, not E[x^2]-mu^2.
    return nnx.LayerNorm(dim, epsilon=eps, use_fast_variance=False, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)


# Above this many bytes of hidden activation in one call, the MLP runs over token chunks whose
# hidden activations are recomputed in the backward pass: at 1024 px the first SGA layer's three
# MLPs would otherwise keep ~10 GiB of GELU inputs, outputs and dropout masks alive.
CHUNK_HIDDEN_BYTES = 256 * 2**20
CHUNK_TOKENS_BYTES = 32 * 2**20  # hidden bytes of one chunk
# On CPU, from this many hidden bytes up to CHUNK_HIDDEN_BYTES the MLP also runs over token chunks,
# of CPU_CHUNK_BYTES, but keeps what the backward needs instead of recomputing it: the memory is
# that of the plain form, and each chunk's GELU, dropout and their gradients work in the cache.
# Plain, those passes over a hidden activation out of the cache grew 12-27x from 256 to 512 px
# (4x the tokens); chunked, the sparse RAT step at 512 px went 17.8 -> 15.5 s, 256 px 3.49 -> 3.40 s
# (2-16 MiB chunks within noise of each other). Accelerators want the one wide product.
CPU_CHUNK_HIDDEN_BYTES = 16 * 2**20
CPU_CHUNK_BYTES = 8 * 2**20


class Mlp(nnx.Module):
    """timm ``Mlp``: fc1 -> exact GELU -> dropout -> fc2 -> dropout.

    Calls whose hidden activation would exceed ``CHUNK_HIDDEN_BYTES`` run as a scan over token
    chunks with each chunk rematerialised (same values; in training, different dropout draws); on
    CPU, calls above ``CPU_CHUNK_HIDDEN_BYTES`` run as a scan over cache-sized chunks without it.
    """

    def __init__(self, dim: int, hidden: int, *, dropout: float = 0.0, bias: bool = True, dtype: Dtype,
                 rngs: nnx.Rngs) -> None:
        self.fc1 = linear(dim, hidden, use_bias=bias, dtype=dtype, rngs=rngs)
        self.fc2 = linear(hidden, dim, use_bias=bias, dtype=dtype, rngs=rngs)
        self.drop1 = nnx.Dropout(dropout, rngs=rngs)
        self.drop2 = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x: Array) -> Array:
        tokens = math.prod(x.shape[:-1])
        itemsize = jnp.dtype(self.fc1.dtype or x.dtype).itemsize
        hidden_bytes = tokens * self.fc1.out_features * itemsize
        if x.ndim >= 2 and hidden_bytes > CHUNK_HIDDEN_BYTES:
            return self.drop2(self._chunked(x, hidden_bytes))
        if x.ndim >= 2 and hidden_bytes > CPU_CHUNK_HIDDEN_BYTES and jax.default_backend() == "cpu":
            return self.drop2(self._chunked(x, hidden_bytes, CPU_CHUNK_BYTES, remat=False))
        x = self.drop1(jax.nn.gelu(self.fc1(x), approximate=False))
        return self.drop2(self.fc2(x))

    def _chunked(self, x: Array, hidden_bytes: int, chunk_bytes: Optional[int] = None, remat: bool = True) -> Array:
        """fc2(drop1(gelu(fc1(x)))) as a scan over chunks of axis -2 holding about ``chunk_bytes``
        (default ``CHUNK_TOKENS_BYTES``) of hidden activation; with ``remat`` each chunk is
        recomputed in the backward pass.

        A scan (not one ``jax.checkpoint``) because XLA's scheduler runs independent recomputations
        side by side; a loop forces one chunk's hidden activation at a time.
        """
        n = x.shape[-2]
        chunks = max(2, -(-hidden_bytes // (chunk_bytes or CHUNK_TOKENS_BYTES)))
        size = -(-n // chunks)
        chunks = -(-n // size)
        pad = chunks * size - n
        xp = jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, pad), (0, 0)]) if pad else x
        xs = jnp.moveaxis(xp.reshape(*x.shape[:-2], chunks, size, x.shape[-1]), -3, 0)
        rate = self.drop1.rate
        train = not self.drop1.deterministic and rate > 0.0
        keys = jax.random.split(self.drop1.rngs(), chunks) if train else jnp.zeros((chunks,), jnp.uint32)

        def body(carry, chunk_and_key):
            chunk, key = chunk_and_key
            h = jax.nn.gelu(checkpoint_name(self.fc1(chunk), "mlp_fc1"), approximate=False)
            if train:
                keep = jax.random.bernoulli(key, 1.0 - rate, h.shape)
                h = jnp.where(keep, h / (1.0 - rate), jnp.zeros_like(h))
            return carry, self.fc2(h)

        # Without remat only fc1's output is kept: GELU and the dropout mask are recomputed from it
        # in the cache, and the backward holds one hidden-sized array per chunk, not three.
        policy = None if remat else jax.checkpoint_policies.save_only_these_names("mlp_fc1")
        _, ys = jax.lax.scan(jax.checkpoint(body, policy=policy), None, (xs, keys))
        y = jnp.moveaxis(ys, 0, -3).reshape(*x.shape[:-2], chunks * size, ys.shape[-1])
        return y[..., :n, :] if pad else y
