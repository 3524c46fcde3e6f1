"""The train step under ``train.reduction_shards = N``: the same bits on any number of devices and hosts.

Under plain GSPMD the sums over the batch (each weight gradient's contraction, the loss's mean,
the all-reduce) are split as the batch is split, so their rounding changes with the device count,
and training amplifies one ulp into visibly different losses within tens of steps. Here every
(micro-)batch is cut into ``N`` fixed runs of consecutive rows, and each shard's gradient comes
from one single-device program, the same XLA program whatever the topology, run on the device that
holds the shard's rows. The per-shard results are then gathered and added in shard order by
explicit adds in a second, jitted program that also applies the optimizer.

Why not one jitted ``shard_map`` with a loop over each device's shards: XLA's CPU compiler fuses
and partitions a loop body in the context of the program around it, and a loop of 8 shards on one
device and of 1 shard on 8 devices measured different bits (docs/tasks.md). A single-device
program compiled on its own has no such context. The host dispatches ``N * grad_accum_steps``
shard programs a step; on an accelerator that costs a few hundred microseconds of dispatch.

The XLA CPU client also sizes its thread pool, and with it how elementwise kernels are partitioned,
from the device count: :func:`jaxrat.parallel.cpu_client.pin_cpu_parallelism` fixes it before JAX
creates the client (jaxrat.main calls it).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrat.parallel import sharding
from jaxrat.tasks.base import SHARD_TOTALS
from jaxrat.trainer.state import StateSpec

LossFn = Callable[[Any, Any, jax.Array], tuple[jax.Array, dict]]
Apply = Callable[[dict, Any, jax.Array, dict], tuple[dict, dict]]


class FixedShardStep:
    """``step(state, batch) -> (state, metrics)`` with fixed shards, see the module docstring.

    Shard ``j`` of micro-batch ``i`` is rows ``j*s:(j+1)*s`` of that micro-batch (micro-batches are
    strided as in :func:`jaxrat.trainer.step.split_microbatches`), with key ``fold_in(micro key, j)``;
    the loss is the mean over shards and micro-batches. What the task normalises over the whole
    micro-batch (:meth:`Task.batch_totals`) is summed first and handed to every shard divided by ``N``.
    """

    def __init__(self, spec: StateSpec, loss_of: LossFn, apply: Apply) -> None:
        self.spec, self.task = spec, spec.task
        self.shards, self.accum = spec.reduction_shards, spec.accum
        mesh = spec.mesh
        self.rows = NamedSharding(mesh, sharding.batch_spec(mesh))
        rep = NamedSharding(mesh, P())
        self._grad = jax.jit(jax.value_and_grad(loss_of, has_aux=True))
        self._prepare = jax.jit(self._prepare_fn, out_shardings=rep)
        self._apply = jax.jit(functools.partial(self._apply_fn, apply),
                              in_shardings=(spec.state_shardings, self.rows),
                              out_shardings=(spec.state_shardings, rep), donate_argnums=0)

    # ---- the two jitted programs around the shards

    def _prepare_fn(self, state: dict, batch: Any) -> tuple[Any, jax.Array, Any]:
        """Replicated params, the step's key, and each micro-batch's totals divided by ``N``."""
        rng = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"])
        micro = [jax.tree.map(lambda x: x[i::self.accum], batch) for i in range(self.accum)]
        totals = [{k: v / self.shards for k, v in self.task.batch_totals(m).items()} for m in micro]
        return state["params"], jax.random.key_data(rng), totals

    def _apply_fn(self, apply: Apply, state: dict, stacked: Any) -> tuple[dict, dict]:
        # (N, accum, ...) gathered on every device; explicit adds keep the order XLA must follow.
        stacked = jax.lax.with_sharding_constraint(stacked, NamedSharding(self.spec.mesh, P()))

        def in_order(x: jax.Array) -> jax.Array:
            micro = [functools.reduce(jnp.add, [x[j, i] for j in range(self.shards)]) / self.shards
                     for i in range(self.accum)]
            return functools.reduce(jnp.add, micro) / self.accum

        grads, loss, parts = jax.tree.map(in_order, stacked)
        return apply(state, grads, loss, parts)

    # ---- the step

    def __call__(self, state: dict, batch: Any) -> tuple[dict, dict]:
        params, key_data, totals = self._prepare(state, batch)
        leaves = jax.tree.leaves(batch)
        global_rows = leaves[0].shape[0]
        per_shard = global_rows // (self.accum * self.shards)
        stacked_shape = (self.shards, self.accum)
        mine: dict[Any, Any] = {}  # in the order make_array_from_single_device_arrays expects
        for device, index in self.rows.addressable_devices_indices_map(stacked_shape).items():
            rows = leaves[0].sharding.devices_indices_map(leaves[0].shape)[device][0]
            local = jax.tree.map(lambda x: _on(x, device), batch)
            p, k, t = (jax.tree.map(lambda x: _on(x, device), v) for v in (params, key_data, totals))
            rng = jax.random.wrap_key_data(k)
            first = index[0].start or 0
            out = []
            for j in range(first, index[0].stop if index[0].stop is not None else self.shards):
                row = j * per_shard * self.accum - (rows.start or 0)  # where shard j's rows start locally
                per_micro = []
                for i in range(self.accum):
                    one = jax.tree.map(lambda x: x[i::self.accum][row // self.accum:row // self.accum + per_shard],
                                       local)
                    if t[i]:
                        one = {**one, SHARD_TOTALS: t[i]}
                    micro_key = rng if self.accum == 1 else jax.random.fold_in(rng, i)
                    (loss, parts), g = self._grad(p, one, jax.random.fold_in(micro_key, j))
                    per_micro.append((g, loss, parts))
                out.append(jax.tree.map(lambda *xs: jnp.stack(xs), *per_micro))
            mine[device] = jax.tree.map(lambda *xs: jnp.stack(xs), *out)
        stacked = jax.tree.map(
            lambda *xs: jax.make_array_from_single_device_arrays(
                (self.shards, self.accum, *xs[0].shape[2:]), self.rows, list(xs)),
            *mine.values())
        with jax.set_mesh(self.spec.mesh):  # as the plain step's: kernels inside run per device (per_device)
            return self._apply(state, stacked)

    def lower(self, state: Any, batch: Any) -> "_Lowered":
        """For :func:`compiled_together` and automatic sizing: every program of the step, compiled
        on ``compile()``; its memory analysis is the shard program's."""
        return _Lowered(self, state, batch)


