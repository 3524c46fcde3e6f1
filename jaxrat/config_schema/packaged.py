"""The config files that ship with the package: their names, the file a ``--config`` path names, each
imported as a module (for ``get_config``, ``get_sweep``, ``VARIANTS``), and the list ``--help`` prints."""

from __future__ import annotations

import glob
import importlib.util
import os
from typing import Any

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
