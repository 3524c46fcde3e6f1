"""Optimizer from config: AdamW, linear warmup + cosine decay, global-norm clipping."""

from __future__ import annotations

from typing import Any

import jax
import optax


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


def make_optimizer(cfg: Any, num_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Return (transformation, schedule). Weight decay skips biases and norm scales (ndim < 2)."""
    schedule = make_schedule(cfg, num_steps)
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)  # noqa: E731
    parts = []
    if cfg.clip_norm > 0:
        parts.append(optax.clip_by_global_norm(cfg.clip_norm))
    parts.append(
        optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=decay_mask)
    )
    return optax.chain(*parts), schedule
