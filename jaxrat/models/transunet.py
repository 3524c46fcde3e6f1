"""TransUNet (Chen et al. 2021), Flax NNX: a ViT encoder, a CNN decoder with skips
(``config.model.name``: ``transunet``).

The ViT (a timm name, :mod:`jaxrat.models.backbones`, pretrained weights through
``config.model.pretrained``) encodes the image in ``patch x patch`` tokens; its last block,
normed, becomes a map at 1/patch resolution. A small CNN on the image (two 3x3 conv blocks per
level, 2x2 max-pooling between levels, as TransUNet's hybrid encoder provides its skips) gives
skip maps at 1/1, 1/2, 1/4, ...; the decoder doubles the resolution ``log2(patch)`` times (bilinear
upsampling, then a conv block on the map concatenated with the skip of that resolution where there
is one) and a 1x1 convolution gives the logits at the input resolution. GroupNorm throughout, as in
the U-Net baseline (no batch statistics).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrat.models import register
from jaxrat.models.backbones import build_backbone
from jaxrat.models.unet import ConvBlock
from jaxrat.ops import KernelPolicy
from jaxrat.runtime.errors import ConfigError


class TransUNet(nnx.Module):
    """See the module docstring.

    Args:
      backbone: a ViT name (``vit_base_patch16_224``, ...); ``backbone_fields`` overrides its fields
        (``img_size`` the training image size).
      skip_features: widths of the CNN skip levels at 1/1, 1/2, 1/4, ... (at most log2(patch) levels).
      decoder_features: widths of the decoder's conv blocks from 1/(patch/2) up to 1/1.
      num_classes: output channels (1: a binary mask's logits).
      pretrained: the file whose config gives the backbone's architecture (its weights load in the trainer).
    """

    def __init__(self, *, backbone: str = "vit_base_patch16_224", backbone_fields: Any = None,
                 skip_features: Sequence[int] = (32, 64, 128), decoder_features: Sequence[int] = (256, 128, 64, 32),
                 num_classes: int = 1, in_channels: int = 3, pretrained: str = "", kernels: KernelPolicy,
                 dtype: Any = jnp.float32, rngs: nnx.Rngs) -> None:
        fields = {**dict(backbone_fields or {}), "num_classes": 0, "in_channels": in_channels}
        self.backbone = build_backbone(backbone, kernels=kernels, dtype=dtype, rngs=rngs, pretrained=pretrained,
                                       **fields)
        if not hasattr(self.backbone, "patch_size"):
            raise ConfigError(f"transunet needs a ViT or BEiT backbone, got {backbone!r}; use swin_unet for Swin.")
        ups = int(round(math.log2(self.backbone.patch_size)))
        if 2 ** ups != self.backbone.patch_size or len(decoder_features) != ups or len(skip_features) > ups:
            raise ConfigError(f"transunet: patch size {self.backbone.patch_size} needs a power of two, "
                              f"{ups} decoder_features (got {len(decoder_features)}) and at most {ups} "
                              f"skip_features (got {len(skip_features)}).")
        widths = [in_channels, *skip_features]
        self.skips = nnx.List([ConvBlock(a, b, dtype=dtype, rngs=rngs) for a, b in zip(widths[:-1], widths[1:])])
        self.bridge = ConvBlock(self.backbone.num_features, decoder_features[0], dtype=dtype, rngs=rngs)
        blocks, cin = [], decoder_features[0]
        for i, f in enumerate(decoder_features):
            level = ups - 1 - i  # the decoder block's resolution is 1 / 2**level
            skip = skip_features[level] if level < len(skip_features) else 0
            blocks.append(ConvBlock(cin + skip, f, dtype=dtype, rngs=rngs))
            cin = f
        self.up = nnx.List(blocks)
        self.head = nnx.Conv(cin, num_classes, (1, 1), dtype=dtype, rngs=rngs)

    def __call__(self, images: jax.Array, *, all_levels: bool = False) -> jax.Array | list[jax.Array]:
        """(B, H, W, C) -> (B, H, W, num_classes) logits; H and W multiples of the patch size."""
        skips, x = [], images
        for i, block in enumerate(self.skips):
            if i:
                x = nnx.max_pool(x, (2, 2), strides=(2, 2))
            x = block(x)
            skips.append(x)
        tokens = self.backbone.features(images, [-1])[0]
        if hasattr(self.backbone, "norm"):
            tokens = self.backbone.norm(tokens)
        x = self.bridge(tokens)
        for i, block in enumerate(self.up):
            b, h, w, c = x.shape
            x = jax.image.resize(x, (b, 2 * h, 2 * w, c), method="bilinear")
            level = len(self.up) - 1 - i
            if level < len(skips):
                x = jnp.concatenate([x, skips[level]], axis=-1)
            x = block(x)
        logits = self.head(x).astype(jnp.float32)
        return [logits] if all_levels else logits


@register("transunet")
def transunet(**kwargs: Any) -> TransUNet:
    """Factory for ``config.model.name = "transunet"`` (fields as :class:`TransUNet`)."""
    return TransUNet(**kwargs)
