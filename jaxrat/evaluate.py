"""Evaluate a trained run: ``python -m jaxrat.evaluate --workdir DIR [--step N|best|latest] [--name NAME]``.

The run's own config (``DIR/config.json``) is loaded and may be overridden like training's
(``--config.data.image_size=384``: evaluate at another resolution). The same command runs under
``srun``/``mpirun``/``torchrun`` on many hosts. Metrics go to ``DIR/eval/NAME/metrics.json`` (and
``metrics.jsonl`` + TensorBoard there); checkpoints are only read. Synthetic data is read at the
size it was trained on and resized like real data (:func:`jaxrat.config.load_run_config`). The work
is :func:`jaxrat.trainer.evaluation.evaluate_checkpoint`; ``python -m jaxrat.robustness`` runs it at
several resolutions.
"""

from __future__ import annotations

from absl import flags

from jaxrat.cli import fail, quiet_libraries, run_with_config_overrides
from jaxrat.errors import UserError

_WORKDIR = flags.DEFINE_string("workdir", None, "A training workdir (holds config.json and checkpoints/).")
_STEP = flags.DEFINE_string("step", "latest", "Checkpoint to evaluate: a step number, 'best' or 'latest'.")
_NAME = flags.DEFINE_string("name", "", "Subfolder of WORKDIR/eval for the results (default: step and overrides).")
flags.mark_flags_as_required(["workdir"])


def main(argv: list[str], overrides: list[str]) -> None:
    """Initialise the runtime from the run's config, then evaluate."""
    from jaxrat.trainer.evaluation import evaluate_checkpoint, open_trained_run

    quiet_libraries()
    try:
        if argv[1:]:
            raise UserError(f"Unexpected arguments {argv[1:]}; pass --workdir, --step, --name and --config.KEY=VALUE.")
        workdir, config = open_trained_run(_WORKDIR.value, overrides)
        evaluate_checkpoint(config, workdir, _STEP.value, _NAME.value)
    except UserError as e:
        fail(str(e))


def run() -> None:
    """Console entry point (also ``python -m jaxrat.evaluate``)."""
    run_with_config_overrides(main)


if __name__ == "__main__":
    run()
