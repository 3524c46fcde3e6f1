"""Optimizer from config: AdamW, linear warmup + cosine decay, global-norm clipping."""

from __future__ import annotations

import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from jaxrat.config_schema import field
from jaxrat.optim.gpu_adamw import flatten
from jaxrat.runtime.errors import ConfigError
from jaxrat.runtime.tree_paths import path_name

ADAM_EPS = 1e-8  # optax's default, named because the fused update (trainer/fused_optimizer.py) needs it too


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


_BLOCK = re.compile(r"(?:^|/)blocks/(\d+)/")
_EMBEDDING = re.compile(r"(?:^|/)(?:patch_embed|cls_token|pos_embed)(?:/|$)")


def layer_scales(params: Any, decay: float) -> Any:
    """Per-parameter learning-rate factors of layer-wise decay (BEiT fine-tuning): ``decay ** (L + 1 - i)``
    for a parameter of transformer block ``i - 1`` (a path holding ``blocks/<i - 1>/``), ``i = 0``
    for the embeddings, ``i = L + 1`` (factor 1) for everything else (heads, decoders); ``L`` the
    number of blocks."""
    names = [path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    depth = 1 + max((int(m.group(1)) for n in names if (m := _BLOCK.search(n))), default=-1)

    def factor(path: tuple, _: Any) -> float:
        name = path_name(path)
        if (m := _BLOCK.search(name)) is not None:
            layer = int(m.group(1)) + 1
        elif _EMBEDDING.search(name):
            layer = 0
        else:
            layer = depth + 1
        return float(decay ** (depth + 1 - layer))

    return jax.tree_util.tree_map_with_path(factor, params)


def _scale_by_layer(decay: float) -> optax.GradientTransformation:
    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        scales = layer_scales(updates, decay)
        return jax.tree_util.tree_map(lambda u, f: u * jnp.asarray(f, u.dtype), updates, scales), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def global_norm(tree: Any, *, concatenate: bool) -> jax.Array:
    """The L2 norm of every leaf of ``tree`` together. ``concatenate``: as one float32 vector, one
    reduction for the whole tree (a model of ~190 parameter leaves otherwise runs ~190 reduction kernels
    on a GPU, a few microseconds each, and XLA fuses none of them). Only for unsharded leaves: under
    ZeRO-2/3 the concatenation would gather every gradient shard onto each device."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.zeros((), jnp.float32)
    if concatenate:  # the vector the fused AdamW reads its gradients from: XLA writes it once for both
        flat = flatten(leaves)
        return jnp.sqrt(jnp.sum(jnp.square(flat)))
    return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in leaves))


def clip_by_global_norm(max_norm: float, *, concatenate: bool) -> optax.GradientTransformation:
    """``optax.clip_by_global_norm`` with the norm of :func:`global_norm`: the same empty state (so the
    optimizer state's tree, and checkpoints, are unchanged) and the same rule, scaling the updates by
    ``max_norm / norm`` when the norm is not below ``max_norm``."""

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        norm = global_norm(updates, concatenate=concatenate)
        keep = norm < max_norm
        scaled = jax.tree_util.tree_map(lambda t: jax.lax.select(keep, t, t / norm.astype(t.dtype) * max_norm), updates)
        return scaled, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def make_optimizer(cfg: Any, num_steps: int, *, concatenate_norm: bool = False
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Return (transformation, schedule); see :func:`decay_mask` for which parameters decay.
    ``layer_decay`` in (0, 1) scales each update by :func:`layer_scales` (the learning rate and the
    decoupled weight decay of each layer, as BEiT's parameter groups do); 0 or 1: off.
    ``concatenate_norm``: clip by :func:`global_norm` over one concatenated vector (unsharded gradients)."""
    schedule = make_schedule(cfg, num_steps)
    exclude = str(field(cfg, "optimizer.weight_decay_exclude"))
    _exclude_rule(exclude)  # a bad regex fails now, not inside the first jit
    parts = []
    if cfg.clip_norm > 0:
        parts.append(clip_by_global_norm(cfg.clip_norm, concatenate=concatenate_norm))
    parts.append(optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=ADAM_EPS, weight_decay=cfg.weight_decay,
                             mask=lambda params: decay_mask(params, exclude)))
    layer_decay = float(field(cfg, "optimizer.layer_decay") or 0.0)
    if not 0.0 <= layer_decay <= 1.0:
        raise ConfigError(f"config.optimizer.layer_decay={layer_decay}; use 0 (off) or a factor in (0, 1] such as "
                          f"0.65.")
    if 0.0 < layer_decay < 1.0:
        parts.append(_scale_by_layer(layer_decay))
    return optax.chain(*parts), schedule



def ema_enabled(cfg: Any) -> bool:
    """Whether ``optimizer.ema_decay`` asks for an average of the parameters; a decay outside
    [0, 1) is a ConfigError."""
    decay = float(field(cfg, "optimizer.ema_decay") or 0.0)
    if not 0.0 <= decay < 1.0:
        raise ConfigError(f"config.optimizer.ema_decay={decay}; use 0 (off) or a decay in (0, 1) such as 0.999.")
    return decay > 0.0


def ema_schedule(cfg: Any) -> Callable[[jax.Array], jax.Array]:
    """``decay(step)``: the decay applied by update ``step + 1`` (``step`` counts updates already made).

    With ``ema_warmup`` it is ``min(ema_decay, (1 + t) / (10 + t))`` (the ``num_updates`` form of
    TensorFlow's ExponentialMovingAverage and timm's first ModelEma), so early updates weigh more.
    """
    value, warmup = float(cfg.ema_decay), bool(field(cfg, "optimizer.ema_warmup"))

    def decay_at(step: jax.Array) -> jax.Array:
        decay = jnp.asarray(value, jnp.float32)
        if not warmup:
            return decay
        t = step.astype(jnp.float32) + 1.0
        return jnp.minimum(decay, (1.0 + t) / (10.0 + t))

    return decay_at


def update_ema(ema: Any, params: Any, decay: jax.Array) -> Any:
    """``decay * ema + (1 - decay) * params``, leaf by leaf in each leaf's dtype."""
    return jax.tree_util.tree_map(lambda e, p: (decay * e + (1.0 - decay) * p).astype(e.dtype), ema, params)
