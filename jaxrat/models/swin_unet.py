"""Swin-UNet (Cao et al. 2022), Flax NNX: a Swin encoder and a symmetric Swin decoder
(``config.model.name``: ``swin_unet``).

The encoder is a Swin (:mod:`jaxrat.models.backbones.swin`, pretrained weights through
``config.model.pretrained``). The decoder mirrors it: from the deepest stage, each step expands
the patches (a linear layer to twice the width, each token split into 2x2 tokens of half the
width, LayerNorm), concatenates the encoder stage of that resolution (the skip), projects back to
the width with a linear layer and runs as many Swin blocks as the encoder stage had. A final
expansion by the patch size (linear to ``patch**2`` times the width, split, LayerNorm) and a 1x1
convolution give the logits at the input resolution.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrat.models import register
from jaxrat.models.backbones import backbone_fields as fields_of
from jaxrat.models.backbones import build_backbone
from jaxrat.models.backbones.layers import layer_norm
from jaxrat.models.backbones.swin import EPS, SwinBlock, window_and_shift
from jaxrat.ops import KernelPolicy
from jaxrat.runtime.errors import ConfigError


class PatchExpand(nnx.Module):
    """(B, H, W, C) -> (B, sH, sW, C * 2 // s) for ``scale`` 2 (or (B, sH, sW, C) for the final
    expansion): linear, each token split into s x s, LayerNorm."""

    def __init__(self, dim: int, scale: int, out: int, *, dtype: Any, rngs: nnx.Rngs) -> None:
        self.scale, self.out = scale, out
        self.expand = nnx.Linear(dim, scale * scale * out, use_bias=False, dtype=dtype, rngs=rngs)
        self.norm = layer_norm(out, EPS, dtype, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, h, w, _ = x.shape
        s = self.scale
        x = self.expand(x).reshape(b, h, w, s, s, self.out).transpose(0, 1, 3, 2, 4, 5)
        return self.norm(x.reshape(b, h * s, w * s, self.out))


class SwinUNet(nnx.Module):
    """See the module docstring. ``backbone``: a Swin name; ``backbone_fields`` overrides its fields."""

    def __init__(self, *, backbone: str = "swin_tiny_patch4_window7_224", backbone_fields: Any = None,
                 num_classes: int = 1, in_channels: int = 3, pretrained: str = "", kernels: KernelPolicy,
                 dtype: Any = jnp.float32, rngs: nnx.Rngs) -> None:
        fields = fields_of(backbone, dict(backbone_fields or {}), pretrained)
        if fields.pop("kind") != "swin":
            raise ConfigError(f"swin_unet needs a Swin backbone, got {backbone!r}; use transunet for a ViT.")
        self.backbone = build_backbone(backbone, kernels=kernels, dtype=dtype, rngs=rngs, pretrained=pretrained,
                                       **{**dict(backbone_fields or {}), "num_classes": 0, "in_channels": in_channels})
        widths, depths, heads = self.backbone.widths, tuple(fields["depths"]), tuple(fields["num_heads"])
        patch = int(fields.get("patch_size", 4))
        resolutions = [fields["img_size"] // patch]
        for _ in widths[1:]:
            resolutions.append((resolutions[-1] + 1) // 2)
        self.expands, self.fuse, self.stages = nnx.List(), nnx.List(), nnx.List()
        for i in range(len(widths) - 2, -1, -1):  # from the second-deepest encoder stage up
            self.expands.append(PatchExpand(widths[i + 1], 2, widths[i], dtype=dtype, rngs=rngs))
            self.fuse.append(nnx.Linear(2 * widths[i], widths[i], dtype=dtype, rngs=rngs))
            self.stages.append(nnx.List([
                SwinBlock(widths[i], heads[i], *window_and_shift(resolutions[i], fields["window_size"], j % 2 == 1),
                          mlp_ratio=4.0, kernels=kernels, dtype=dtype, rngs=rngs)
                for j in range(depths[i])]))
        self.norm_up = layer_norm(widths[0], EPS, dtype, rngs)
        self.final = PatchExpand(widths[0], patch, widths[0], dtype=dtype, rngs=rngs)
        self.head = nnx.Conv(widths[0], num_classes, (1, 1), dtype=dtype, rngs=rngs)

    def __call__(self, images: jax.Array, *, all_levels: bool = False) -> jax.Array | list[jax.Array]:
        """(B, H, W, C) -> (B, H, W, num_classes) logits; H and W multiples of patch * 2**(stages - 1)."""
        feats = self.backbone.features(images)
        x = self.backbone.norm(feats[-1])
        for expand, fuse, blocks, skip in zip(self.expands, self.fuse, self.stages, reversed(feats[:-1])):
            x = expand(x)[:, :skip.shape[1], :skip.shape[2]]
            x = fuse(jnp.concatenate([x, skip], axis=-1))
            for block in blocks:
                x = block(x)
        logits = self.head(self.final(self.norm_up(x))).astype(jnp.float32)
        return [logits] if all_levels else logits


@register("swin_unet")
def swin_unet(**kwargs: Any) -> SwinUNet:
    """Factory for ``config.model.name = "swin_unet"`` (fields as :class:`SwinUNet`)."""
    return SwinUNet(**kwargs)
