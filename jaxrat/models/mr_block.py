"""Multi-resolution RoSE transformer block (port of ``RoSE.MultiRes_RoSE_Block``).

Joint pre-norm self-attention over the tokens of every scale (concatenated in list order), each
scale's queries and keys rotated at its own grid and spacing, then a pre-norm MLP. Optional
leading tokens are prepended unrotated. The attention is the memory-efficient kernel of
:mod:`jaxrat.models.attention`, so a 256x256 pyramid's ~10k-token first block stays small.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrat.models.layers import Mlp, layer_norm, linear
from jaxrat.models.rose import RotarySpatialEmbedding
from jaxrat.models.window_attention import MR_ATTENTION_TYPES, multires_attention

Array = jax.Array


class MultiResBlock(nnx.Module):
    """One multi-resolution RoSE block; LayerNorm eps 1e-6 as in the reference.

    ``attention="global"`` is the reference (every token sees every token, cost quadratic in
    pixels); ``"windowed"`` tiles grids larger than ``window`` tokens per axis into windows that
    see themselves and the small grids (linear cost, :mod:`jaxrat.models.window_attention`).
    Both have the same parameters.
    """

    def __init__(
        self,
        feature_dims: int,
        num_heads: int,
        spatial_dims: int = 2,
        base_theta: float = 1e4,
        learnable: bool = True,
        init_jitter_std: float = 0.02,
        rotary_ratio: float = 1.0,
        frequency_scaling: str = "sqrt",
        learnable_scale: bool = False,
        initial_scaling: Optional[str] = None,
        mlp_ratio: float = 4.0,
        mlp_dropout: float = 0.0,
        mlp_bias: bool = True,
        qkv_bias: bool = True,
        norm_eps: float = 1e-6,
        max_block_elements: Optional[int] = None,
        slice_batch: int = 1,
        attention: str = "global",
        window: int = 16,
        dtype: Any = jnp.float32,
        *,
        rngs: nnx.Rngs,
    ) -> None:
        if attention not in MR_ATTENTION_TYPES:
            raise ValueError(f"mr_attention must be one of {MR_ATTENTION_TYPES}, got {attention!r}")
        if window < 1:
            raise ValueError(f"mr_window must be >= 1, got {window}")
        self.attention = attention
        self.window = window
        self.num_heads = num_heads
        self.head_dim = feature_dims // num_heads
        self.max_block_elements = max_block_elements
        self.slice_batch = slice_batch
        self.rose = RotarySpatialEmbedding(
            feature_dims, num_heads, spatial_dims, base_theta, learnable, init_jitter_std,
            frequency_scaling, rotary_ratio, learnable_scale, initial_scaling, rngs=rngs,
        )
        self.norm1 = layer_norm(feature_dims, norm_eps, dtype=dtype, rngs=rngs)
        self.qkv = linear(feature_dims, 3 * feature_dims, use_bias=qkv_bias, dtype=dtype, rngs=rngs)
        self.proj = linear(feature_dims, feature_dims, dtype=dtype, rngs=rngs)
        self.norm2 = layer_norm(feature_dims, norm_eps, dtype=dtype, rngs=rngs)
        self.mlp = Mlp(feature_dims, int(feature_dims * mlp_ratio), dropout=mlp_dropout, bias=mlp_bias, dtype=dtype,
                       rngs=rngs)

    def __call__(
        self,
        xs: Sequence[Array],
        grid_shapes: Sequence[Sequence[int]],
        spacings: Sequence[Sequence[float]],
        leading: Optional[Array] = None,
    ) -> tuple[list[Array], Optional[Array]]:
        """Attend jointly over all scales.

        Args:
          xs: per scale (B, N_s, D) tokens.
          grid_shapes, spacings: per scale grid and spacing, used for the rotation.
          leading: optional (B, L, D) tokens prepended unrotated.

        Returns:
          (per-scale tokens, updated leading tokens or None).
        """
        parts = ([leading] if leading is not None else []) + list(xs)
        x = jnp.concatenate(parts, axis=1)
        b, n, d = x.shape
        h, dh = self.num_heads, self.head_dim
        q, k, v = jnp.split(self.qkv(self.norm1(x)), 3, axis=-1)
        q, k, v = (a.reshape(b, n, h, dh) for a in (q, k, v))
        start = 0 if leading is None else leading.shape[1]
        q_parts = [q[:, :start]] if start else []
        k_parts = [k[:, :start]] if start else []
        for grid, spacing, xi in zip(grid_shapes, spacings, xs):
            stop = start + xi.shape[1]
            q_parts.append(self.rose(q[:, start:stop], grid, spacing))
            k_parts.append(self.rose(k[:, start:stop], grid, spacing))
            start = stop
        q = jnp.concatenate(q_parts, axis=1) * jnp.asarray(dh**-0.5, q.dtype)
        k = jnp.concatenate(k_parts, axis=1)
        segments = ([(leading.shape[1], None)] if leading is not None else []) + [
            (xi.shape[1], tuple(g)) for xi, g in zip(xs, grid_shapes)
        ]
        out = multires_attention(
            q, k, v, segments, self.window if self.attention == "windowed" else None,
            max_block_elements=self.max_block_elements, slice_batch=self.slice_batch,
        )
        x = x + self.proj(out.reshape(b, n, d))
        x = x + self.mlp(self.norm2(x))
        start = 0
        new_leading = None
        if leading is not None:
            new_leading, start = x[:, : leading.shape[1]], leading.shape[1]
        outs = []
        for xi in xs:
            outs.append(x[:, start : start + xi.shape[1]])
            start += xi.shape[1]
        return outs, new_leading
