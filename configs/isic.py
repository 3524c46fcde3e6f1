"""ISIC 2018 Task 1 lesion segmentation.

Variants (``--config configs/isic.py:VARIANT``):
  (none)  real ISIC 2018 data, full resolution.
  demo    synthetic lesions in the official layout; learns visibly in minutes on a laptop CPU.
  smoke   tiny and fast, for tests.
"""

from __future__ import annotations

import ml_collections as mlc

from jaxrat.configlib import base_config


def get_config(arg: str | None = None) -> mlc.ConfigDict:
    """Return the ISIC config for ``arg`` in {None, "demo", "smoke"}."""
    c = base_config()
    c.data.name = "isic2018"
    c.data.image_size = 256
    c.data.batch_size = 16
    c.data.eval_batch_size = 16
    c.num_train_steps = 20_000
    c.optimizer.learning_rate = 1e-3
    c.optimizer.warmup_steps = 500
    c.train.eval_every = 1000
    c.train.checkpoint_every = 1000
    c.train.log_every = 50

    c.model.name = "unet"
    c.model.features = (32, 64, 128, 256)
    c.model.num_classes = 1

    variant = arg or ""
    if variant == "demo":
        c.data.synthetic = True
        c.data.synthetic_train = 256
        c.data.synthetic_val = 64
        c.data.image_size = 64
        c.data.batch_size = 16
        c.data.eval_batch_size = 32
        c.num_train_steps = 400
        c.optimizer.learning_rate = 3e-3
        c.optimizer.warmup_steps = 40
        c.train.eval_every = 100
        c.train.checkpoint_every = 100
        c.train.log_every = 20
        c.model.features = (16, 32, 64)
    elif variant == "smoke":
        c.data.synthetic = True
        c.data.synthetic_train = 32
        c.data.synthetic_val = 8
        c.data.image_size = 32
        c.data.batch_size = 8
        c.data.eval_batch_size = 8
        c.data.num_threads = 1
        c.num_train_steps = 6
        c.optimizer.warmup_steps = 2
        c.train.eval_every = 3
        c.train.checkpoint_every = 3
        c.train.log_every = 1
        c.train.log_images = False
        c.model.features = (4, 8)
    elif variant:
        raise ValueError(f"Unknown variant {variant!r} for configs/isic.py; use demo, smoke or none.")
    return c