def _on(x: jax.Array, device: Any) -> jax.Array:
    """``device``'s own copy or block of ``x``."""
    for s in x.addressable_shards:
        if s.device == device:
            return s.data
    raise ValueError(f"no block of the array on {device}")


class _Lowered:
    def __init__(self, step: FixedShardStep, state: Any, batch: Any) -> None:
        self.step, self.state, self.batch = step, state, batch

    def compile(self) -> Any:
        step = self.step
        prep = step._prepare.lower(self.state, self.batch)
        params, key_data, totals = prep.out_info
        rows = jax.tree.leaves(self.batch)[0].shape[0] // (step.accum * step.shards)
        on = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])  # as the shard programs are called
        plain = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on)  # noqa: E731
        one = jax.tree.map(lambda x: plain(jax.ShapeDtypeStruct((rows, *x.shape[1:]), x.dtype)), self.batch)
        if totals[0]:
            one = {**one, SHARD_TOTALS: jax.tree.map(plain, totals[0])}
        key = jax.ShapeDtypeStruct(key_data.shape[:-1], jax.eval_shape(jax.random.wrap_key_data, plain(key_data)).dtype,
                                   sharding=on)
        grad = step._grad.lower(jax.tree.map(plain, params), one, key).compile()
        shapes = grad.out_info
        stacked = jax.tree.map(lambda s: jax.ShapeDtypeStruct((step.shards, step.accum, *s.shape), s.dtype,
                                                              sharding=step.rows),
                               (shapes[1], shapes[0][0], shapes[0][1]))
        prep.compile()
        with jax.set_mesh(step.spec.mesh):
            step._apply.lower(self.state, stacked).compile()
        return grad
