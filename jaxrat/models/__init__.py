"""Model registry.

Models are Flax NNX modules and know nothing about training, nor about the machine: they state the
math and call :mod:`jaxrat.ops` with the kernel policy they are built with. A model is registered
under a name and built from ``config.model`` (a ConfigDict whose ``name`` picks the factory and
whose other fields are passed as keyword arguments; ``kernels`` is the policy), plus the compute
``dtype`` and ``rngs``. The RAT models take the RAT whole as ``config.model.rat``.

Contract for segmentation models: ``model(images)`` with ``images`` float of shape
(batch, height, width, channels) returns logits of shape (batch, height, width, num_classes)
at the input resolution; ``model(images, all_levels=True)`` returns a list of logits, one per
level the model predicts (a multi-scale RAT: each pyramid level at its own size, finest first;
others: the one level). Models may switch dropout etc. via ``model.train()``/``model.eval()``.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

import jax.numpy as jnp
from flax import nnx

from jaxrat.runtime.errors import ConfigError

ModelFactory = Callable[..., nnx.Module]
_REGISTRY: dict[str, ModelFactory] = {}
# Modules imported lazily on first lookup so importing jaxrat.models stays cheap.
_BUILTIN_MODULES = ("jaxrat.models.unet", "jaxrat.models.rat.segmenter", "jaxrat.models.classifier",
                    "jaxrat.models.detr", "jaxrat.models.backbone_classifier", "jaxrat.models.transunet",
                    "jaxrat.models.swin_unet")


def register(name: str) -> Callable[[ModelFactory], ModelFactory]:
    """Decorator registering a model factory under ``name``."""

    def deco(factory: ModelFactory) -> ModelFactory:
        if name in _REGISTRY and _REGISTRY[name] is not factory:
            raise ValueError(f"model {name!r} registered twice")
        _REGISTRY[name] = factory
        return factory

    return deco


def _load_builtins() -> None:
    # Every builtin module exists: a renamed one fails here, loudly, instead of its models vanishing.
    for mod in _BUILTIN_MODULES:
        importlib.import_module(mod)


def available_models() -> list[str]:
    """Names of all registered models."""
    _load_builtins()
    return sorted(_REGISTRY)


def build_model(model_config: Any, *, dtype: Any = jnp.float32, rngs: nnx.Rngs, kernels: Any) -> nnx.Module:
    """Build the model named ``model_config.name`` with the remaining fields as kwargs.

    ``kernels``: the run's resolved :class:`jaxrat.ops.KernelPolicy` (``model_config.kernels`` is
    the name it was resolved from, once, by whoever builds the run). Every registered factory takes it.
    """
    from jaxrat import ops

    _load_builtins()
    cfg = dict(model_config)
    name = cfg.pop("name", None)
    cfg.pop("kernels", None)
    cfg.pop("gpu_forms", None)  # the policy's too, resolved with it
    policy = ops.policy.require(kernels)
    if name not in _REGISTRY:
        raise ConfigError(
            f"Unknown model {name!r} in config.model.name; choose one of {available_models()}."
        )
    try:
        return _REGISTRY[name](**cfg, dtype=dtype, rngs=rngs, kernels=policy)
    except TypeError as e:
        if "unexpected keyword" in str(e) and "'kernels'" in str(e):
            raise ConfigError(f"model {name!r} is registered with a factory that takes no kernels argument; "
                              f"add `kernels: jaxrat.ops.KernelPolicy` to it (it may ignore it).") from None
        if "unexpected keyword" in str(e):
            raise ConfigError(f"config.model has a field model {name!r} does not accept: {e}.") from None
        raise
