"""Test-time augmentation (``--tta``) and sliding-window tiling (``--tile``) of segmentation and
classification outputs.

TTA runs inside the jitted forward pass: each view (a mirror, a rescaled copy) goes through the
model, its output is mapped back onto the input's grid, and the probabilities are averaged.
Tiling runs on the host: an image larger than the window is cut into overlapping windows, each is
predicted (with TTA when asked) and the windows are blended with a Gaussian weight that trusts a
window's centre more than its border (as nnU-Net does).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxrat.runtime.errors import UserError

# Rescaled views are rounded to a multiple of this many pixels (the models' downsampling).
SCALE_MULTIPLE = 8


@dataclasses.dataclass(frozen=True)
class TTA:
    """``flip``: mirrored views (segmentation: left-right and up-down; classification: left-right,
    since photos have an up); ``scales``: input scale factors (1 is the plain view)."""

    flip: bool = False
    scales: tuple[float, ...] = (1.0,)

    @property
    def active(self) -> bool:
        return self.flip or self.scales != (1.0,)

    def describe(self) -> str:
        parts = (["flip"] if self.flip else []) + ([f"scale={':'.join(f'{s:g}' for s in self.scales)}"]
                                                 if self.scales != (1.0,) else [])
        return ",".join(parts) or "none"


def parse_tta(spec: str) -> TTA:
    """``""``/``none``, ``flip``, ``scale=0.75:1:1.25`` or both, comma-separated."""
    spec = (spec or "").strip()
    if spec in ("", "none"):
        return TTA()
    flip, scales = False, (1.0,)
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        if part == "flip":
            flip = True
        elif part.startswith("scale="):
            try:
                scales = tuple(float(s) for s in part[len("scale="):].split(":") if s)
            except ValueError:
                scales = ()
            if not scales or any(s <= 0 for s in scales):
                raise UserError(f"--tta {spec}: scales must be positive numbers separated by ':', "
                                f"e.g. scale=0.75:1:1.25.")
        else:
            raise UserError(f"--tta {spec}: unknown part {part!r}; use flip, scale=A:B:C, or both separated by ','.")
    return TTA(flip, scales)


def _scaled_side(side: int, scale: float) -> int:
    return max(SCALE_MULTIPLE, int(round(side * scale / SCALE_MULTIPLE)) * SCALE_MULTIPLE)


def segmentation_probs(logits_fn: Callable[[jax.Array], jax.Array], images: jax.Array, tta: TTA) -> jax.Array:
    """(B, H, W) foreground probabilities of ``images`` (B, H, W, 3), averaged over ``tta``'s views;
    (B, H, W, C) class probabilities (softmax) for a model with C >= 2 output channels."""
    b, h, w, c = images.shape
    flips = [(), (2,), (1,)] if tta.flip else [()]
    total, n = 0.0, 0
    for s in tta.scales:
        size = (h, w) if s == 1 else (_scaled_side(h, s), _scaled_side(w, s))
        x = images if size == (h, w) else jax.image.resize(images, (b, *size, c), "linear")
        for axes in flips:
            view = jnp.flip(x, axes) if axes else x
            logits = logits_fn(view).astype(jnp.float32)
            p = jax.nn.sigmoid(logits)[..., 0] if logits.shape[-1] == 1 else jax.nn.softmax(logits, -1)
            p = jnp.flip(p, axes) if axes else p
            if size != (h, w):
                p = jax.image.resize(p, (b, h, w, *p.shape[3:]), "linear")
            total, n = total + p, n + 1
    return total / n


def classification_probs(logits_fn: Callable[[jax.Array], list], images: jax.Array, tta: TTA) -> list[jax.Array]:
    """Per head (B, classes) softmax probabilities averaged over ``tta``'s views (left-right mirror only)."""
    b, h, w, c = images.shape
    flips = [(), (2,)] if tta.flip else [()]
    total, n = None, 0
    for s in tta.scales:
        size = (h, w) if s == 1 else (_scaled_side(h, s), _scaled_side(w, s))
        x = images if size == (h, w) else jax.image.resize(images, (b, *size, c), "linear")
        for axes in flips:
            probs = [jax.nn.softmax(lg.astype(jnp.float32), -1) for lg in logits_fn(jnp.flip(x, axes) if axes else x)]
            total = probs if total is None else [t + p for t, p in zip(total, probs)]
            n += 1
    return [t / n for t in total]


