"""U-Net baseline (the ISIC reference literature's baseline), Flax NNX.

GroupNorm instead of BatchNorm: no batch statistics to synchronise across devices or carry in the
train state, and results independent of the per-device batch size.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrat import ops
from jaxrat.models import register


def _groups(channels: int) -> int:
    for g in (8, 4, 2, 1):
        if channels % g == 0:
            return g
    return 1


class ConvBlock(nnx.Module):
    """Two (3x3 conv -> GroupNorm -> ReLU) layers."""

    def __init__(self, cin: int, cout: int, *, dtype: Any, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(cin, cout, (3, 3), dtype=dtype, rngs=rngs)
        self.norm1 = nnx.GroupNorm(cout, num_groups=_groups(cout), dtype=dtype, rngs=rngs)
        self.conv2 = nnx.Conv(cout, cout, (3, 3), dtype=dtype, rngs=rngs)
        self.norm2 = nnx.GroupNorm(cout, num_groups=_groups(cout), dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = jax.nn.relu(self.norm1(self.conv1(x)))
        return jax.nn.relu(self.norm2(self.conv2(x)))


class UNet(nnx.Module):
    """Encoder-decoder with skip connections; one 2x2 pooling per level after the first.

    Input height and width must be divisible by ``2 ** (len(features) - 1)``.
    """

    def __init__(
        self,
        features: Sequence[int] = (32, 64, 128, 256),
        in_channels: int = 3,
        num_classes: int = 1,
        *,
        dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ):
        features = tuple(features)
        self.features = features
        self.down = nnx.List()
        cin = in_channels
        for f in features:
            self.down.append(ConvBlock(cin, f, dtype=dtype, rngs=rngs))
            cin = f
        self.upconv = nnx.List()
        self.up = nnx.List()
        for f in reversed(features[:-1]):
            self.upconv.append(nnx.ConvTranspose(cin, f, (2, 2), strides=(2, 2), dtype=dtype, rngs=rngs))
            self.up.append(ConvBlock(2 * f, f, dtype=dtype, rngs=rngs))
            cin = f
        self.head = nnx.Conv(cin, num_classes, (1, 1), dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, *, all_levels: bool = False) -> jax.Array | list[jax.Array]:
        """(B, H, W, C) -> (B, H, W, num_classes) logits; ``all_levels``: as a list of the one level."""
        skips = []
        for i, block in enumerate(self.down):
            if i > 0:
                x = nnx.max_pool(x, (2, 2), strides=(2, 2))
            x = block(x)
            skips.append(x)
        for upconv, block, skip in zip(self.upconv, self.up, reversed(skips[:-1])):
            x = block(jnp.concatenate([upconv(x), skip], axis=-1))
        logits = self.head(x).astype(jnp.float32)
        return [logits] if all_levels else logits


@register("unet")
def unet(
    features: Sequence[int] = (32, 64, 128, 256),
    in_channels: int = 3,
    num_classes: int = 1,
    *,
    dtype: Any = jnp.float32,
    rngs: nnx.Rngs,
    kernels: ops.KernelPolicy,
) -> UNet:
    """Registry entry for :class:`UNet` (plain XLA convolutions, whatever the kernel policy)."""
    del kernels
    return UNet(features, in_channels, num_classes, dtype=dtype, rngs=rngs)
