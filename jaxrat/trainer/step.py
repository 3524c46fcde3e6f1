"""The jitted train and eval steps.

The train step runs the task's loss on ``grad_accum_steps`` micro-batches (a scan, so memory is
that of one micro-batch), clips and applies AdamW, and leaves the state untouched when the loss or
the gradient norm is not finite (the host stops the run at its next check).

With ``train.reduction_shards = N`` the gradient of each micro-batch is instead the mean of N fixed
shards' gradients, added in one order on every topology (:mod:`jaxrat.trainer.fixed_shards`).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrat.parallel import sharding
from jaxrat.trainer.fixed_shards import FixedShardStep
from jaxrat.trainer.optimizer import global_norm
from jaxrat.trainer.param_cast import NARROW, cast_narrow_reads
from jaxrat.trainer.state import StateSpec

TASK_STREAM = 0x7A5C  # folded into a micro-batch's key for the task's own randomness


def split_microbatches(batch: Any, accum: int, mesh: jax.sharding.Mesh) -> Any:
    """``(B, ...)`` -> ``(accum, B // accum, ...)`` where micro-batch ``i`` holds rows ``i, i + accum, ...``.

    Strided rather than contiguous: each device's block of rows splits into its own share of every
    micro-batch, so no row changes device. (Contiguous micro-batch ``i`` would be rows that live on
    a fraction of the devices, and XLA would reshard the whole batch across devices and hosts.)
    """
    spec = NamedSharding(mesh, P(None, *sharding.batch_spec(mesh)))

    def one(x: jax.Array) -> jax.Array:
        x = x.reshape(x.shape[0] // accum, accum, *x.shape[1:])
        return jax.lax.with_sharding_constraint(jnp.swapaxes(x, 0, 1), spec)

    return jax.tree_util.tree_map(one, batch)


def _loss_fn(spec: StateSpec) -> Callable[[Any, Any, jax.Array], tuple[jax.Array, dict]]:
    """``loss(params, batch, rng) -> (loss, parts)``: the task's loss of the model in train mode."""

    def loss_of(params: Any, batch: Any, rng: jax.Array) -> tuple[jax.Array, dict]:
        # The model's streams keep the step's key itself, so dropout noise is what it always was.
        task_rng = jax.random.fold_in(rng, TASK_STREAM)
        return spec.task.loss(spec.model(params, rng, train=True), batch, task_rng)

    # Where the fused AdamW applies (gpu policy, replicated float32 parameters), the weights a narrow
    # step reads once, cast, are cast in one kernel up front rather than each in its own before its
    # matmul; in the fixed shards' programs too (the same values: their bits do not change).
    return cast_narrow_reads(loss_of) if spec.tx.fused and jnp.dtype(spec.dtype) in NARROW else loss_of


def _apply_fn(spec: StateSpec) -> Callable[[dict, Any, jax.Array, dict], tuple[dict, dict]]:
    """``apply(state, grads, loss, parts) -> (state, metrics)``: the optimizer's step (and the average's),
    taken only when the loss and the gradients' norm are finite."""

    def apply(state: dict, grads: Any, loss: jax.Array, parts: dict) -> tuple[dict, dict]:
        grads = jax.lax.with_sharding_constraint(grads, spec.grad_shardings)
        gnorm = global_norm(grads, concatenate=spec.concatenate_norm)
        ok = jnp.isfinite(loss) & jnp.isfinite(gnorm)
        # Named so that profiles can tell the optimizer's ops from the model's (benchmarks/step_profile.py);
        # the scope lives here because models know nothing of training. The finite-guard's selects
        # are in it: they rewrite every parameter and moment, as the update does.
        with jax.named_scope("optimizer"):
            params, opt_state = spec.tx.apply_gradients(grads, state["opt_state"], state["params"], ok, gnorm)
        new_state = {"step": state["step"] + 1, "params": params, "opt_state": opt_state, "rng": state["rng"]}
        if spec.ema:
            with jax.named_scope("ema"):
                decay = spec.ema_schedule(state["step"])
                new_state["ema_params"] = spec.tx.average(state["ema_params"], params, decay, ok)
        metrics = {"train/loss": loss, **{f"train/{k}": v for k, v in parts.items()},
                   "train/grad_norm": gnorm, "train/learning_rate": spec.schedule(state["step"]),
                   "train/nonfinite": jnp.logical_not(ok).astype(jnp.float32)}
        return new_state, metrics

    return apply


def accumulated_gradients(grad_fn: Callable, params: Any, batch: Any, rng: jax.Array, accum: int,
                          mesh: jax.sharding.Mesh) -> tuple[Any, jax.Array, dict]:
    """``(grads, loss, parts)`` of ``grad_fn`` (``value_and_grad`` of the loss, with aux) averaged over
    ``accum`` strided micro-batches (:func:`split_microbatches`) in a scan; micro-batch ``i`` draws
    from ``fold_in(rng, i)``. One micro-batch is the whole batch, with ``rng`` itself."""
    if accum == 1:
        (loss, parts), grads = grad_fn(params, batch, rng)
        return grads, loss, parts

    def body(carry: Any, xs: Any) -> tuple[Any, None]:
        mb, i = xs
        (loss_i, parts_i), g = grad_fn(params, mb, jax.random.fold_in(rng, i))
        return jax.tree_util.tree_map(jnp.add, carry, (g, loss_i, parts_i)), None

    micro = split_microbatches(batch, accum, mesh)
    shapes = jax.eval_shape(grad_fn, params, jax.tree_util.tree_map(lambda x: x[0], micro), rng)
    zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), (shapes[1], shapes[0][0], shapes[0][1]))
    (grads, loss, parts), _ = jax.lax.scan(body, zeros, (micro, jnp.arange(accum)))
    return jax.tree_util.tree_map(lambda x: x / accum, (grads, loss, parts))


