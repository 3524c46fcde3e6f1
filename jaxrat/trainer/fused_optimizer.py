"""The optimizer step of :func:`jaxrat.trainer.optimizer.make_optimizer` in a few GPU kernels.

Under the gpu kernel policy with replicated parameters and optimizer state (``sharding.zero = 0``, no
sharding rules) and float32 parameters, the train step updates every leaf with
:func:`jaxrat.optim.gpu_adamw.multi_tensor_adamw` instead of optax's leaf-by-leaf update: the same
arithmetic (clipping, Adam, masked decoupled weight decay, schedule, layer-wise factors, the finite
guard), the same optimizer state, read and written in optax's own structure, so checkpoints do not
change and a run may resume under either form. The parameters' moving average (``optimizer.ema_decay``)
is updated the same way, by :func:`jaxrat.optim.gpu_ema.multi_tensor_ema` (:meth:`FusedAdamW.ema`).
Which form a run takes is decided once, where its optimizer is built
(:func:`jaxrat.trainer.optimizer_step.optimizer_for`).
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax

from jaxrat.config_schema import field
from jaxrat.ops.per_device import replicated
from jaxrat.optim import gpu_adamw as adamw
from jaxrat.optim import gpu_ema as ema
from jaxrat.trainer.optimizer import ADAM_EPS, decay_mask, layer_scales

_STATES = (optax.ScaleByAdamState, optax.ScaleByScheduleState)


def _is_state(x: Any) -> bool:
    return isinstance(x, _STATES)


def _states(opt_state: Any) -> list:
    """The chain's Adam and schedule states, in the order they come."""
    return [x for x in jax.tree.leaves(opt_state, is_leaf=_is_state) if _is_state(x)]


def _adam_and_schedule(opt_state: Any) -> tuple[optax.ScaleByAdamState, optax.ScaleByScheduleState]:
    states = _states(opt_state)
    return (next(x for x in states if isinstance(x, optax.ScaleByAdamState)),
            next(x for x in states if isinstance(x, optax.ScaleByScheduleState)))


class FusedAdamW:
    """``update(grads, opt_state, params, ok, norm) -> (params, opt_state)`` with the step applied only
    where ``ok``; built by :func:`fused_adamw`."""

    def __init__(self, cfg: Any, schedule: optax.Schedule, *, interpret: bool = False,
                 fused_ema: bool = True) -> None:
        self.cfg, self.schedule, self.interpret, self.fused_ema = cfg, schedule, interpret, fused_ema
        self.hyper = adamw.Hyper(b1=float(cfg.b1), b2=float(cfg.b2), eps=ADAM_EPS, eps_root=0.0,
                                 weight_decay=float(cfg.weight_decay), clip=cfg.clip_norm > 0)

    def update(self, grads: Any, opt_state: Any, params: Any, ok: jax.Array, norm: jax.Array) -> tuple[Any, Any]:
        """The new parameters and optimizer state; ``norm`` is the gradients' global norm (clipping)."""
        adam, sched = _adam_and_schedule(opt_state)
        leaves, treedef = jax.tree.flatten(params)
        decays = jax.tree.leaves(decay_mask(params, str(field(self.cfg, "optimizer.weight_decay_exclude"))))
        layer_decay = float(field(self.cfg, "optimizer.layer_decay") or 0.0)
        scales = (jax.tree.leaves(layer_scales(params, layer_decay)) if 0.0 < layer_decay < 1.0
                  else [1.0] * len(leaves))
        count_inc = optax.safe_increment(adam.count)
        s = adamw.scalars(count_inc=count_inc, step_size=-1 * self.schedule(sched.count), ok=ok, hyper=self.hyper,
                          norm=norm, max_norm=float(self.cfg.clip_norm))

        def run(s: jax.Array, g: jax.Array, p: list, mu: list, nu: list) -> tuple[list, list, list]:
            return adamw.multi_tensor_adamw(p, g, mu, nu, s, self.hyper, decays, scales, interpret=self.interpret)

        # the gradients as the one float32 vector the step's global norm concatenates too (XLA writes it once)
        new_p, new_mu, new_nu = replicated(run, s, adamw.flatten(jax.tree.leaves(grads)), leaves,
                                           jax.tree.leaves(adam.mu), jax.tree.leaves(adam.nu))
        bump = lambda old: jnp.where(ok, optax.safe_increment(old), old)
        unflat = lambda xs: jax.tree.unflatten(treedef, xs)

        def swap(x: Any) -> Any:
            if isinstance(x, optax.ScaleByAdamState):
                return optax.ScaleByAdamState(count=bump(x.count), mu=unflat(new_mu), nu=unflat(new_nu))
            if isinstance(x, optax.ScaleByScheduleState):
                return optax.ScaleByScheduleState(count=bump(x.count))
            return x

        return unflat(new_p), jax.tree.map(swap, opt_state, is_leaf=_is_state)

    def ema(self, averages: Any, params: Any, decay: jax.Array, ok: jax.Array) -> Optional[Any]:
        """The averages after the step (kept where not ``ok``) in a few kernels, or None where the
        multi-tensor kernel does not take them (then the step averages leaf by leaf)."""
        if not self.fused_ema:  # the policy holds the "ema" form back
            return None
        a_leaves, treedef = jax.tree.flatten(averages)
        p_leaves = jax.tree.leaves(params)
        if jax.tree.structure(params) != treedef or ema.supports(a_leaves, p_leaves) is not None:
            return None

        def run(decay: jax.Array, ok: jax.Array, a: list, p: list) -> list:
            return ema.multi_tensor_ema(a, p, decay, ok, interpret=self.interpret)

        return jax.tree.unflatten(treedef, replicated(run, decay, ok, a_leaves, p_leaves))


def why_not(config: Any, kernels: Any, abstract_state: dict) -> Optional[str]:
    """Why the fused update does not apply to this run (one sentence), or None when it does."""
    if not kernels.gpu:
        return f"the kernel policy is {kernels.form}, not gpu"
    if not kernels.uses("adamw"):
        return "the gpu policy holds the fused AdamW form back (model.gpu_forms)"
    if config.sharding.zero != 0 or config.sharding.get("rules"):
        return "the optimizer state is sharded (sharding.zero > 0 or sharding rules)"
    if sorted(type(x).__name__ for x in _states(abstract_state["opt_state"])) != ["ScaleByAdamState",
                                                                                   "ScaleByScheduleState"]:
        return "the optimizer is not the AdamW chain the fused update knows"
    adam, _ = _adam_and_schedule(abstract_state["opt_state"])
    params = jax.tree.leaves(abstract_state["params"])
    if not params or jax.tree.structure(adam.mu) != jax.tree.structure(abstract_state["params"]):
        return "the moments do not mirror the parameters"
    return adamw.supports(params, jax.tree.leaves(adam.mu) + jax.tree.leaves(adam.nu))


def fused_adamw(config: Any, kernels: Any, abstract_state: dict, schedule: optax.Schedule, *,
                interpret: bool = False) -> Optional[FusedAdamW]:
    """A :class:`FusedAdamW` for this run, or None where :func:`why_not` says it does not apply."""
    if why_not(config, kernels, abstract_state) is not None:
        return None
    return FusedAdamW(config.optimizer, schedule, interpret=interpret, fused_ema=kernels.uses("ema"))