class TTAModel:
    """A model seen through test-time augmentation, for a task's eval step: called like the model,
    it returns the logits of the views' averaged probabilities (segmentation: (B, H, W, 1);
    classification: one (B, classes) array per head), so the task's metrics and loss apply as is."""

    def __init__(self, model: Callable, tta: TTA, kind: str) -> None:
        if kind not in ("segmentation", "classification"):
            raise UserError(f"--tta is for segmentation and classification, not {kind}; drop --tta.")
        self.model, self.tta, self.kind = model, tta, kind

    def __call__(self, images: jax.Array) -> jax.Array | list[jax.Array]:
        if self.kind == "segmentation":
            p = jnp.clip(segmentation_probs(self.model, images, self.tta), 1e-7, 1 - 1e-7)
            return (jnp.log(p) - jnp.log1p(-p))[..., None]
        return [jnp.log(jnp.maximum(p, 1e-30)) for p in classification_probs(self.model, images, self.tta)]


# ------------------------------------------------------------------------------------ tiling

def window_starts(length: int, window: int, overlap: float) -> list[int]:
    """Start offsets of windows of ``window`` covering ``length`` with at least ``overlap`` (0..1) shared."""
    if length <= window:
        return [0]
    step = max(1, int(window * (1.0 - overlap)))
    n = math.ceil((length - window) / step) + 1
    # Spread evenly so the last window ends exactly at the border.
    return [int(round(i * (length - window) / (n - 1))) for i in range(n)]


def gaussian_weight(window: int, sigma_fraction: float = 1.0 / 8) -> np.ndarray:
    """(window, window) Gaussian importance map, peak 1, never 0 (nnU-Net's sigma = window / 8)."""
    x = np.arange(window, dtype=np.float64) - (window - 1) / 2
    g = np.exp(-0.5 * (x / (window * sigma_fraction)) ** 2)
    w = np.outer(g, g)
    w /= w.max()
    return np.maximum(w, 1e-3).astype(np.float32)


def tiles(height: int, width: int, window: int, overlap: float) -> list[tuple[int, int]]:
    """(y, x) top-left corners of the windows covering an ``height x width`` image."""
    return [(y, x) for y in window_starts(height, window, overlap) for x in window_starts(width, window, overlap)]


def blend(height: int, width: int, window: int, corners: list[tuple[int, int]], probs: list[np.ndarray]) -> np.ndarray:
    """The (height, width) map of window probabilities ``probs`` at ``corners``, Gaussian-weighted;
    (height, width, C) for windows of class probabilities (each class blended alike, so each pixel's
    classes still sum to 1)."""
    weight = gaussian_weight(window)
    classes = np.shape(probs[0])[2:] if probs else ()
    acc = np.zeros((max(height, window), max(width, window), *classes), np.float32)
    norm = np.zeros(acc.shape[:2], np.float32)
    spread = weight.reshape(weight.shape + (1,) * len(classes))
    for (y, x), p in zip(corners, probs):
        acc[y:y + window, x:x + window] += p * spread
        norm[y:y + window, x:x + window] += weight
    return (acc / np.maximum(norm, 1e-12).reshape(norm.shape + (1,) * len(classes)))[:height, :width]


def check_tiling(tile: int, overlap: float) -> None:
    """One sentence when ``--tile``/``--overlap`` cannot work."""
    if tile < SCALE_MULTIPLE or tile % SCALE_MULTIPLE:
        raise UserError(f"--tile {tile}: use a window side that is a multiple of {SCALE_MULTIPLE}, e.g. the "
                        f"training size.")
    if not 0 <= overlap < 1:
        raise UserError(f"--overlap {overlap}: use a fraction in [0, 1), e.g. 0.5.")
