"""Swin Transformer backbone (Flax NNX), parameter for parameter as timm's ``SwinTransformer``.

Patch embedding (a ``patch`` convolution and a LayerNorm), then stages of window-attention blocks
whose odd blocks shift the windows by half a window (the wrapped-around regions masked apart with
-100, as the paper and timm do), a relative position bias per block, and a patch merging (2x2
neighbours concatenated, LayerNorm, linear to twice the width) opening every stage after the first.
A stage whose grid is no larger than the window attends over the whole grid without a shift; grids
not divisible by the window are zero-padded (timm's behaviour, padding not masked).

Windows and shifts are fixed by ``img_size`` (as in timm, where they size the bias tables); other
image sizes run with the same windows.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrat.models.backbones.layers import Attention, Mlp, PatchEmbed, layer_norm, relative_position_index
from jaxrat.ops import KernelPolicy

Array = jax.Array
EPS = 1e-5  # torch's nn.LayerNorm default, which Swin uses


def window_and_shift(resolution: int, window: int, odd: bool) -> tuple[int, int]:
    """The effective (window, shift) of a block on a ``resolution`` grid (timm's ``_calc_window_shift``)."""
    w = min(resolution, window)
    shift = 0 if (resolution <= w or not odd) else window // 2
    return w, shift


def shift_mask(h: int, w: int, window: int, shift: int) -> np.ndarray:
    """(windows, N, N) additive mask of a shifted block on the padded ``h x w`` grid: -100 between
    tokens of different regions of the wrapped-around image."""
    hp, wp = -(-h // window) * window, -(-w // window) * window
    img = np.zeros((hp, wp), np.float32)
    cnt = 0
    for hs in (slice(0, -window), slice(-window, -shift), slice(-shift, None)):
        for ws in (slice(0, -window), slice(-window, -shift), slice(-shift, None)):
            img[hs, ws] = cnt
            cnt += 1
    win = img.reshape(hp // window, window, wp // window, window).transpose(0, 2, 1, 3).reshape(-1, window * window)
    diff = win[:, None, :] - win[:, :, None]
    return np.where(diff != 0, -100.0, 0.0).astype(np.float32)


class SwinBlock(nnx.Module):
    """Window attention (shifted when ``shift``) and MLP, each pre-norm with a residual."""

    def __init__(self, dim: int, heads: int, window: int, shift: int, *, mlp_ratio: float, kernels: KernelPolicy,
                 dtype: Any, rngs: nnx.Rngs, eps: float = EPS, qkv_bias: bool = True) -> None:
        self.window, self.shift = window, shift
        self.norm1 = layer_norm(dim, eps, dtype, rngs)
        self.attn = Attention(dim, heads, qkv_bias="all" if qkv_bias else "none", rel_table=(2 * window - 1) ** 2,
                              kernels=kernels, dtype=dtype, rngs=rngs)
        self.norm2 = layer_norm(dim, eps, dtype, rngs)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), dtype=dtype, rngs=rngs)

    def _attend(self, x: Array) -> Array:
        b, h, w, c = x.shape
        ws, s = self.window, self.shift
        if s:
            x = jnp.roll(x, (-s, -s), axis=(1, 2))
        ph, pw = (-h) % ws, (-w) % ws
        x = jnp.pad(x, ((0, 0), (0, ph), (0, pw), (0, 0)))
        hp, wp = h + ph, w + pw
        win = x.reshape(b, hp // ws, ws, wp // ws, ws, c).transpose(0, 1, 3, 2, 4, 5).reshape(-1, ws * ws, c)
        bias = self.attn.relative_bias(relative_position_index(ws, ws))[None]  # (1, heads, N, N)
        if s:
            mask = jnp.asarray(shift_mask(h, w, ws, s))  # (nW, N, N)
            nw = mask.shape[0]
            bias = (bias[None] + mask[None, :, None]).reshape(nw, -1, ws * ws, ws * ws)  # (nW, heads, N, N)
            bias = jnp.tile(bias, (b, 1, 1, 1))  # window index runs fastest within each image
        out = self.attn(win, bias)
        out = out.reshape(b, hp // ws, wp // ws, ws, ws, c).transpose(0, 1, 3, 2, 4, 5).reshape(b, hp, wp, c)
        out = out[:, :h, :w]
        if s:
            out = jnp.roll(out, (s, s), axis=(1, 2))
        return out

    def __call__(self, x: Array) -> Array:
        x = x + self._attend(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PatchMerging(nnx.Module):
    """2x2 neighbours concatenated (timm's order), LayerNorm, linear ``4 * dim -> out`` without bias."""

    def __init__(self, dim: int, out: int, *, dtype: Any, rngs: nnx.Rngs, eps: float = EPS) -> None:
        self.norm = layer_norm(4 * dim, eps, dtype, rngs)
        self.reduction = nnx.Linear(4 * dim, out, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x: Array) -> Array:
        b, h, w, c = x.shape
        x = jnp.pad(x, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)))
        h, w = x.shape[1], x.shape[2]
        x = x.reshape(b, h // 2, 2, w // 2, 2, c).transpose(0, 1, 3, 4, 2, 5).reshape(b, h // 2, w // 2, 4 * c)
        return self.reduction(self.norm(x))


class SwinStage(nnx.Module):
    """An optional patch merging, then ``depth`` blocks alternating plain and shifted windows."""

    def __init__(self, dim: int, out: int, depth: int, heads: int, resolution: int, window: int, *,
                 downsample: bool, mlp_ratio: float, kernels: KernelPolicy, dtype: Any, rngs: nnx.Rngs,
                 eps: float = EPS, qkv_bias: bool = True) -> None:
        if downsample:
            self.downsample = PatchMerging(dim, out, dtype=dtype, rngs=rngs, eps=eps)
            resolution = (resolution + 1) // 2
        self.blocks = nnx.List([
            SwinBlock(out, heads, *window_and_shift(resolution, window, i % 2 == 1), mlp_ratio=mlp_ratio,
                      kernels=kernels, dtype=dtype, rngs=rngs, eps=eps, qkv_bias=qkv_bias)
            for i in range(depth)])

    def __call__(self, x: Array) -> Array:
        if hasattr(self, "downsample"):
            x = self.downsample(x)
        for block in self.blocks:
            x = block(x)
        return x


class SwinTransformer(nnx.Module):
    """Swin on (B, H, W, C) images; stage ``i`` has width ``embed_dim * 2**i``.

    Args:
      img_size: the image side windows and shifts are laid out for.
      num_classes: a linear ``head`` (timm's ``head.fc``) on the pooled features when > 0.
      eps: the LayerNorms' epsilon (torch's 1e-5, timm's and Hugging Face's default).
      qkv_bias: biases on the attention's q, k and v.
      kernels: the resolved kernel policy (:mod:`jaxrat.ops.policy`).
    """

    def __init__(self, *, img_size: int = 224, patch_size: int = 4, in_channels: int = 3, embed_dim: int = 96,
                 depths: Sequence[int] = (2, 2, 6, 2), num_heads: Sequence[int] = (3, 6, 12, 24),
                 window_size: int = 7, mlp_ratio: float = 4.0, num_classes: int = 0, eps: float = EPS,
                 qkv_bias: bool = True, kernels: KernelPolicy, dtype: Any = jnp.float32, rngs: nnx.Rngs) -> None:
        self.patch_embed = PatchEmbed(patch_size, in_channels, embed_dim, norm_eps=eps, dtype=dtype, rngs=rngs)
        self.widths = [embed_dim * 2 ** i for i in range(len(depths))]
        resolution = img_size // patch_size
        stages = []
        for i, (depth, heads) in enumerate(zip(depths, num_heads)):
            dim = self.widths[max(i - 1, 0)]
            stages.append(SwinStage(dim, self.widths[i], depth, heads, resolution, window_size, downsample=i > 0,
                                    mlp_ratio=mlp_ratio, kernels=kernels, dtype=dtype, rngs=rngs, eps=eps,
                                    qkv_bias=qkv_bias))
            if i > 0:
                resolution = (resolution + 1) // 2
        self.layers = nnx.List(stages)
        self.norm = layer_norm(self.widths[-1], eps, dtype, rngs)
        if num_classes:
            self.head = nnx.Linear(self.widths[-1], int(num_classes), dtype=dtype, rngs=rngs)

    @property
    def num_features(self) -> int:
        """Width of the pooled features (the last stage's)."""
        return self.widths[-1]

    def features(self, images: Array) -> list[Array]:
        """Every stage's output, (B, H/p/2**i, W/p/2**i, widths[i]), before the final norm."""
        x = self.patch_embed(images)
        out = []
        for stage in self.layers:
            x = stage(x)
            out.append(x)
        return out

    def pooled(self, images: Array) -> Array:
        """(B, widths[-1]): the final norm's output averaged over the grid."""
        return self.norm(self.features(images)[-1]).mean(axis=(1, 2))

    def __call__(self, images: Array) -> Array:
        """Logits (B, num_classes) when the model has a head, else the pooled features."""
        pooled = self.pooled(images)
        return self.head(pooled).astype(jnp.float32) if hasattr(self, "head") else pooled
