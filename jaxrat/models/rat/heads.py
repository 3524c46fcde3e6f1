"""Segmentation heads for the RAT backbone.

* :class:`ReferenceSegmentationHead` — the reference's head (experiments ``SegmentationHead``):
  a per-token MLP D -> D/2 -> D/4 -> classes on the **final** grid only (4x4 for a 256x256
  input), upsampled bilinearly (half-pixel centres, as ``align_corners=False``). PyTorch default
  init. Kept for parity and comparison; it cannot draw fine boundaries (docs/reference.md, flaw 8).
  The reference guesses a square grid from the token count; we use the known grid.
* :class:`MultiLevelDecoderHead` — our default: a light FPN-style decoder over every stage of the
  backbone (initial projection at full resolution, then each block's grid), coarse to fine:
  upsample, add a linear projection of the next finer stage, refine with a residual
  conv-GroupNorm-GELU. Uses GroupNorm, no batch statistics.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrat import ops
from jaxrat.models.layers import linear
from jaxrat.ops.conv import conv_general_dilated
from jaxrat.ops.resize import resize_linear

Array = jax.Array


def resize_to(x: Array, grid: Sequence[int], kernels: ops.KernelPolicy = ops.PORTABLE) -> Array:
    """Linear resize of (B, *grid, C) channels-last maps (half-pixel centres, edge-clamped)."""
    return resize_linear(x, grid, kernels)


class ReferenceSegmentationHead(nnx.Module):
    """Reference head: token MLP on the final grid, then bilinear upsampling."""

    def __init__(self, dim: int, num_classes: int, *, dtype: Any = jnp.float32, rngs: nnx.Rngs) -> None:
        self.fc1 = linear(dim, dim // 2, dtype=dtype, rngs=rngs, init="torch")
        self.fc2 = linear(dim // 2, dim // 4, dtype=dtype, rngs=rngs, init="torch")
        self.fc3 = linear(dim // 4, num_classes, dtype=dtype, rngs=rngs, init="torch")

    def __call__(self, tokens: Array, grid: Sequence[int], out_grid: Sequence[int]) -> Array:
        """(B, N, D) tokens on ``grid`` -> (B, *out_grid, classes) logits."""
        y = self.fc3(jax.nn.relu(self.fc2(jax.nn.relu(self.fc1(tokens)))))
        return resize_to(y.reshape(y.shape[0], *grid, y.shape[-1]), out_grid)


class _Refine(nnx.Module):
    def __init__(self, dim: int, spatial_dims: int, *, kernels: ops.KernelPolicy, dtype: Any,
                 rngs: nnx.Rngs) -> None:
        form = conv_general_dilated(kernels)
        self.conv = nnx.Conv(dim, dim, (3,) * spatial_dims, padding="SAME", dtype=dtype, rngs=rngs,
                             **(dict(conv_general_dilated=form) if form is not None else {}))
        self.norm = nnx.GroupNorm(dim, num_groups=min(8, dim), dtype=dtype, rngs=rngs)

    def __call__(self, x: Array) -> Array:
        return x + jax.nn.gelu(self.norm(self.conv(x)))


class MultiLevelDecoderHead(nnx.Module):
    """Coarse-to-fine decoder over all backbone stages (see module docstring).

    Args:
      dim: backbone feature size D.
      num_stages: number of stages fed in (num_blocks + 1: the projection and every block).
      num_classes: output channels.
      decoder_dim: channels inside the decoder.
      spatial_dims: 1, 2 or 3.
      kernels: the kernel policy of its convolutions.
    """

    def __init__(
        self,
        dim: int,
        num_stages: int,
        num_classes: int,
        decoder_dim: int = 32,
        spatial_dims: int = 2,
        *,
        kernels: ops.KernelPolicy,
        dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ) -> None:
        self.lateral = nnx.List([linear(dim, decoder_dim, dtype=dtype, rngs=rngs, init="torch")
                                 for _ in range(num_stages)])
        self.refine = nnx.List([_Refine(decoder_dim, spatial_dims, kernels=kernels, dtype=dtype, rngs=rngs)
                                for _ in range(num_stages - 1)])
        self.out = linear(decoder_dim, num_classes, dtype=dtype, rngs=rngs, init="torch")
        self.kernels = kernels

    def __call__(self, features: Sequence[Array], grids: Sequence[Sequence[int]], out_grid: Sequence[int]) -> Array:
        """Stage tokens (finest first) on their grids -> (B, *out_grid, classes) logits."""
        b = features[0].shape[0]
        y = self.lateral[-1](features[-1]).reshape(b, *grids[-1], -1)
        for level in range(len(features) - 2, -1, -1):
            skip = self.lateral[level](features[level]).reshape(b, *grids[level], -1)
            y = self.refine[level](resize_to(y, grids[level], self.kernels) + skip)
        return resize_to(self.out(y), out_grid, self.kernels)
