"""Model registry.

Models are Flax NNX modules and know nothing about training. A model is registered under a
name and built from ``config.model`` (a ConfigDict whose ``name`` picks the factory and whose
other fields are passed as keyword arguments), plus the compute ``dtype`` and ``rngs``.

Contract for segmentation models: ``model(images)`` with ``images`` float of shape
(batch, height, width, channels) returns logits of shape (batch, height, width, num_classes)
at the input resolution. Models may switch dropout etc. via ``model.train()``/``model.eval()``.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

import jax.numpy as jnp
from flax import nnx

from jaxrat.errors import ConfigError

ModelFactory = Callable[..., nnx.Module]
_REGISTRY: dict[str, ModelFactory] = {}
# Modules imported lazily on first lookup so importing jaxrat.models stays cheap.
_BUILTIN_MODULES = ("jaxrat.models.unet", "jaxrat.models.rat_models", "jaxrat.models.classifier",
                    "jaxrat.models.detr")


def register(name: str) -> Callable[[ModelFactory], ModelFactory]:
    """Decorator registering a model factory under ``name``."""

    def deco(factory: ModelFactory) -> ModelFactory:
        if name in _REGISTRY and _REGISTRY[name] is not factory:
            raise ValueError(f"model {name!r} registered twice")
        _REGISTRY[name] = factory
        return factory

    return deco


def _load_builtins() -> None:
    for mod in _BUILTIN_MODULES:
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:  # a builtin module not written yet
            if e.name != mod:
                raise


def available_models() -> list[str]:
    """Names of all registered models."""
    _load_builtins()
    return sorted(_REGISTRY)


def build_model(model_config: Any, *, dtype: Any = jnp.float32, rngs: nnx.Rngs) -> nnx.Module:
    """Build the model named ``model_config.name`` with the remaining fields as kwargs."""
    _load_builtins()
    cfg = dict(model_config)
    name = cfg.pop("name", None)
    if name not in _REGISTRY:
        raise ConfigError(
            f"Unknown model {name!r} in config.model.name; choose one of {available_models()}."
        )
    try:
        return _REGISTRY[name](**cfg, dtype=dtype, rngs=rngs)
    except TypeError as e:
        if "unexpected keyword" in str(e):
            raise ConfigError(f"config.model has a field model {name!r} does not accept: {e}.") from None
        raise
