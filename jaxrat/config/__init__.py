"""Configs: the defaults every task shares, and the one loader of ``path[:variant]`` config files."""

from jaxrat.config.base import base_config
from jaxrat.config.loader import check_override_args, flatten, load_config, load_config_module

__all__ = ["base_config", "check_override_args", "flatten", "load_config", "load_config_module"]
