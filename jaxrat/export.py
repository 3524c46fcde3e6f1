"""Export a trained model: ``python -m jaxrat.export --workdir W --out DIR [--step best|latest|N]
[--platforms cpu,cuda] [--batch N]``.

Writes ``DIR/model.jax`` (the inference function serialised with ``jax.export``, weights
included), ``DIR/model.json`` (the input contract: size, channel order, normalisation, threshold,
label names, what the outputs mean) and ``DIR/exported.py`` (a loader that needs only jax, numpy
and PIL), and says done only after the deserialised program reproduced the model's outputs
(<= 1e-5) on this machine. See docs/predict.md.
"""

from __future__ import annotations

import os
import shutil

from absl import flags

from jaxrat.config.loader import ALLOW_IMPORT_HELP
from jaxrat.runtime import output_folder
from jaxrat.runtime.console import fail, quiet_libraries, run_with_config_overrides
from jaxrat.runtime.errors import UserError

_WORKDIR = flags.DEFINE_string("workdir", None, "A training workdir (holds config.json and checkpoints/).")
_ALLOW_IMPORT = flags.DEFINE_multi_string("allow_import", [], ALLOW_IMPORT_HELP)
_STEP = flags.DEFINE_string("step", "", "Checkpoint: a step number, 'best' or 'latest' (default: the best when the "
                            "run ranked one, else the latest).")
_OUT = flags.DEFINE_string("out", None, "Output folder (new or empty; see --overwrite).")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace an export in an existing non-empty --out.")
_PLATFORMS = flags.DEFINE_string("platforms", "cpu", "Comma-separated platforms to lower for: cpu, cuda, rocm, tpu.")
_BATCH = flags.DEFINE_integer("batch", 1, "The exported program's batch size (the loader pads to it); 0: any "
                               "batch size, for models whose code allows a symbolic batch (the U-Net; not RAT).")
flags.mark_flags_as_required(["workdir", "out"])


def main(argv: list[str], overrides: list[str]) -> None:
    """Load the run with portable kernels, export, verify, copy the loader."""
    quiet_libraries()
    try:
        if argv[1:]:
            raise UserError(f"Unexpected arguments {argv[1:]}; pass --workdir, --out, --platforms, --batch.")
        platforms = tuple(p.strip() for p in _PLATFORMS.value.split(",") if p.strip())
        if not platforms or _BATCH.value < 0:
            raise UserError("Pass --platforms as e.g. cpu or cpu,cuda and --batch as a number >= 0.")
        from jaxrat.inference import exported
        from jaxrat.inference.checkpoint_choice import choose
        from jaxrat.inference.exporting import export_model, portable
        from jaxrat.inference.predictor import Predictor
        from jaxrat.trainer.evaluation import open_trained_run

        workdir, config = open_trained_run(_WORKDIR.value, overrides, _ALLOW_IMPORT.value)
        # Before the minutes of loading and exporting: never the run's files or its data, writable,
        # not full; --overwrite replaces only a previous export's files. (A non-empty --out was once
        # refused before this, telling a user who pointed it at the workdir to pass --overwrite.)
        output_folder.check(_OUT.value, output_folder.run_inputs(workdir, config), command="export", what="export")
        output_folder.claim(_OUT.value, command="export", overwrite=_OVERWRITE.value,
                            files=[exported.MODEL_FILE, exported.CONTRACT_FILE, "exported.py"])
        predictor = Predictor(portable(config), workdir, choose(workdir, _STEP.value), batch_size=_BATCH.value or 0)
        check = export_model(predictor, _OUT.value, platforms=platforms, batch=_BATCH.value)
        shutil.copyfile(exported.__file__, os.path.join(_OUT.value, "exported.py"))
        said = (f"verified: max difference {check['max_abs_diff']:.2g}" if check["verified"]
                else "not verified on this machine (no matching platform)")
        print(f"jaxrat: exported {predictor.kind} model (step {predictor.step}) for {', '.join(platforms)} to "
              f"{_OUT.value}; {said}", flush=True)
    except UserError as e:
        fail(str(e))


def run() -> None:
    """Console entry point (also ``python -m jaxrat.export``)."""
    run_with_config_overrides(main)


if __name__ == "__main__":
    run()
