"""A three-variant sweep of the smoke config (configs/isic.py:smoke), for the sweep tests.

``get_sweep`` returns the dict form; the variants differ in what they train (learning rate, U-Net
width), so each is a run of its own.
"""

from __future__ import annotations

import os

from jaxrat.config_schema import load_config

ISIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "configs", "isic.py")


def get_config(arg=None):
    c = load_config(f"{ISIC}:smoke")
    c.num_train_steps = 4
    c.train.eval_every = 2
    c.checkpoint.every_steps = 2
    c.checkpoint.best_metric = "eval/dice"
    return c


def get_sweep(arg=None):
    return {
        "base": [],
        "lr_high": ["--config.optimizer.learning_rate=0.01"],
        "wide": {"model.features": (8, 16)},
    }


def get_search_space(arg=None):
    # From a learning rate too small to move the U-Net in 4 steps to one that moves it well: the
    # trials' eval losses differ, so the median pruner has something to prune.
    return {
        "optimizer.learning_rate": {"type": "float", "low": 1e-6, "high": 3e-2, "log": True},
        "model.features": {"type": "categorical", "choices": [(4, 8), (8, 16)]},
    }
