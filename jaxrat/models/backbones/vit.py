"""ViT and BEiT backbones (Flax NNX), parameter for parameter as timm's ``VisionTransformer`` and
``Beit`` so their weights load unchanged (:mod:`jaxrat.models.backbones.convert`).

* ViT: patch embedding, a class token, learned absolute position embeddings (resampled bicubically
  for an image size other than ``img_size``, as timm's ``dynamic_img_size`` does), pre-norm blocks,
  final LayerNorm, the class token's features.
* BEiT: no absolute position embedding; a learned relative position bias per block over the patch
  grid (plus three entries for the class token), q and v biases without a k bias, layer scale
  (``gamma``), and the mean of the patch tokens through ``fc_norm`` as the pooled features. The bias
  table belongs to one grid, so a BEiT runs at ``img_size`` (weights of another size are resampled
  when they load).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrat.models.backbones.layers import Block, PatchEmbed, layer_norm, relative_position_index
from jaxrat.ops import KernelPolicy
from jaxrat.runtime.errors import ConfigError

Array = jax.Array
RESAMPLE_RULES = ("timm", "hf")  # whose resampling of position embeddings a backbone follows


def torch_resize_matrix(n_in: int, n_out: int, method: str) -> np.ndarray:
    """(n_out, n_in) weights of torch's ``F.interpolate(mode=method, align_corners=False)`` along one
    axis without antialiasing (``method``: "bicubic", Keys' kernel with A=-0.75, or "bilinear"),
    the rule Hugging Face's models resample position embeddings and bias tables with."""
    m = np.zeros((n_out, n_in), np.float64)
    scale = n_in / n_out
    for i in range(n_out):
        src = (i + 0.5) * scale - 0.5
        if method == "bilinear":
            src = max(src, 0.0)  # torch clamps the linear source index, not the cubic one
            lo = min(int(np.floor(src)), n_in - 1)
            t = src - lo
            m[i, lo] += 1.0 - t
            m[i, min(lo + 1, n_in - 1)] += t
            continue
        lo = int(np.floor(src))
        t = src - lo
        a = -0.75
        for k, x in zip((-1, 0, 1, 2), (t + 1.0, t, 1.0 - t, 2.0 - t)):
            w = ((a + 2) * x - (a + 3)) * x * x + 1 if x <= 1 else ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
            m[i, min(max(lo + k, 0), n_in - 1)] += w
    return m.astype(np.float32)


def resample_grid(grid: Array, size: tuple[int, int], method: str) -> Array:
    """(h, w, ...) values on a grid resampled to ``size`` as torch's ``F.interpolate`` (no
    antialias, ``align_corners=False``) does; numpy in, numpy out, traced arrays stay traced."""
    my = torch_resize_matrix(grid.shape[0], size[0], method)
    mx = torch_resize_matrix(grid.shape[1], size[1], method)
    xp = np if isinstance(grid, np.ndarray) else jnp
    return xp.einsum("yi,xj,ij...->yx...", my, mx, grid.astype(xp.float32))


def resample_pos_embed(pos: Array, grid: tuple[int, int], prefix: int = 1, rule: str = "timm") -> Array:
    """(1, prefix + h*w, D) position embeddings of a square grid onto ``grid``, as the library the
    weights come from does it: ``rule="timm"``, bicubic with antialiasing (timm's
    ``resample_abs_pos_embed``, to float32 rounding); ``rule="hf"``, plain bicubic
    (``align_corners=False``, no antialias: transformers' ``interpolate_pos_encoding``)."""
    if rule not in RESAMPLE_RULES:
        raise ConfigError(f"pos_resample must be one of {RESAMPLE_RULES}, got {rule!r}.")
    n = pos.shape[1] - prefix
    side = int(round(n ** 0.5))
    if (side, side) == tuple(grid):
        return pos
    d = pos.shape[-1]
    patches = pos[:, prefix:].reshape(1, side, side, d).astype(jnp.float32)
    if rule == "hf":
        patches = resample_grid(patches[0], tuple(grid), "bicubic")[None]
    else:
        patches = jax.image.resize(patches, (1, *grid, d), method="bicubic", antialias=True)
    return jnp.concatenate([pos[:, :prefix].astype(jnp.float32), patches.reshape(1, -1, d)], axis=1).astype(pos.dtype)


class VisionTransformer(nnx.Module):
    """A ViT (``kind="vit"``) or BEiT (``kind="beit"``) on (B, H, W, C) images.

    Args:
      img_size: the image side the position embeddings (ViT) or bias tables (BEiT) are laid out for.
      patch_size, embed_dim, depth, num_heads, mlp_ratio: the transformer's shape.
      num_classes: a linear ``head`` on the pooled features when > 0 (timm's); 0: ``__call__``
        returns the pooled features.
      layer_scale: BEiT's initial ``gamma`` (timm's ``init_values``); None: no layer scale.
      eps: the LayerNorms' epsilon (timm's 1e-6; Hugging Face's configs default to 1e-12).
      global_pool: "token" (the normed class token; ViT's default) or "avg" (``fc_norm`` of the mean
        patch token; BEiT's default).
      qkv_bias: biases on the attention's q, k and v (BEiT: on q and v only, as timm and HF have it).
      rel_pos_bias: BEiT's relative position bias per block (HF's ``use_relative_position_bias``).
      pos_resample: whose rule resamples the position embeddings for another grid: "timm" (bicubic
        with antialiasing) or "hf" (plain bicubic), the library the weights come from.
      kernels: the resolved kernel policy (:mod:`jaxrat.ops.policy`).
    """

    def __init__(self, *, kind: str = "vit", img_size: int = 224, patch_size: int = 16, in_channels: int = 3,
                 embed_dim: int = 768, depth: int = 12, num_heads: int = 12, mlp_ratio: float = 4.0,
                 num_classes: int = 0, layer_scale: Optional[float] = 0.1, eps: float = 1e-6,
                 global_pool: Optional[str] = None, qkv_bias: bool = True, rel_pos_bias: bool = True,
                 pos_resample: str = "timm", kernels: KernelPolicy, dtype: Any = jnp.float32,
                 rngs: nnx.Rngs) -> None:
        if kind not in ("vit", "beit"):
            raise ConfigError(f"backbone kind must be 'vit' or 'beit', got {kind!r}.")
        global_pool = global_pool or ("avg" if kind == "beit" else "token")
        if global_pool not in ("token", "avg"):
            raise ConfigError(f"backbone global_pool must be 'token' or 'avg', got {global_pool!r}.")
        if pos_resample not in RESAMPLE_RULES:
            raise ConfigError(f"backbone pos_resample must be one of {RESAMPLE_RULES}, got {pos_resample!r}.")
        self.global_pool, self.pos_resample = global_pool, pos_resample
        if img_size % patch_size:
            raise ConfigError(f"img_size={img_size} is not a multiple of patch_size={patch_size}; pick one that is.")
        self.kind, self.patch_size, self.embed_dim, self.depth = kind, patch_size, embed_dim, depth
        self.grid = (img_size // patch_size,) * 2
        beit = kind == "beit"
        self.patch_embed = PatchEmbed(patch_size, in_channels, embed_dim, dtype=dtype, rngs=rngs)
        init = nnx.initializers.truncated_normal(0.02)
        self.cls_token = nnx.Param(init(rngs.params(), (1, 1, embed_dim), jnp.float32))
        table = 0
        if beit and rel_pos_bias:
            table = (2 * self.grid[0] - 1) * (2 * self.grid[1] - 1) + 3
        else:
            self.pos_embed = nnx.Param(init(rngs.params(), (1, 1 + self.grid[0] * self.grid[1], embed_dim),
                                            jnp.float32))
        self.blocks = nnx.List([
            Block(embed_dim, num_heads, mlp_ratio=mlp_ratio, eps=eps,
                  qkv_bias=("qv" if beit else "all") if qkv_bias else "none",
                  rel_table=table, layer_scale=layer_scale if beit else None, kernels=kernels, dtype=dtype,
                  rngs=rngs)
            for _ in range(depth)])
        if global_pool == "avg":  # timm: fc_norm after the mean, no norm before it
            self.fc_norm = layer_norm(embed_dim, eps, dtype, rngs)
        else:
            self.norm = layer_norm(embed_dim, eps, dtype, rngs)
        if num_classes:
            self.head = nnx.Linear(embed_dim, int(num_classes), dtype=dtype, rngs=rngs)

    @property
    def num_features(self) -> int:
        """Width of the pooled features and of every feature map."""
        return self.embed_dim

    def _tokens(self, images: Array) -> tuple[Array, tuple[int, int]]:
        x = self.patch_embed(images)
        b, h, w, d = x.shape
        x = x.reshape(b, h * w, d)
        cls = jnp.broadcast_to(self.cls_token[...].astype(x.dtype), (b, 1, d))
        x = jnp.concatenate([cls, x], axis=1)
        if self.kind == "vit":
            x = x + resample_pos_embed(self.pos_embed[...], (h, w), rule=self.pos_resample).astype(x.dtype)
        elif (h, w) != self.grid:
            raise ConfigError(f"a BEiT built for {self.grid[0] * self.patch_size} px images got "
                              f"{h * self.patch_size}x{w * self.patch_size}; set the backbone's img_size to the "
                              f"image size (pretrained tables are resampled to it when they load).")
        return x, (h, w)

    def _run(self, images: Array, keep: Sequence[int] = ()) -> tuple[Array, list[Array], tuple[int, int]]:
        x, grid = self._tokens(images)
        kept = []
        rel = self.kind == "beit" and hasattr(self.blocks[0].attn, "relative_position_bias_table")
        index = relative_position_index(*grid, extra=True) if rel else None
        for i, block in enumerate(self.blocks):
            bias = block.attn.relative_bias(index)[None] if index is not None else None
            x = block(x, bias)
            if i in keep:
                kept.append(x)
        return x, kept, grid

    def features(self, images: Array, indices: Optional[Sequence[int]] = None) -> list[Array]:
        """Outputs of the blocks ``indices`` (default: four evenly spaced, the last included) as
        (B, H/p, W/p, D) maps, class token dropped and no final norm (timm's ``forward_intermediates``)."""
        if indices is None:
            indices = [self.depth * (i + 1) // 4 - 1 for i in range(4)]
        indices = [i % self.depth for i in indices]
        _, kept, (h, w) = self._run(images, keep=indices)
        return [t[:, 1:].reshape(t.shape[0], h, w, t.shape[-1]) for t in kept]

    def pooled(self, images: Array) -> Array:
        """(B, D) pooled features: the normed class token (``global_pool="token"``) or fc_norm of the
        mean patch token ("avg")."""
        x, _, _ = self._run(images)
        if self.global_pool == "avg":
            return self.fc_norm(x[:, 1:].mean(axis=1))
        return self.norm(x)[:, 0]

    def __call__(self, images: Array) -> Array:
        """Logits (B, num_classes) when the model has a head, else the pooled features."""
        pooled = self.pooled(images)
        return self.head(pooled).astype(jnp.float32) if hasattr(self, "head") else pooled
