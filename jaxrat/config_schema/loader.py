"""The one loader of config files (``path[:variant]``) and the check of command-line overrides."""

from __future__ import annotations

import ast
import difflib
import glob
import importlib.util
import json
import logging
import os
from typing import Any, Sequence

import ml_collections as mlc

from jaxrat.config_schema.base import base_config, default
from jaxrat.runtime.dotted import flatten
from jaxrat.runtime.errors import ConfigError

# The config files that ship with the package (a clone's configs/ is a link to this folder).
PACKAGED_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def packaged_configs() -> list[str]:
    """The names of the packaged config files (``isic``, ``coco``, ...), sorted."""
    paths = glob.glob(os.path.join(PACKAGED_DIR, "*.py"))
    return sorted(os.path.splitext(os.path.basename(p))[0] for p in paths if not p.endswith("__init__.py"))


def resolve_config_path(path: str) -> str:
    """The file a ``--config`` path names: the path itself when it is a file; else a packaged config
    named ``NAME`` (or ``NAME.py``, or ``configs/NAME.py`` from outside a clone, as the docs write it).

    A path that names neither is a ConfigError listing the packaged names; a folder is one saying what to pass.
    """
    if os.path.isfile(path):
        return path
    name = os.path.splitext(os.path.basename(path))[0]
    folder = os.path.basename(os.path.dirname(os.path.normpath(path)))
    if (folder in ("", "configs") and path.endswith((".py", name)) and not path.endswith(".json")
            and name in packaged_configs()):
        return os.path.join(PACKAGED_DIR, name + ".py")  # even beside a folder of that name (./coco, the data)
    if os.path.isdir(path):
        raise ConfigError(_folder_message(path))
    names = ", ".join(packaged_configs())
    raise ConfigError(f"Config file {path} does not exist; pass a config file's path or a packaged config's "
                      f"name ({names}), e.g. --config isic:demo.")


def _folder_message(path: str) -> str:
    """What to pass instead of the folder ``path``: its config.json when it is a run's folder."""
    run_config = os.path.join(path, "config.json")
    if os.path.isfile(run_config):
        return (f"--config {path} is a folder, not a config file; pass {run_config} to train with that run's "
                f"config.")
    return (f"--config {path} is a folder, not a config file; pass a config file's path (.py), a run's "
            f"config.json or a packaged config's name ({', '.join(packaged_configs())}).")


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
    from jaxrat.config_schema.own_fields import check_own_fields  # it builds the packaged configs with this module

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
    return float(value) if _json_kind(schema_value) is float else value


def json_misfit(key: str, value: Any, reference: Any) -> str | None:
    """What the field ``key`` should hold, in JSON's words ("an integer", "a list of numbers"), where
    ``value`` (read from JSON) is not of the kind of ``reference`` (its default); None where it is."""
    kind = _json_kind(reference)
    if kind is int:
        return None if _json_kind(value) is int else "an integer"  # a step count, a size: 30, not 30.0
    if kind is float:
        return None if _json_kind(value) in (int, float) else "a number"
    if kind is tuple:
        return _json_list_misfit(key, value, reference)
    if _json_kind(value) is not kind:
        return {bool: "true or false", str: "a string (in double quotes)"}.get(kind, f"a {kind.__name__}")
    return None


def _json_kind(value: Any) -> type:
    """The kind a JSON value (or a schema default) is checked as: bool, int, float, str, tuple (lists) or other."""
    if isinstance(value, bool):
        return bool
    if isinstance(value, (tuple, list)):
        return tuple
    return type(value)


def _json_list_misfit(key: str, value: Any, schema_value: tuple) -> str | None:
    """What a tuple field expects where ``value`` (from JSON) does not fit it, in JSON's words; None where it fits."""
    misfit = _sequence_misfit(key, value, schema_value)
    if misfit is None:
        return None
    return misfit.replace("tuple", "list").replace("(low, high)", "[low, high]")


def _tuples(x: Any) -> Any:
    """JSON lists back to the tuples the config files use (mesh axes, heads, scales)."""
    if isinstance(x, dict):
        return {k: _tuples(v) for k, v in x.items()}
    if isinstance(x, list):
        return tuple(_tuples(v) for v in x)
    return x


