"""A trained run's own config (``WORKDIR/config.json``), read back for evaluation with overrides."""

from __future__ import annotations

import ast
import os
from typing import Any, Sequence

import ml_collections as mlc

from jaxrat.config_schema.kinds import check_counts, check_value
from jaxrat.config_schema.loader import check_task_import, flatten, read_config_json
from jaxrat.runtime.errors import ConfigError, UserError


def load_run_config(workdir: str, overrides: Sequence[str] = (), allow_import: Sequence[str] = ()) -> mlc.ConfigDict:
    """The run's resolved config with ``--config.a.b=value`` overrides applied (types kept).

    A task the file names outside jaxrat is refused unless its module is in ``allow_import``
    (:func:`jaxrat.config_schema.loader.check_task_import`); a ``--config.task.name`` override is the
    user's own choice and is not checked.

    Synthetic data is pinned to the side it was generated at in training (``data.synthetic_image_size``,
    which follows ``data.image_size`` when 0), so an override of ``data.image_size`` evaluates the
    same images resized, as it would real data, rather than a new dataset drawn at the new size.
    """
    path = os.path.join(workdir, "config.json")
    if not os.path.isfile(path):
        raise UserError(f"{path} not found; pass the --workdir of a training run.")
    config = read_config_json(path)
    if not any(o.removeprefix("--config.").startswith("task.name=") for o in overrides):
        check_task_import(config, path, allow_import)
    data = config.get("data")
    if data is not None and data.get("synthetic") and "image_size" in data:
        data.synthetic_image_size = int(data.get("synthetic_image_size", 0) or data.image_size)
    flat = flatten(config)
    for item in overrides:
        key, eq, value = item.removeprefix("--config.").partition("=")
        if not eq:
            raise ConfigError(f"{item}: write overrides as --config.KEY=VALUE.")
        if key not in flat:
            raise ConfigError(f"Unknown config key --config.{key} for this run; see {path} for its keys.")
        check_value(key, flat[key], value)  # the field's kind and shape, as for training's overrides
        node = config
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = _parse(value, flat[key], key)
    check_counts(config)  # a hand-edited size below 1 ended in a traceback from the data pipeline
    return config


def _parse(value: str, current: Any, key: str) -> Any:
    if isinstance(current, str):
        return value
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        raise ConfigError(f"--config.{key}={value} is not a Python literal like {current!r}; fix the value.") from None
    if isinstance(current, bool) or isinstance(parsed, bool):
        return bool(parsed)
    if isinstance(current, float) and isinstance(parsed, int):
        return float(parsed)
    return parsed
