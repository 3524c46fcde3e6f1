"""The training loop: sharded state creation, one jitted step, periodic eval, checkpoints, logs.

Sections: world -> data -> model and state -> step functions -> restore -> loop.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import ml_collections as mlc
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrat.parallel import sharding
from jaxrat.checkpointing import Checkpointer, Policy, SaveSchedule, load_init
from jaxrat.cluster.preemption import PreemptionWatch
from jaxrat.data import datasets, pipeline
from jaxrat.errors import ConfigError, UserError
from jaxrat.input_feed import DeviceFeed
from jaxrat.parallel.mesh import make_mesh, processes_on_this_host
from jaxrat.models import build_model
from jaxrat.optim import make_optimizer
from jaxrat.tasks import segmentation
from jaxrat.writers import MetricWriter, format_progress

# Exit status after a preemption checkpoint: job scripts requeue on it.
PREEMPTED_EXIT_CODE = 42


class TrainingDiverged(UserError):
    """The loss became NaN or Inf."""


class Preempted(Exception):
    """A preemption signal arrived; a checkpoint was written and the run should exit for requeue."""


# ----------------------------------------------------------------------------------------- world

def check_batch_sizes(config: mlc.ConfigDict, num_devices: int, num_processes: int) -> None:
    """Raise ConfigError unless the global batches split evenly over steps, devices and hosts."""
    gb, accum, eb = config.data.batch_size, config.optimizer.grad_accum_steps, config.data.eval_batch_size
    if accum < 1 or gb % accum:
        raise ConfigError(
            f"config.data.batch_size={gb} does not divide by config.optimizer.grad_accum_steps={accum}; "
            f"make the batch a multiple of the accumulation steps."
        )
    if (gb // accum) % num_devices:
        raise ConfigError(
            f"The micro-batch of {gb // accum} (config.data.batch_size={gb} / grad_accum_steps={accum}) "
            f"does not divide over {num_devices} devices; use a batch size that is a multiple of "
            f"{num_devices * accum}."
        )
    if eb % num_devices or eb % num_processes:
        raise ConfigError(
            f"config.data.eval_batch_size={eb} does not divide over {num_devices} devices; use a "
            f"multiple of {num_devices}."
        )


# ------------------------------------------------------------------------------------------ data

def resolve_data(config: mlc.ConfigDict, workdir: str) -> tuple[pipeline.SegmentationData, pipeline.SegmentationData]:
    """(train, validation) data; writes the synthetic dataset or stages to local disk first when asked."""
    if tuple(config.data.get("pyramid_scales", ())):
        # The levels would be decoded, copied to the devices and never read: refuse a switch that
        # does nothing rather than pay for it silently.
        raise ConfigError(
            f"config.data.pyramid_scales={tuple(config.data.pyramid_scales)} builds input-pipeline pyramid levels "
            f"that the segmentation models do not read; for multi-scale RAT set config.model.scales instead "
            f"(configs/isic_multiscale.py), which builds the pyramid and its spacing on the devices."
        )
    return datasets.resolve_segmentation(config.data, workdir, seed=config.seed, process_index=jax.process_index())


def to_global(batch: dict[str, np.ndarray], spec: NamedSharding) -> dict[str, jax.Array]:
    """Assemble per-host numpy batches into global arrays sharded over the batch axes."""
    return {k: jax.make_array_from_process_local_data(spec, np.asarray(v)) for k, v in batch.items()}


# ------------------------------------------------------------------------------ model and state

def _is_key(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def fresh_rest(abstract_rest: Any, rng: jax.Array) -> Any:
    """Concrete non-parameter model state (dropout RNG streams) derived from ``rng``.

    Rebuilt every step from the step's key rather than carried in the train state, so the
    checkpoint holds only plain arrays and dropout noise depends only on (seed, step).
    """
    leaves, treedef = jax.tree.flatten(abstract_rest)
    out = []
    for i, x in enumerate(leaves):
        if _is_key(x):
            out.append(jnp.broadcast_to(jax.random.fold_in(rng, i), x.shape))
        else:
            out.append(jnp.zeros(x.shape, x.dtype))
    return jax.tree.unflatten(treedef, out)


class Setup:
    """Everything derived from the config that the step functions close over."""

    def __init__(self, config: mlc.ConfigDict, mesh: jax.sharding.Mesh):
        self.config = config
        self.mesh = mesh
        dtypes = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
        if config.train.compute_dtype not in dtypes:
            raise ConfigError(
                f"config.train.compute_dtype={config.train.compute_dtype!r}; use 'float32' or 'bfloat16'."
            )
        self.dtype = dtypes[config.train.compute_dtype]
        self.tx, self.schedule = make_optimizer(config.optimizer, config.num_train_steps)

        abstract_model = nnx.eval_shape(self._make_model_for_split)
        model = abstract_model
        model.train()
        self.train_graphdef, abs_params, self.abstract_rest = nnx.split(model, nnx.Param, ...)
        model.eval()
        self.eval_graphdef, _, _ = nnx.split(model, nnx.Param, ...)
        self.abstract_rest = nnx.to_pure_dict(self.abstract_rest)
        for path, leaf in jax.tree_util.tree_flatten_with_path(self.abstract_rest)[0]:
            if not _is_key(leaf) and "count" not in jax.tree_util.keystr(path):
                raise ConfigError(
                    f"Model state {jax.tree_util.keystr(path)} is neither a parameter nor an RNG stream; "
                    f"jaxrat models must not keep mutable statistics (use GroupNorm/LayerNorm)."
                )

        self.abstract_state = jax.eval_shape(self.init_state, jax.random.key_data(jax.random.key(0)))
        zero, sc = config.sharding.zero, config.sharding
        if zero not in (0, 1, 2, 3):
            raise ConfigError(f"config.sharding.zero={zero}; use 0, 1, 2 or 3.")
        shard = lambda tree, on: sharding.tree_shardings(
            tree, mesh, shard=on, axis=sc.axis, min_size=sc.min_size, rules=sc.rules)  # noqa: E731
        rep = NamedSharding(mesh, P())
        self.state_shardings = {
            "step": rep,
            "rng": rep,
            "params": shard(self.abstract_state["params"], zero >= 3),
            "opt_state": shard(self.abstract_state["opt_state"], zero >= 1),
        }
        self.grad_shardings = shard(self.abstract_state["params"], zero >= 2)
        self.batch_sharding = NamedSharding(mesh, sharding.batch_spec(mesh))
        sharding.log_shardings(self.abstract_state["params"], self.state_shardings["params"], "params")
        sharding.log_shardings(self.abstract_state["opt_state"], self.state_shardings["opt_state"], "opt_state")

    def _make_model_for_split(self) -> nnx.Module:
        return build_model(self.config.model, dtype=self.dtype, rngs=nnx.Rngs(0))

    def init_state(self, rng_data: jax.Array) -> dict[str, Any]:
        """Fresh train state; jitted with out_shardings so it is born sharded."""
        key = jax.random.wrap_key_data(rng_data)
        model = build_model(self.config.model, dtype=self.dtype, rngs=nnx.Rngs(params=jax.random.fold_in(key, 0), default=jax.random.fold_in(key, 1)))
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        return {
            "step": jnp.zeros((), jnp.int32),
            "params": params,
            "opt_state": self.tx.init(params),
            "rng": jax.random.key_data(jax.random.fold_in(key, 2)),
        }

    def abstract_with_shardings(self) -> Any:
        """The state's shapes carrying the current mesh's shardings (restore target)."""
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            self.abstract_state,
            self.state_shardings,
        )


# ------------------------------------------------------------------------------ step functions

def make_train_step(s: Setup):
    """The jitted train step: micro-batch accumulation, clipping, AdamW, non-finite guard."""
    cfg = s.config
    accum = cfg.optimizer.grad_accum_steps
    micro_spec = NamedSharding(s.mesh, P(None, *sharding.batch_spec(s.mesh)))

    def loss_of(params, mb, rng):
        model = nnx.merge(s.train_graphdef, params, fresh_rest(s.abstract_rest, rng))
        logits = model(mb["image"])
        return segmentation.loss_fn(
            logits, mb["mask"], bce_weight=cfg.task.bce_weight, dice_weight=cfg.task.dice_weight
        )

    grad_fn = jax.value_and_grad(loss_of, has_aux=True)

    def step(state, batch):
        params = state["params"]
        rng = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"])
        if accum == 1:
            (loss, parts), grads = grad_fn(params, batch, rng)
        else:
            micro = jax.tree.map(lambda x: x.reshape(accum, -1, *x.shape[1:]), batch)
            micro = jax.lax.with_sharding_constraint(micro, jax.tree.map(lambda _: micro_spec, micro))

            def body(carry, xs):
                g_sum, l_sum, p_sum = carry
                mb, i = xs
                (l, p), g = grad_fn(params, mb, jax.random.fold_in(rng, i))
                return (jax.tree.map(jnp.add, g_sum, g), l_sum + l, jax.tree.map(jnp.add, p_sum, p)), None

            zeros = jax.tree.map(jnp.zeros_like, params)
            init = (zeros, jnp.zeros(()), {"bce": jnp.zeros(()), "dice_loss": jnp.zeros(())})
            (grads, loss, parts), _ = jax.lax.scan(body, init, (micro, jnp.arange(accum)))
            grads = jax.tree.map(lambda g: g / accum, grads)
            loss, parts = loss / accum, jax.tree.map(lambda p: p / accum, parts)
        grads = jax.lax.with_sharding_constraint(grads, s.grad_shardings)
        gnorm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
        ok = jnp.isfinite(loss) & jnp.isfinite(gnorm)
        updates, opt_state = s.tx.update(grads, state["opt_state"], params)
        new_params = jax.tree.map(lambda p, u: p + u, params, updates)
        # A non-finite step leaves the state untouched; the host stops the run at its next check.
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)  # noqa: E731
        new_state = {
            "step": state["step"] + 1,
            "params": keep(new_params, params),
            "opt_state": keep(opt_state, state["opt_state"]),
            "rng": state["rng"],
        }
        metrics = {
            "train/loss": loss,
            "train/bce": parts["bce"],
            "train/dice_loss": parts["dice_loss"],
            "train/grad_norm": gnorm,
            "train/learning_rate": s.schedule(state["step"]),
            "train/nonfinite": jnp.logical_not(ok).astype(jnp.float32),
            # Exact in float32 (a sum of 0/1 pixels): a fingerprint of which examples a step saw.
            "train/foreground_fraction": jnp.mean(batch["mask"]),
        }
        return new_state, metrics

    rep = NamedSharding(s.mesh, P())
    return jax.jit(
        step,
        in_shardings=(s.state_shardings, s.batch_sharding),
        out_shardings=(s.state_shardings, rep),
        donate_argnums=0,
    )


def make_eval_step(s: Setup):
    """Jitted eval step returning metric sums (already reduced over devices and hosts) and probs."""
    cfg = s.config

    def step(params, batch):
        model = nnx.merge(s.eval_graphdef, params, fresh_rest(s.abstract_rest, jax.random.key(0)))
        logits = model(batch["image"])
        sums = segmentation.eval_sums(
            logits, batch["mask"], batch["valid"], threshold=cfg.task.threshold,
            bce_weight=cfg.task.bce_weight, dice_weight=cfg.task.dice_weight,
        )
        return sums, jax.nn.sigmoid(logits)

    rep = NamedSharding(s.mesh, P())
    return jax.jit(
        step, in_shardings=(s.state_shardings["params"], s.batch_sharding), out_shardings=(rep, s.batch_sharding)
    )


def evaluate(
    s: Setup, eval_step, params, val_pairs, interrupt: Callable[[], bool] | None = None
) -> tuple[dict[str, float], dict[str, np.ndarray]] | None:
    """Metrics over the whole validation set and a few images (input, mask, prediction) to log.

    ``interrupt`` is asked before every batch (in every process alike); when it says yes the
    evaluation stops and None is returned, so a preemption notice is honoured mid-evaluation.
    """
    cfg = s.config
    totals = None
    images: dict[str, np.ndarray] = {}
    for batch in pipeline.eval_batches(
        val_pairs, image_size=cfg.data.image_size, global_batch=cfg.data.eval_batch_size,
        process_index=jax.process_index(), process_count=jax.process_count(), **pipeline.eval_options(cfg.data),
    ):
        if interrupt is not None and interrupt():
            return None
        sums, probs = eval_step(params, to_global(batch, s.batch_sharding))
        totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
        if not images and cfg.train.log_images:
            n = min(4, batch["image"].shape[0])
            local = np.asarray(probs.addressable_shards[0].data)[:n]
            img = batch["image"][:n] * pipeline.IMAGENET_STD + pipeline.IMAGENET_MEAN
            images = {
                "eval/input": img / 255.0,
                "eval/mask": np.repeat(batch["mask"][:n], 3, -1),
                "eval/prediction": np.repeat(local[:n], 3, -1),
            }
    return segmentation.finalize_metrics(jax.device_get(totals)), images


# ----------------------------------------------------------------------------------------- loop

def _save_config(config: mlc.ConfigDict, workdir: str) -> None:
    path = os.path.join(workdir, "config.json")
    with open(path + ".tmp", "w") as f:
        f.write(config.to_json_best_effort(indent=2, sort_keys=True))
    os.replace(path + ".tmp", path)


def train_and_evaluate(config: mlc.ConfigDict, workdir: str) -> dict[str, float]:
    """Train (resuming from ``workdir`` if it holds checkpoints) and return the last eval metrics."""
    workdir = os.path.abspath(workdir)
    os.makedirs(workdir, exist_ok=True)
    is_main = jax.process_index() == 0
    mesh = make_mesh(config.mesh.axes)
    check_batch_sizes(config, mesh.size, jax.process_count())
    if config.data.device_prefetch < 0:
        raise ConfigError(f"config.data.device_prefetch={config.data.device_prefetch}; "
                          "use 0 (off) or the number of batches to keep on the devices ahead.")
    logging.info("mesh %s over %d devices in %d processes", dict(mesh.shape), mesh.size, jax.process_count())
    if is_main:
        _save_config(config, workdir)

    train_pairs, val_pairs = resolve_data(config, workdir)
    logging.info("data: %d train and %d validation images", len(train_pairs), len(val_pairs))
    gb = config.data.batch_size
    local_batch = gb // jax.process_count()

    # Auto worker counts share the machine's cores among its training processes.
    on_host = processes_on_this_host() if config.data.num_workers == -1 else 1

    def train_iter(start_example: int):
        return pipeline.train_iterator(
            train_pairs, image_size=config.data.image_size, local_batch=local_batch, seed=config.seed,
            process_index=jax.process_index(), process_count=jax.process_count(),
            start_example=start_example, processes_on_host=on_host, **pipeline.train_options(config.data),
        )

    s = Setup(config, mesh)
    train_step = make_train_step(s)
    eval_step = make_eval_step(s)
    policy = Policy.from_config(config.checkpoint)
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), policy)

    latest = ckpt.latest_step()
    eval_pending = False  # the run stopped inside this step's evaluation: redo it first
    if latest is not None:
        data_it = train_iter(0)
        state, data_ok = ckpt.restore(latest, s.abstract_with_shardings(), data_it)
        if not data_ok:  # saved by another process count: the position follows from the step
            data_it = train_iter(latest * gb)
        eval_pending = bool(ckpt.step_metadata(latest).get("eval_pending"))
        logging.info("resumed from step %d (%s)", latest, "iterator state" if data_ok else "position from step")
        if config.init_from:
            logging.info("init_from=%s ignored: this workdir already has checkpoints", config.init_from)
    else:
        loaded: dict[str, Any] = {}
        if config.init_from:  # read first: a mismatching checkpoint fails before anything compiles
            loaded = load_init(
                config.init_from, s.abstract_with_shardings(), optimizer=config.checkpoint.init_optimizer
            )
        init = jax.jit(s.init_state, out_shardings=s.state_shardings)
        state = {**init(jax.random.key_data(jax.random.key(config.seed))), **loaded}
        data_it = train_iter(0)
    start = int(jax.device_get(state["step"]))

    writer = MetricWriter(workdir, is_main=is_main)
    total = config.num_train_steps
    last_eval: dict[str, float] = {}
    pending: list[tuple[int, dict]] = []
    t_start, t_last, steps_since = time.perf_counter(), time.perf_counter(), 0
    data_wait = 0.0  # seconds the devices sat idle waiting for the input pipeline since the last log
    last_output: jax.Array | None = None  # of the last dispatched step: ready once the devices are idle

    def flush_train_metrics(step: int) -> None:
        nonlocal t_last, steps_since, data_wait
        fetched = jax.device_get([m for _, m in pending])
        bad = [st for (st, _), m in zip(pending, fetched) if m["train/nonfinite"] > 0]
        if bad:
            ckpt.wait()
            kept = ckpt.latest_step()
            raise TrainingDiverged(
                f"Loss became NaN/Inf at step {bad[0]}; the run stopped without applying that update and "
                f"the last good checkpoint (step {kept}) is kept in {ckpt.directory}; lower "
                f"--config.optimizer.learning_rate or set --config.optimizer.clip_norm and resume."
            )
        now = time.perf_counter()
        scalars = {k: float(np.mean([m[k] for m in fetched])) for k in fetched[-1] if k != "train/nonfinite"}
        scalars["train/learning_rate"] = float(fetched[-1]["train/learning_rate"])
        scalars["train/steps_per_sec"] = steps_since / max(now - t_last, 1e-9)
        scalars["train/images_per_sec"] = scalars["train/steps_per_sec"] * gb
        scalars["train/data_wait_fraction"] = data_wait / max(now - t_last, 1e-9)
        writer.write_scalars(step, scalars)
        if is_main:
            logging.info("%s", format_progress(step, total, scalars, now - t_start, step - start))
        pending.clear()
        t_last, steps_since, data_wait = now, 0, 0.0

    watch = PreemptionWatch()
    schedule = SaveSchedule(policy, total)

    def save(step: int, reason: str, metrics: dict[str, float] | None = None, eval_pending: bool = False) -> None:
        blocked = ckpt.save(step, state, feed.consumed_state(), reason=reason, metrics=metrics,
                            eval_pending=eval_pending)
        schedule.saved()
        if blocked is not None:
            writer.write_scalars(step, {"checkpoint/blocked_s": blocked})

    def stop_for_preemption(step: int, eval_pending: bool) -> None:
        if pending:
            flush_train_metrics(step)
        watch.hold_signals()  # a second signal must not cut this save short or change the exit status
        save(step, "preemption", eval_pending=eval_pending)
        ckpt.wait()
        where = "during evaluation " if eval_pending else ""
        raise Preempted(f"preempted {where}at step {step}: checkpoint saved, exit for requeue")

    def run_eval(step: int) -> dict[str, float] | None:
        """This step's eval metrics as ``{"eval/dice": ...}``, or None if a preemption cut it short."""
        nonlocal last_eval
        result = evaluate(s, eval_step, state["params"], val_pairs, interrupt=watch.requested)
        if result is None:
            return None
        metrics, images = result
        named = {f"eval/{k}": v for k, v in metrics.items()}
        if policy.best_metric and policy.best_metric not in named:
            raise ConfigError(
                f"config.checkpoint.best_metric={policy.best_metric!r} is not computed by this task; "
                f"use one of {sorted(named)}."
            )
        last_eval = metrics
        writer.write_scalars(step, named)
        if images:
            writer.write_images(step, images)
        if is_main:
            logging.info(
                "eval step %d: dice %.4f iou %.4f sensitivity %.4f specificity %.4f accuracy %.4f loss %.4f",
                step, metrics["dice"], metrics["iou"], metrics["sensitivity"], metrics["specificity"],
                metrics["accuracy"], metrics["loss"],
            )
        return named

    feed = DeviceFeed(data_it, lambda b: to_global(b, s.batch_sharding), depth=config.data.device_prefetch)
    try:
        if eval_pending and run_eval(start) is None:
            stop_for_preemption(start, eval_pending=True)
        for step in range(start, total):
            batch, starved = feed.next_timed(lambda: last_output is not None and not last_output.is_ready())
            data_wait += starved
            state, metrics = train_step(state, batch)
            last_output = metrics["train/loss"]
            pending.append((step + 1, metrics))
            steps_since += 1
            done = step + 1
            log_step = done % config.train.log_every == 0 or done == total
            if log_step:
                flush_train_metrics(done)
            eval_due = done % config.train.eval_every == 0 or (done == total and config.train.eval_at_end)
            if watch.requested():
                stop_for_preemption(done, eval_pending=eval_due)
            evaluated = run_eval(done) if eval_due else None
            if eval_due and evaluated is None:
                stop_for_preemption(done, eval_pending=True)
            reason = schedule.reason(done, log_step=log_step)
            if reason:
                save(done, reason, metrics=evaluated)
        ckpt.wait()
        if ckpt.blocked_s:
            logging.info("checkpoints: %d saves; train loop blocked %.3f s on average, %.3f s at most",
                         len(ckpt.blocked_s), float(np.mean(ckpt.blocked_s)), max(ckpt.blocked_s))
    finally:
        feed.close()
        writer.close()
        ckpt.close()
    if start >= total:
        logging.info("nothing to do: workdir already at step %d of %d", start, total)
    return last_eval
