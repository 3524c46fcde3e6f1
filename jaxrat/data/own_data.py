"""A demo or smoke variant pointed at the user's dataset is no longer the demo.

``--config.data.data_dir=DIR`` on a variant that generates synthetic data (``isic:demo``,
``segmentation:demo``, ...) trains on DIR: the resolved config then says so itself
(``data.synthetic`` off, in ``config.json`` too, so evaluation and prediction read DIR as well), and
the synthetic data's class names are not the user's (their classes are named by
``task.class_names`` when given, else ``class_<k>``).
"""

from __future__ import annotations

import ml_collections as mlc

from jaxrat.data.synthetic.segmentation import CLASS_NAMES as SYNTHETIC_CLASS_NAMES


def on_own_data(config: mlc.ConfigDict) -> mlc.ConfigDict:
    """``config`` with synthetic data off when ``data.data_dir`` names a dataset (changed in place; returned)."""
    data = config.get("data")
    if data is None or not data.get("synthetic") or not (data.get("data_dir") or ""):
        return config
    with config.ignore_type():
        data.synthetic = False
        task = config.get("task")
        if task is not None and tuple(task.get("class_names", ()) or ()) == SYNTHETIC_CLASS_NAMES:
            task.class_names = ()
    from jaxrat.data.datasets import note_synthetic_off

    note_synthetic_off(data.data_dir)
    return config
