"""COCO 2017 object detection: a DETR decoder on RAT's multi-scale tokens, scored by COCOeval.

Variants (``--config configs/coco.py:VARIANT``):
  (none)  real COCO 2017 under ``--config.data.data_dir`` (default ~/data/coco2017; download with
          ``python -m jaxrat.data.download coco2017``): an 800 px square canvas, the reference's
          optimiser (AdamW lr 1e-4, wd 1e-4, grad clip 0.1, batch 16, 10% warm-up), 100 queries,
          6 decoder layers, sparse SGA; the queries attend to blocks 1.. (not the full-resolution
          projection, which alone would be 640k tokens).
  demo    synthetic COCO (coloured rectangles and ellipses, 1-3 per image) on a 64 px canvas with a
          small CNN-backbone model whose queries are the 8x8 stage's tokens, with anchor boxes
          refined layer by layer and the focal class loss (what made it learn: docs/tasks.md,
          "Detection"); learns on a CPU in minutes.
  rat_demo  the demo with a small RAT backbone instead of the CNN (64 features, 3 blocks, 4 heads,
          one grouping iteration, sparse SGA, windowed MR attention: grids 64 -> 22 -> 8 -> 3), the
          queries the 8x8 stage's tokens, one program per step (no reduction shards).
  smoke   tiny, with a small CNN backbone; seconds, for tests.

Expected (demo): eval AP50 0.77 after 1000 steps, ~7 min on a 2-core CPU
(docs/tasks.md, "Detection"; the README quotes this line, tests/unit/test_docs.py keeps them equal).
Expected (rat_demo): eval AP50 0.53 after 600 steps (0.20 at 200, 0.45 at 400), ~12 min on a 2-core CPU
(measured once, the machine shared; 1.2 steps/s, 0.88 s a step in benchmarks/rat_detr_step.py).
"""

from __future__ import annotations

import ml_collections as mlc

from jaxrat.config_schema import base_config
from jaxrat.models.rat import rat_config

# What ``jaxrat train --list-configs`` lists ("" is the default variant).
VARIANTS = ("", "demo", "rat_demo", "smoke")


def get_config(arg: str | None = None) -> mlc.ConfigDict:
    """Return the detection config for ``arg`` in {None, "demo", "rat_demo", "smoke"}."""
    c = _real()
    variant = arg or ""
    if variant in ("demo", "rat_demo", "smoke"):
        _synthetic(c)
    if variant in ("demo", "rat_demo"):
        _demo(c)
    if variant == "rat_demo":
        _rat_demo(c)
    if variant == "smoke":
        _smoke(c)
    elif variant not in ("", "demo", "rat_demo"):
        raise ValueError(f"Unknown variant {variant!r} for configs/coco.py; use demo, rat_demo, smoke or none.")
    return c


def _real() -> mlc.ConfigDict:
    """The default variant: COCO 2017 at 800 px, DETR on the RAT, the reference's schedule."""
    c = base_config()
    c.data.name = "coco2017"
    c.data.image_size = 800  # square canvas; images are letterboxed (top-left) with a pad mask
    c.data.batch_size = 16
    c.data.eval_batch_size = 16
    c.data.random_flip = True  # left-right only
    c.data.scale_jitter = (0.5, 1.25)  # rescale, then random crop (boxes leaving it dropped) or pad
    c.data.color_jitter = 0.0
    c.data.synthetic_image_size = 64  # stored image height of synthetic COCO (widths 1-1.5x)
    c.data.synthetic_classes = 5
    c.num_train_steps = 150 * 118_287 // 16  # the reference's 150 epochs
    c.optimizer.learning_rate = 1e-4
    c.optimizer.weight_decay = 1e-4
    c.optimizer.clip_norm = 0.1
    c.optimizer.warmup_steps = c.num_train_steps // 15  # 10 of 150 epochs
    c.train.eval_every = 7393  # one epoch
    c.train.log_every = 50
    c.checkpoint.every_steps = 7393
    c.checkpoint.best_metric = "eval/AP"

    c.task.name = "detection"
    c.task.max_boxes = 100  # targets per image (COCO has at most 93 non-crowd objects per image)
    c.task.cost_class, c.task.cost_bbox, c.task.cost_giou = 1.0, 5.0, 2.0  # Hungarian matching
    c.task.ce_weight, c.task.bbox_weight, c.task.giou_weight = 1.0, 5.0, 2.0  # loss
    c.task.eos_coef = 0.1  # weight of the no-object class in the cross-entropy
    c.task.focal = False  # sigmoid focal class loss (no no-object class) instead
    c.task.focal_alpha, c.task.focal_gamma = 0.25, 2.0
    c.task.aux_loss = True  # the loss of every decoder layer, not only the last
    c.task.num_detections = 100  # kept per image for COCOeval (its maxDets)

    c.model = mlc.ConfigDict(dict(
        name="detr", kernels="auto", backbone="rat", hidden_dim=256, num_queries=100, decoder_layers=6,
        decoder_heads=8, ffn_dim=2048, dropout=0.1, feature_levels=(1, 2, 3, 4), cnn_widths=(32, 64, 128),
        box_refine=False, query_level=None, head="detr"))
    # The RAT backbone: every jaxrat.models.rat.RATConfig option, as --config.model.rat.<option>.
    # At 800 px the first grid is 267x267 tokens: the reference's dense SGA and global multi-resolution
    # attention are quadratic in it (global MR ~95x the 256 px block, docs/rat.md "Recommended
    # defaults"), so COCO trains the linear forms: sparse SGA and 16x16-token MR windows.
    c.model.rat = rat_config(feature_dims=128, num_blocks=4, num_heads=8, iters=3, mlp_ratio=4, mlp_dropout=0.1,
                             sga_kernel_size=7, proj_kernel_size=7, attention="sparse", positional_encoding="rose",
                             mr_attention="windowed", mr_window=16)
    return c


