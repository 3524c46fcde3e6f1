"""The config files that ship with jaxrat: ``--config isic:demo`` names ``isic.py``'s ``demo`` variant
from any folder (:func:`jaxrat.config_schema.load_config`); a clone's ``configs/`` is this folder."""
