"""Configs: the defaults every task shares, and the one loader of ``path[:variant]`` config files,
and a trained run's own config read back."""

from jaxrat.config.base import base_config
from jaxrat.config.loader import check_override_args, flatten, load_config, load_config_module
from jaxrat.config.run_config import load_run_config

__all__ = ["base_config", "check_override_args", "flatten", "load_config", "load_config_module", "load_run_config"]
