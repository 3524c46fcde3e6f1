"""The fields a task, its model and its data add to the schema, checked in a run's config.json by the
kinds the packaged configs give them.

The schema (``base.py``) holds the fields every task shares; a task's own fields (``task.threshold``,
``task.num_classes``, ``model.num_queries``, ``model.rat.*``, ``data.train_csv``) are set by the config
files that choose it, and the task reads them as they are: a hand-edited ``"threshold": "high"``
ended in a traceback in evaluate, predict, export or the resume. Each such field of a config.json is
checked against the values the packaged configs (every variant) give it, in the configs of the same
task (``task.*``, ``data.*``) or of the same model (``model.*``): a field none of them has (a task or
model of the user's own, a field a newer jaxrat added) is kept as it is, and one that a config leaves
open (None, or a reference of any type, e.g. ``model.rat.attention``) takes any value.
"""

from __future__ import annotations

import functools
import json
import os
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import ml_collections as mlc
from ml_collections import config_dict

from jaxrat.config_schema.base import base_config, default
from jaxrat.config_schema.kinds import json_misfit
from jaxrat.config_schema.packaged import PACKAGED_DIR, load_config_module, packaged_configs
from jaxrat.runtime.dotted import flatten
from jaxrat.runtime.errors import ConfigError

OWNERS = ("task", "model", "data")  # the sections a task's config files add fields to
_ANY = object()  # a field left open: None, or a reference declared of any type
_SECTION = object()  # a section of fields (a ConfigDict)


def _fields(node: mlc.ConfigDict, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every field under ``node``, sections first and then their fields."""
    for name in node.keys():
        stored = node._fields[name]  # noqa: SLF001 - where ml_collections keeps a reference's declared type
        if isinstance(stored, config_dict.FieldReference):
            if stored.get_type() is object:
                yield prefix + name, _ANY
                continue
            stored = stored.get()
        if isinstance(stored, mlc.ConfigDict):
            yield prefix + name, _SECTION
            yield from _fields(stored, f"{prefix}{name}.")
        else:
            yield prefix + name, _ANY if stored is None else stored


@functools.cache
def _packaged() -> tuple[tuple[str, tuple[str, str, str], dict[str, Any]], ...]:
    """(``config:variant``, its task, model and data names, its own fields) of every packaged config's variants."""
    schema = set(flatten(base_config()))
    found = []
    for name in packaged_configs():
        try:
            module = load_config_module(os.path.join(PACKAGED_DIR, name + ".py"))
            for variant in getattr(module, "VARIANTS", ("",)):
                config = module.get_config(variant) if variant else module.get_config()
                own = {k: v for k, v in _fields(config) if k.split(".")[0] in OWNERS and k not in schema}
                names = (str(config.task.name), str(config.model.name), str(config.data.name))
                found.append((f"{name}:{variant}" if variant else name, names, own))
        except Exception:  # noqa: BLE001 - a packaged config that cannot be built here only checks less
            continue
    return tuple(found)


def references(task: str, model: str, data: str = "") -> dict[str, list[tuple[str, Any]]]:
    """Each own field of a run of ``task`` with ``model`` (on ``data``): the (``config:variant``, value)
    pairs the packaged configs of that task (``task.*``, ``data.*``) or that model (``model.*``) give it,
    those of the same task, model and data first (the example a refusal shows)."""
    found: dict[str, list[tuple[str, Any]]] = defaultdict(list)
    run = (task, model, data)
    ranked = sorted(_packaged(), key=lambda entry: -sum(a == b for a, b in zip(entry[1], run)))
    for spec, (config_task, config_model, _), own in ranked:
        for key, value in own.items():
            if (config_model == model) if key.startswith("model.") else (config_task == task):
                found[key].append((spec, value))
    return found


def check_own_fields(raw: dict[str, Any], path: str) -> None:
    """Refuse the first own field of ``raw`` (a config.json's object, its schema fields checked) whose
    value is of none of the kinds the packaged configs give it: one sentence naming the field, what it
    holds and what it should hold. A number where every config has a float becomes a float."""
    for key, given in references(_name(raw, "task"), _name(raw, "model"), _name(raw, "data")).items():
        values = [v for _, v in given]
        if any(v is _ANY for v in values):
            continue
        *parents, leaf = key.split(".")
        node: Any = raw
        for name in parents:
            node = node.get(name) if isinstance(node, dict) else None
        if not isinstance(node, dict) or leaf not in node:
            continue  # missing (a null section counts as missing, as in the schema)
        value = node[leaf]
        if all(v is _SECTION for v in values):
            if value is not None and not isinstance(value, dict):  # null: missing, as for the schema's sections
                raise ConfigError(f"{path}: {key} is {json.dumps(value)}, not a section of fields; put back the "
                                  f"object the run was trained with.")
            continue
        leaves = [(spec, v) for spec, v in given if v is not _SECTION]
        misfits = [json_misfit(key, value, v) for _, v in leaves]
        if None not in misfits:
            spec, example = leaves[0]
            raise ConfigError(f"{path}: {key} is {json.dumps(value)}, not {misfits[0]}; put back the value the run "
                              f"was trained with (the packaged config {spec} has {json.dumps(example)}).")
        if isinstance(value, int) and not isinstance(value, bool) and all(isinstance(v, float) for v in values):
            node[leaf] = float(value)


def _name(raw: dict[str, Any], section: str) -> str:
    node = raw.get(section)
    name = node.get("name") if isinstance(node, dict) else None
    return str(name if name is not None else default(f"{section}.name"))
