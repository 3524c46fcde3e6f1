"""The one loader of config files (``path[:variant]``) and of a run's config.json, and the check of
command-line overrides (the kinds themselves: :mod:`jaxrat.config_schema.kinds`)."""

from __future__ import annotations

import difflib
import json
import logging
import os
from typing import Any, Sequence

import ml_collections as mlc

from jaxrat.config_schema.base import base_config, default
from jaxrat.config_schema.kinds import check_value, json_kind, json_misfit
from jaxrat.config_schema.own_fields import check_own_fields
from jaxrat.config_schema.packaged import PACKAGED_DIR, load_config_module, resolve_config_path
from jaxrat.runtime.dotted import flatten
from jaxrat.runtime.errors import ConfigError

ALLOW_IMPORT_HELP = ("A module (or package) whose task a run's config.json may name as task.name='module:Class'; "
                     "repeat for several. A config.json is data: only jaxrat's own tasks are imported without it.")


def check_task_import(config: mlc.ConfigDict, source: str, allow_import: Sequence[str] = ()) -> None:
    """Refuse a config read as data (a run's ``config.json``) whose ``task.name`` would import code
    from outside jaxrat, unless the user named that module (or a package above it) in ``allow_import``.

    A config *file* is code and runs when loaded; a ``config.json`` in a shared workdir is data that
    anyone could have written, so the module it names is imported only with the reader's consent.
    """
    task = config.get("task")
    name = str(task.get("name", "")) if task is not None else ""
    module, sep, _ = name.partition(":")
    if not sep or module == "jaxrat" or module.startswith("jaxrat."):
        return  # a built-in name, or jaxrat's own code
    if any(module == m or module.startswith(m.rstrip(".") + ".") for m in allow_import if m):
        return
    raise ConfigError(f"{source} names the task {name!r}, which would import and run the module {module}; a "
                      f"run's config.json is data, so only jaxrat's built-in tasks are imported from it: pass "
                      f"--allow-import {module} if you trust that code.")


def portable_spec(spec: str) -> str:
    """``spec`` (``path[:variant]``) as another folder or machine loads it, for job scripts and child
    processes: a packaged config by its name (every jaxrat install resolves it; a clone's
    ``configs/NAME.py`` is that file), any other file (a config file, a run's ``config.json``) by its
    absolute path. A spec naming neither is the ConfigError of :func:`resolve_config_path`."""
    path, sep, variant = spec.partition(":")
    if os.path.isfile(path):
        name = os.path.splitext(os.path.basename(path))[0]
        packaged = os.path.join(PACKAGED_DIR, name + ".py")
        if path.endswith(".py") and os.path.isfile(packaged) and os.path.samefile(path, packaged):
            return name + sep + variant  # a clone's configs/NAME.py is the packaged config
        return os.path.abspath(path) + sep + variant
    resolve_config_path(path)
    return spec


def load_config(spec: str, allow_import: Sequence[str] = ()) -> mlc.ConfigDict:
    """Load ``path[:variant]`` the way ml_collections' ``--config`` flag does: ``get_config(variant)``.

    ``path`` may also name a packaged config (``isic:demo``, see :func:`resolve_config_path`) or be
    a run's ``config.json`` (the resolved config a run wrote; no variant), whose task is imported only
    if built-in or in ``allow_import`` (:func:`check_task_import`). A missing file or an
    unknown variant (the file's ``get_config`` raising ValueError) is a ConfigError naming it.
    Config files use it to build on each other (``isic_multiscale.py`` loads ``isic.py``), and
    ``jaxrat.main`` loads its ``--config`` with it.
    """
    path, _, variant = spec.partition(":")
    if path.endswith(".json"):
        if variant:
            raise ConfigError(f"--config {spec}: a config.json is one resolved config and has no variants; "
                              f"drop :{variant}.")
        config = read_config_json(path)
        check_task_import(config, path, allow_import)
        return config
    module = load_config_module(path)
    if not hasattr(module, "get_config"):
        raise ConfigError(f"Config file {path} defines no get_config(); see configs/isic.py for the shape of one.")
    try:
        return module.get_config(variant) if variant else module.get_config()
    except ValueError as e:
        raise ConfigError(str(e)) from None


def read_config_json(path: str) -> mlc.ConfigDict:
    """A run's ``config.json`` as the ConfigDict it was written from (JSON lists back to tuples)."""
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path} not found; pass the config.json in a training run's workdir.") from None
    except ValueError as e:
        raise ConfigError(f"{path} is not valid JSON ({e}); it was not written by jaxrat, or was damaged.") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} holds no config object; pass the config.json in a training run's workdir.")
    check_sections(raw, path)
    raw = checked_json(raw, path)
    check_own_fields(raw, path)  # the task's, model's and data's own fields, which the schema does not hold
    return mlc.ConfigDict(_tuples(raw))


# The sections every run's config.json holds and the commands read directly. Without one (deleted
# by hand) train, evaluate, predict and export ended in AttributeError: "'model'"; a run's own data,
# model or optimizer cannot be filled in from defaults. tracking and workdir are read with defaults.
REQUIRED_SECTIONS = ("model", "task", "data", "train", "optimizer", "checkpoint", "mesh", "sharding", "distributed")


def check_sections(raw: dict[str, Any], path: str) -> None:
    """A ConfigError naming the first of :data:`REQUIRED_SECTIONS` that ``raw`` (a config.json) lacks."""
    for section in REQUIRED_SECTIONS:
        if section not in raw:
            raise ConfigError(f"{path} has no {section} section; put it back, from the config.<time>.json a "
                              f"resume kept beside it or from the config the run was started with (jaxrat train "
                              f"--config NAME writes it whole).")