def make_train_step(spec: StateSpec) -> Callable[[dict, dict], tuple[dict, dict]]:
    """``step(state, batch) -> (state, metrics)``, jitted with the state donated (under
    ``train.reduction_shards``, a :class:`FixedShardStep` whose programs are)."""
    loss_fn, apply = _loss_fn(spec), _apply_fn(spec)
    if spec.reduction_shards:
        return FixedShardStep(spec, loss_fn, apply)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    accum = spec.accum

    def step(state: dict, batch: dict) -> tuple[dict, dict]:
        rng = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"])
        grads, loss, parts = accumulated_gradients(grad_fn, state["params"], batch, rng, accum, spec.mesh)
        return apply(state, grads, loss, parts)

    rep = NamedSharding(spec.mesh, P())
    return OnMesh(jax.jit(step, in_shardings=(spec.state_shardings, spec.batch_sharding),
                          out_shardings=(spec.state_shardings, rep), donate_argnums=0), spec.mesh)


class OnMesh:
    """A jitted function traced, lowered and run with ``mesh`` as JAX's current mesh, so that code
    inside it (a task's loss) can ask for the mesh (``jax.sharding.get_abstract_mesh()``) instead of
    being handed it."""

    def __init__(self, fn: Any, mesh: jax.sharding.Mesh) -> None:
        self.fn, self.mesh = fn, mesh

    def __call__(self, *args: Any) -> Any:
        with jax.set_mesh(self.mesh):
            return self.fn(*args)

    def lower(self, *args: Any) -> Any:
        with jax.set_mesh(self.mesh):
            return self.fn.lower(*args)

    def trace(self, *args: Any) -> Any:
        with jax.set_mesh(self.mesh):
            return self.fn.trace(*args)


def make_eval_step(spec: StateSpec, wrap_model: Callable[[Any], Any] | None = None
                   ) -> Callable[[Any, dict], tuple[dict, Any]]:
    """``eval_step(params, batch) -> (sums, outputs)``: sums replicated, outputs batch-sharded.
    ``wrap_model(model)``: a callable the task's eval step calls instead of the model (test-time
    augmentation returns the logits of the views' averaged probabilities)."""

    def step(params: Any, batch: dict) -> tuple[dict, Any]:
        model = spec.model(params, jax.random.key(0), train=False)
        return spec.task.eval_step(wrap_model(model) if wrap_model else model, batch)

    # As the train step: on the gpu policy with the parameters replicated, a narrow step's weights read
    # once, cast, are cast in one kernel up front (each was a kernel of its own before its matmul).
    if spec.kernels.uses("cast") and not spec.state_sharded and jnp.dtype(spec.dtype) in NARROW:
        step = cast_narrow_reads(step)
    # One sharding stands for every leaf below it: all sums replicated, all outputs batch-sharded.
    rep = NamedSharding(spec.mesh, P())
    return jax.jit(step, in_shardings=(spec.state_shardings["params"], spec.batch_sharding),
                   out_shardings=(rep, spec.batch_sharding))
