"""Resolution-transfer robustness of a trained run:
``python -m jaxrat.robustness --workdir DIR --sizes 128,192,256 [--spacings 1,2] [--step N|best|latest]``.

Evaluates one checkpoint at every input size and spacing (see :mod:`jaxrat.experiments.robustness`
for what a spacing is) in this process, and writes ``DIR/robustness/{table.md,table.csv,
table.json,plot.png}``: each metric and its relative change from the training resolution.
``--config.KEY=VALUE`` overrides apply to every point (e.g. ``--config.data.eval_batch_size=4``).
The same command runs under ``srun``/``mpirun`` on many hosts.
"""

from __future__ import annotations

from absl import flags

from jaxrat.cli.entry import TrainedRunFlags, no_positional, run_with_config_overrides, user_errors
from jaxrat.runtime import device_errors
from jaxrat.runtime.console import quiet_libraries

_RUN = TrainedRunFlags(__name__)
_SIZES = flags.DEFINE_string("sizes", None, "Input sizes in pixels, comma-separated, e.g. 128,192,256,384,512.")
_SPACINGS = flags.DEFINE_string("spacings", "1", "Spacing factors >= 1, comma-separated (1: the image as resized; "
                                "2: recorded at twice the pixel size, i.e. half the detail).")
_STEP = flags.DEFINE_string("step", "latest", "Checkpoint to evaluate: a step number, 'best' or 'latest'.")
flags.mark_flags_as_required(["sizes"])


def main(argv: list[str], overrides: list[str]) -> None:
    """Initialise the runtime from the run's config, then evaluate the grid and write the table."""
    from jaxrat.experiments.robustness import parse_sizes, parse_spacings, run_robustness
    from jaxrat.trainer.evaluation import evaluate_checkpoint

    quiet_libraries()
    with user_errors():
        no_positional(argv, "--workdir, --sizes, --spacings, --step and --config.KEY=VALUE")
        sizes, spacings = parse_sizes(_SIZES.value), parse_spacings(_SPACINGS.value)
        workdir, config = _RUN.open(overrides)
        import jax

        with device_errors.in_a_sentence(lambda: f"--config.data.eval_batch_size (now {config.data.eval_batch_size})"):
            run_robustness(config, workdir, sizes=sizes, spacings=spacings, step=_STEP.value,
                           evaluate=evaluate_checkpoint, write=jax.process_index() == 0)


def run() -> None:
    """Console entry point (also ``python -m jaxrat.robustness``)."""
    run_with_config_overrides(main, "python -m jaxrat.robustness")

