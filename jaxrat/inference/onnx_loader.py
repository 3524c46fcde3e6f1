"""Run a model written by ``jaxrat export --format onnx`` with onnxruntime: no jax, no jaxrat.

This module imports only the standard library, numpy and onnxruntime (PIL on first use, for images);
``jaxrat export --format onnx`` copies it next to ``model.onnx``::

    from onnx_loader import load
    model = load("export_dir")              # reads model.onnx and model.json
    probs = model(pixels)                   # pixels: (batch, size, size, 3) RGB values 0..255
    prob = model.predict_image("photo.jpg") # binary segmentation: (H, W) probabilities at the photo's size;
                                            # multi-class (H, W, classes); classification {head: probs}

Without this module, onnxruntime alone::

    import onnxruntime as ort
    session = ort.InferenceSession("export_dir/model.onnx")
    probs = session.run(None, {"pixels": pixels})[0]  # pixels: float32 (N, S, S, 3), RGB 0..255

``model.json`` holds the input contract (as for ``jaxrat export``'s jax format): ``image_size``,
``channel_order`` (RGB), 0..255 inputs (the ImageNet normalisation is inside the model), ``letterbox``,
``threshold`` (binary segmentation), ``classes`` or ``labels``, ``outputs``, ``output_shape`` and, under
``onnx``, the graph's input and output names, the opset and the converter.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

MODEL_FILE, CONTRACT_FILE = "model.onnx", "model.json"


class OnnxModel:
    """An ONNX export on onnxruntime: callable on (N, size, size, 3) pixel arrays, any N."""

    def __init__(self, directory: str, providers: list[str] | None = None) -> None:
        import onnxruntime

        with open(os.path.join(directory, CONTRACT_FILE)) as f:
            self.contract: dict[str, Any] = json.load(f)
        self.session = onnxruntime.InferenceSession(os.path.join(directory, MODEL_FILE),
                                                    providers=providers or ["CPUExecutionProvider"])
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.image_size = int(self.contract["image_size"])

    def __call__(self, pixels: np.ndarray, *extra: np.ndarray) -> Any:
        """The model's outputs for ``pixels`` (N, size, size, 3) in 0..255 (and, for detection,
        ``pad_mask`` (N, size, size), 1 on padding): segmentation one array, classification a list
        (one array per head, in ``contract["heads"]`` order), detection ``{name: array}``."""
        arrays = [np.asarray(pixels, np.float32), *(np.asarray(e, np.float32) for e in extra)]
        outs = self.session.run(None, dict(zip(self.input_names, arrays)))
        task = self.contract.get("task", "segmentation")
        if task == "detection":
            return dict(zip(self.output_names, outs))
        return list(outs) if task == "classification" else outs[0]

    # The rest is exported.py's, line for line (tests/unit/test_onnx_convert.py checks they stay equal).
    def predict_image(self, path: str) -> Any:
        """The model's answer for the image file ``path``, preprocessed as ``jaxrat.predict`` does
        (reduced-scale JPEG decoding, EXIF orientation, bilinear resizes; stretched, not
        letterboxed, unless the contract says ``letterbox``). Binary segmentation: (H, W)
        foreground probabilities at the photo's size; multi-class segmentation: (H, W, classes)
        class probabilities (``argmax(-1)`` is the label map, ``contract["classes"]`` names them);
        classification: ``{head: (classes,) probabilities}`` (``contract["labels"]`` names them);
        detection: ``{"boxes": (K, 4) x1, y1, x2, y2 in the photo's pixels, "scores": (K,), "labels": (K,)
        indices into contract["categories"]}``, best first."""
        from PIL import Image

        task = self.contract.get("task", "segmentation")
        if task not in ("segmentation", "classification", "detection"):
            raise ValueError(f"predict_image reads one image for segmentation, classification or detection; this "
                             f"export is {task}: call the model on pixels as contract['input'] says.")
        image, (h, w) = read_upright(path, self.image_size)
        s = self.image_size
        if self.contract.get("letterbox"):
            scale = min(s / h, s / w)
            ch, cw = max(1, min(s, round(h * scale))), max(1, min(s, round(w * scale)))
            pixels = np.zeros((s, s, 3), np.uint8)
            pixels[:ch, :cw] = np.asarray(Image.fromarray(image).resize((cw, ch), Image.BILINEAR))
        else:
            ch, cw = s, s
            pixels = image if image.shape[:2] == (s, s) else np.asarray(
                Image.fromarray(image).resize((s, s), Image.BILINEAR))
        if task == "detection":  # the padding masked, the canvas-normalised boxes mapped to the photo
            pad = np.ones((1, s, s), np.float32)
            pad[0, :ch, :cw] = 0.0
            out = self(pixels[None], pad)
            canvas = np.asarray([s / cw, s / ch, s / cw, s / ch], np.float32)
            boxes = np.clip(np.asarray(out["boxes"][0], np.float32) * canvas, 0.0, 1.0)
            return {"boxes": boxes * np.asarray([w, h, w, h], np.float32),
                    "scores": np.asarray(out["scores"][0], np.float32), "labels": np.asarray(out["labels"][0])}
        out = self(pixels[None])
        if task == "classification":
            return {head: np.asarray(p[0], np.float32) for head, p in zip(self.contract["heads"], out)}
        prob = np.asarray(out[0], np.float32)[:ch, :cw]
        if prob.ndim == 3:  # class probabilities: each class's map resized on its own
            return np.stack([_resized(prob[..., k], h, w) for k in range(prob.shape[-1])], -1)
        return _resized(prob, h, w)


def _resized(prob: np.ndarray, h: int, w: int) -> np.ndarray:
    """A (h', w') float map resized (bilinear) to (h, w), as jaxrat maps probabilities back."""
    from PIL import Image

    if prob.shape == (h, w):
        return np.asarray(prob, np.float32)
    return np.asarray(Image.fromarray(np.ascontiguousarray(prob, np.float32)).resize((w, h), Image.BILINEAR))


def read_upright(path: str, at_least: int) -> tuple[np.ndarray, tuple[int, int]]:
    """(uint8 RGB pixels, full (h, w)) of an image file: JPEGs decoded at a reduced scale no smaller
    than ``at_least``, turned by their EXIF orientation, any mode converted as jaxrat does."""
    from PIL import Image, ImageOps

    img = Image.open(path)
    w, h = img.size
    if img.format == "JPEG":
        img.draft("RGB", (at_least, at_least))
    img.load()
    try:
        orientation = int(img.getexif().get(0x0112, 1) or 1)
    except (ValueError, OSError, SyntaxError, TypeError):
        orientation = 1
    if orientation != 1:
        img = ImageOps.exif_transpose(img)
        if orientation in (5, 6, 7, 8):
            w, h = h, w
    if img.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        arr = np.asarray(img, np.float64)
        lo, hi = (float(arr.min()), float(arr.max())) if arr.size else (0.0, 1.0)
        if img.mode == "F":
            arr = (arr - lo) / max(hi - lo, 1e-12)
        else:
            full = next((2.0**b - 1 for b in (8, 10, 12, 16, 32) if hi <= 2.0**b - 1), hi)
            arr = np.clip(arr, 0, None) / full
        arr = (arr * 255.0).round().astype(np.uint8)
        return np.repeat(arr[..., None], 3, -1), (h, w)
    if img.mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    return np.asarray(img.convert("RGB"), np.uint8), (h, w)


def load(directory: str, providers: list[str] | None = None) -> OnnxModel:
    """The ONNX export in ``directory`` on onnxruntime (``providers``: default the CPU)."""
    return OnnxModel(directory, providers)
