"""Optimizer from config: AdamW, linear warmup + cosine decay, global-norm clipping."""

from __future__ import annotations

import re
from typing import Any

import jax
import optax

from jaxrat.errors import ConfigError
from jaxrat.tree_paths import path_name


def make_schedule(cfg: Any, num_steps: int) -> optax.Schedule:
    """Warmup from 0 to ``learning_rate``, then cosine to ``learning_rate * end_learning_rate_factor``."""
    warmup = min(int(cfg.warmup_steps), max(num_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.learning_rate,
        warmup_steps=warmup,
        decay_steps=max(num_steps, warmup + 1),
        end_value=cfg.learning_rate * cfg.end_learning_rate_factor,
    )


def _exclude_rule(exclude: str) -> re.Pattern | None:
    try:
        return re.compile(exclude) if exclude else None
    except re.error as e:
        raise ConfigError(f"config.optimizer.weight_decay_exclude={exclude!r} is not a valid regex ({e}); "
                          f"fix the pattern.") from None


def decay_mask(params: Any, exclude: str) -> Any:
    """True for parameters that get weight decay: at least 2 dimensions and a path not matching
    ``exclude`` (biases, norm scales, position tables and rotary frequencies by default).

    Decaying a position table or a frequency pulls it towards zero, i.e. towards "no position",
    which is a prior nobody asked for; those are learned like biases.
    """
    rule = _exclude_rule(exclude)
    return jax.tree_util.tree_map_with_path(
        lambda path, p: p.ndim > 1 and not (rule and rule.search(path_name(path))), params)


def make_optimizer(cfg: Any, num_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Return (transformation, schedule); see :func:`decay_mask` for which parameters decay."""
    schedule = make_schedule(cfg, num_steps)
    exclude = str(cfg.get("weight_decay_exclude", ""))
    _exclude_rule(exclude)  # a bad regex fails now, not inside the first jit
    parts = []
    if cfg.clip_norm > 0:
        parts.append(optax.clip_by_global_norm(cfg.clip_norm))
    parts.append(optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay,
                             mask=lambda params: decay_mask(params, exclude)))
    return optax.chain(*parts), schedule

