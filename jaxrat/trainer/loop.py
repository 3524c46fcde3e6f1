"""The training loop: world -> task and data -> state -> steps, with logs, evals and checkpoints.

Every process runs every line (steps, evals and saves are collectives); only process 0 writes
logs and files the run shares.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
from typing import Any, Callable

import jax
import ml_collections as mlc
import numpy as np

from jaxrat.checkpointing import Checkpointer, Policy, store
from jaxrat.cluster import Interrupted, Preempted, PreemptionWatch, startup_exit
from jaxrat.cluster.together import compiled_together
from jaxrat.config_schema.kinds import check_counts
from jaxrat.data.own_data import on_own_data
from jaxrat.parallel.mesh import make_mesh, processes_on_this_host
from jaxrat.runtime.errors import ConfigError, UserError
from jaxrat.tasks.base import load_task
from jaxrat.tracking.summary import JSON_NAME as SUMMARY_JSON
from jaxrat.tracking.writers import MetricWriter, check_tracking
from jaxrat.trainer import autotune, hooks, label_space, run_summary
from jaxrat.trainer.input_feed import DeviceFeed
from jaxrat.trainer.state import check_state_settings, make_state_spec, restore_or_init
from jaxrat.trainer.step import make_eval_step, make_train_step
from jaxrat.trainer.workdir import has_checkpoint
from jaxrat.trainer.workdir import hold as hold_workdir


def check_batch_sizes(config: mlc.ConfigDict, num_devices: int, num_processes: int) -> None:
    """Raise ConfigError unless the global batches split evenly over steps, devices and hosts."""
    gb, accum, eb = config.data.batch_size, config.optimizer.grad_accum_steps, config.data.eval_batch_size
    if accum < 1 or gb % accum:
        raise ConfigError(f"config.data.batch_size={gb} does not divide by config.optimizer.grad_accum_steps={accum}; "
                          f"make the batch a multiple of the accumulation steps.")
    if (gb // accum) % num_devices:
        raise ConfigError(f"The micro-batch of {gb // accum} (config.data.batch_size={gb} / grad_accum_steps={accum}) "
                          f"does not divide over {num_devices} devices; use a batch size that is a multiple of "
                          f"{num_devices * accum}.")
    shards = config.train.reduction_shards
    if shards < 0 or (shards and (shards % num_devices or (gb // accum) % shards)):
        raise ConfigError(
            f"config.train.reduction_shards={shards} must be 0 (off) or a multiple of the {num_devices} devices "
            f"that divides the micro-batch of {gb // accum}; set it to {num_devices}, or 0 to let XLA split the "
            f"sums (faster, not bit-identical across device counts).")
    if eb % num_devices or eb % num_processes:
        raise ConfigError(f"config.data.eval_batch_size={eb} does not divide over {num_devices} devices; use a "
                          f"multiple of {num_devices}.")
    if config.data.device_prefetch < 0:
        raise ConfigError(f"config.data.device_prefetch={config.data.device_prefetch}; "
                          "use 0 (off) or the number of batches to keep on the devices ahead.")


def check_steps(config: mlc.ConfigDict) -> None:
    """Refuse a negative ``num_train_steps``: it trained nothing and recorded the run as finished.
    0 stays allowed (a run that only initialises, saves and evaluates)."""
    steps = config.num_train_steps
    if not isinstance(steps, int) or steps < 0:
        raise ConfigError(f"config.num_train_steps={steps!r} is not a number of steps; set it to 0 or more "
                          f"(e.g. --config.num_train_steps=1000).")


def check_run(config: mlc.ConfigDict, mesh: jax.sharding.Mesh, task: Any, policy: Policy) -> None:
    """The config's refusals on these devices and for this task, before the data is prepared (which can
    take minutes): the number of steps, the state's settings, the batch sizes, the hooks' settings."""
    check_steps(config)
    check_state_settings(config, mesh)
    check_batch_sizes(config, mesh.size, jax.process_count())
    hooks.check_config(config, policy, task)


def to_global(batch: dict[str, np.ndarray], sharding: jax.sharding.NamedSharding) -> dict[str, jax.Array]:
    """Assemble per-host numpy batches into global arrays sharded over the batch axes."""
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in batch.items()}


def _first_batch(iterator: Any) -> dict[str, np.ndarray]:
    try:
        return next(iterator)
    finally:
        if hasattr(iterator, "close"):
            iterator.close()


def train_and_evaluate(config: mlc.ConfigDict, workdir: str) -> dict[str, float]:
    """Train (resuming from ``workdir`` if it holds checkpoints) and return the last eval metrics.

    A run refused before its state exists (missing data, a config the devices cannot run) leaves a
    new or empty ``workdir`` as it found it: a stray config.json would make the fixed rerun a "resume".
    """
    t_created = time.perf_counter()
    check_counts(config)  # sizes and periods below 1, before the dataset is looked at
    config = on_own_data(config)  # before config.json is written: a demo on the user's data is not the demo
    workdir = os.path.abspath(workdir)
    check_is_folder(workdir)
    existed = os.path.isdir(workdir)
    fresh = not existed or not os.listdir(workdir)
    started: list[bool] = []
    startup_exit.note_step(_newest_step(workdir))  # until the restore says which: for a second Ctrl-C's line
    try:
        with hold_workdir(config, workdir) as save_config:  # one run per workdir; a resume keeps the config

            def save_and_mark(files: dict[str, Any] | None = None) -> None:
                save_config(files)
                started.append(True)  # the state exists: from here on a failure keeps what the run wrote

            return _train_and_evaluate(config, workdir, t_created, save_and_mark)
    except UserError:
        if fresh and not started and jax.process_index() == 0:
            _clear(workdir, remove_folder=not existed)
        raise
    finally:
        startup_exit.done()  # the run is over: what ends it now prints its own closing line


def _newest_step(workdir: str) -> int:
    """The newest committed checkpoint's step in ``workdir`` (0: none, or none readable)."""
    try:
        return max(store.committed_steps(os.path.join(workdir, "checkpoints")), default=0)
    except OSError:  # an unreadable workdir is refused, in one sentence, when the run holds it
        return 0


