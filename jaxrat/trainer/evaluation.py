"""Score one checkpoint of a trained run under a (possibly changed) config, with the training loop's
own eval machinery, so the numbers are those training would have logged."""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Callable, Sequence

import jax
import ml_collections as mlc

from jaxrat import cluster
from jaxrat.checkpointing import load_init
from jaxrat.checkpointing.reading import Opened, open_checkpoint
from jaxrat.cluster.together import compiled_together
from jaxrat.config_schema import field, load_run_config
from jaxrat.data.synthetic import location
from jaxrat.parallel.mesh import make_mesh
from jaxrat.runtime import compile_cache
from jaxrat.runtime.errors import UserError
from jaxrat.runtime.fileio import unwritable, write_csv, write_json
from jaxrat.tasks.base import load_task
from jaxrat.tracking.writers import MetricWriter
from jaxrat.trainer import label_space
from jaxrat.trainer.hooks import Evaluation
from jaxrat.trainer.loop import check_batch_sizes, to_global
from jaxrat.trainer.state import check_kernels_run_here, make_state_spec
from jaxrat.trainer.step import make_eval_step

READ_ITEMS = ("params", "ema_params")  # what an evaluation reads, checked before it is trusted


def open_trained_run(workdir: str, overrides: list[str],
                     allow_import: Sequence[str] = ()) -> tuple[str, mlc.ConfigDict]:
    """The absolute ``workdir`` and its run's config with ``overrides``, the runtime started as for
    training (``jax.distributed`` from the launcher's environment, the compilation cache).
    ``allow_import``: modules the run's config.json may name a task from (``--allow-import``)."""
    workdir = os.path.abspath(os.path.expanduser(workdir))
    config = load_run_config(workdir, overrides, allow_import)
    cluster.initialize(config.distributed)
    compile_cache.enable(field(config.train, "train.compilation_cache_dir"))
    return workdir, config


def evaluate_checkpoint(config: mlc.ConfigDict, workdir: str, step_spec: str = "latest",
                        name: str | Callable[[int], str] = "", *, out_dir: str | None = None,
                        data_dir: str | None = None, prepared: Callable[[Any], None] | None = None,
                        wrap_model: Callable[[Any], Any] | None = None, per_image: bool = False,
                        context: dict | None = None, opened: Opened | None = None) -> tuple[int, dict[str, float]]:
    """Evaluate checkpoint ``step_spec`` (a step, "best" or "latest") of ``workdir`` under ``config``.

    Writes ``metrics.json`` (and ``metrics.jsonl`` + TensorBoard) to ``out_dir`` (default
    ``workdir/eval/NAME``, NAME defaulting to ``step_<step>``, or ``name(step)`` when callable; it
    must stay inside ``workdir/eval``); the task prepares its data under ``data_dir`` (default
    ``out_dir``), where synthetic data is written only when the run's own copy is not the same data
    (:mod:`jaxrat.data.synthetic.location`). Checkpoints are only read, as
    :func:`jaxrat.checkpointing.reading.open_checkpoint` holds them (``opened``: one held already,
    e.g. for every point of a robustness grid). ``prepared(task)`` runs once the task's data are
    prepared (e.g. to pick another split); ``wrap_model``: see
    :func:`jaxrat.trainer.step.make_eval_step` (test-time augmentation); ``per_image``: also
    ``per_image.csv`` (the accumulator's :meth:`per_image` rows) and its :meth:`per_image_summary`
    in metrics.json; ``context``: filled with the ``task`` (its data prepared), the ``out_dir`` and
    the ``step`` read. Returns ``(step, {"eval/<metric>": value})``.
    """
    if opened is None:
        with open_checkpoint(f"{workdir}:{step_spec}", READ_ITEMS) as held:
            return evaluate_checkpoint(config, workdir, step_spec, name, out_dir=out_dir, data_dir=data_dir,
                                       prepared=prepared, wrap_model=wrap_model, per_image=per_image,
                                       context=context, opened=held)
    step = opened.step
    mesh = make_mesh(config.mesh.axes)
    check_kernels_run_here(config, mesh)
    check_batch_sizes(config, mesh.size, jax.process_count())
    task = load_task(config)
    out_dir = _out_dir(workdir, out_dir, name, step)
    with location.reading_run(workdir):  # the run's own synthetic data, read where it is: not a copy per evaluation
        logging.info("data: %s", task.prepare_data(data_dir or out_dir))
    label_space.check(label_space.of(task), workdir,
                      fix="point --config.data.data_dir at data labelled as the run's was")
    if prepared is not None:
        prepared(task)
    if context is not None:
        context.update(task=task, out_dir=out_dir, step=step)
    spec = make_state_spec(config, mesh, task)
    # A run trained with an average of its weights is scored with it, as training ranked it.
    params = load_init(opened.spec, spec.abstract_with_shardings(), params_from="ema_params" if spec.ema else "params",
                       opened=opened)["params"]
    writer = MetricWriter(out_dir, is_main=jax.process_index() == 0)
    try:
        eval_step = compiled_together(make_eval_step(spec, wrap_model), "eval step")
        evaluation = Evaluation(config, task, eval_step, lambda b: to_global(b, spec.batch_sharding), writer)
        metrics = evaluation.run(step, params, interrupt=lambda: False)
    finally:
        writer.close()
    _save_results(config, workdir, out_dir, step, metrics, evaluation.last_accumulator, per_image)
    return step, metrics


