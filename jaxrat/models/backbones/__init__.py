"""Pretrained transformer backbones by timm's names: ViT, BEiT and Swin (Flax NNX).

:func:`build_backbone` makes one from its name (``vit_base_patch16_224``, ``beit_base_patch16_224``,
``swin_tiny_patch4_window7_224``, ...) with fields overridden (``img_size``, ``depth``, ...); its
weights come from a timm or Hugging Face file through :mod:`jaxrat.models.backbones.weights`.
Every backbone has ``features(images)`` (a list of (B, h, w, C) maps), ``pooled(images)`` and
``num_features``.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import nnx

from jaxrat.ops import KernelPolicy
from jaxrat.runtime.errors import ConfigError

_VIT = {"tiny": (192, 12, 3), "small": (384, 12, 6), "base": (768, 12, 12), "large": (1024, 24, 16)}
_SWIN = {"tiny": (96, (2, 2, 6, 2), (3, 6, 12, 24)), "small": (96, (2, 2, 18, 2), (3, 6, 12, 24)),
         "base": (128, (2, 2, 18, 2), (4, 8, 16, 32))}


def _architectures() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for size, (dim, depth, heads) in _VIT.items():
        for patch in (16, 32):
            for img in (224, 384):
                out[f"vit_{size}_patch{patch}_{img}"] = dict(kind="vit", img_size=img, patch_size=patch, embed_dim=dim,
                                                             depth=depth, num_heads=heads)
        if size in ("base", "large"):
            for img in (224, 384):
                out[f"beit_{size}_patch16_{img}"] = dict(kind="beit", img_size=img, patch_size=16, embed_dim=dim,
                                                         depth=depth, num_heads=heads, layer_scale=0.1)
    for size, (dim, depths, heads) in _SWIN.items():
        out[f"swin_{size}_patch4_window7_224"] = dict(kind="swin", img_size=224, embed_dim=dim, depths=depths,
                                                      num_heads=heads, window_size=7)
    out["swin_base_patch4_window12_384"] = dict(kind="swin", img_size=384, embed_dim=128, depths=(2, 2, 18, 2),
                                                num_heads=(4, 8, 16, 32), window_size=12)
    return out


ARCHITECTURES = _architectures()


def backbone_fields(arch: str, overrides: dict[str, Any] | None = None, pretrained: str = "") -> dict[str, Any]:
    """The constructor fields of ``arch``, with those the ``pretrained`` file's config states laid over
    them (:mod:`jaxrat.models.backbones.architecture`), then ``overrides`` (a ConfigError for an
    unknown name, or an override that contradicts the file)."""
    from jaxrat.models.backbones.architecture import resolve

    if arch not in ARCHITECTURES:
        raise ConfigError(f"unknown backbone {arch!r}; choose one of {sorted(ARCHITECTURES)}.")
    return resolve(arch, ARCHITECTURES[arch], dict(overrides or {}), str(pretrained or ""))


def build_backbone(arch: str, *, kernels: KernelPolicy, dtype: Any = jnp.float32, rngs: nnx.Rngs,
                   pretrained: str = "", **overrides: Any) -> nnx.Module:
    """The backbone ``arch`` (a name of :data:`ARCHITECTURES`) with the fields the ``pretrained``
    file states, then ``overrides``; the weights themselves load elsewhere (:mod:`.weights`)."""
    from jaxrat.models.backbones.swin import SwinTransformer
    from jaxrat.models.backbones.vit import VisionTransformer

    fields = backbone_fields(arch, overrides, pretrained)
    kind = fields.pop("kind")
    cls = SwinTransformer if kind == "swin" else VisionTransformer
    if kind != "swin":
        fields["kind"] = kind
    try:
        return cls(**fields, kernels=kernels, dtype=dtype, rngs=rngs)
    except TypeError as e:
        raise ConfigError(f"backbone {arch!r}: {e}; use the fields of {cls.__name__}.") from None
