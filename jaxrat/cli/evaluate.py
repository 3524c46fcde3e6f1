"""Evaluate a trained run: ``python -m jaxrat.evaluate --workdir DIR [--step N|best|latest] [--name NAME | --out DIR
[--overwrite]] [--split validation|test|train] [--tta flip,scale=0.75:1:1.25] [--tile SIZE --overlap F]
[--save_predictions]``.

The run's own config (``DIR/config.json``) is loaded and may be overridden like training's
(``--config.data.image_size=384``: evaluate at another resolution). The same command runs under
``srun``/``mpirun``/``torchrun`` on many hosts. Metrics go to ``DIR/eval/NAME/metrics.json`` (and
``metrics.jsonl`` + TensorBoard there), one row per image to ``per_image.csv``, and with
``--save_predictions`` the files ``python -m jaxrat.predict`` writes to ``predictions/``;
checkpoints are only read. Synthetic data is read at the size it was trained on and resized like
real data (:func:`jaxrat.config_schema.load_run_config`). The work is
:func:`jaxrat.trainer.evaluation.evaluate_checkpoint`; ``python -m jaxrat.robustness`` runs it at
several resolutions. ``--tta`` averages augmented views inside the eval step (every metric);
``--tile`` predicts each image in windows at its own resolution and reports the metrics at the
original resolution (``eval/orig/...``) only.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

from absl import flags

from jaxrat.cli.entry import TrainedRunFlags, no_positional, run_with_config_overrides, user_errors
from jaxrat.runtime import device_errors, output_folder
from jaxrat.runtime.console import quiet_libraries
from jaxrat.runtime.errors import UserError
from jaxrat.runtime.fileio import write_json
from jaxrat.runtime.interrupt import Stopped, raise_on_signals

_RUN = TrainedRunFlags(__name__)
_STEP = flags.DEFINE_string("step", "", "Checkpoint to evaluate: a step number, 'best' or 'latest' (default: the "
                            "best when the run ranked one, else the latest).")
_NAME = flags.DEFINE_string("name", "", "Subfolder of WORKDIR/eval for the results (default: step, split, TTA).")
_OUT = flags.DEFINE_string("out", "", "Write the results to this folder (new or empty; see --overwrite) instead of "
                           "WORKDIR/eval/NAME.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace a previous evaluation's files in an existing non-empty "
                               "--out (files jaxrat did not write are never removed).")
_SPLIT = flags.DEFINE_enum("split", "validation", ["validation", "test", "train"], "The data to evaluate.")
_TTA = flags.DEFINE_string("tta", "", "Test-time augmentation: flip, scale=A:B:C, or both (flip,scale=0.75:1:1.25).")
_TILE = flags.DEFINE_integer("tile", 0, "Segmentation: predict each image in TILE x TILE windows at its own size.")
_OVERLAP = flags.DEFINE_float("overlap", 0.5, "Fraction of a window shared with its neighbour (with --tile).")
_PER_IMAGE = flags.DEFINE_bool("per_image", True, "Write per_image.csv.")
_SAVE = flags.DEFINE_bool("save_predictions", False, "Also write jaxrat.predict's files to NAME/predictions/.")


# What an evaluation writes at the top of its folder, listed before it starts (the manifest of an
# evaluation stopped halfway); the full list is recorded when it ends.
EVAL_FILES = ("metrics.json", "metrics.jsonl", "per_image.csv", "label_stats.json")


def _default_name(step: str) -> str:
    parts = [] if _SPLIT.value == "validation" else [_SPLIT.value]
    parts += [f"tta-{_TTA.value.replace(',', '-').replace(':', '_').replace('=', '')}"] if _TTA.value else []
    parts += [f"tile{_TILE.value}"] if _TILE.value else []
    return "_".join([step] + parts)


def main(argv: list[str], overrides: list[str]) -> None:
    """Initialise the runtime from the run's config, then evaluate; SIGTERM or Ctrl-C end it in one
    line, with no temporary file left and the output folder's lock released."""
    from jaxrat.inference.augment import check_tiling, parse_tta

    quiet_libraries()
    with user_errors():
        try:
            raise_on_signals()
            no_positional(argv, "--workdir, --step, --name, --split, --tta, --tile and --config.KEY=VALUE")
            tta = parse_tta(_TTA.value)
            if _TILE.value:
                check_tiling(_TILE.value, _OVERLAP.value)
            workdir, config = _RUN.open(overrides)
            _check_tile(config)
            if _OUT.value:  # before the checkpoint is opened: never the run's files, its data, unwritable or full
                output_folder.check(_OUT.value, output_folder.run_inputs(workdir, config), command="evaluate")
                output_folder.refuse_taken(_OUT.value, command="evaluate", overwrite=_OVERWRITE.value)
            from jaxrat.checkpointing.reading import open_checkpoint
            from jaxrat.inference.checkpoint_choice import choose
            from jaxrat.trainer.evaluation import READ_ITEMS

            # The step is chosen once and held for both the evaluation and the predictions: "latest"
            # resolved here and again later named a step the user never asked for once a training
            # beside it had rotated it away.
            advice = lambda: f"--config.data.eval_batch_size (now {config.data.eval_batch_size})"  # noqa: E731
            with open_checkpoint(f"{workdir}:{choose(workdir, _STEP.value)}", READ_ITEMS) as opened, \
                    device_errors.in_a_sentence(advice):
                _evaluate(config, workdir, opened, tta)
        except Stopped as e:
            # The files are written whole (runtime.fileio) and the stop ran their cleanup; what may be
            # missing is the rest of the evaluation, so the line says to run it again.
            where = getattr(e, "out_dir", "")
            part = f"; {where} may hold part of its results" if where else ""
            sys.stderr.write(f"jaxrat: evaluate stopped by {e.name}{part}: run the same command again.\n")
            sys.stderr.flush()
            sys.exit(e.exit_code)