def check_is_folder(workdir: str) -> None:
    """Refuse a ``workdir`` that is a file (or lies under one) before anything is written."""
    path = workdir
    while path and not os.path.exists(path):
        path = os.path.dirname(path) if os.path.dirname(path) != path else ""
    if path and not os.path.isdir(path):
        what = "is a file, not a folder" if path == workdir else f"is not a folder: {path} is a file"
        raise UserError(f"--workdir {workdir} {what}; pass a folder for the run (a new one, or a run's workdir to "
                        "resume it).")


def _clear(workdir: str, remove_folder: bool) -> None:
    """Remove what a refused run wrote into the new or empty ``workdir`` (nothing else was there)."""
    if remove_folder:
        shutil.rmtree(workdir, ignore_errors=True)
        return
    for name in os.listdir(workdir):
        path = os.path.join(workdir, name)
        shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)


@dataclasses.dataclass
class _Started:
    """A run's world, task, state spec, compiled steps and restored (or fresh) state."""

    config: mlc.ConfigDict  # with the batch automatic sizing chose, where it was asked for
    mesh: jax.sharding.Mesh
    task: Any
    policy: Policy
    spec: Any
    train_step: Any
    eval_step: Any
    ckpt: Checkpointer
    start: Any


def _start(config: mlc.ConfigDict, workdir: str, watch: PreemptionWatch,
           save_config: Callable[..., None]) -> _Started:
    # ---- task and world, the config checked against both before anything is prepared
    task = load_task(config)
    check_tracking(config.get("tracking"))
    mesh = make_mesh(config.mesh.axes)
    policy = Policy.from_config(config.checkpoint)
    check_run(config, mesh, task, policy)
    logging.info("mesh %s over %d devices in %d processes", dict(mesh.shape), mesh.size, jax.process_count())

    # ---- data, state
    logging.info("data: %s", task.prepare_data(workdir))
    labels = label_space.of(task)  # what each output means: kept with the run for predict, export and a resume
    if has_checkpoint(workdir):  # a resume trains the outputs it trained: each must still mean the same class
        label_space.check(labels, workdir, fix="restore the dataset's labels as they were, or train in a new "
                                              "--workdir (with --config.init_from to start from this run's weights)")
    hooks.stop_if_preempted(watch, 0)
    on_host = processes_on_this_host() if config.data.num_workers == -1 else 1  # a collective: all call it

    def train_iter(start_example: int, local_batch: int = 0):
        local_batch = local_batch or config.data.batch_size // jax.process_count()
        return task.train_iterator(start_example, local_batch=local_batch, process_index=jax.process_index(),
                                   process_count=jax.process_count(), processes_on_host=on_host)

    if autotune.wanted(config):
        choice = autotune.size_batch(config, mesh, task, _first_batch(train_iter(0, local_batch=1)), workdir)
        config = autotune.apply(config, choice)
        check_batch_sizes(config, mesh.size, jax.process_count())
    spec = make_state_spec(config, mesh, task)
    train_fn, eval_fn = make_train_step(spec), make_eval_step(spec)
    train_step, eval_step = compiled_together(train_fn, "train step"), compiled_together(eval_fn, "eval step")
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), policy)
    start = restore_or_init(config, spec, ckpt, train_iter)
    startup_exit.note_step(start.step)
    # only now: a resume the checkpoint refused has left config.json and labels.json as they were
    save_config({label_space.LABELS_NAME: labels})
    return _Started(config, mesh, task, policy, spec, train_step, eval_step, ckpt, start)


