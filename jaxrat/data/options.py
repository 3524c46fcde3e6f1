"""From a ``config.data`` section to the keyword arguments of the pipeline's iterators."""

from __future__ import annotations

from typing import Any

from jaxrat.data import transforms as T
from jaxrat.data.augmentation import augment_ops
from jaxrat.runtime.errors import ConfigError

# The one place the pipeline's defaults are written, for config sections that lack a field (configs
# written before it existed, tasks with their own data sections); base_config sets the same values.
DEFAULTS: dict[str, Any] = {
    "num_workers": -1, "worker_ram_budget_gb": 0.0, "num_threads": 2, "prefetch_buffer": 4,
    "random_flip": True, "keep_aspect_ratio": False, "scale_jitter": (1.0, 1.0), "color_jitter": 0.0,
    "eval_spacing": 1.0,
}


def option(data_cfg: Any, name: str) -> Any:
    """``config.data.<name>``, or the pipeline's default for it (:data:`DEFAULTS`)."""
    return _cfg(data_cfg, name, DEFAULTS.get(name))


def _cfg(data_cfg: Any, name: str, default: Any) -> Any:
    return data_cfg.get(name, default) if hasattr(data_cfg, "get") else getattr(data_cfg, name, default)


def loader_options(data_cfg: Any) -> dict[str, Any]:
    """The reading keyword arguments of :func:`~jaxrat.data.pipeline.train_iterator` (workers, threads,
    prefetch): every task's training stream takes them from ``config.data`` alike."""
    return {"num_workers": option(data_cfg, "num_workers"),
            "worker_ram_budget_gb": option(data_cfg, "worker_ram_budget_gb"),
            "num_threads": option(data_cfg, "num_threads"), "prefetch": option(data_cfg, "prefetch_buffer")}


def train_options(data_cfg: Any) -> dict[str, Any]:
    """Keyword arguments of :func:`train_iterator` from a ``config.data`` section."""
    keys = ("random_flip", "keep_aspect_ratio", "random_crop_scale", "scale_jitter", "rotation_degrees",
            "color_jitter", "elastic_prob", "elastic_alpha", "elastic_sigma")
    kw = {k: _cfg(data_cfg, k, None) for k in keys}
    ops = augment_ops(data_cfg.image_size, **{k: v for k, v in kw.items() if v is not None}, train=True)
    return {"ops": ops, **loader_options(data_cfg)}


def eval_options(data_cfg: Any) -> dict[str, Any]:
    """Keyword arguments of :func:`eval_batches` from a ``config.data`` section."""
    ops = augment_ops(data_cfg.image_size, keep_aspect_ratio=option(data_cfg, "keep_aspect_ratio"), train=False)
    coarsen = eval_coarsen(data_cfg)
    if coarsen:
        ops.insert(-1, coarsen)  # after the resize, before Normalize
    return {"ops": ops, "num_threads": option(data_cfg, "num_threads")}


def eval_coarsen(data_cfg: Any) -> T.Coarsen | None:
    """The :class:`~jaxrat.data.transforms.Coarsen` op for ``data.eval_spacing`` (None at 1)."""
    spacing = float(option(data_cfg, "eval_spacing"))
    if spacing < 1:
        raise ConfigError(f"config.data.eval_spacing={spacing}; use 1 (the input as it is) or more (coarser detail).")
    return T.Coarsen(spacing) if spacing != 1 else None
