"""A demo or smoke variant pointed at the user's dataset is no longer the demo.

``--config.data.data_dir=DIR`` on a variant that generates synthetic data (``isic:demo``,
``segmentation:demo``, ...) trains on DIR: the resolved config then says so itself
(``data.synthetic`` off, in ``config.json`` too, so evaluation and prediction read DIR as well), and
the synthetic data's class names are not the user's (their classes are named by
``task.class_names`` when given, else ``class_<k>``). A classification demo's two synthetic heads
(shape, kind) become the one head a folder per class gives (``data.source=folder``), as in
``configs/classification.py`` without a variant.
"""

from __future__ import annotations

import os

import ml_collections as mlc

from jaxrat.data.synthetic.classification import LABEL_COLUMNS as SYNTHETIC_HEADS
from jaxrat.data.synthetic.segmentation import CLASS_NAMES as SYNTHETIC_CLASS_NAMES


def on_own_data(config: mlc.ConfigDict) -> mlc.ConfigDict:
    """``config`` with ``data.data_dir`` absolute (so the run's config.json names the dataset from any
    folder: ``jaxrat evaluate`` run elsewhere finds it) and synthetic data off when it names a dataset
    (changed in place; returned)."""
    data = config.get("data")
    data_dir = str(data.get("data_dir") or "") if data is not None else ""
    if data_dir and "://" not in data_dir:  # a URL (gs://...) is no local path
        with config.ignore_type():
            data.data_dir = os.path.abspath(os.path.expanduser(data_dir))
    if data is None or not data.get("synthetic") or not data_dir:
        return config
    with config.ignore_type():
        data.synthetic = False
        task = config.get("task")
        if task is not None and tuple(task.get("class_names", ()) or ()) == SYNTHETIC_CLASS_NAMES:
            task.class_names = ()
        one_head = data.get("source") == "folder"  # a folder per class gives one head
        if task is not None and tuple(task.get("heads", ()) or ()) == SYNTHETIC_HEADS and one_head:
            task.heads, task.num_classes, task.loss_weights = ("label",), (0,), (1.0,)
            checkpoint = config.get("checkpoint")
            best = str(checkpoint.get("best_metric", "")) if checkpoint is not None else ""
            if best.split("/")[1:2] in (["shape"], ["kind"]):  # a synthetic head's metric
                checkpoint.best_metric = "eval/label/balanced_accuracy"
    from jaxrat.data.datasets import note_synthetic_off

    note_synthetic_off(data.data_dir)
    return config