def _out_dir(workdir: str, out_dir: str | None, name: str | Callable[[int], str], step: int) -> str:
    """Where the evaluation of ``step`` is written (see :func:`evaluate_checkpoint`); refused, with the
    reason, when it cannot be written."""
    out_dir = out_dir or eval_dir(workdir, (name(step) if callable(name) else name) or f"step_{step}")
    why = unwritable(out_dir)
    if why:
        raise UserError(f"Cannot write the evaluation to {out_dir} ({why}); pass --out DIR to write it to a folder "
                        "you can write to.")
    return out_dir


def _save_results(config: mlc.ConfigDict, workdir: str, out_dir: str, step: int, metrics: dict[str, float],
                  acc: Any, per_image: bool) -> None:
    """``metrics.json`` (and with ``per_image`` ``per_image.csv``) in ``out_dir``, from process 0; every
    process calls it."""
    rows = acc.per_image() if per_image else []  # a collective under several processes: every one asks
    extra = acc.per_image_summary() if per_image else {}
    if jax.process_index() != 0:
        return
    result = {"workdir": workdir, "step": step, "metrics": metrics, **extra,
              "config": json.loads(config.to_json_best_effort())}
    if per_image:
        write_rows(os.path.join(out_dir, "per_image.csv"), rows)
        logging.info("wrote %s (%d images)", os.path.join(out_dir, "per_image.csv"), len(rows))
    write_json(os.path.join(out_dir, "metrics.json"), result, indent=2, sort_keys=True)
    logging.info("wrote %s", os.path.join(out_dir, "metrics.json"))


def eval_dir(workdir: str, name: str) -> str:
    """``WORKDIR/eval/NAME``; a name that leads out of it (``..``, an absolute path) is refused."""
    root = os.path.join(workdir, "eval")
    target = os.path.normpath(os.path.join(root, name))
    if not target.startswith(root + os.sep):
        raise UserError(f"--name {name!r} leads out of {root}; give a folder name inside it, or --out DIR to write "
                        "the evaluation elsewhere.")
    return target


def write_rows(path: str, rows: list[dict[str, Any]]) -> None:
    """Rows (dicts with the same keys) as a CSV file, floats with 8 significant digits."""
    columns: list[str] = []
    for r in rows:
        columns += [k for k in r if k not in columns]
    cell = lambda v: f"{v:.8g}" if isinstance(v, float) else ("" if v is None else v)  # noqa: E731
    write_csv(path, [[cell(r.get(k)) for k in columns] for r in rows], header=columns)
