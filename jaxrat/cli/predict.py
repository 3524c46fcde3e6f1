"""Predict new images with a trained run:
``python -m jaxrat.predict --workdir W --input PATH --out OUT [--step best|latest|N]``.

PATH is a folder (searched recursively), an image, a glob (quoted) or a text file listing paths.
Segmentation writes a mask PNG per image at its original size and orientation, an overlay JPEG and
``predictions.csv``; classification a CSV of each head's top-k labels; detection COCO results JSON
and the images with their boxes drawn (layout: :mod:`jaxrat.inference.writers`, docs/predict.md).
Unreadable files are listed in ``OUT/skipped.txt``. ``--tta flip,scale=0.75:1:1.25`` averages
augmented views, ``--tile SIZE --overlap F`` predicts big images in Gaussian-blended windows at
their own resolution. Under ``srun``/``mpirun`` the processes split the images and process 0
writes the merged CSV/JSON.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from absl import flags

from jaxrat.cli.entry import TrainedRunFlags, no_positional, run_with_config_overrides, user_errors
from jaxrat.runtime import device_errors
from jaxrat.runtime.console import quiet_libraries
from jaxrat.runtime.interrupt import Stopped, raise_on_signals

_RUN = TrainedRunFlags(__name__)
_STEP = flags.DEFINE_string("step", "", "Checkpoint: a step number, 'best' or 'latest' (default: the best when the "
                            "run ranked one, else the latest).")
_INPUT = flags.DEFINE_string("input", None, "A folder (recursive), an image, a glob or a text file of paths.")
_OUT = flags.DEFINE_string("out", None, "Output folder (new or empty; see --overwrite).")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace jaxrat's outputs in an existing non-empty --out.")
_SAVE_PROBS = flags.DEFINE_enum("save_probs", "", ["", "png16", "npy"],
                                "Also save segmentation probabilities: 16-bit PNG (p * 65535) or float32 .npy "
                                "(multi-class runs: npy, (H, W, classes)).")
_TTA = flags.DEFINE_string("tta", "", "Test-time augmentation: flip, scale=A:B:C, or both (flip,scale=0.75:1:1.25).")
_TILE = flags.DEFINE_integer("tile", 0, "Segmentation: predict at the image's own resolution in TILE x TILE windows.")
_OVERLAP = flags.DEFINE_float("overlap", 0.5, "Fraction of a window shared with its neighbour (with --tile).")
_BATCH = flags.DEFINE_integer("batch", 0, "Images (or windows) per forward pass (default: the run's eval batch).")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Classification: labels per head in the CSV (default: config.task.top_k).")
_MIN_SCORE = flags.DEFINE_float("min_score", 0.3, "Detection: the lowest score drawn on the images and counted.")
_PROGRESS = flags.DEFINE_bool("progress", True, "Show a progress line on stderr.")
flags.mark_flags_as_required(["input", "out"])


def main(argv: list[str], overrides: list[str]) -> None:
    """Load the run, expand the inputs, predict, say how many were written and skipped; SIGTERM or
    Ctrl-C end it in one line, with no temporary file left."""
    quiet_libraries()
    with user_errors():
        try:
            raise_on_signals()
            no_positional(argv, "--workdir, --input, --out and options (--help)")
            _predict(overrides)
        except Stopped as e:
            sys.stderr.write(("\n" if _PROGRESS.value else "") + f"jaxrat: predict stopped by {e.name}; {_OUT.value} "
                             f"holds the images finished so far: rerun with --overwrite to predict them all.\n")
            sys.stderr.flush()
            sys.exit(e.exit_code)


def _predict(overrides: list[str]) -> None:
    """Check the options, expand the inputs, open the run; then process 0 claims --out under its lock
    (checked before the minutes of loading) while every process predicts its share of the images."""
    from jaxrat.inference.augment import check_tiling, parse_tta
    from jaxrat.inference.batch import check_batch
    from jaxrat.inference.checkpoint_choice import check_step
    from jaxrat.inference.inputs import expand_inputs
    from jaxrat.inference.run import Options, check_output, claim_output

    check_step(_STEP.value)
    check_batch(_BATCH.value)
    tta = parse_tta(_TTA.value)
    options = Options(save_probs=_SAVE_PROBS.value, tile=_TILE.value, overlap=_OVERLAP.value,
                      top_k=_TOP_K.value, min_score=_MIN_SCORE.value)
    if options.tile:
        check_tiling(options.tile, options.overlap)
    inputs = expand_inputs(_INPUT.value)
    workdir, config = _RUN.open(overrides)
    _check_save_probs(config)
    import jax

    from jaxrat.runtime.output_folder import run_inputs
    from jaxrat.trainer.workdir_lock import OutputFolderLock

    lock = None
    try:
        if jax.process_index() == 0:
            check_output(_OUT.value, inputs, _INPUT.value, run_inputs(workdir, config))  # before minutes of loading
            lock = OutputFolderLock(_OUT.value)
            lock.acquire()
            claim_output(_OUT.value, inputs, _OVERWRITE.value)
        counts = _predict_files(config, workdir, inputs, tta, options)
        if jax.process_index() == 0:
            skipped = f"; {counts['skipped']} skipped (see {_OUT.value}/skipped.txt)" if counts["skipped"] else ""
            print(f"jaxrat: predicted {counts['images']} images into {_OUT.value}{skipped}", flush=True)
    finally:
        if lock is not None:
            lock.release()


def _check_save_probs(config: Any) -> None:
    """Refuse --save_probs png16 for a multi-class segmentation run before --out is claimed."""
    from jaxrat.inference.writers import check_probs_format

    if _SAVE_PROBS.value and config.task.get("name") == "segmentation":
        check_probs_format(_SAVE_PROBS.value, int(config.model.get("num_classes", 1) or 1))


def _predict_files(config: Any, workdir: str, inputs: list[Any], tta: Any, options: Any) -> dict[str, Any]:
    """Load the checkpoint and predict this process's share of ``inputs`` into --out; the counts."""
    import jax

    from jaxrat.inference.checkpoint_choice import choose
    from jaxrat.inference.predictor import Predictor
    from jaxrat.inference.run import predict_files

    sync, run_id = None, ""
    if jax.process_count() > 1:
        import numpy as np
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("predict: output folder ready")
        sync = lambda: multihost_utils.sync_global_devices("predict: parts written")  # noqa: E731
        # One name for this prediction's part files, the same in every process.
        run_id = f"{int(multihost_utils.broadcast_one_to_all(np.int64(time.time_ns() % 2**62))):x}"
    predictor = Predictor(config, workdir, choose(workdir, _STEP.value), batch_size=_BATCH.value, tta=tta)
    logging.info("predict: %d images, %s, step %d, tta %s%s", len(inputs), predictor.kind, predictor.step,
                 tta.describe(), f", tiles {options.tile} px" if options.tile else "")
    with device_errors.in_a_sentence(lambda: f"--batch (now {predictor.batch_size})"):
        return predict_files(predictor, inputs, _OUT.value, options, process_index=jax.process_index(),
                             process_count=jax.process_count(), progress=_PROGRESS.value, sync=sync, run_id=run_id)


def run() -> None:
    """Console entry point (also ``python -m jaxrat.predict``)."""
    run_with_config_overrides(main, "python -m jaxrat.predict")

