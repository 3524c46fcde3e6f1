"""The RAT ablation study on ISIC 2018: five axes, one change at a time from the ISIC RAT.

    python -m jaxrat.sweep --config configs/ablations.py --root runs/ablations --slurm --gpus-per-node 1
    python -m jaxrat.summarize runs/ablations

Variants of the base (``--config configs/ablations.py:VARIANT``), as in configs/isic.py:
  (none)  real ISIC 2018 data, the RAT of configs/isic.py (single scale, RoSE, dense SGA, windowed
          multi-resolution attention, 4 blocks of 128 channels).
  demo    synthetic lesions at 48 px; every variant trains in minutes on a CPU.
  smoke   tiny and fast, for tests (a 2-block RAT of 8 channels).

The sweep (``get_sweep``), each variant the base with one change (docs/experiments.md):
  positional encoding  pe_none, pe_absolute, pe_rope (the base: RoSE)
  attention            attn_sparse, attn_standard (SGA variants; base: dense SGA) and mr_global
                       (global multi-resolution attention; base: windowed)
  multi-scale          multiscale: the [256, 128, 64] pyramid of configs/isic_multiscale.py
  depth                depth_half, depth_1.5x (num_blocks)
  width                width_half, width_2x (feature_dims)
  baselines            transunet, swin_unet (and unet on real data): configs/isic.py's variants of the
                       same name (_demo forms for the demo), trained by the sweep beside the RAT so
                       the summary and the report hold them in the same table
"""

from __future__ import annotations

import os

import ml_collections as mlc

from jaxrat.config_schema import load_config
from jaxrat.models.rat import rat_config

_ISIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "isic.py")

# What ``jaxrat train --list-configs`` lists ("" is the default variant).
VARIANTS = ("", "demo", "smoke")


def get_config(arg: str | None = None) -> mlc.ConfigDict:
    """The base of the study for ``arg`` in {None, "demo", "smoke"}: the ISIC RAT, single scale."""
    if arg not in (None, "", "demo", "smoke"):
        raise ValueError(f"Unknown variant {arg!r} for configs/ablations.py; use demo, smoke or none.")
    c = load_config(f"{_ISIC}:{arg}" if arg else _ISIC)
    if c.model.name != "rat":  # isic.py's smoke variant trains a U-Net; the ablations need a (tiny) RAT
        c.model = mlc.ConfigDict(dict(name="rat", kernels="auto", num_classes=1, head="decoder", decoder_dim=8))
        c.model.rat = rat_config(feature_dims=8, num_blocks=2, num_heads=2, iters=1, mlp_dropout=0.0,
                                 positional_encoding="rose", mr_attention="windowed", mr_window=16)
    # The study's base is the reference's SGA (configs/isic.py trains the sparse form by default):
    # attn_sparse is then the one-change variant it is named for. No pyramid unless a variant sets
    # model.rat.scales.
    c.model.rat.attention = "dense"
    c.model.rat.scales = ()
    c.model.rat.pyramid_spacing = "relative"
    return c


def get_sweep(arg: str | None = None) -> dict[str, list[str]]:
    """The ablation variants, named, as overrides of :func:`get_config` (``arg``)."""
    m = get_config(arg).model.rat
    blocks, dims = m.num_blocks, m.feature_dims
    return {
        "baseline": [],
        # positional encoding: RoSE against none, a learned absolute embedding, and RoPE
        "pe_none": ["--config.model.rat.positional_encoding=none"],
        "pe_absolute": ["--config.model.rat.positional_encoding=absolute"],
        "pe_rope": ["--config.model.rat.positional_encoding=rope"],
        # attention: SGA's dense form against its sparse (windowed) and standard-attention forms, and
        # the multi-resolution blocks' global attention against their windowed form
        "attn_sparse": ["--config.model.rat.attention=sparse"],
        "attn_standard": ["--config.model.rat.attention=standard"],
        "mr_global": ["--config.model.rat.mr_attention=global"],
        # multi-scale: the image pyramid of configs/isic_multiscale.py
        "multiscale": ["--config.model.rat.scales=(256,128,64)"],
        # depth and width, half and one and a half or twice the base
        "depth_half": [f"--config.model.rat.num_blocks={max(1, blocks // 2)}"],
        "depth_1.5x": [f"--config.model.rat.num_blocks={blocks + max(1, blocks // 2)}"],
        "width_half": [f"--config.model.rat.feature_dims={dims // 2}"],
        "width_2x": [f"--config.model.rat.feature_dims={dims * 2}"],
        **_baselines(arg),
    }


def _baselines(arg: str | None) -> dict[str, list[str]]:
    """The study's other models, each its configs/isic.py variant (a sweep variant may train another
    config file); the smoke sweep, which the framework's tests run whole, leaves them out."""
    if arg == "smoke":
        return {}
    if arg == "demo":
        return {name: [f"--config={_ISIC}:{name}_demo"] for name in ("transunet", "swin_unet")}
    return {name: [f"--config={_ISIC}:{name}"] for name in ("unet", "transunet", "swin_unet")}


def get_search_space(arg: str | None = None) -> dict[str, dict]:
    """What ``python -m jaxrat.tune`` searches (docs/experiments.md): the optimiser's learning rate
    and weight decay on log scales, and the RAT's dropout. The objective is checkpoint.best_metric."""
    return {
        "optimizer.learning_rate": {"type": "float", "low": 1e-4, "high": 3e-2, "log": True},
        "optimizer.weight_decay": {"type": "float", "low": 1e-6, "high": 1e-2, "log": True},
        "model.rat.mlp_dropout": {"type": "categorical", "choices": [0.0, 0.1]},
    }
