"""Multi-resolution RoSE transformer block (port of ``RoSE.MultiRes_RoSE_Block``).

Joint pre-norm self-attention over the tokens of every scale (concatenated in list order), each
scale's queries and keys rotated at its own grid and spacing, then a pre-norm MLP. Optional
leading tokens are prepended unrotated. The attention is :func:`jaxrat.ops.attention.multires_attention`
in the form the kernel policy picks (memory-bounded everywhere, so a 256x256 pyramid's ~10k-token
first block stays small).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrat import ops
from jaxrat.models.layers import Mlp, layer_norm, linear
from jaxrat.models.rat.config import RATConfig
from jaxrat.models.rat.rose import RotarySpatialEmbedding
from jaxrat.ops import attention as attn

Array = jax.Array


class MultiResBlock(nnx.Module):
    """One multi-resolution RoSE block; LayerNorm eps 1e-6 as in the reference.

    ``config.mr_attention="global"`` is the reference (every token sees every token, cost quadratic
    in pixels); ``"windowed"`` tiles grids larger than ``config.mr_window`` tokens per axis into
    windows that see themselves and the small grids (linear cost, :mod:`jaxrat.ops.portable.windowed_attention`).
    Both have the same parameters.
    """

    def __init__(self, config: RATConfig, *, kernels: ops.KernelPolicy, norm_eps: float = 1e-6,
                 dtype: Any = jnp.float32, rngs: nnx.Rngs) -> None:
        c = config
        d = c.feature_dims
        self.window = c.mr_window if c.mr_attention == "windowed" else None
        self.num_heads = c.num_heads
        self.head_dim = d // c.num_heads
        self.kernels = kernels
        self.rose = RotarySpatialEmbedding.from_config(c, kernels=kernels, rngs=rngs)
        self.norm1 = layer_norm(d, norm_eps, dtype=dtype, rngs=rngs, kernels=kernels)
        self.qkv = linear(d, 3 * d, use_bias=c.qkv_bias, dtype=dtype, rngs=rngs)
        self.proj = linear(d, d, dtype=dtype, rngs=rngs)
        self.norm2 = layer_norm(d, norm_eps, dtype=dtype, rngs=rngs, kernels=kernels)
        self.mlp = Mlp(d, int(d * c.mlp_ratio), dropout=c.mlp_dropout, bias=c.mlp_bias, dtype=dtype, rngs=rngs,
                       kernels=kernels)

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
        out = attn.multires_attention(q, k, v, segments, self.window, self.kernels)
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
