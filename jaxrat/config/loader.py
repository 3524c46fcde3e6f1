"""The one loader of config files (``path[:variant]``) and the check of command-line overrides."""

from __future__ import annotations

import difflib
import importlib.util
import os
from typing import Any

import ml_collections as mlc

from jaxrat.runtime.dotted import flatten
from jaxrat.runtime.errors import ConfigError


def load_config(spec: str) -> mlc.ConfigDict:
    """Load ``path[:variant]`` the way ml_collections' ``--config`` flag does: ``get_config(variant)``.

    A missing file or an unknown variant (the file's ``get_config`` raising ValueError) is a
    ConfigError naming it. Config files use it to build on each other (``isic_multiscale.py``
    loads ``isic.py``), and ``jaxrat.main`` checks a command line with it before ml_collections'
    flag (which applies the overrides) loads the same file.
    """
    path, _, variant = spec.partition(":")
    module = load_config_module(path)
    if not hasattr(module, "get_config"):
        raise ConfigError(f"Config file {path} defines no get_config(); see configs/isic.py for the shape of one.")
    try:
        return module.get_config(variant) if variant else module.get_config()
    except ValueError as e:
        raise ConfigError(str(e)) from None


def load_config_module(path: str) -> Any:
    """Import the config file at ``path`` as a module (for ``get_config``, ``get_sweep``)."""
    if not os.path.isfile(path):
        raise ConfigError(f"Config file {path} does not exist; pass e.g. --config configs/isic.py:demo.")
    name = "_jaxrat_config_" + os.path.splitext(os.path.basename(path))[0]
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


_KIND_NAMES = {bool: "true or false", int: "an integer", float: "a number"}


def _check_value(key: str, current: object, raw: str | None) -> None:
    if raw is None or current is None:
        return
    kind = type(current)
    if kind not in _KIND_NAMES:
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
        raise ConfigError(
            f"--config.{key}={raw} is not {_KIND_NAMES[kind]} (the field's default is {current!r}); "
            f"pass {_KIND_NAMES[kind]}."
        ) from None


def check_override_args(argv: list[str]) -> None:
    """Fail with one sentence on a missing config file, an unknown variant, an unknown
    ``--config.KEY`` or a value of the wrong type.

    ml_collections reports unknown keys with a KeyError traceback; we check first and name the
    closest existing key instead.
    """
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
        _check_value(key, flat[key], value)