def _synthetic(c: mlc.ConfigDict) -> None:
    """Synthetic COCO-format images, for the demos and the smoke variant."""
    c.data.synthetic = True
    c.data.scale_jitter = (0.8, 1.2)
    c.optimizer.clip_norm = 1.0
    c.model.dropout = 0.0
    c.task.max_boxes = 8


def _demo(c: mlc.ConfigDict) -> None:
    """The demos' 64 px images and schedule, with a small CNN DETR."""
    c.data.synthetic_train = 1024
    c.data.synthetic_val = 128
    c.data.image_size = 64
    c.data.synthetic_image_size = 64
    c.data.batch_size = 16
    c.data.eval_batch_size = 32
    c.num_train_steps = 1000  # eval AP50 ~0.5 after 250 steps, 0.77 at 1000 (docs/tasks.md, "Detection")
    c.optimizer.learning_rate = 5e-4
    c.optimizer.warmup_steps = 100
    c.train.eval_every = 250
    c.checkpoint.every_steps = 250
    c.train.log_every = 50
    # The same losses on any device or process count (docs/tasks.md, "Over a whole demo"), at
    # the default step's speed here (2.8 steps/s on one CPU device).
    c.train.reduction_shards = 8
    c.task.num_detections = 20
    c.task.focal = True
    c.model.update(dict(backbone="cnn", cnn_widths=(32, 64, 96, 128), feature_levels=(1, 2, 3), hidden_dim=96,
                        num_queries=64, decoder_layers=3, decoder_heads=4, ffn_dim=256, box_refine=True,
                        query_level=2))


def _rat_demo(c: mlc.ConfigDict) -> None:
    """The demo with a small RAT backbone."""
    # The COCO RAT's width, depth and 3 grouping iterations dominate the demo step (6.6 s against
    # 0.88 s for this one, benchmarks/rat_detr_step.py); one program per step rather than the demo's
    # 8 shard programs (their cost for a RAT is not measured yet: the benchmark's *_shards rows).
    c.train.reduction_shards = 0
    c.num_train_steps = 600
    c.train.eval_every = 200
    c.checkpoint.every_steps = 200
    c.model.update(dict(backbone="rat", feature_levels=(1, 2, 3), query_level=2))
    c.model.rat = rat_config(feature_dims=64, num_blocks=3, num_heads=4, iters=1, mlp_ratio=2,
                             mlp_dropout=0.0, sga_kernel_size=7, proj_kernel_size=7, attention="sparse",
                             positional_encoding="rose", mr_attention="windowed", mr_window=16)


def _smoke(c: mlc.ConfigDict) -> None:
    """Tiny and fast, for the framework tests."""
    c.data.synthetic_train = 16
    c.data.synthetic_val = 8
    c.data.image_size = 32
    c.data.synthetic_image_size = 32
    c.data.batch_size = 8
    c.data.eval_batch_size = 8
    c.data.num_threads = 1
    c.data.num_workers = 0
    c.num_train_steps = 4
    c.optimizer.warmup_steps = 1
    c.train.eval_every = 2
    c.checkpoint.every_steps = 2
    c.train.log_every = 1
    c.train.log_images = False
    c.task.num_detections = 10
    c.model.update(dict(backbone="cnn", cnn_widths=(8, 16), feature_levels=None, hidden_dim=16, num_queries=10,
                        decoder_layers=2, decoder_heads=2, ffn_dim=32))