def checked_json(raw: dict[str, Any], path: str) -> dict[str, Any]:
    """``raw`` (a config.json's object) with every field the schema (:func:`base.base_config`) knows
    checked against the kind of its default, as ``--config.KEY=VALUE`` overrides are; a ConfigError
    names the first wrong one. A missing top-level field (read directly) is set to :func:`base.default`;
    a missing field of a section, or a missing optional section (tracking, workdir), stays missing, as
    in the config that was saved: its readers take the default (:func:`base.field`); a missing
    section of :data:`REQUIRED_SECTIONS` was refused before (:func:`check_sections`). The task's and
    model's own fields are not in the schema: :func:`jaxrat.config_schema.own_fields.check_own_fields`
    checks them next.
    """
    schema = flatten(base_config())
    for key, schema_value in schema.items():
        *parents, leaf = key.split(".")
        node: Any = raw
        for i, name in enumerate(parents):
            node = node.get(name)
            if node is None:
                break
            if not isinstance(node, dict):
                section = ".".join(parents[:i + 1])
                raise ConfigError(f"{path}: {section} is {json.dumps(node)}, not a section of fields; write it "
                                  f"as an object of fields, or delete it to take the defaults.")
        if node is None:
            continue
        if leaf in node:
            node[leaf] = _checked_json_value(key, node[leaf], schema_value, path)
        elif not parents:
            node[leaf] = default(key)
    say_unknown_fields(raw, path, list(schema))
    return raw


# The sections jaxrat's schema defines whole (data, model and task also hold the task's own fields).
SCHEMA_SECTIONS = ("checkpoint", "distributed", "mesh", "optimizer", "sharding", "tracking", "train", "workdir")


def say_unknown_fields(raw: dict[str, Any], path: str, known: list[str]) -> None:
    """Warn of the fields of a config.json that this jaxrat does not have, at the top level and in
    :data:`SCHEMA_SECTIONS`: ignored, so a hand-edited typo (``train.evl_every``) changed nothing
    without a word. A warning, not a refusal: a config.json written by a newer jaxrat still loads.
    ``known``: the schema's dotted field names."""
    unknown = []
    for key in flatten(raw):
        section, dot, _ = key.partition(".")
        if dot and section not in SCHEMA_SECTIONS:
            continue
        field_name = ".".join(key.split(".")[:2])
        if not any(k == field_name or k.startswith(field_name + ".") for k in known):
            unknown.append(field_name)
    for name in sorted(set(unknown)):
        close = difflib.get_close_matches(name, known, n=1)
        logging.warning("%s: %s is not a field of this jaxrat's config and is ignored (a typo%s, or a config.json "
                        "of a newer jaxrat)", path, name, f": did you mean {close[0]}?" if close else "")


def _checked_json_value(key: str, value: Any, schema_value: Any, path: str) -> Any:
    """``value`` if of ``schema_value``'s kind (an integer for a float field made a float), else a ConfigError."""
    expected = json_misfit(key, value, schema_value)
    if expected:
        raise ConfigError(f"{path}: {key} is {json.dumps(value)}, not {expected}; write it like the default, "
                          f"{json.dumps(schema_value)}, or delete the key to take that default.")
    return float(value) if json_kind(schema_value) is float else value


def _tuples(x: Any) -> Any:
    """JSON lists back to the tuples the config files use (mesh axes, heads, scales)."""
    if isinstance(x, dict):
        return {k: _tuples(v) for k, v in x.items()}
    if isinstance(x, list):
        return tuple(_tuples(v) for v in x)
    return x


def parse_overrides(argv: list[str]) -> tuple[str | None, list[tuple[str, str | None]]]:
    """(the ``--config`` spec, the ``(KEY, VALUE)`` of each ``--config.KEY=VALUE``) of a command line."""
    spec, overrides, i = None, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--config=") or arg == "--config":
            spec = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else None)
        elif arg.startswith("--config."):
            key, eq, value = arg[len("--config."):].partition("=")
            if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value = argv[i + 1]
            overrides.append((key, value if (eq or value) else None))
        i += 1
    return spec, overrides


def check_override_args(argv: list[str], config: mlc.ConfigDict | None = None, spec: str | None = None) -> None:
    """Fail with one sentence on a missing config file, an unknown variant, an unknown
    ``--config.KEY`` or a value of the wrong type or shape (the field's default says which).

    ml_collections reports unknown keys with a KeyError traceback, and takes ``0.5`` for a range;
    we check first and name the closest existing key instead. ``config``: the config ``argv``'s
    overrides apply to, when already loaded (else ``argv``'s ``--config`` is loaded).
    """
    found, overrides = parse_overrides(argv)
    spec = spec or found
    if config is None:
        if not spec:
            return
        config = load_config(spec)  # a missing file or unknown variant: one sentence, not absl's traceback
    flat = flatten(config)
    for key, value in overrides:
        if key.startswith("no") and key[2:] in flat and isinstance(flat[key[2:]], bool):
            continue
        if key not in flat:
            close = difflib.get_close_matches(key, list(flat), n=1)
            hint = f"did you mean --config.{close[0]}?" if close else "see the config file for valid keys."
            raise ConfigError(f"Unknown config key --config.{key}; {hint}")
        check_value(key, flat[key], value)


