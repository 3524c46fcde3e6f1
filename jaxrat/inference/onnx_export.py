"""A trained model as ONNX, what ``jaxrat export --format onnx`` runs: convert, check with onnxruntime, write.

The graph is the same inference function as the jax format's (``jaxrat.inference.exporting``): RGB
pixel values 0..255 at the training size in, the ImageNet normalisation inside, probabilities (or
detections) out, the weights as initializers; converted by :mod:`jaxrat.inference.onnx_convert` from
the model built with the portable kernels. The batch dimension is free (any N); the image size is the
training size (fixed: the models' code picks shapes and kernel blocks from it while tracing).

Nothing is written until onnxruntime, run on the graph in memory, reproduced the model's own outputs
(``Predictor.run_batch``) on random pixels at two batch sizes within :data:`TOLERANCE`.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrat.runtime import fileio
from jaxrat.runtime.errors import UserError

ONNX_FILE, LOADER_FILE = "model.onnx", "onnx_loader.py"
# Largest difference allowed between onnxruntime and the model (float32 probabilities or boxes).
TOLERANCE = 1e-4
INSTALL = "pip install 'jaxrat[onnx]'"


def require_onnx() -> None:
    """Refuse (one sentence) when onnx or onnxruntime is not installed."""
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError as e:
        raise UserError(f"--format onnx needs the onnx and onnxruntime packages ({e.name} is missing); install them "
                        f"with {INSTALL}.") from None


def inference_function(predictor: Any) -> tuple[Any, list[tuple[str, tuple[int, ...], Any]], list[str]]:
    """(function of pixels [and pad_mask], graph inputs, output names) of a :class:`Predictor`."""
    from jaxrat.data.transforms import IMAGENET_MEAN, IMAGENET_STD

    s, kind = predictor.image_size, predictor.kind
    params = jax.device_get(predictor.params)
    mean, std = np.asarray(IMAGENET_MEAN, np.float32), np.asarray(IMAGENET_STD, np.float32)

    def infer(pixels: jax.Array, *pad_mask: jax.Array) -> Any:
        x = (pixels - mean) / std
        return predictor._outputs(params, {"image": x, **({"pad_mask": pad_mask[0]} if pad_mask else {})})

    inputs = [("pixels", (s, s, 3), np.float32)]
    if kind == "detection":
        inputs.append(("pad_mask", (s, s), np.float32))
    shapes = jax.eval_shape(infer, *[jax.ShapeDtypeStruct((1, *shape), dtype) for _, shape, dtype in inputs])
    if kind == "segmentation":
        names = ["probabilities"]
    elif kind == "classification":
        names = [f"probabilities_{head}" for head in predictor.task.heads]
    else:  # a dict: its leaves in jax.tree order (sorted keys)
        names = [str(k) for k in sorted(shapes)]
    if len(names) != len(jax.tree.leaves(shapes)):
        raise UserError(f"The {kind} model returns {len(jax.tree.leaves(shapes))} arrays where the export names "
                        f"{len(names)}; report this with the run's config.json.")
    return infer, inputs, names


def convert(predictor: Any) -> tuple[Any, list[tuple[str, tuple[int, ...], Any]], list[str]]:
    """(ONNX model, graph inputs, output names); refuses in one sentence what the converter cannot write."""
    from jaxrat.inference.onnx_convert import Unsupported, to_onnx

    if predictor.tta.active:
        raise UserError("Export does not include test-time augmentation; export without --tta.")
    infer, inputs, names = inference_function(predictor)
    try:
        model = to_onnx(infer, inputs, names, doc=f"jaxrat {predictor.kind} model, {predictor.workdir} step "
                                                  f"{predictor.step}")
    except Unsupported as e:
        raise UserError(f"This {predictor.config.model.name} model cannot be exported to ONNX: jaxrat's converter has "
                        f"no ONNX form for {e}; export it with --format jax.") from None
    if model.ByteSize() >= 2**31:  # protobuf's limit for one message; ONNX's external data is not written
        raise UserError(f"This {predictor.config.model.name} model cannot be exported to ONNX: its "
                        f"{model.ByteSize() / 2**30:.1f} GiB exceed the 2 GiB of one ONNX file; export it with "
                        f"--format jax.")
    return model, inputs, names


def check(predictor: Any, model_bytes: bytes, inputs: list, seed: int = 0) -> dict[str, Any]:
    """Run the graph with onnxruntime (CPU) and the model on the same random pixels, at batch sizes 1
    and 3; raise unless they agree within :data:`TOLERANCE` (and, for class probabilities, pick the
    same class wherever the model's best two classes differ by more than it)."""
    import onnxruntime

    session = onnxruntime.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(seed)
    s, diff, same_argmax = predictor.image_size, 0.0, True
    for n in (1, 3):  # the free batch dimension, and more than one image in it
        feeds = {"pixels": rng.uniform(0, 255, (n, s, s, 3)).astype(np.float32)}
        if predictor.kind == "detection":
            feeds["pad_mask"] = np.zeros((n, s, s), np.float32)
        from jaxrat.data.transforms import IMAGENET_MEAN, IMAGENET_STD

        x = (feeds["pixels"] - np.asarray(IMAGENET_MEAN, np.float32)) / np.asarray(IMAGENET_STD, np.float32)
        want = jax.tree.leaves(predictor.run_batch({"image": x, **({"pad_mask": feeds["pad_mask"]}
                                                                   if "pad_mask" in feeds else {})}))
        got = session.run(None, {name: feeds[name] for name, _, _ in inputs})
        if predictor.kind == "detection":  # class indices may swap on ties; scores and boxes must agree
            want, got = [want[0], want[2]], [got[0], got[2]]  # boxes, scores (sorted keys: boxes, labels, scores)
        for a, b in zip(want, got):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            diff = max(diff, float(np.max(np.abs(a - b))) if a.size else 0.0)
            # class probabilities: classification (N, classes), multi-class segmentation (N, S, S, classes)
            if (predictor.kind, a.ndim) in (("classification", 2), ("segmentation", 4)):
                top2 = np.sort(a, -1)[..., -2:]
                clear = (top2[..., 1] - top2[..., 0]) > TOLERANCE
                same_argmax &= bool(np.all((a.argmax(-1) == b.argmax(-1))[clear]))
    if not (diff <= TOLERANCE and same_argmax):
        raise UserError(f"export: onnxruntime's outputs differ from the model's by {diff:.3g} (allowed {TOLERANCE})"
                        f"{'' if same_argmax else ' and pick other classes'}; nothing was written, report this with "
                        f"the run's config.json.")
    return {"verified": True, "max_abs_diff": diff, "argmax_equal": same_argmax,
            "onnxruntime": onnxruntime.__version__}


def contract(predictor: Any, inputs: list, names: list[str], model: Any, checked: dict[str, Any]) -> dict[str, Any]:
    """``model.json``: the jax format's contract, for any batch size, with the graph's names and the converter."""
    import onnx

    import jaxrat
    from jaxrat.inference.exporting import contract as jax_contract
    from jaxrat.inference.onnx_convert import BATCH, OPSET

    out_avals = [jax.ShapeDtypeStruct([d.dim_value for d in o.type.tensor_type.shape.dim], jnp.float32)
                 for o in model.graph.output]
    c = jax_contract(predictor, 0, (), out_avals)
    c.pop("platforms")
    c["format"] = f"ONNX opset {OPSET}"
    c["onnx"] = {
        "opset": OPSET, "converter": f"jaxrat.inference.onnx_convert (jaxrat {jaxrat.__version__}, jax "
                                     f"{jax.__version__})",
        "onnx_version": onnx.__version__, "verified_with": f"onnxruntime {checked['onnxruntime']} (CPU)",
        "max_abs_diff": checked["max_abs_diff"],
        "inputs": [{"name": n, "shape": [BATCH, *shape], "dtype": np.dtype(dt).name} for n, shape, dt in inputs],
        "outputs": [{"name": o.name, "shape": [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim],
                     "dtype": onnx.helper.tensor_dtype_to_np_dtype(o.type.tensor_type.elem_type).name}
                    for o in model.graph.output],
    }
    return c


def export_onnx(predictor: Any, out: str, claim: Any = None, seed: int = 0) -> dict[str, Any]:
    """Convert, check with onnxruntime, then (``claim()`` first, when given) write ``ONNX_FILE``, the
    contract and the loader to ``out``; returns the check."""
    import shutil

    from jaxrat.inference import onnx_loader

    model, inputs, names = convert(predictor)
    data = model.SerializeToString()
    checked = check(predictor, data, inputs, seed)
    c = contract(predictor, inputs, names, model, checked)
    if claim is not None:
        claim()
    os.makedirs(out, exist_ok=True)
    fileio.write_bytes(os.path.join(out, ONNX_FILE), data)
    fileio.write_json(os.path.join(out, onnx_loader.CONTRACT_FILE), c, indent=2)
    shutil.copyfile(onnx_loader.__file__, os.path.join(out, LOADER_FILE))
    return checked
