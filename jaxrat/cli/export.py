"""Export a trained model: ``python -m jaxrat.export --workdir W --out DIR [--step best|latest|N]
[--format jax|onnx] [--platforms cpu,cuda] [--batch N]``.

``--format jax`` (default) writes ``DIR/model.jax`` (the inference function serialised with
``jax.export``, weights included), ``DIR/model.json`` (the input contract: size, channel order,
normalisation, threshold, label names, what the outputs mean) and ``DIR/exported.py`` (a loader that
needs only jax, numpy and PIL), and says done only after the deserialised program reproduced the
model's outputs (<= 1e-5) on this machine. ``--format onnx`` writes ``DIR/model.onnx`` (any batch
size), the same ``model.json`` and ``DIR/onnx_loader.py`` (onnxruntime, numpy and PIL only), after
onnxruntime reproduced the model's outputs (<= 1e-4). See docs/predict.md.
"""

from __future__ import annotations

import contextlib
import os
import shutil

from absl import flags

from jaxrat.cli.entry import TrainedRunFlags, no_positional, run_with_config_overrides, user_errors
from jaxrat.runtime import output_folder
from jaxrat.runtime.console import quiet_libraries
from jaxrat.runtime.errors import UserError

_RUN = TrainedRunFlags(__name__)
_STEP = flags.DEFINE_string("step", "", "Checkpoint: a step number, 'best' or 'latest' (default: the best when the "
                            "run ranked one, else the latest).")
_OUT = flags.DEFINE_string("out", None, "Output folder (new or empty; see --overwrite).")
_FORMAT = flags.DEFINE_enum("format", "jax", ["jax", "onnx"], "jax: a jax.export program (model.jax); onnx: an ONNX "
                            "graph for onnxruntime, TensorRT, OpenVINO (model.onnx; needs jaxrat[onnx]).")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace an export in an existing non-empty --out.")
_PLATFORMS = flags.DEFINE_string("platforms", "cpu", "--format jax: comma-separated platforms to lower for: cpu, "
                                 "cuda, rocm, tpu.")
_BATCH = flags.DEFINE_integer("batch", 1, "--format jax: the exported program's batch size (the loader pads to it); "
                              "0: any batch size, for models whose code allows a symbolic batch (the U-Net; not RAT). "
                              "ONNX exports take any batch size.")
flags.mark_flags_as_required(["out"])


def main(argv: list[str], overrides: list[str]) -> None:
    """Load the run with portable kernels, export, verify, copy the loader."""
    quiet_libraries()
    with user_errors():
        no_positional(argv, "--workdir, --out, --format, --platforms, --batch")
        from jaxrat.inference.checkpoint_choice import check_step

        check_step(_STEP.value)
        platforms = tuple(p.strip() for p in _PLATFORMS.value.split(",") if p.strip())
        if not platforms:
            raise UserError(f"--platforms {_PLATFORMS.value!r} names no platform; pass e.g. cpu or cpu,cuda.")
        if _BATCH.value < 0:
            raise UserError(f"--batch {_BATCH.value} is negative; pass the exported batch size, or 0 for any.")
        onnx = _FORMAT.value == "onnx"
        if onnx and (flags.FLAGS["batch"].present or flags.FLAGS["platforms"].present):
            raise UserError("--batch and --platforms are for --format jax; an ONNX export takes any batch size and "
                            "runs wherever onnxruntime does: drop them.")
        if onnx:
            from jaxrat.inference.onnx_export import require_onnx

            require_onnx()
        from jaxrat.inference import exported
        from jaxrat.inference.checkpoint_choice import choose
        from jaxrat.inference.exporting import export_model, platform_names, portable
        from jaxrat.inference.predictor import Predictor
        platforms = platform_names(platforms)
        workdir, config = _RUN.open(overrides)
        # Before the minutes of loading and exporting: never the run's files or its data, writable,
        # not full; --overwrite replaces only a previous export's files. (A non-empty --out was once
        # refused before this, telling a user who pointed it at the workdir to pass --overwrite.)
        existed = os.path.exists(_OUT.value)
        output_folder.check(_OUT.value, output_folder.run_inputs(workdir, config), command="export", what="export")
        output_folder.refuse_taken(_OUT.value, command="export", overwrite=_OVERWRITE.value)
        if onnx:
            _export_onnx(workdir, config, existed)
            return
        output_folder.claim(_OUT.value, command="export", overwrite=_OVERWRITE.value,
                            files=[exported.MODEL_FILE, exported.CONTRACT_FILE, "exported.py"])
        predictor = Predictor(portable(config), workdir, choose(workdir, _STEP.value), batch_size=_BATCH.value or 0)
        check = export_model(predictor, _OUT.value, platforms=platforms, batch=_BATCH.value)
        shutil.copyfile(exported.__file__, os.path.join(_OUT.value, "exported.py"))
        said = (f"verified: max difference {check['max_abs_diff']:.2g}" if check["verified"]
                else "not verified on this machine (no matching platform)")
        print(f"jaxrat: exported {predictor.kind} model (step {predictor.step}) for {', '.join(platforms)} to "
              f"{_OUT.value}; {said}", flush=True)


def _export_onnx(workdir: str, config, existed: bool) -> None:
    """Convert and check in memory, then claim --out and write: a model that cannot be exported, or
    whose graph onnxruntime does not reproduce, leaves nothing behind (not even the folder, when new)."""
    from jaxrat.inference.checkpoint_choice import choose
    from jaxrat.inference.exporting import portable
    from jaxrat.inference.onnx_export import LOADER_FILE, ONNX_FILE, export_onnx
    from jaxrat.inference.onnx_loader import CONTRACT_FILE
    from jaxrat.inference.predictor import Predictor

    predictor = Predictor(portable(config), workdir, choose(workdir, _STEP.value), batch_size=1)
    claim = lambda: output_folder.claim(_OUT.value, command="export", overwrite=_OVERWRITE.value,
                                        files=[ONNX_FILE, CONTRACT_FILE, LOADER_FILE])
    try:
        check = export_onnx(predictor, _OUT.value, claim=claim)
    except UserError:
        if not existed:
            with contextlib.suppress(OSError):
                os.rmdir(_OUT.value)  # only when still empty
        raise
    print(f"jaxrat: exported {predictor.kind} model (step {predictor.step}) as ONNX to {_OUT.value}; verified with "
          f"onnxruntime: max difference {check['max_abs_diff']:.2g}", flush=True)


def run() -> None:
    """Console entry point (also ``python -m jaxrat.export``)."""
    run_with_config_overrides(main, "python -m jaxrat.export")

