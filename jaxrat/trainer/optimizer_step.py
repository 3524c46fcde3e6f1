"""The optimizer as the train step applies it, in the form chosen once for the run.

:func:`optimizer_for` returns an :class:`Optimizer`: an optax transformation (``init`` and ``update``
are the chain of :func:`jaxrat.trainer.optimizer.make_optimizer`, so the optimizer state, and what a
checkpoint holds, is one pytree under every form) with the two calls the train step makes:
``apply_gradients`` (the parameters and optimizer state after the step) and ``average`` (the
parameters' moving average after it). Under the gpu policy with replicated float32 parameters both
are the fused kernels (:class:`jaxrat.trainer.fused_optimizer.FusedAdamW`); otherwise optax's update,
added leaf by leaf. Either way the finite guard is inside the call: a step whose loss or gradient
norm is not finite leaves the parameters, the state and the average as they were.

The fused update is not the transformation's ``update`` because optax returns updates that the caller
adds to the parameters, while the kernels write the new parameters and moments in place, the guard
included: handing back ``new - old`` to be added again would cost a subtraction and an addition per
element and change the rounding.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxrat.trainer.fused_optimizer import FusedAdamW, fused_adamw
from jaxrat.trainer.optimizer import update_ema

ApplyGradients = Callable[[Any, Any, Any, jax.Array, jax.Array], tuple[Any, Any]]
Average = Callable[[Any, Any, jax.Array, jax.Array], Any]


class Optimizer(NamedTuple):
    """An optax transformation (``init``, ``update``) with the train step's two calls.

    Attributes:
      init, update: the optax chain's (the optimizer state's pytree does not depend on the form).
      apply_gradients: ``(grads, opt_state, params, ok, norm) -> (params, opt_state)``, the step taken
        only where ``ok``; ``norm`` is the gradients' global norm (clipping).
      average: ``(averages, params, decay, ok) -> averages``, kept where not ``ok``.
      fused: whether the fused kernels take the step (the weights a narrow step reads are then cast up
        front too, :mod:`jaxrat.trainer.param_cast`).
    """

    init: optax.TransformInitFn
    update: optax.TransformUpdateFn
    apply_gradients: ApplyGradients
    average: Average
    fused: bool


def keep(ok: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where ``ok``, else ``old``, leaf by leaf (the step's finite guard)."""
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def _average_leaf_by_leaf(averages: Any, params: Any, decay: jax.Array, ok: jax.Array) -> Any:
    return keep(ok, update_ema(averages, params, decay), averages)


def optax_form(tx: optax.GradientTransformation) -> Optimizer:
    """The step as optax takes it: ``tx.update``, the updates added, the guard on both results."""

    def apply_gradients(grads: Any, opt_state: Any, params: Any, ok: jax.Array, norm: jax.Array) -> tuple[Any, Any]:
        updates, new_state = tx.update(grads, opt_state, params)
        return keep(ok, optax.apply_updates(params, updates), params), keep(ok, new_state, opt_state)

    return Optimizer(tx.init, tx.update, apply_gradients, _average_leaf_by_leaf, fused=False)


def fused_form(tx: optax.GradientTransformation, fused: FusedAdamW) -> Optimizer:
    """The step in a few kernels; the average too where the multi-tensor kernel takes it, else leaf by leaf."""

    def average(averages: Any, params: Any, decay: jax.Array, ok: jax.Array) -> Any:
        out = fused.ema(averages, params, decay, ok)
        return _average_leaf_by_leaf(averages, params, decay, ok) if out is None else out

    return Optimizer(tx.init, tx.update, fused.update, average, fused=True)


def optimizer_for(config: Any, kernels: Any, tx: optax.GradientTransformation, schedule: optax.Schedule,
                  abstract_state: dict) -> Optimizer:
    """The run's optimizer: fused where :func:`jaxrat.trainer.fused_optimizer.why_not` finds nothing
    against it, else optax's. ``tx`` and ``schedule``: :func:`make_optimizer`'s; ``abstract_state``:
    the state's shapes (as ``tx.init`` makes them)."""
    fused = fused_adamw(config, kernels, abstract_state, schedule)
    return optax_form(tx) if fused is None else fused_form(tx, fused)
