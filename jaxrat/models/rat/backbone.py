"""Resolution Aware Transformer (RAT) backbone in Flax NNX: the one backbone of every RAT model.

Port of ``resolution_aware_transformer.ResolutionAwareTransformer`` (PyPI
``resolution-aware-transformer==2025.9.29.2036``), described in docs/reference.md and docs/rat.md.

Inputs are channels-last: one image (B, *spatial, C) or a pyramid (a list of them, same batch),
each with its own spacing. A C->D convolution makes tokens; then ``num_blocks`` times: one SGA
layer per scale (shared weights; each grid shrinks by the stride and its spacing grows by it),
then one multi-resolution RoSE block attending jointly over all scales. The segmenter, the
classifier and DETR all hold this class; :meth:`ResolutionAwareTransformer.features` builds their
image pyramid (``scales``) first.

Departures from the reference are options of :class:`~jaxrat.models.rat.config.RATConfig`, each
with the reference's behaviour available: ``reference_compat`` (SGA value heads, flaw 1; unused
leading tokens, flaw 11), ``attention`` (dense, sparse, standard, mixed or per block),
``positional_encoding`` ("rope" on grid indices: the reference's "rope" starts with no rotation at
all, flaw 4; a real learned absolute embedding), ``mr_attention="windowed"``, ``remat="blocks"``;
and ``return_maps`` with ``iters=0`` raises (the reference returns uninitialised memory, flaw 17).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from jaxrat import ops
from jaxrat.models.layers import conv, trunc_normal_init
from jaxrat.models.rat.config import RATConfig, as_tuple
from jaxrat.models.rat.mr_block import MultiResBlock
from jaxrat.models.rat.sga import SpatialGroupingAttention

Array = jax.Array


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
    """RAT backbone: ``ResolutionAwareTransformer(config)`` or ``ResolutionAwareTransformer(**fields)``.

    Args:
      config: the whole RAT (:class:`RATConfig`); or give its fields as keyword arguments (the
        reference constructor's, e.g. ``feature_dims=64, num_heads=8``; ``sga_attention_type`` is
        taken as ``attention``).
      kernels: the resolved kernel policy (:func:`jaxrat.ops.resolve`; a training run resolves it
        once from its mesh).
      dtype: compute dtype; parameters stay float32.
      rngs: parameter initialisation and dropout randomness.
    """

    def __init__(self, config: Optional[RATConfig] = None, *, kernels: ops.KernelPolicy, dtype: Any = jnp.float32,
                 rngs: nnx.Rngs, **fields: Any) -> None:
        if config is None:
            config = RATConfig.from_mapping(fields)
        elif fields:
            config = config.replace(**fields)
        c = self.config = config
        self.kernels = ops.policy.require(kernels)
        sd = c.spatial_dims
        self.remat = c.remat
        self.spatial_dims = sd
        self.feature_dims = c.feature_dims
        self.num_blocks = c.num_blocks
        self.num_heads = c.num_heads
        self.reference_compat = c.reference_compat
        self.scales = tuple(int(s) for s in c.scales) if c.scales else None
        self.pyramid_spacing = c.pyramid_spacing
        self.proj_kernel_size = as_tuple(c.proj_kernel_size, sd, int)
        self.default_spacing = as_tuple(1.0 if c.spacing is None else c.spacing, sd, float)
        self.sga_types = c.block_attention()
        if c.proj_padding == "same":
            padding: Any = "SAME"
        else:
            padding = [(p, p) for p in as_tuple(c.proj_padding, sd, int)]
        self.init_proj = conv(c.input_features, c.feature_dims, self.proj_kernel_size, padding=padding, dtype=dtype,
                              rngs=rngs, kernels=kernels)
        self.leading_tokens = (
            nnx.Param(jax.random.uniform(rngs.params(), (1, c.leading_tokens, c.feature_dims), jnp.float32))
            if c.leading_tokens > 0 else None
        )
        grid = c.absolute_grid
        self.abs_pos = AbsolutePositionEmbedding(grid, c.feature_dims, rngs=rngs) if grid is not None else None
        self.sga_layers = nnx.List([
            SpatialGroupingAttention(c, t, kernels=kernels, dtype=dtype, rngs=rngs) for t in self.sga_types
        ])
        self.mr_attn_layers = nnx.List([
            MultiResBlock(c, kernels=kernels, dtype=dtype, rngs=rngs) for _ in range(c.num_blocks)
        ])

    def pyramid(self, images: Array) -> tuple[list[Array], list[tuple[float, ...]]]:
        """The input pyramid of ``config.scales`` and per-level spacing for an image batch (B, H, W, C)."""
        if not self.scales:
            return [images], [(1.0,) * (images.ndim - 2)]
        b, h, w, c = images.shape
        levels, spacings = [], []
        for s in self.scales:
            f = s / self.scales[0]
            size = (max(1, round(h * f)), max(1, round(w * f)))
            if size != (h, w):
                images_at = jax.image.resize(images, (b, *size, c), "linear", antialias=True)
            levels.append(images if size == (h, w) else images_at)
            sp = (h / size[0], w / size[1]) if self.pyramid_spacing == "relative" else (1.0, 1.0)
            spacings.append(sp)
        return levels, spacings

    def features(self, images: Array, mask: Optional[Array] = None, *,
                 return_features: bool = False) -> list["ScaleOutput"]:
        """The backbone's output per pyramid level for one image batch (what the task models call);
        ``mask`` (B, H, W) > 0 = masked, for the finest level."""
        levels, spacings = self.pyramid(images)
        masks = None if mask is None else [mask] + [None] * (len(levels) - 1)
        return self(levels, input_spacing=spacings, mask=masks, return_features=return_features)

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

    def _inputs(self, x: Array | Sequence[Array], input_spacing: Any, mask: Any
                ) -> tuple[list[Array], list[tuple[float, ...]], list[Optional[Array]]]:
        """The images as a list, one spacing and one (dilated) mask or None per image."""
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
        return images, spacings, [None if m is None else self.dilate_mask(m) for m in masks]

    def _tokens(self, image: Array) -> tuple[Array, tuple[int, ...]]:
        """The image's tokens (B, N, D) after the initial projection (and absolute positions), and their grid."""
        feat = self.init_proj(image)
        grid = tuple(feat.shape[1:-1])
        t = feat.reshape(feat.shape[0], -1, self.feature_dims)
        if self.abs_pos is not None:
            t = t + self.abs_pos(grid).astype(t.dtype)
        return t, grid

    def _leading(self, batch: int, dtype: Any) -> Optional[Array]:
        """The leading tokens (B, L, D) every block's joint attention shares, or None."""
        if self.leading_tokens is None or self.reference_compat:
            return None
        return jnp.broadcast_to(self.leading_tokens[...], (batch,) + self.leading_tokens.shape[1:]).astype(dtype)

    def _group(self, sga: SpatialGroupingAttention, tokens: Array, grid: tuple, spacing: tuple,
               mask: Optional[Array], return_maps: bool) -> Any:
        """One scale through one SGA layer (recomputed in the backward with ``remat="blocks"``)."""
        # The scope names this layer's ops in the compiled HLO (op_name metadata, gradients included), so
        # profiles can charge time to a component (benchmarks/step_profile.py).
        with jax.named_scope("sga"):
            if self.remat == "blocks" and not return_maps:
                # Grids and spacings are static: closed over, not traced.
                x = nnx.remat(lambda layer, t, mk: layer(t, grid, spacing, mk).x)(sga, tokens, mask)
                return sga.output_geometry(x, grid, spacing)
            return sga(tokens, grid, spacing, mask, return_maps)

    def _attend_jointly(self, mr: MultiResBlock, tokens: list[Array], grids: list, spacings: list,
                        leading: Optional[Array]) -> tuple[list[Array], Optional[Array]]:
        """Every scale (and the leading tokens) through one multi-resolution block."""
        with jax.named_scope("mr_blocks"):  # for profiles, as "sga" in _group
            if self.remat == "blocks":
                gs, sps = tuple(grids), tuple(spacings)
                tokens, leading = nnx.remat(lambda layer, t, lead: layer(t, gs, sps, lead))(mr, tokens, leading)
                return list(tokens), leading
            return mr(tokens, grids, spacings, leading)

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
        images, spacings, masks = self._inputs(x, input_spacing, mask)
        n = len(images)
        tokens, grids = map(list, zip(*(self._tokens(im) for im in images)))
        features, feature_grids = [[t] for t in tokens], [[g] for g in grids]
        maps_q: list[Optional[Array]] = [None] * n
        maps_k: list[Optional[Array]] = [None] * n
        leading = self._leading(images[0].shape[0], tokens[0].dtype)
        for block in range(self.num_blocks):
            for s in range(n):
                out = self._group(self.sga_layers[block], tokens[s], grids[s], spacings[s],
                                  masks[s] if block == 0 else None, return_maps)
                tokens[s], grids[s], spacings[s] = out.x, out.grid_shape, out.spacing
                if return_maps:  # chained: each layer's maps after the previous layers'
                    maps_q[s] = out.attn_q if maps_q[s] is None else jnp.matmul(out.attn_q, maps_q[s])
                    maps_k[s] = out.attn_k if maps_k[s] is None else jnp.matmul(out.attn_k, maps_k[s])
            tokens, leading = self._attend_jointly(self.mr_attn_layers[block], tokens, grids, spacings, leading)
            for s in range(n):
                features[s].append(tokens[s])
                feature_grids[s].append(grids[s])
        return [
            ScaleOutput(tokens=tokens[s], grid_shape=grids[s], spacing=spacings[s], attn_q=maps_q[s],
                        attn_k=maps_k[s], features=tuple(features[s]) if return_features else None,
                        feature_grids=tuple(feature_grids[s]) if return_features else (), leading=leading)
            for s in range(n)
        ]
