"""ISIC 2018 Task 1 lesion segmentation.

Variants (``--config configs/isic.py:VARIANT``):
  (none)  real ISIC 2018 data, full resolution.
  demo    synthetic lesions in the official layout; learns visibly in minutes on a laptop CPU.
  smoke   tiny and fast, for tests.
  unet    the U-Net baseline on real ISIC 2018 data (same data, schedule and metrics as the RAT).
  transunet  TransUNet (ViT-B/16 encoder, CNN decoder with skips) on real data; its paper starts
          from ImageNet weights: --config.model.pretrained=PATH (a timm file or Hugging Face folder).
  swin_unet  Swin-UNet (Swin-T encoder, symmetric Swin decoder) on real data, pretrained the same way.
  transunet_demo, swin_unet_demo  the demo's synthetic lesions with small forms of both, from scratch.

Expected (demo): eval Dice 0.989 after 400 steps, under 10 min on a 2-core CPU
(docs/rat.md, "Recommended defaults"; the README quotes this line, tests/unit/test_docs.py keeps them equal).
Expected (transunet_demo): eval Dice 0.991 after 400 steps, 5-10 min on a 2-core CPU (docs/tasks.md)
Expected (swin_unet_demo): eval Dice 0.984 after 400 steps, ~4 min on a 2-core CPU (docs/tasks.md)
"""

from __future__ import annotations

import ml_collections as mlc

from jaxrat.config_schema import base_config
from jaxrat.models.rat import rat_config

# What ``jaxrat train --list-configs`` lists ("" is the default variant).
VARIANTS = ("", "demo", "smoke", "unet", "transunet", "transunet_demo", "swin_unet", "swin_unet_demo")


def get_config(arg: str | None = None) -> mlc.ConfigDict:
    """Return the ISIC config for ``arg``: None, demo, smoke, unet, transunet, swin_unet or their _demo forms."""
    variant = arg or ""
    baseline = variant.removesuffix("_demo")
    if baseline in ("transunet", "swin_unet"):
        demo = variant.endswith("_demo")
        return _baseline(get_config("demo") if demo else _real(), baseline, demo)
    c = _real()
    if variant in ("demo", "smoke"):
        c.data.rotation_degrees = 0.0
        c.data.color_jitter = 0.0
        c.data.elastic_prob = 0.0
    if variant == "demo":
        _demo(c)
    elif variant == "smoke":
        _smoke(c)
    elif variant == "unet":
        c.model = mlc.ConfigDict(dict(name="unet", kernels="auto", features=(32, 64, 128, 256), num_classes=1))
    elif variant:
        raise ValueError(f"Unknown variant {variant!r} for configs/isic.py; use demo, smoke, unet, transunet, "
                         f"transunet_demo, swin_unet, swin_unet_demo or none.")
    return c


def _real() -> mlc.ConfigDict:
    """The default variant: real ISIC 2018 data at full resolution, the RAT at the reference's dims."""
    c = base_config()
    c.data.name = "isic2018"
    c.data.image_size = 256
    c.data.batch_size = 16
    c.data.eval_batch_size = 16
    c.num_train_steps = 20_000
    c.optimizer.learning_rate = 1e-3
    c.optimizer.warmup_steps = 500
    c.train.eval_every = 1000
    c.checkpoint.every_steps = 1000
    c.train.log_every = 50
    c.checkpoint.best_metric = "eval/dice"

    c.task.name = "segmentation"
    c.task.bce_weight = 0.5  # loss = bce_weight * BCE + dice_weight * (1 - soft Dice)
    c.task.dice_weight = 0.5
    c.task.threshold = 0.5  # probability above which a pixel counts as lesion in the eval metrics
    # Metrics also at each image's original resolution (eval/orig/...: predictions resized back on
    # the host, compared with the masks as stored), as the ISIC challenge scores; see docs/tasks.md.
    c.task.eval_original_resolution = True
    # Augmentations of the reference study's ISIC setup (docs/data.md); the demo and smoke
    # variants below switch them off for speed.
    c.data.random_flip = True
    c.data.rotation_degrees = 15.0
    c.data.color_jitter = 0.1
    c.data.elastic_prob = 0.1

    # RAT at the ISIC dims of the reference (docs/rat.md). The U-Net baseline: variant "unet".
    # config.model holds the task model's own fields (head); config.model.rat the RAT, every option
    # of jaxrat.models.rat.RATConfig (docs/rat.md), each settable as --config.model.rat.<option>.
    c.model.name = "rat"
    c.model.num_classes = 1
    c.model.head = "decoder"  # decoder | reference
    c.model.decoder_dim = 32
    c.model.rat = rat_config(
        feature_dims=128, num_blocks=4, num_heads=8, iters=3, mlp_dropout=0.1,
        # Sparse (windowed) SGA: linear in pixels, 3.3x faster than the reference's dense form at
        # 128 px and the same demo Dice (docs/rat.md, "Recommended defaults"); "dense" is the reference's.
        attention="sparse",  # dense | sparse | mixed | standard
        positional_encoding="rose",  # rose | rope | absolute | none
        # Multi-resolution attention in 16x16-token tiles on the large grids (global on the small
        # ones): 7.7x cheaper than the reference's global form for the first block at 256 px, same
        # demo Dice (docs/rat.md); a tile covering the whole grid, as at the demo's 48 px, is global.
        mr_attention="windowed", mr_window=16,
    )
    return c