def _adds_nothing(workdir: str, first: int, done: int, eval_step: int | None) -> bool:
    """Whether this run did no step and no evaluation while an earlier run's summary exists: rewriting
    it would replace that run's metrics and throughput with empty ones (a finished run started again)."""
    return done == first and eval_step is None and os.path.exists(os.path.join(workdir, SUMMARY_JSON))


def _write_summary(w: _Started, run: hooks.RunHooks, writer: MetricWriter, workdir: str, *, first: int, done: int,
                   status: str, error: str | None, wall_time_s: float) -> None:
    """summary.json and summary.md of the run that did steps ``first`` to ``done``, also to the trackers;
    an earlier run's kept when this one added nothing. A failure to write it only warns: the summary
    is not worth hiding why a run failed."""
    if _adds_nothing(workdir, first, done, run.evaluation.last_step):
        logging.info("run summary: kept as it was (this run did no step and no evaluation)")
        return
    try:
        summary = run_summary.build(w.config, workdir, status=status, mesh=w.mesh, first=first, last=done,
                                    wall_time_s=wall_time_s, checkpoint_dir=w.ckpt.directory, kernels=w.spec.kernels,
                                    compute_dtype=jax.numpy.dtype(w.spec.dtype).name, error=error,
                                    **run.summary(done))
        confusions = getattr(getattr(run.evaluation, "last_accumulator", None), "confusions", dict)()
        run_summary.publish(writer, workdir, summary, confusions, w.task.curve_classes)
    except Exception as e:
        logging.warning("run summary: not written (%s: %s)", type(e).__name__, e)


def _train_and_evaluate(config: mlc.ConfigDict, workdir: str, t_created: float, save_config: Any) -> dict[str, float]:
    watch = PreemptionWatch()  # one counter for every check of the run (a collective's agreed call number)
    w = _start(config, workdir, watch, save_config)
    config = w.config
    spec, ckpt, start = w.spec, w.ckpt, w.start
    state, first, total = start.state, start.step, config.num_train_steps

    # ---- loop
    writer = MetricWriter(workdir, is_main=jax.process_index() == 0, tracking=config.get("tracking"))
    # A second Ctrl-C before the first step ends the trackers' runs as interrupted: left open, an
    # MLflow run stays RUNNING for good and a W&B one ends as crashed.
    forget_writer = startup_exit.on_exit(lambda: writer.close("interrupted"))
    put = lambda b: to_global(b, spec.batch_sharding)  # noqa: E731
    try:
        writer.write_hparams(config.to_dict())
        run = hooks.RunHooks.create(config, w.task, spec, ckpt, w.policy, writer, watch, w.eval_step, put, start,
                                    t_created)
        feed = DeviceFeed(start.data, put, depth=config.data.device_prefetch)
    except BaseException:  # e.g. early stopping's record refused: the trackers' runs end as failed
        forget_writer()
        writer.close("failed")
        ckpt.close()
        raise
    # A second Ctrl-C before the first step stops the input workers first: left to die with the
    # process, their batches' shared memory is reported leaked after the run's closing line.
    forget_feed = startup_exit.on_exit(feed.close)
    done, status, error = first, "failed", None
    try:
        ended = run.resume(first, state, feed.consumed_state, start.eval_pending)
        for step in range(first, first if ended else total):
            batch, waited = feed.next_timed(run.chrono.devices_busy)
            state, metrics = w.train_step(state, batch)
            if step == first:  # compiled and started: a second Ctrl-C from here on is training's
                startup_exit.done()
                forget_feed()
                forget_writer()
            done = step + 1
            if run.after_step(done, state, metrics, waited, feed.consumed_state):
                break
        run.finish()
        status = "finished"
    except Preempted as e:
        status = "interrupted" if isinstance(e, Interrupted) else "preempted"
        raise
    except BaseException as e:  # the summary says why, so every table can say "failed: <why>"
        error = (f"{type(e).__name__}: " + (str(e).strip().splitlines() or [""])[0])[:300]
        raise
    finally:
        forget_feed()
        forget_writer()
        feed.close()
        _write_summary(w, run, writer, workdir, first=first, done=done, status=status, error=error,
                       wall_time_s=time.perf_counter() - t_created)
        writer.close(status)
        ckpt.close()
    if first >= total:
        logging.info("nothing to do: workdir already at step %d of %d", first, total)
    return run.evaluation.last