def _check_tile(config: Any) -> None:
    """Refuse --tile for a run it cannot score, before --out is claimed or the checkpoint opened."""
    if not _TILE.value:
        return
    if config.task.name != "segmentation":
        raise UserError(f"--tile is for segmentation; this run's task is {config.task.name}: drop --tile.")
    if int(config.model.get("num_classes", 1) or 1) > 1:
        raise UserError("evaluate --tile scores binary masks; this run predicts several classes: drop --tile "
                        "(jaxrat predict --tile writes the tiled label maps).")


def _evaluate(config: Any, workdir: str, opened: Any, tta: Any) -> None:
    """Evaluate the held checkpoint ``opened`` (and tile or save predictions, when asked), holding
    the output folder's lock (process 0): a second evaluate into it is refused, naming this one."""
    import jax

    from jaxrat.trainer.evaluation import eval_dir
    from jaxrat.trainer.workdir_lock import OutputFolderLock

    step = opened.step
    out_dir = os.path.abspath(os.path.expanduser(_OUT.value)) if _OUT.value else \
        eval_dir(workdir, _NAME.value or _default_name(f"step_{step}"))
    if not _OUT.value:
        output_folder.check(out_dir, output_folder.run_inputs(workdir, config), command="evaluate")
        # Not claimed (the run's own folder, evaluated into again), but a predict or export --out
        # may have taken this name: evaluating into it would mix the two commands' files.
        output_folder.refuse_other(out_dir, command="evaluate", fix="pass another --name (or --out)")
    way_around = "" if _OUT.value else "pass another --name (or --out)"
    lock = OutputFolderLock(out_dir, way_around) if jax.process_index() == 0 else None
    if lock is not None:
        lock.acquire()
    try:
        # --out is the user's folder: taken as predict and export take theirs. The default folder
        # under WORKDIR/eval is the run's own and is evaluated into again as it always was.
        claimed = bool(_OUT.value) and lock is not None
        if claimed:
            output_folder.claim(out_dir, command="evaluate", overwrite=_OVERWRITE.value, files=EVAL_FILES)
        before = output_folder.files_in(out_dir) if claimed else set()
        _evaluate_into(out_dir, config, workdir, opened, tta)
        if claimed:  # the files are known only now (TensorBoard's, the predictions): a later --overwrite removes them
            output_folder.record(out_dir, command="evaluate", files=sorted(output_folder.files_in(out_dir) - before))
    except Stopped as e:
        e.out_dir = out_dir  # type: ignore[attr-defined]  (the closing line names it)
        raise
    finally:
        if lock is not None:
            lock.release()


def _evaluate_into(out_dir: str, config: Any, workdir: str, opened: Any, tta: Any) -> None:
    import jax

    from jaxrat.inference.augment import TTAModel
    from jaxrat.trainer.evaluation import evaluate_checkpoint, write_rows

    step = opened.step
    name = _NAME.value or _default_name(f"step_{step}")
    kind = {"segmentation": "segmentation", "classification": "classification"}.get(config.task.name, "other")
    wrap = (lambda m: TTAModel(m, tta, kind)) if tta.active else None
    if tta.active:
        TTAModel(None, tta, kind)  # refuses detection and custom tasks in one sentence, before any work
    from jaxrat.inference.split_eval import swap_to_train, use_split

    per_image = _PER_IMAGE.value and not _TILE.value
    use_split(config, _SPLIT.value, per_image)
    context: dict = {}
    _, metrics = evaluate_checkpoint(config, workdir, str(step), name, wrap_model=wrap, per_image=per_image,
                                     prepared=lambda task: swap_to_train(task, _SPLIT.value), context=context,
                                     out_dir=out_dir, opened=opened)
    if _TILE.value or _SAVE.value:
        from jaxrat.inference import split_eval
        from jaxrat.inference.predictor import Predictor

        task, out_dir = context["task"], context["out_dir"]
        predictor = Predictor(config, workdir, str(step), tta=tta, data_dir=out_dir, opened=opened)
        if _TILE.value:
            tiled, rows = split_eval.tiled_segmentation(predictor, task, _TILE.value, _OVERLAP.value)
            if jax.process_index() == 0:
                _add_metrics(out_dir, tiled, _TILE.value, _OVERLAP.value)
                if _PER_IMAGE.value:
                    write_rows(os.path.join(out_dir, "per_image.csv"), rows)
            logging.info("tiled (%d px, overlap %g): %s", _TILE.value, _OVERLAP.value,
                         " ".join(f"{k} {v:.4f}" for k, v in tiled.items()))
        if _SAVE.value:
            counts = split_eval.save_predictions(predictor, task, os.path.join(out_dir, "predictions"))
            logging.info("wrote predictions of %d images to %s", counts["images"],
                         os.path.join(out_dir, "predictions"))


def _add_metrics(out_dir: str, tiled: dict[str, float], tile: int, overlap: float) -> None:
    """Replace the original-resolution metrics of metrics.json by the tiled prediction's."""
    path = os.path.join(out_dir, "metrics.json")
    with open(path) as f:
        result = json.load(f)
    result["metrics"] = {k: v for k, v in result["metrics"].items() if not k.startswith("eval/orig/")}
    result["metrics"].update(tiled)
    result["tiling"] = {"tile": tile, "overlap": overlap}
    write_json(path, result, indent=2, sort_keys=True)


def run() -> None:
    """Console entry point (also ``python -m jaxrat.evaluate``)."""
    run_with_config_overrides(main, "python -m jaxrat.evaluate")

