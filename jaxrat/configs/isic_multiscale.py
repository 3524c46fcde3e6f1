"""ISIC 2018 Task 1 with multi-scale RAT: a [256, 128, 64] image pyramid.

The model builds the pyramid from the one input image (level i = input resized by
scales[i] / scales[0], spacing scales[0] / scales[i]), so the data pipeline is the one of
configs/isic.py. Variants are those of configs/isic.py (demo, smoke; smoke with a tiny RAT); the
pyramid keeps the same relative factors at their smaller image sizes.
"""

from __future__ import annotations

import os

import ml_collections as mlc

from jaxrat.config_schema import load_config
from jaxrat.models.rat import rat_config

# What ``jaxrat train --list-configs`` lists ("" is the default variant).
VARIANTS = ("", "demo", "smoke")


def get_config(arg: str | None = None) -> mlc.ConfigDict:
    """Return the multi-scale ISIC config for ``arg`` in {None, "demo", "smoke"}."""
    isic = os.path.join(os.path.dirname(os.path.abspath(__file__)), "isic.py")
    c = load_config(f"{isic}:{arg}" if arg else isic)
    if c.model.name != "rat":  # the isic smoke variant uses a U-Net; here a tiny RAT instead
        c.model = mlc.ConfigDict(dict(name="rat", kernels="auto", num_classes=1, head="decoder", decoder_dim=8))
        c.model.rat = rat_config(feature_dims=8, num_blocks=2, num_heads=2, iters=1, mlp_dropout=0.1)
    c.model.rat.scales = (256, 128, 64)
    c.model.rat.pyramid_spacing = "relative"
    # Supervise every pyramid level (the mean of the levels' losses, each level against the mask
    # resized to it), as the reference's multi-scale runs did; False trains on level 0 only.
    # Eval metrics use level 0 either way. For reference parity: on the demo the two were within
    # noise (docs/tasks.md, "ISIC metrics").
    c.task.multiscale_loss = True
    return c