def _baseline(c: mlc.ConfigDict, baseline: str, demo: bool) -> mlc.ConfigDict:
    """``c`` (the real or the demo variant) with TransUNet or Swin-UNet as its model; small ones for the demo."""
    size = c.data.image_size
    if baseline == "transunet":
        c.model = mlc.ConfigDict(dict(name="transunet", kernels="auto", num_classes=1, pretrained="",
                                      backbone="vit_base_patch16_224", backbone_fields={"img_size": size},
                                      skip_features=(32, 64, 128), decoder_features=(256, 128, 64, 32)))
        if demo:
            c.model.backbone_fields = {"img_size": size, "patch_size": 8, "embed_dim": 64, "depth": 4,
                                       "num_heads": 4}
            c.model.skip_features, c.model.decoder_features = (16, 32, 32), (64, 32, 16)
    else:
        c.model = mlc.ConfigDict(dict(name="swin_unet", kernels="auto", num_classes=1, pretrained="",
                                      backbone="swin_tiny_patch4_window7_224", backbone_fields={"img_size": size}))
        if demo:
            c.model.backbone_fields = {"img_size": size, "embed_dim": 32, "depths": (2, 2, 2),
                                       "num_heads": (2, 4, 8), "window_size": 3}
        else:  # the window must tile every stage's grid: 256 px -> 64, 32, 16, 8 tokens
            c.model.backbone_fields.window_size = 8
    c.optimizer.weight_decay_exclude += "|cls_token|relative_position_bias_table"
    return c


def _demo(c: mlc.ConfigDict) -> None:
    """Synthetic lesions and a small RAT: learns visibly in minutes on a laptop CPU."""
    c.data.synthetic = True
    c.data.synthetic_train = 256
    c.data.synthetic_val = 64
    # Lesions are drawn at 256 px (288 x 320 files) and resized by the pipeline like real data,
    # so the robustness command can evaluate the demo at other sizes on the same images.
    c.data.synthetic_image_size = 256
    # RAT's first grouping layer costs pixels x groups: 48x48 keeps the demo within 10 minutes
    # on 2 CPU cores (eval Dice 0.984 after 100 steps, 0.989 at 400 on the 256 px lesions).
    c.data.image_size = 48
    c.data.batch_size = 16
    c.data.eval_batch_size = 32
    c.num_train_steps = 400
    c.optimizer.learning_rate = 3e-3
    c.optimizer.warmup_steps = 40
    c.train.eval_every = 100
    c.checkpoint.every_steps = 100
    c.train.log_every = 20
    c.model.rat.update(dict(feature_dims=32, num_blocks=3, num_heads=2, iters=1, mlp_dropout=0.0))
    c.model.decoder_dim = 16


def _smoke(c: mlc.ConfigDict) -> None:
    """Tiny and fast, for the framework tests."""
    c.data.synthetic = True
    c.data.synthetic_train = 32
    c.data.synthetic_val = 8
    c.data.image_size = 32
    c.data.batch_size = 8
    c.data.eval_batch_size = 8
    c.data.num_threads = 1
    c.data.num_workers = 0  # starting worker processes would cost more than these tiny batches
    c.num_train_steps = 6
    c.optimizer.warmup_steps = 2
    c.train.eval_every = 3
    c.checkpoint.every_steps = 3
    c.train.log_every = 1
    c.train.log_images = False
    c.train.plots = False  # matplotlib would cost a fifth of a smoke run's CPU
    c.task.eval_original_resolution = False  # framework tests run smoke many times: keep eval minimal
    # The smoke variant keeps the tiny U-Net: it compiles in seconds and the framework tests
    # (training, multi-process, preemption, SLURM) run it many times. RAT's own tests use tiny
    # RAT models directly (tests/integration/test_rat_model.py).
    c.model = mlc.ConfigDict(dict(name="unet", kernels="auto", features=(4, 8), num_classes=1))
