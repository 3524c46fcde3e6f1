"""Resolution Aware Transformer (RAT) backbone in Flax NNX.

Port of ``resolution_aware_transformer.ResolutionAwareTransformer`` (PyPI
``resolution-aware-transformer==2025.9.29.2036``), described in
docs/reference.md and docs/rat.md.

Inputs are channels-last: one image (B, *spatial, C) or a pyramid (a list of them, same batch),
each with its own spacing. A C->D convolution makes tokens; then ``num_blocks`` times: one SGA
layer per scale (shared weights; each grid shrinks by the stride and its spacing grows by it),
then one multi-resolution RoSE block attending jointly over all scales.

Departures from the reference, each a named option with the reference behaviour available:

* ``reference_compat=True`` (default False): SGA value-head reshaping as the reference (flaw 1);
  also keeps ``leading_tokens`` as an unused parameter (flaw 11). With False the heads are split
  properly and leading tokens are prepended (unrotated) to every multi-resolution block.
* ``sga_attention_type``: "dense" (reference), "sparse" (working windowed SGA, ours), "standard"
  (plain cross-attention ablation), "mixed" (sparse in the first half of the blocks, dense after),
  or one entry per block.
* ``rose_initial_scaling="index"``: RoPE-like grid-index coordinates (the reference "rope" starts
  with no rotation at all, flaw 4).
* ``absolute_pos_grid``: a real learned absolute position embedding (the reference has none).
* ``iters=0`` with ``return_maps`` raises (the reference returns uninitialised memory, flaw 17).
* ``mr_attention="windowed"`` (default "global", the reference): multi-resolution attention in
  ``mr_window``-token tiles on large grids, linear in pixels (:mod:`jaxrat.models.window_attention`).
* ``remat="blocks"``: recompute each SGA layer and multi-resolution block in the backward pass
  instead of keeping its activations (memory for time; default "none").
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from jaxrat.models.layers import conv, trunc_normal_init
from jaxrat.models.mr_block import MultiResBlock
from jaxrat.models.sga import SpatialGroupingAttention, as_tuple

Array = jax.Array
SGA_TYPES = ("dense", "sparse", "standard", "mixed")
REMAT_TYPES = ("none", "blocks")


@flax.struct.dataclass
class ScaleOutput:
    """The backbone's result for one input image (one pyramid level).

    Attributes:
      tokens: (B, N_final, D) tokens after the last block, row-major over ``grid_shape``.
      grid_shape: final grid (static).
      spacing: final spacing = input spacing x stride^num_blocks (static).
      attn_q, attn_k: chained grouping maps (B, H, N_final, N_input), only with ``return_maps``.
      features: with ``return_features``, the tokens after the initial projection and after every
        block: ((B, N_0, D), ..., (B, N_final, D)).
      feature_grids: the grid of each entry of ``features`` (static).
      leading: leading tokens after the last block (shared by all scales), if any.
    """

    tokens: Array
    grid_shape: tuple = flax.struct.field(pytree_node=False)
    spacing: tuple = flax.struct.field(pytree_node=False)
    attn_q: Optional[Array] = None
    attn_k: Optional[Array] = None
    features: Optional[tuple] = None
    feature_grids: tuple = flax.struct.field(pytree_node=False, default=())
    leading: Optional[Array] = None


def block_attention_types(sga_attention_type: str | Sequence[str], num_blocks: int) -> tuple[str, ...]:
    """Per-block SGA type; "mixed" = sparse for the first ceil(n/2) (large-grid) blocks, then dense."""
    if isinstance(sga_attention_type, str):
        if sga_attention_type == "mixed":
            n_sparse = (num_blocks + 1) // 2
            return ("sparse",) * n_sparse + ("dense",) * (num_blocks - n_sparse)
        if sga_attention_type not in SGA_TYPES:
            raise ValueError(f"sga_attention_type must be one of {SGA_TYPES} or a per-block list, "
                             f"got {sga_attention_type!r}")
        return (sga_attention_type,) * num_blocks
    types = tuple(sga_attention_type)
    if len(types) != num_blocks or any(t not in ("dense", "sparse", "standard") for t in types):
        raise ValueError(f"per-block sga_attention_type needs {num_blocks} of dense/sparse/standard, got {types}")
    return types


class AbsolutePositionEmbedding(nnx.Module):
    """Learned absolute position table on a base grid, resized (linearly) to each scale's grid."""

    def __init__(self, grid_shape: Sequence[int], dim: int, *, rngs: nnx.Rngs) -> None:
        self.table = nnx.Param(trunc_normal_init()(rngs.params(), (*grid_shape, dim)))

    def __call__(self, grid_shape: Sequence[int]) -> Array:
        table = self.table[...]
        if tuple(table.shape[:-1]) != tuple(grid_shape):
            table = jax.image.resize(table, (*grid_shape, table.shape[-1]), "linear")
        return table.reshape(1, -1, table.shape[-1])


