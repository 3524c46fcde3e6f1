"""The pieces the ViT, BEiT and Swin backbones share, laid out as timm lays them out (so weights
convert name for name): patch embedding, MLP, multi-head self-attention with an optional additive
bias (relative positions, Swin's shift mask) and the pre-norm transformer block with optional layer
scale.

Attention without a bias goes through :func:`jaxrat.ops.attention.softmax_attention` (the policy's
kernel: fused on GPUs). With a bias the logits are materialised in float32: ``jaxrat.ops`` has no
biased form yet, and the biased calls here are short sequences (a Swin window of 49 tokens, BEiT's
patch grid plus one).
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrat.ops import KernelPolicy
from jaxrat.ops.attention import softmax_attention

Array = jax.Array


def gelu(x: Array) -> Array:
    """The exact (erf) GELU, as torch's ``nn.GELU()`` computes it."""
    return jax.nn.gelu(x, approximate=False)


def layer_norm(dim: int, eps: float, dtype: Any, rngs: nnx.Rngs) -> nnx.LayerNorm:
    """A LayerNorm with torch's variance (not the fast E[x^2] - E[x]^2 form)."""
    return nnx.LayerNorm(dim, epsilon=eps, use_fast_variance=False, dtype=dtype, rngs=rngs)


def biased_attention(q: Array, k: Array, v: Array, bias: Optional[Array], kernels: KernelPolicy) -> Array:
    """``softmax(q k^T + bias) v`` over (..., N, d) operands, ``q`` scaled; ``bias`` broadcasts to
    (..., Nq, Nk). Without a bias it is the policy's kernel."""
    if bias is None:
        return softmax_attention(q, k, v, kernels)
    logits = jnp.einsum("...qd,...kd->...qk", q, k, preferred_element_type=jnp.float32) + bias.astype(jnp.float32)
    weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("...qk,...kd->...qd", weights, v)


class PatchEmbed(nnx.Module):
    """A ``patch x patch`` convolution with stride ``patch``: (B, H, W, C) -> (B, H/p, W/p, dim),
    then a LayerNorm when ``norm_eps`` is given (Swin)."""

    def __init__(self, patch: int, in_channels: int, dim: int, *, norm_eps: Optional[float] = None, dtype: Any,
                 rngs: nnx.Rngs) -> None:
        self.proj = nnx.Conv(in_channels, dim, (patch, patch), strides=(patch, patch), padding="VALID",
                             dtype=dtype, rngs=rngs)
        if norm_eps is not None:
            self.norm = layer_norm(dim, norm_eps, dtype, rngs)

    def __call__(self, images: Array) -> Array:
        x = self.proj(images)
        return self.norm(x) if hasattr(self, "norm") else x


class Mlp(nnx.Module):
    """fc1 -> GELU -> fc2."""

    def __init__(self, dim: int, hidden: int, *, dtype: Any, rngs: nnx.Rngs) -> None:
        self.fc1 = nnx.Linear(dim, hidden, dtype=dtype, rngs=rngs)
        self.fc2 = nnx.Linear(hidden, dim, dtype=dtype, rngs=rngs)

    def __call__(self, x: Array) -> Array:
        return self.fc2(gelu(self.fc1(x)))