def load_config_module(path: str) -> Any:
    """Import the config file at ``path`` (or the packaged config it names) as a module (for
    ``get_config``, ``get_sweep``)."""
    path = resolve_config_path(path)
    if not path.endswith(".py"):
        # Only a .py file is imported as code: an image or a YAML file has no loader (spec None) to run it.
        raise ConfigError(f"--config {path} is neither a Python config file (.py, defining get_config()) nor a "
                          f"run's config.json; pass one of those, or a packaged config's name such as isic:demo.")
    name = "_jaxrat_config_" + os.path.splitext(os.path.basename(path))[0]
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except ModuleNotFoundError as e:
        if e.name and (e.name == "jaxrat.config" or e.name.startswith("jaxrat.config.")):
            raise ConfigError(f"{path} imports {e.name}, which is now jaxrat.config_schema (renamed so it is not "
                              f"confused with jaxrat.configs); change the import in that file.") from None
        raise
    return module


def describe_packaged() -> str:
    """One line per packaged config: its name, its variants (``VARIANTS``) and its first docstring line."""
    lines = []
    for name in packaged_configs():
        module = load_config_module(os.path.join(PACKAGED_DIR, name + ".py"))
        summary = (module.__doc__ or "").strip().splitlines()[0] if module.__doc__ else ""
        variants = [v or "(none)" for v in getattr(module, "VARIANTS", ("",))]
        lines.append(f"{name:<16} {summary}")
        lines.append(f"{'':<16} variants: {', '.join(variants)}   (--config {name}[:VARIANT])")
    return "\n".join(lines) + "\n"


_KIND_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
# Fields whose value is a (low, high) range: two numbers, low <= high.
RANGES = {"data.random_crop_scale", "data.scale_jitter"}


def _kind(value: object) -> type:
    if isinstance(value, bool):
        return bool
    if isinstance(value, (int, float)):
        return float
    if isinstance(value, (tuple, list)):
        return tuple
    return type(value)


def _wrong(key: str, raw: str, what: str, current: object) -> ConfigError:
    return ConfigError(f"--config.{key}={raw} is not {what}; pass a value like the field's default, {current!r}.")


def _check_sequence(key: str, current: tuple | list, raw: str) -> None:
    """A tuple field takes a Python literal tuple (or list) whose items are of the default's kind."""
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        raise _wrong(key, raw, "a tuple", current) from None
    misfit = _sequence_misfit(key, value, current)
    if misfit:
        raise _wrong(key, raw, misfit, current)


def _sequence_misfit(key: str, value: object, current: tuple | list) -> str | None:
    """What a tuple field expects where ``value`` does not fit it: a range is two ordered numbers, other
    tuples hold items of the default's kind; None where it fits."""
    if key in RANGES:
        fits = (isinstance(value, (tuple, list)) and len(value) == 2 and all(_kind(v) is float for v in value)
                and value[0] <= value[1])
        return None if fits else "a range (low, high) with low <= high"
    if not isinstance(value, (tuple, list)):
        return "a tuple"
    kinds = {_kind(v) for v in current}
    if len(kinds) == 1 and value and any(_kind(v) not in kinds for v in value):
        plural = {float: "numbers", str: "strings", tuple: "tuples", bool: "booleans"}.get(_kind(current[0]), "items")
        return f"a tuple of {plural}"
    return None


# Sizes and periods that must be 1 or more, and what to set instead. Below 1 each failed deep in
# the data pipeline or the loop with a traceback (negative dimensions, a batch of 0, a modulo by
# zero), most of them after the first checkpoint was written; eval_every=-1 evaluated every step.
COUNTS = {
    "data.image_size": ("the side the images are resized to", 256),
    "data.batch_size": ("the global batch", 32),
    "data.eval_batch_size": ("the evaluation's global batch", 32),
    "train.log_every": ("the steps between progress lines", 10),
    "train.eval_every": ("the steps between evaluations (num_train_steps evaluates once, at the end)", 200),
}


def check_counts(config: mlc.ConfigDict) -> None:
    """Refuse a size or period of :data:`COUNTS` below 1 (an integer: the config's kind check ran first)."""
    for key, (what, example) in COUNTS.items():
        section, name = key.split(".")
        node = config.get(section)
        value = node.get(name) if node is not None else None
        if isinstance(value, int) and value < 1:
            raise ConfigError(f"config.{key}={value} must be 1 or more; set it to {what}, such as "
                              f"--config.{key}={example}.")


def check_value(key: str, current: object, raw: str | None) -> None:
    """Refuse ``raw`` unless it parses as the kind (and, for tuples, the shape) of the field's default."""
    if raw is None or current is None:
        return
    if isinstance(current, (tuple, list)):
        _check_sequence(key, current, raw)
        return
    kind = type(current)
    if kind not in _KIND_NAMES or kind is str:
        return
    try:
        if kind is bool:
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError
        elif kind is int:
            int(raw)
        elif kind is float:
            float(raw)
    except ValueError:
        raise _wrong(key, raw, _KIND_NAMES[kind], current) from None


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


