"""Serialise a trained model's inference function with ``jax.export`` (StableHLO), what
``python -m jaxrat.export`` runs.

The function takes RGB pixel values 0..255 at the training size (normalisation inside) and returns
probabilities (binary segmentation (B, S, S), multi-class (B, S, S, classes); classification one
(B, classes) array per head) or
detections (scores, class indices, boxes normalised x1, y1, x2, y2 on the canvas). The weights are
constants of the serialised program. The model is built with ``config.model.kernels="portable"``
where the config has that key (no platform-specific custom calls, which cannot be serialised).
Before anything is reported done, the deserialised function is run and compared with the model.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrat.inference.exported import CONTRACT_FILE, MODEL_FILE, Exported
from jaxrat.runtime import fileio
from jaxrat.runtime.errors import UserError

# Largest difference allowed between the deserialised function and the model.
TOLERANCE = 1e-5
# The platform names jax.export lowers for and its loader compares with jax.default_backend():
# a name outside them ("CPU", "bogus") exported fine and then refused to load anywhere.
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


def platform_names(platforms: Sequence[str]) -> tuple[str, ...]:
    """``platforms`` lower-cased, each once, in order; a UserError for a name jax.export does not know."""
    names = tuple(dict.fromkeys(p.strip().lower() for p in platforms if p.strip()))
    for name in names:
        if name == "gpu":
            raise UserError("--platforms gpu: jax.export names a GPU by its runtime; pass cuda (NVIDIA) or rocm "
                            "(AMD).")
        if name not in PLATFORMS:
            raise UserError(f"--platforms {name} is not a platform jax.export knows; pass {', '.join(PLATFORMS[:-1])} "
                            f"or {PLATFORMS[-1]} (several separated by commas, e.g. cpu,cuda).")
    return names


def portable(config: Any) -> Any:
    """``config`` with the portable kernel policy when it has ``model.kernels`` (left as is otherwise)."""
    if "kernels" in config.model:
        with config.unlocked():
            config.model.kernels = "portable"
    return config


def contract(predictor: Any, batch: int, platforms: Sequence[str], out_avals: Sequence[Any] = ()) -> dict[str, Any]:
    """The JSON written beside the program: what goes in, what comes out (``out_avals``: the
    program's output shapes, which size each classification head's labels)."""
    from jaxrat.data.transforms import IMAGENET_MEAN, IMAGENET_STD

    s = predictor.image_size
    c: dict[str, Any] = {
        "format": "jax.export (StableHLO), jax " + jax.__version__, "platforms": list(platforms),
        "task": predictor.kind, "image_size": s, "batch_size": batch or None, "channel_order": "RGB",
        "input": f"float32 (batch, {s}, {s}, 3) pixel values 0..255, the image resized to {s} x {s}"
                 + (" (letterboxed: scaled to fit, padded at the bottom/right with 0)" if predictor.keep_aspect
                    else " (stretched, bilinear)"),
        "letterbox": bool(predictor.keep_aspect),
        "normalisation": {"mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD),
                          "applied": "inside the program: (pixels - mean) / std"},
        "threshold": predictor.threshold, "workdir": predictor.workdir, "step": predictor.step,
    }
    if predictor.kind == "segmentation":
        names = list(getattr(predictor.task, "class_names", ()))
        if len(names) > 1:  # class maps: softmax over the classes, the argmax is the label
            c["outputs"] = (f"float32 (batch, {s}, {s}, {len(names)}) softmax probability of each class in the "
                            f"order of classes; a pixel's label is the most likely class (0: {names[0]})")
            c["output_shape"] = ["batch", s, s, len(names)]
            c["classes"], c["threshold"] = names, None
        else:
            c["outputs"] = f"float32 (batch, {s}, {s}) foreground probability; a pixel is foreground at >= threshold"
            c["output_shape"] = ["batch", s, s]
            c["classes"] = ["background", "foreground"]
    elif predictor.kind == "classification":
        c["outputs"] = "one float32 (batch, classes) softmax probability array per head, in the order of heads"
        c["heads"] = list(predictor.task.heads)
        sizes = [int(a.shape[-1]) for a in out_avals] if out_avals else [0] * len(c["heads"])
        c["output_shape"] = {h: ["batch", n] for h, n in zip(c["heads"], sizes)}
        # Every class named (its number where the data had no label string), in output order.
        c["labels"] = {h: [predictor.label_name(h, i) for i in range(n)] for h, n in zip(c["heads"], sizes)}
        c["threshold"] = None
    else:
        c["input"] += f"; second input float32 pad_mask (batch, {s}, {s}), 1 on padding"
        c["outputs"] = ("scores (batch, K), class indices (batch, K) into categories, boxes (batch, K, 4) x1, y1, "
                        "x2, y2 normalised to the canvas")
        c["categories"] = [{"index": i, "id": cid, "name": n} for i, (cid, n) in
                           enumerate(zip(predictor.category_ids, predictor.category_names))]
    return c


def export_model(predictor: Any, out: str, *, platforms: Sequence[str] = ("cpu",), batch: int = 1,
                 seed: int = 0) -> dict[str, Any]:
    """Write ``MODEL_FILE`` and ``CONTRACT_FILE`` to ``out`` and verify them; returns the check."""
    from jaxrat.data.transforms import IMAGENET_MEAN, IMAGENET_STD

    if predictor.tta.active:
        raise UserError("Export does not include test-time augmentation; export without --tta.")
    platforms = platform_names(platforms)
    s, kind = predictor.image_size, predictor.kind
    params = jax.device_get(predictor.params)  # constants of the program, on no particular device
    mean, std = np.asarray(IMAGENET_MEAN, np.float32), np.asarray(IMAGENET_STD, np.float32)

    def infer(pixels: jax.Array, *pad_mask: jax.Array) -> Any:
        x = (pixels - mean) / std
        return predictor._outputs(params, {"image": x, **({"pad_mask": pad_mask[0]} if pad_mask else {})})

    # batch 0: one symbolic batch dimension (any batch size), where the model's code allows it.
    n = jax.export.symbolic_shape("batch")[0] if batch == 0 else batch
    shapes = [jax.ShapeDtypeStruct((n, s, s, 3), jnp.float32)]
    if kind == "detection":
        shapes.append(jax.ShapeDtypeStruct((n, s, s), jnp.float32))
    try:
        exp = jax.export.export(jax.jit(infer), platforms=tuple(platforms))(*shapes)
    except Exception as e:  # a kernel without a lowering for one of the platforms, or a size-dependent choice
        fix = ("export with a fixed --batch N (this model picks its kernels from the batch's size)" if batch == 0
               else "export for fewer --platforms")
        raise UserError(f"Export for {', '.join(platforms)} failed ({type(e).__name__}: {str(e)[:300]}); "
                        f"{fix}.") from None
    os.makedirs(out, exist_ok=True)
    fileio.write_bytes(os.path.join(out, MODEL_FILE), exp.serialize())
    fileio.write_json(os.path.join(out, CONTRACT_FILE), contract(predictor, batch, platforms, exp.out_avals), indent=2)
    return verify(predictor, out, seed)


def verify(predictor: Any, out: str, seed: int = 0) -> dict[str, Any]:
    """Run the deserialised program and the model on the same random pixels; raise unless they agree."""
    loaded = Exported(out)
    here = jax.default_backend()
    if here not in loaded.exported.platforms:
        logging.warning("export: not verified: this machine runs %s, the export is for %s", here,
                        ", ".join(loaded.exported.platforms))
        return {"verified": False, "max_abs_diff": None}
    rng = np.random.default_rng(seed)
    n, s = (loaded.batch_size or 2) + 1, predictor.image_size  # more than one batch: the loader's padding too
    pixels = rng.uniform(0, 255, (n, s, s, 3)).astype(np.float32)
    from jaxrat.data.transforms import IMAGENET_MEAN, IMAGENET_STD

    x = (pixels - np.asarray(IMAGENET_MEAN, np.float32)) / np.asarray(IMAGENET_STD, np.float32)
    inputs = {"image": x}
    extra = []
    if predictor.kind == "detection":
        inputs["pad_mask"] = np.zeros((n, s, s), np.float32)
        extra = [inputs["pad_mask"]]
    want = predictor.run_batch(inputs)
    got = loaded(pixels, *extra)
    diff = max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
               for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)))
    if predictor.kind == "detection":  # class indices may swap on ties; scores and boxes must agree
        diff = max(float(np.max(np.abs(want["scores"] - got["scores"]))),
                   float(np.max(np.abs(want["boxes"] - got["boxes"]))))
    if not diff <= TOLERANCE:
        raise UserError(f"export: the deserialised program differs from the model by {diff:.3g} (> {TOLERANCE}); "
                        f"the export in {out} is not usable, report this with the run's config.json.")
    return {"verified": True, "max_abs_diff": diff}
