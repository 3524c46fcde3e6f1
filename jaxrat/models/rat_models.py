"""Registered RAT task models (``config.model.name = "rat"``).

:class:`RATSegmenter` turns one channels-last image batch into per-pixel logits: it builds the
image pyramid itself (``scales``), runs the RAT backbone and a segmentation head. Ablation
switches are plain config fields; docs/rat.md lists them with the reference behaviour.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrat.errors import ConfigError
from jaxrat.models import register
from jaxrat.models.heads import MultiLevelDecoderHead, ReferenceSegmentationHead
from jaxrat.models.rat import ResolutionAwareTransformer

Array = jax.Array
POSITIONAL_ENCODINGS = ("rose", "rope", "absolute", "none")
HEADS = ("decoder", "reference")


def positional_kwargs(positional_encoding: str, rose_scaling: Optional[str], rotary_ratio: float) -> dict[str, Any]:
    """Backbone arguments for a positional-encoding ablation.

    rose: learnable frequencies and spacing transform (initial mode ``rose_scaling``, "log" as in
      the reference). rope: learnable frequencies on grid-index coordinates ("index" init; the
      reference's "rope" init rotates nothing, flaw 4) at unit spacing. absolute: a learned
      absolute embedding and no rotation (the reference's "absolute" is identical to "none").
      none: no positional information.
    """
    if positional_encoding == "rose":
        return dict(rotary_ratio=rotary_ratio, rose_initial_scaling=rose_scaling or "log")
    if positional_encoding == "rope":
        return dict(rotary_ratio=rotary_ratio, rose_initial_scaling=rose_scaling or "index")
    if positional_encoding in ("absolute", "none"):
        return dict(rotary_ratio=0.0, rose_initial_scaling=rose_scaling or "log")
    raise ConfigError(f"model.positional_encoding must be one of {POSITIONAL_ENCODINGS}, got {positional_encoding!r}.")


class RATBackbone(nnx.Module):
    """The RAT backbone with its input pyramid, as every RAT task model uses it.

    Args:
      in_channels: image channels.
      feature_dims, num_blocks, num_heads, iters, mlp_ratio, dropout, sga_kernel_size, stride,
        proj_kernel_size, rotary_ratio: backbone dimensions (reference names; ``dropout`` is the
        MLP dropout).
      attention: "dense" | "sparse" | "mixed" | "standard", or one of dense/sparse/standard per block.
      positional_encoding: "rose" | "rope" | "absolute" | "none" (see :func:`positional_kwargs`).
      rose_scaling: initial RoSE spacing transform; None picks the encoding's default.
      scales: None for a single image, or pyramid sizes such as (256, 128, 64): level i is the input
        resized by scales[i] / scales[0] (so any input size works).
      pyramid_spacing: "relative" (level spacing scales[0]/scales[i], the physical pixel size) or
        "unit" (spacing 1 at every level, as the reference experiments).
      abs_grid: table grid of the absolute embedding (resized to every scale).
      leading_tokens: learned tokens that attend to every scale (e.g. one to classify with).
      reference_compat: reproduce the reference backbone exactly (SGA head reshaping).
      max_block_elements, slice_batch: attention kernel knobs (block None: the machine's default).
      mr_attention: "global" (reference: every token sees every token, quadratic in pixels) or
        "windowed" (grids wider than ``mr_window`` tokens attend in tiles plus the small grids).
      mr_window: tile side in tokens for the windowed multi-resolution attention.
      remat: "none" or "blocks" (recompute every SGA layer and MR block in the backward pass).
      dtype: compute dtype; rngs: init and dropout randomness.
    """

    def __init__(
        self,
        *,
        in_channels: int = 3,
        feature_dims: int = 128,
        num_blocks: int = 4,
        num_heads: int = 8,
        iters: int = 3,
        mlp_ratio: float = 4,
        dropout: float = 0.1,
        sga_kernel_size: int = 7,
        stride: Optional[int] = None,
        proj_kernel_size: int = 7,
        rotary_ratio: float = 0.5,
        attention: str | Sequence[str] = "dense",
        positional_encoding: str = "rose",
        rose_scaling: Optional[str] = None,
        scales: Optional[Sequence[int]] = None,
        pyramid_spacing: str = "relative",
        abs_grid: Sequence[int] = (32, 32),
        leading_tokens: int = 0,
        reference_compat: bool = False,
        max_block_elements: Optional[int] = None,
        slice_batch: int = 1,
        mr_attention: str = "global",
        mr_window: int = 16,
        remat: str = "none",
        dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ) -> None:
        if pyramid_spacing not in ("relative", "unit"):
            raise ConfigError(f"model.pyramid_spacing must be 'relative' or 'unit', got {pyramid_spacing!r}.")
        self.scales = tuple(int(s) for s in scales) if scales else None
        self.pyramid_spacing = pyramid_spacing
        self.feature_dims, self.num_blocks = feature_dims, num_blocks
        pe = positional_kwargs(positional_encoding, rose_scaling, rotary_ratio)
        try:
            self.backbone = ResolutionAwareTransformer(
                spatial_dims=2, input_features=in_channels, proj_kernel_size=proj_kernel_size,
                feature_dims=feature_dims, num_blocks=num_blocks, sga_attention_type=attention,
                sga_kernel_size=sga_kernel_size, stride=stride, num_heads=num_heads, iters=iters,
                mlp_ratio=mlp_ratio, mlp_dropout=dropout, reference_compat=reference_compat,
                absolute_pos_grid=tuple(abs_grid) if positional_encoding == "absolute" else None,
                leading_tokens=leading_tokens, max_block_elements=max_block_elements, slice_batch=slice_batch,
                mr_attention=mr_attention, mr_window=mr_window, remat=remat, dtype=dtype, rngs=rngs, **pe,
            )
        except ValueError as e:
            raise ConfigError(f"invalid RAT config: {e}") from None

    def pyramid(self, images: Array) -> tuple[list[Array], list[tuple[float, float]]]:
        """The input pyramid and per-level spacing for an image batch (B, H, W, C)."""
        if not self.scales:
            return [images], [(1.0, 1.0)]
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

    def features(self, images: Array, *, return_features: bool = False) -> list[Any]:
        """The backbone's output per pyramid level (:class:`jaxrat.models.rat.ScaleOutput`)."""
        levels, spacings = self.pyramid(images)
        return self.backbone(levels, input_spacing=spacings, return_features=return_features)


class RATSegmenter(RATBackbone):
    """RAT backbone + segmentation head; ``model(images)`` -> logits at the input resolution.

    Args:
      num_classes: output channels (1 for binary lesion masks).
      head: "decoder" (multi-level decoder, default) or "reference" (final-grid MLP head).
      decoder_dim: channels of the decoder head.
      **backbone: the fields of :class:`RATBackbone`.
    """

    def __init__(self, *, num_classes: int = 1, head: str = "decoder", decoder_dim: int = 32, dtype: Any = jnp.float32,
                 rngs: nnx.Rngs, **backbone: Any) -> None:
        if head not in HEADS:
            raise ConfigError(f"model.head must be one of {HEADS}, got {head!r}.")
        super().__init__(dtype=dtype, rngs=rngs, **backbone)
        self.head_type = head
        self.spatial_dims = 2
        d, n = self.feature_dims, self.num_blocks
        if head == "decoder":
            self.head = MultiLevelDecoderHead(d, n + 1, num_classes, decoder_dim, dtype=dtype, rngs=rngs)
        else:
            self.head = ReferenceSegmentationHead(d, num_classes, dtype=dtype, rngs=rngs)

    def __call__(self, images: Array) -> Array:
        """(B, H, W, C) float images -> (B, H, W, num_classes) logits."""
        decoder = self.head_type == "decoder"
        first = self.features(images, return_features=decoder)[0]
        return self._predict(first, images.shape[1:3])

    def level_logits(self, images: Array) -> list[Array]:
        """Logits of every pyramid level at that level's own size, finest first: the head (shared)
        applied to each level's backbone output, as the reference's multi-scale model predicts.
        Level 0 equals ``self(images)``; a single-scale model returns ``[self(images)]``."""
        levels, _ = self.pyramid(images)
        outs = self.features(images, return_features=self.head_type == "decoder")
        return [self._predict(o, lv.shape[1:3]) for o, lv in zip(outs, levels)]

    def _predict(self, out: Any, out_grid: Sequence[int]) -> Array:
        # Names the head's ops in the compiled HLO, as the backbone's "sga" and "mr_blocks" scopes do.
        with jax.named_scope("head"):
            if self.head_type == "decoder":
                return self.head(out.features, out.feature_grids, out_grid)
            return self.head(out.tokens, out.grid_shape, out_grid)


@register("rat")
def rat(**kwargs: Any) -> RATSegmenter:
    """Factory for ``config.model.name = "rat"`` (fields as :class:`RATSegmenter`)."""
    return RATSegmenter(**kwargs)
