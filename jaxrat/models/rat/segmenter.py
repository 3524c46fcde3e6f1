"""The RAT segmenter (``config.model.name = "rat"``): RAT backbone + segmentation head.

``model(images)`` turns a channels-last image batch into per-pixel logits at the input
resolution; ``model(images, all_levels=True)`` returns the logits of every pyramid level at that
level's size, finest first (the segmentation models' output contract, :mod:`jaxrat.models`).
The RAT is ``config.model.rat`` (:class:`~jaxrat.models.rat.config.RATConfig`, with its image
pyramid); the head's fields sit beside it in ``config.model``.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrat import ops
from jaxrat.models import register
from jaxrat.models.rat.backbone import ResolutionAwareTransformer, ScaleOutput
from jaxrat.models.rat.config import RATConfig
from jaxrat.models.rat.heads import MultiLevelDecoderHead, ReferenceSegmentationHead
from jaxrat.runtime.errors import ConfigError

Array = jax.Array
HEADS = ("decoder", "reference")


def rat_from_config(rat: Any, *, kernels: ops.KernelPolicy, dtype: Any, rngs: nnx.Rngs,
                    **fields: Any) -> ResolutionAwareTransformer:
    """The backbone of ``config.model.rat`` (a mapping or a :class:`RATConfig`; ``fields`` override
    it); an invalid RAT is a ConfigError naming the option."""
    try:
        cfg = rat if isinstance(rat, RATConfig) else RATConfig.from_mapping(dict(rat or {}), "config.model.rat option")
        if fields:
            cfg = cfg.replace(**fields)
        return ResolutionAwareTransformer(cfg, kernels=kernels, dtype=dtype, rngs=rngs)
    except ValueError as e:
        raise ConfigError(f"invalid RAT config (config.model.rat): {e}.") from None


class RATSegmenter(nnx.Module):
    """RAT backbone + segmentation head.

    Args:
      rat: the RAT (``config.model.rat``).
      num_classes: output channels (1 for binary lesion masks).
      head: "decoder" (multi-level decoder, default) or "reference" (final-grid MLP head).
      decoder_dim: channels of the decoder head.
      kernels: the kernel policy (:mod:`jaxrat.ops.policy`).
    """

    def __init__(self, *, rat: Any = None, num_classes: int = 1, head: str = "decoder", decoder_dim: int = 32,
                 kernels: ops.KernelPolicy, dtype: Any = jnp.float32, rngs: nnx.Rngs) -> None:
        if head not in HEADS:
            raise ConfigError(f"model.head must be one of {HEADS}, got {head!r}.")
        self.backbone = rat_from_config(rat, kernels=kernels, dtype=dtype, rngs=rngs)
        self.head_type = head
        d, n, sd = self.backbone.feature_dims, self.backbone.num_blocks, self.backbone.spatial_dims
        if head == "decoder":
            self.head = MultiLevelDecoderHead(d, n + 1, num_classes, decoder_dim, sd, kernels=kernels, dtype=dtype,
                                              rngs=rngs)
        else:
            self.head = ReferenceSegmentationHead(d, num_classes, dtype=dtype, rngs=rngs)

    def __call__(self, images: Array, *, all_levels: bool = False) -> Array | list[Array]:
        """(B, H, W, C) float images -> (B, H, W, num_classes) logits; with ``all_levels`` the logits
        of every pyramid level at its own size, finest first (the head shared by the levels, as the
        reference's multi-scale model predicts); level 0 is the plain call's result."""
        levels, _ = self.backbone.pyramid(images) if all_levels else ([images], None)
        outs = self.backbone.features(images, return_features=self.head_type == "decoder")
        if not all_levels:
            return self._predict(outs[0], images.shape[1:3])
        return [self._predict(o, lv.shape[1:3]) for o, lv in zip(outs, levels)]

    def _predict(self, out: ScaleOutput, out_grid: Sequence[int]) -> Array:
        # Names the head's ops in the compiled HLO, as the backbone's "sga" and "mr_blocks" scopes do.
        with jax.named_scope("head"):
            if self.head_type == "decoder":
                return self.head(out.features, out.feature_grids, out_grid)
            return self.head(out.tokens, out.grid_shape, out_grid)


@register("rat")
def rat(*, rat: Optional[Any] = None, **kwargs: Any) -> RATSegmenter:
    """Factory for ``config.model.name = "rat"`` (fields as :class:`RATSegmenter`)."""
    return RATSegmenter(rat=rat, **kwargs)
