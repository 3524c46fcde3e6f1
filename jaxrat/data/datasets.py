"""From a ``config.data`` section to the train and validation :class:`~jaxrat.data.pipeline.ExampleSource`.

Handles, in order: the synthetic dataset, staging to node-local disk, the bad-file policy (with
``WORKDIR/skipped_files.txt`` written by process 0), the split file, and the source format
(``files``: the official folders; ``tfds``: the ArrayRecord made by ``python -m jaxrat.data.prepare_isic``).

A dataset folder (``config.data.data_dir``) is the user's and only ever read: synthetic data is
written under the workdir, and only when no ``data_dir`` is given (a given one wins, so any
variant trains on real data when pointed at it); staged copies go to ``stage_to_local_dir``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from jaxrat.data.badfiles import SKIPPED_FILES_NAME, BadFilePolicy
from jaxrat.data.pipeline import ExampleSource
from jaxrat.data.sources import isic
from jaxrat.data.synthetic import isic as synthetic_isic
from jaxrat.errors import ConfigError

SEGMENTATION_DATASETS = ("isic2018",)
SOURCES = ("files", "tfds")


def _get(cfg: Any, name: str, default: Any) -> Any:
    return cfg.get(name, default) if hasattr(cfg, "get") else getattr(cfg, name, default)


def resolve_segmentation(
    data_cfg: Any, workdir: str, *, seed: int, process_index: int
) -> tuple[ExampleSource, ExampleSource]:
    """(train, validation) for ``config.data``; writes the synthetic dataset first when asked."""
    if data_cfg.name not in SEGMENTATION_DATASETS:
        raise ConfigError(f"Unknown dataset config.data.name={data_cfg.name!r}; "
                          f"use one of {list(SEGMENTATION_DATASETS)}.")
    source = _get(data_cfg, "source", "files")
    if source not in SOURCES:
        raise ConfigError(f"config.data.source={source!r}; use one of {list(SOURCES)}.")
    record = os.path.join(workdir, SKIPPED_FILES_NAME) if process_index == 0 else None
    policy = BadFilePolicy(_get(data_cfg, "on_bad_file", "fail"), record)

    if source == "tfds":
        from jaxrat.data.sources import isic_arrayrecord

        tfds_dir = os.path.expanduser(data_cfg.data_dir or "") or os.path.join(isic.default_data_dir(), "tfds")
        return tuple(  # type: ignore[return-value]
            isic_arrayrecord.example_source(tfds_dir, split, policy, _get(data_cfg, "split_file", ""))
            for split in ("train", "validation")
        )

    data_dir = os.path.expanduser(data_cfg.data_dir or "")
    if data_cfg.synthetic and data_dir:
        logging.info("data: no synthetic data: config.data.data_dir=%s is given, so training reads that dataset "
                     "(and never writes into it)", data_dir)
    elif data_cfg.synthetic:
        # One copy per process on its own disk: correct whether or not the workdir is shared.
        data_dir = os.path.join(workdir, "synthetic_data", f"process_{process_index}")
        synthetic_isic.write_dataset(data_dir, data_cfg.synthetic_train, data_cfg.synthetic_val, data_cfg.image_size,
                                     seed)
    data_dir = data_dir or isic.default_data_dir()
    local = os.path.expanduser(_get(data_cfg, "stage_to_local_dir", "") or "")
    if local:
        from jaxrat.data import staging

        if not os.path.isdir(data_dir):
            isic.find_pairs(data_dir, "train")  # raises the helpful "not found" message
        data_dir = staging.stage(data_dir, local)
    split_file = _get(data_cfg, "split_file", "")
    out = []
    for split in ("train", "validation"):
        pairs = isic.find_pairs(data_dir, split, split_file=split_file, policy=policy)
        out.append(ExampleSource(pairs, policy=policy, name=f"isic2018/{split}"))
    return out[0], out[1]