class Attention(nnx.Module):
    """Multi-head self-attention on (B, N, dim) tokens.

    ``qkv_bias``: "all" (one bias over q, k and v: ViT, Swin), "qv" (learned q and v biases, none on
    k: BEiT) or "none". ``rel_table``: rows of a learned relative-position table (BEiT, Swin); the
    caller indexes it into the bias.
    """

    def __init__(self, dim: int, heads: int, *, qkv_bias: str = "all", rel_table: int = 0, kernels: KernelPolicy,
                 dtype: Any, rngs: nnx.Rngs) -> None:
        self.heads, self.kernels = heads, kernels
        self.qkv = nnx.Linear(dim, 3 * dim, use_bias=qkv_bias == "all", dtype=dtype, rngs=rngs)
        if qkv_bias == "qv":
            self.q_bias = nnx.Param(jnp.zeros((dim,), jnp.float32))
            self.v_bias = nnx.Param(jnp.zeros((dim,), jnp.float32))
        if rel_table:
            init = nnx.initializers.truncated_normal(0.02)
            self.relative_position_bias_table = nnx.Param(init(rngs.params(), (rel_table, heads), jnp.float32))
        self.proj = nnx.Linear(dim, dim, dtype=dtype, rngs=rngs)

    def relative_bias(self, index: Array) -> Array:
        """The (heads, N, N) bias of a relative-position ``index`` (N, N) into the table."""
        return self.relative_position_bias_table[...][index].transpose(2, 0, 1)

    def __call__(self, x: Array, bias: Optional[Array] = None) -> Array:
        b, n, dim = x.shape
        qkv = self.qkv(x)
        if hasattr(self, "q_bias"):
            qkv = qkv + jnp.concatenate([self.q_bias[...], jnp.zeros_like(self.q_bias[...]),
                                         self.v_bias[...]]).astype(qkv.dtype)
        qkv = qkv.reshape(b, n, 3, self.heads, dim // self.heads).transpose(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]  # (B, heads, N, d)
        q = q * (dim // self.heads) ** -0.5
        out = biased_attention(q, k, v, bias, self.kernels)
        return self.proj(out.transpose(0, 2, 1, 3).reshape(b, n, dim))


class Block(nnx.Module):
    """Pre-norm transformer block: ``x + g1 * attn(norm1(x)); x + g2 * mlp(norm2(x))``, the layer
    scales ``g`` (BEiT's ``gamma_1``/``gamma_2``) only where ``layer_scale`` is set."""

    def __init__(self, dim: int, heads: int, *, mlp_ratio: float = 4.0, eps: float = 1e-6, qkv_bias: str = "all",
                 rel_table: int = 0, layer_scale: Optional[float] = None, kernels: KernelPolicy, dtype: Any,
                 rngs: nnx.Rngs) -> None:
        self.norm1 = layer_norm(dim, eps, dtype, rngs)
        self.attn = Attention(dim, heads, qkv_bias=qkv_bias, rel_table=rel_table, kernels=kernels, dtype=dtype,
                              rngs=rngs)
        self.norm2 = layer_norm(dim, eps, dtype, rngs)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), dtype=dtype, rngs=rngs)
        if layer_scale is not None:
            self.gamma_1 = nnx.Param(jnp.full((dim,), layer_scale, jnp.float32))
            self.gamma_2 = nnx.Param(jnp.full((dim,), layer_scale, jnp.float32))

    def __call__(self, x: Array, bias: Optional[Array] = None) -> Array:
        a = self.attn(self.norm1(x), bias)
        if hasattr(self, "gamma_1"):
            a = a * self.gamma_1[...].astype(a.dtype)
        x = x + a
        m = self.mlp(self.norm2(x))
        if hasattr(self, "gamma_2"):
            m = m * self.gamma_2[...].astype(m.dtype)
        return x + m


def relative_position_index(h: int, w: int, extra: bool = False) -> Array:
    """Index into a relative-position table for an ``h x w`` grid (timm's layout), (hw, hw); with
    ``extra`` (BEiT) a leading class-token row and column point at the table's last three rows."""
    import numpy as np

    coords = np.stack(np.meshgrid(np.arange(h), np.arange(w), indexing="ij")).reshape(2, -1)
    rel = (coords[:, :, None] - coords[:, None, :]).transpose(1, 2, 0)
    rel[..., 0] += h - 1
    rel[..., 1] += w - 1
    rel[..., 0] *= 2 * w - 1
    index = rel.sum(-1)
    if extra:
        n = (2 * h - 1) * (2 * w - 1)
        full = np.zeros((h * w + 1, h * w + 1), np.int32)
        full[1:, 1:] = index
        full[0, :] = n
        full[:, 0] = n + 1
        full[0, 0] = n + 2
        index = full
    return jnp.asarray(index, jnp.int32)
