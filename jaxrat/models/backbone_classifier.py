"""Image classifier on a pretrained transformer backbone (``config.model.name``: ``backbone_classifier``).

``config.model``: ``backbone`` (a timm name, :data:`jaxrat.models.backbones.ARCHITECTURES`, e.g.
``beit_base_patch16_224``), ``backbone_fields`` (overrides of its fields; ``img_size`` should be
the training image size), ``num_classes`` (per head, from the task), ``pretrained`` (a timm file or
Hugging Face folder: its ``config.json`` gives the backbone's architecture,
:mod:`jaxrat.models.backbones.architecture`, and the trainer loads its weights into ``backbone/...``
before the first step, see :func:`jaxrat.models.backbones.weights.pretrained_arrays`). The
backbone's pooled features (``global_pool="token"``: the class token, ViT's default; "avg": the mean
patch token, BEiT's; Swin: the mean over the grid) feed one linear head per label level.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrat.models import register
from jaxrat.models.backbones import build_backbone
from jaxrat.models.classifier import Heads
from jaxrat.ops import KernelPolicy


class BackboneClassifier(nnx.Module):
    """A ViT/BEiT/Swin backbone, pooled, then :class:`~jaxrat.models.classifier.Heads`."""

    def __init__(self, *, backbone: str, num_classes: Sequence[int], backbone_fields: Any = None,
                 pretrained: str = "", kernels: KernelPolicy, dtype: Any = jnp.float32, rngs: nnx.Rngs) -> None:
        # the file's config gives the architecture here; its weights land on the train state (the trainer)
        fields = dict(backbone_fields or {})
        fields["num_classes"] = 0
        self.backbone = build_backbone(backbone, kernels=kernels, dtype=dtype, rngs=rngs, pretrained=pretrained,
                                       **fields)
        self.heads = Heads(self.backbone.num_features, num_classes, dtype=dtype, rngs=rngs)

    def __call__(self, images: jax.Array) -> tuple[jax.Array, ...]:
        return self.heads(self.backbone.pooled(images))


@register("backbone_classifier")
def backbone_classifier(**kwargs: Any) -> BackboneClassifier:
    """Factory for ``config.model.name = "backbone_classifier"`` (fields as :class:`BackboneClassifier`)."""
    return BackboneClassifier(**kwargs)
