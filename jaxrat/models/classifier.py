"""Image classifiers with one or several label heads (``config.model.name``: ``cnn_classifier``,
``rat_classifier``).

A model returns one logits array per head, ``(B, num_classes[h])``, in the order of
``num_classes``; which head means what is the task's business.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrat import ops
from jaxrat.models import register
from jaxrat.models.rat.segmenter import rat_from_config
from jaxrat.models.unet import ConvBlock
from jaxrat.runtime.errors import ConfigError

POOLS = ("mean", "leading")


class Heads(nnx.Module):
    """LayerNorm on pooled features, then one linear layer per head."""

    def __init__(self, dim: int, num_classes: Sequence[int], *, dtype: Any, rngs: nnx.Rngs) -> None:
        self.norm = nnx.LayerNorm(dim, use_fast_variance=False, dtype=dtype, rngs=rngs)
        self.heads = nnx.List([nnx.Linear(dim, int(n), dtype=dtype, rngs=rngs) for n in num_classes])

    def __call__(self, pooled: jax.Array) -> tuple[jax.Array, ...]:
        x = self.norm(pooled)
        return tuple(head(x).astype(jnp.float32) for head in self.heads)


class CNNClassifier(nnx.Module):
    """The baseline: (ConvBlock, 2x2 max-pool) per width in ``features``, global average pool, heads.

    GroupNorm throughout (no batch statistics), as in the U-Net baseline.
    """

    def __init__(self, *, num_classes: Sequence[int], features: Sequence[int] = (32, 64, 128), in_channels: int = 3,
                 dtype: Any = jnp.float32, rngs: nnx.Rngs, kernels: ops.KernelPolicy) -> None:
        del kernels  # plain XLA convolutions whatever the kernel policy
        widths = [in_channels, *features]
        self.blocks = nnx.List([ConvBlock(a, b, dtype=dtype, rngs=rngs) for a, b in zip(widths[:-1], widths[1:])])
        self.heads = Heads(widths[-1], num_classes, dtype=dtype, rngs=rngs)

    def __call__(self, images: jax.Array) -> tuple[jax.Array, ...]:
        x = images
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i < len(self.blocks) - 1:
                x = nnx.max_pool(x, (2, 2), (2, 2))
        return self.heads(x.mean(axis=(1, 2)))


@register("cnn_classifier")
def cnn_classifier(**kwargs: Any) -> CNNClassifier:
    """Factory for ``config.model.name = "cnn_classifier"`` (fields as :class:`CNNClassifier`)."""
    return CNNClassifier(**kwargs)


class RATClassifier(nnx.Module):
    """RAT backbone, pooled, then one linear head per label level.

    Args:
      rat: the RAT (``config.model.rat``).
      num_classes: classes per head.
      pool: "mean" (average of the final tokens of the first pyramid level) or "leading" (a learned
        leading token that attends to every scale, as a class token: at least one is added).
      kernels: the kernel policy (:mod:`jaxrat.ops.policy`).
    """

    def __init__(self, *, rat: Any = None, num_classes: Sequence[int], pool: str = "mean", kernels: ops.KernelPolicy,
                 dtype: Any = jnp.float32, rngs: nnx.Rngs) -> None:
        if pool not in POOLS:
            raise ConfigError(f"model.pool must be one of {POOLS}, got {pool!r}.")
        extra = {}
        if pool == "leading":
            extra["leading_tokens"] = max(1, int(dict(rat or {}).get("leading_tokens", 0)))
        self.backbone = rat_from_config(rat, kernels=kernels, dtype=dtype, rngs=rngs, **extra)
        self.pool = pool
        self.heads = Heads(self.backbone.feature_dims, num_classes, dtype=dtype, rngs=rngs)

    def __call__(self, images: jax.Array) -> tuple[jax.Array, ...]:
        first = self.backbone.features(images)[0]
        pooled = first.leading[:, 0] if self.pool == "leading" else first.tokens.mean(axis=1)
        return self.heads(pooled)


@register("rat_classifier")
def rat_classifier(**kwargs: Any) -> RATClassifier:
    """Factory for ``config.model.name = "rat_classifier"`` (fields as :class:`RATClassifier`)."""
    return RATClassifier(**kwargs)
