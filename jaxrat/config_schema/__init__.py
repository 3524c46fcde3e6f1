"""What a config is and how one is read: the fields and defaults every task shares (``base.py``), the
one loader of ``path[:variant]`` config files and of a run's config.json (``loader.py``), the config
files that ship with the package (``packaged.py``), a value's check against its field's kind
(``kinds.py``), the check of the fields a task adds by the kinds the packaged configs give them
(``own_fields.py``), and a trained run's own config read back (``run_config.py``). The named configs
themselves are :mod:`jaxrat.configs`."""

from jaxrat.config_schema.base import base_config, default, field
from jaxrat.config_schema.loader import check_override_args, flatten, load_config
from jaxrat.config_schema.packaged import load_config_module
from jaxrat.config_schema.run_config import load_run_config

__all__ = ["base_config", "check_override_args", "default", "field", "flatten", "load_config", "load_config_module",
           "load_run_config"]