class ResolutionAwareTransformer(nnx.Module):
    """RAT backbone. Constructor arguments follow the reference (docs/reference.md), plus:

    Args:
      reference_compat: reproduce the reference exactly (see module docstring).
      absolute_pos_grid: grid of a learned absolute position embedding added after the initial
        projection (None = none, as in the reference).
      max_block_elements, slice_batch: memory/speed knobs of the attention kernels (block None:
        the machine's default, `attention.default_block_elements`).
      mr_attention: "global" (reference) or "windowed" multi-resolution attention.
      mr_window: window side in tokens for ``mr_attention="windowed"``.
      remat: "none" or "blocks" (rematerialise every SGA layer and MR block in the backward pass).
      dtype: compute dtype; parameters stay float32.
      rngs: parameter initialisation and dropout randomness.
    """

    def __init__(
        self,
        spatial_dims: int = 2,
        input_features: int = 3,
        proj_kernel_size: int | Sequence[int] = 7,
        proj_padding: int | Sequence[int] | str = "same",
        feature_dims: int = 128,
        num_blocks: int = 4,
        sga_attention_type: str | Sequence[str] = "dense",
        sga_kernel_size: int | Sequence[int] = 7,
        stride: Optional[int | Sequence[int]] = None,
        num_heads: int = 16,
        iters: int = 3,
        mlp_ratio: float = 4,
        mlp_dropout: float = 0.0,
        mlp_bias: bool = True,
        qkv_bias: bool = True,
        base_theta: float = 1e4,
        learnable_rose: bool = True,
        learnable_rose_scaling: bool = True,
        rose_initial_scaling: Optional[str] = "log",
        init_jitter_std: float = 0.02,
        rotary_ratio: float = 0.5,
        frequency_scaling: str = "sqrt",
        leading_tokens: int = 0,
        spacing: Optional[float | Sequence[float]] = None,
        reference_compat: bool = False,
        absolute_pos_grid: Optional[Sequence[int]] = None,
        max_block_elements: Optional[int] = None,
        slice_batch: int = 1,
        mr_attention: str = "global",
        mr_window: int = 16,
        remat: str = "none",
        dtype: Any = jnp.float32,
        *,
        rngs: nnx.Rngs,
    ) -> None:
        if spatial_dims not in (1, 2, 3):
            raise ValueError(f"spatial_dims must be 1, 2 or 3, got {spatial_dims}")
        if remat not in REMAT_TYPES:
            raise ValueError(f"remat must be one of {REMAT_TYPES}, got {remat!r}")
        self.remat = remat
        self.spatial_dims = spatial_dims
        self.feature_dims = feature_dims
        self.num_blocks = num_blocks
        self.num_heads = num_heads
        self.reference_compat = reference_compat
        self.proj_kernel_size = as_tuple(proj_kernel_size, spatial_dims, int)
        self.default_spacing = as_tuple(1.0 if spacing is None else spacing, spatial_dims, float)
        self.sga_types = block_attention_types(sga_attention_type, num_blocks)
        if proj_padding == "same":
            padding: Any = "SAME"
        else:
            padding = [(p, p) for p in as_tuple(proj_padding, spatial_dims, int)]
        self.init_proj = conv(input_features, feature_dims, self.proj_kernel_size, padding=padding, dtype=dtype,
                              rngs=rngs, cpu_fast_forms=True)
        self.leading_tokens = (
            nnx.Param(jax.random.uniform(rngs.params(), (1, leading_tokens, feature_dims), jnp.float32))
            if leading_tokens > 0 else None
        )
        self.abs_pos = (
            AbsolutePositionEmbedding(as_tuple(absolute_pos_grid, spatial_dims, int), feature_dims, rngs=rngs)
            if absolute_pos_grid is not None else None
        )
        rose_kw = dict(base_theta=base_theta, init_jitter_std=init_jitter_std, rotary_ratio=rotary_ratio,
                       frequency_scaling=frequency_scaling)
        self.sga_layers = nnx.List([
            SpatialGroupingAttention(
                feature_dims, spatial_dims, sga_kernel_size, num_heads, stride, iters, mlp_ratio, mlp_dropout,
                mlp_bias, qkv_bias, learnable_rose=learnable_rose, learnable_rose_scaling=learnable_rose_scaling,
                rose_initial_scaling=rose_initial_scaling, attention=t, reference_compat=reference_compat,
                max_block_elements=max_block_elements, slice_batch=slice_batch, dtype=dtype, rngs=rngs, **rose_kw,
            )
            for t in self.sga_types
        ])
        self.mr_attn_layers = nnx.List([
            MultiResBlock(
                feature_dims, num_heads, spatial_dims, learnable=learnable_rose, learnable_scale=learnable_rose_scaling,
                initial_scaling=rose_initial_scaling, mlp_ratio=mlp_ratio, mlp_dropout=mlp_dropout, mlp_bias=mlp_bias,
                qkv_bias=qkv_bias, max_block_elements=max_block_elements, slice_batch=slice_batch,
                attention=mr_attention, window=mr_window, dtype=dtype, rngs=rngs, **rose_kw,
            )
            for _ in range(num_blocks)
        ])

    def dilate_mask(self, mask: Array) -> Array:
        """Mark every pixel whose projection window touches a masked pixel (reference max-pool)."""
        if all(k == 1 for k in self.proj_kernel_size):
            return mask > 0
        k = self.proj_kernel_size
        pooled = jax.lax.reduce_window(
            mask.astype(jnp.float32), -jnp.inf, jax.lax.max, (1, *k), (1,) * (len(k) + 1),
            [(0, 0)] + [(kk // 2, kk // 2) for kk in k],
        )
        return pooled > 0

    def _spacings(self, input_spacing: Any, num_images: int) -> list[tuple[float, ...]]:
        sd = self.spatial_dims
        if input_spacing is None:
            return [self.default_spacing] * num_images
        if all(isinstance(s, (int, float)) for s in input_spacing):
            if num_images != 1:
                raise ValueError("a flat input_spacing is only accepted for a single image; pass one per level")
            return [as_tuple(input_spacing, sd, float)]
        spacings = [as_tuple(s, sd, float) for s in input_spacing]
        if len(spacings) != num_images:
            raise ValueError(f"got {len(spacings)} spacings for {num_images} images")
        return spacings

    def __call__(
        self,
        x: Array | Sequence[Array],
        input_spacing: Optional[Sequence[float] | Sequence[Sequence[float]]] = None,
        mask: Optional[Array | Sequence[Optional[Array]]] = None,
        return_maps: bool = False,
        return_features: bool = False,
    ) -> list[ScaleOutput]:
        """Run the backbone.

        Args:
          x: (B, *spatial, C) image or a list of them (an image pyramid).
          input_spacing: None (default spacing), one tuple (single image) or one tuple per image.
          mask: per image (B, *spatial), values > 0 = masked (the reference code's polarity).
          return_maps: also return the chained grouping maps (memory: B*H*N_final*N_input each,
            and each layer's (B, H, N_out, N_in) maps are materialised to chain them).
          return_features: also return every block's tokens (for multi-level decoders).

        Returns:
          One :class:`ScaleOutput` per image.
        """
        images = [x] if not isinstance(x, (list, tuple)) else list(x)
        n = len(images)
        if len({im.shape[0] for im in images}) != 1:
            raise ValueError("all pyramid levels must have the same batch size")
        spacings = self._spacings(input_spacing, n)
        if mask is None:
            masks = [None] * n
        else:
            masks = list(mask) if isinstance(mask, (list, tuple)) else [mask]
        if len(masks) != n:
            raise ValueError(f"got {len(masks)} masks for {n} images")
        masks = [None if m is None else self.dilate_mask(m) for m in masks]

        tokens, grids = [], []
        for im in images:
            feat = self.init_proj(im)
            grid = tuple(feat.shape[1:-1])
            t = feat.reshape(feat.shape[0], -1, self.feature_dims)
            if self.abs_pos is not None:
                t = t + self.abs_pos(grid).astype(t.dtype)
            tokens.append(t)
            grids.append(grid)
        features = [[t] for t in tokens]
        feature_grids = [[g] for g in grids]
        maps_q: list[Optional[Array]] = [None] * n
        maps_k: list[Optional[Array]] = [None] * n
        leading = None
        if self.leading_tokens is not None and not self.reference_compat:
            shape = (images[0].shape[0],) + self.leading_tokens.shape[1:]
            leading = jnp.broadcast_to(self.leading_tokens[...], shape).astype(tokens[0].dtype)

        for block in range(self.num_blocks):
            sga = self.sga_layers[block]
            for s in range(n):
                m = masks[s] if block == 0 else None
                # The scope names this layer's ops in the compiled HLO (op_name metadata, gradients
                # included), so profiles can charge time to a component (benchmarks/step_profile.py).
                with jax.named_scope("sga"):
                    if self.remat == "blocks" and not return_maps:
                        # Grids and spacings are static: closed over, not traced.
                        g, sp = grids[s], spacings[s]
                        x_s = nnx.remat(lambda layer, t, mk: layer(t, g, sp, mk).x)(sga, tokens[s], m)
                        out = sga.output_geometry(x_s, g, sp)
                    else:
                        out = sga(tokens[s], grids[s], spacings[s], m, return_maps)
                tokens[s], grids[s], spacings[s] = out.x, out.grid_shape, out.spacing
                if return_maps:
                    maps_q[s] = out.attn_q if maps_q[s] is None else jnp.matmul(out.attn_q, maps_q[s])
                    maps_k[s] = out.attn_k if maps_k[s] is None else jnp.matmul(out.attn_k, maps_k[s])
            mr = self.mr_attn_layers[block]
            with jax.named_scope("mr_blocks"):  # for profiles, as "sga" above
                if self.remat == "blocks":
                    gs, sps = tuple(grids), tuple(spacings)
                    tokens, leading = nnx.remat(lambda layer, t, lead: layer(t, gs, sps, lead))(mr, tokens, leading)
                    tokens = list(tokens)
                else:
                    tokens, leading = mr(tokens, grids, spacings, leading)
            for s in range(n):
                features[s].append(tokens[s])
                feature_grids[s].append(grids[s])

        return [
            ScaleOutput(
                tokens=tokens[s], grid_shape=grids[s], spacing=spacings[s], attn_q=maps_q[s], attn_k=maps_k[s],
                features=tuple(features[s]) if return_features else None,
                feature_grids=tuple(feature_grids[s]) if return_features else (),
                leading=leading,
            )
            for s in range(n)
        ]
