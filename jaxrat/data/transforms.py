"""Seeded Grain transforms on example dicts, aware of masks and boxes.

An example is a dict with ``image`` (uint8 H x W x 3) and optionally ``mask`` (uint8, nearest-
neighbour resampled; straight from a decoder it may be larger than a JPEG decoded at reduced
scale, and the first resize or resized crop takes it from its original size to the target in one
resampling, see :func:`align_mask`), ``boxes`` (float32 N x 4, normalised ``x1, y1, x2, y2`` in [0, 1])
with per-box arrays (``labels``, ``is_crowd``, ``area``) kept in step with them. Any other key
is passed through. Every geometric op moves the mask and the boxes with the image, so the same op
serves segmentation and detection; random ops draw only from the ``rng`` Grain gives them (seeded
by the dataset seed and the element's global index), so a stream is reproducible exactly.
"""

from __future__ import annotations

import dataclasses
import math
import re

import grain
import numpy as np
from PIL import Image

from jaxrat.data.geometry import (  # noqa: F401  (re-exported: transforms is where callers look)
    PER_BOX_KEYS,
    Example,
    _filter_boxes,
    _hw,
    align_mask,
    crop,
    full_size,
    letterbox_shape,
    pad,
    pil_resize,
    resize,
)
from jaxrat.runtime.errors import ConfigError

_LEVEL_KEY = re.compile(r"(image|mask)(_\d+)?")  # image, image_1, mask_2, ... (not image_id)
IMAGENET_MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
IMAGENET_STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)
# Largest displacement difference between neighbouring pixels (pixels per pixel) in ElasticDeform;
# below 0.5 the warp x -> x + d(x) cannot fold (its Jacobian stays positive).
MAX_ELASTIC_STRAIN = 0.4


@dataclasses.dataclass(frozen=True)
class Resize(grain.transforms.Map):
    """Resize to ``size`` (int or (h, w)). ``keep_aspect``: scale to fit inside, then pad the
    bottom/right with zeros (background for masks) instead of distorting the image."""

    size: int | tuple[int, int]
    keep_aspect: bool = False

    def map(self, ex: Example) -> Example:
        h, w = _hw(self.size)
        if not self.keep_aspect:
            return resize(ex, h, w)
        # The stored size: a JPEG decoded at reduced scale may round differently.
        return pad(resize(ex, *letterbox_shape(*full_size(ex), self.size)), h, w)


@dataclasses.dataclass(frozen=True)
class Coarsen(grain.transforms.Map):
    """The image as if recorded at ``spacing`` times its pixel spacing and resampled back onto its
    grid: downsampled (antialiased) by ``spacing``, then upsampled to its own size. Labels (mask,
    boxes) are left as they are: the scene is the same, only its detail is lost."""

    spacing: float = 1.0

    def map(self, ex: Example) -> Example:
        if self.spacing == 1.0:
            return ex
        ex = dict(ex)
        h, w = ex["image"].shape[:2]
        small = pil_resize(ex["image"], max(1, round(h / self.spacing)), max(1, round(w / self.spacing)), False)
        ex["image"] = pil_resize(small, h, w, nearest=False)
        return ex


@dataclasses.dataclass(frozen=True)
class RandomResizedCrop(grain.transforms.RandomMap):
    """Crop a random region covering ``scale`` of the area with aspect ratio in ``ratio`` (log-
    uniform), then resize it to ``size`` (the Inception/torchvision recipe)."""

    size: int | tuple[int, int]
    scale: tuple[float, float] = (0.5, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)

    def random_map(self, ex: Example, rng: np.random.Generator) -> Example:
        H, W = ex["image"].shape[:2]
        y0, x0, ch, cw = self.window(H, W, rng)
        h, w = _hw(self.size)
        mask = ex.get("mask")
        if mask is None or mask.shape[:2] == (H, W):
            return resize(crop(ex, y0, x0, ch, cw), h, w)
        # A mask larger than a reduced JPEG decode: the same window, in its own pixels, resampled once.
        sy, sx = mask.shape[0] / H, mask.shape[1] / W
        box = (x0 * sx, y0 * sy, (x0 + cw) * sx, (y0 + ch) * sy)
        out = resize(crop({k: v for k, v in ex.items() if k != "mask"}, y0, x0, ch, cw), h, w)
        out["mask"] = np.asarray(Image.fromarray(mask).resize((w, h), Image.NEAREST, box=box))
        return out

    def window(self, H: int, W: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
        """The crop ``(y0, x0, h, w)`` for an ``H x W`` image: its area ``h * w`` lies in
        ``scale * H * W`` (whole pixels; an image too small or too elongated for that gets a
        central crop of its own aspect and about ``scale[1]`` of its area)."""
        lo, hi = self.scale[0] * H * W, self.scale[1] * H * W
        for _ in range(10):
            area = rng.uniform(lo, hi)
            r = math.exp(rng.uniform(math.log(self.ratio[0]), math.log(self.ratio[1])))
            cw, ch = round(math.sqrt(area * r)), round(math.sqrt(area / r))
            # Rounding to whole pixels can leave the area range (0.48 for scale 0.5 on 5 x 5): redraw.
            if 0 < cw <= W and 0 < ch <= H and lo <= cw * ch <= hi:
                return int(rng.integers(0, H - ch + 1)), int(rng.integers(0, W - cw + 1)), ch, cw
        # No draw fitted (an aspect far outside ``ratio``, a tiny image): a central crop of the
        # image's own aspect at the largest allowed area (the whole image when scale[1] is 1).
        f = math.sqrt(self.scale[1])
        ch, cw = min(H, max(1, math.floor(H * f))), min(W, max(1, math.floor(W * f)))
        return (H - ch) // 2, (W - cw) // 2, ch, cw


@dataclasses.dataclass(frozen=True)
class RandomCrop(grain.transforms.RandomMap):
    """A random ``size`` crop; smaller images are zero-padded (bottom/right) first."""

    size: int | tuple[int, int]

    def random_map(self, ex: Example, rng: np.random.Generator) -> Example:
        h, w = _hw(self.size)
        H, W = ex["image"].shape[:2]
        if H < h or W < w:
            ex = pad(ex, max(H, h), max(W, w))
            H, W = ex["image"].shape[:2]
        y0, x0 = int(rng.integers(0, H - h + 1)), int(rng.integers(0, W - w + 1))
        return crop(ex, y0, x0, h, w)


@dataclasses.dataclass(frozen=True)
class ScaleJitter(grain.transforms.RandomMap):
    """Rescale by a random factor in ``scale`` (aspect kept), then random-crop or zero-pad back to
    ``size``: objects appear larger or smaller while the output shape stays fixed."""

    size: int | tuple[int, int]
    scale: tuple[float, float] = (0.8, 1.25)

    def random_map(self, ex: Example, rng: np.random.Generator) -> Example:
        h, w = _hw(self.size)
        H, W = ex["image"].shape[:2]
        s = rng.uniform(*self.scale) * min(h / H, w / W)
        ex = resize(ex, max(1, round(H * s)), max(1, round(W * s)))
        return RandomCrop((h, w)).random_map(ex, rng)


@dataclasses.dataclass(frozen=True)
class RandomFlip(grain.transforms.RandomMap):
    """Flip left-right with probability ``horizontal`` and up-down with probability ``vertical``."""

    horizontal: float = 0.5
    vertical: float = 0.5

    def random_map(self, ex: Example, rng: np.random.Generator) -> Example:
        ex = dict(align_mask(ex))
        for axis, p in ((1, self.horizontal), (0, self.vertical)):
            if rng.random() < p:
                ex["image"] = np.flip(ex["image"], axis=axis)
                if "mask" in ex:
                    ex["mask"] = np.flip(ex["mask"], axis=axis)
                if "boxes" in ex:
                    b = ex["boxes"].copy()
                    i, j = (0, 2) if axis == 1 else (1, 3)
                    b[:, i], b[:, j] = 1.0 - ex["boxes"][:, j], 1.0 - ex["boxes"][:, i]
                    ex["boxes"] = b
        return ex


@dataclasses.dataclass(frozen=True)
class RandomRotation(grain.transforms.RandomMap):
    """Rotate about the centre by an angle uniform in [-degrees, degrees] (counter-clockwise
    positive), same size, corners filled with zeros. Boxes become the axis-aligned box around
    their rotated corners, clipped to the image."""

    degrees: float

    def random_map(self, ex: Example, rng: np.random.Generator) -> Example:
        angle = float(rng.uniform(-self.degrees, self.degrees))
        return rotate(ex, angle)


def rotate(ex: Example, angle: float) -> Example:
    """Deterministic rotation by ``angle`` degrees counter-clockwise (see RandomRotation)."""
    ex = dict(align_mask(ex))
    H, W = ex["image"].shape[:2]
    ex["image"] = np.asarray(Image.fromarray(ex["image"]).rotate(angle, Image.BILINEAR, fillcolor=(0, 0, 0)))
    if "mask" in ex:
        ex["mask"] = np.asarray(Image.fromarray(ex["mask"]).rotate(angle, Image.NEAREST, fillcolor=0))
    if "boxes" in ex and len(ex["boxes"]):
        b = ex["boxes"] * np.array([W, H, W, H], np.float32)
        corners = np.stack([b[:, [0, 1]], b[:, [2, 1]], b[:, [0, 3]], b[:, [2, 3]]], axis=1)  # N,4,2
        c = np.array([W / 2, H / 2], np.float32)
        t = math.radians(angle)
        # Counter-clockwise on screen is clockwise in (x right, y down) coordinates.
        rot = np.array([[math.cos(t), math.sin(t)], [-math.sin(t), math.cos(t)]], np.float32)
        p = (corners - c) @ rot.T + c
        nb = np.concatenate([p.min(axis=1), p.max(axis=1)], axis=1)
        nb = np.clip(nb, 0, np.array([W, H, W, H], np.float32))
        keep = (nb[:, 2] > nb[:, 0]) & (nb[:, 3] > nb[:, 1])
        ex["boxes"] = (nb / np.array([W, H, W, H], np.float32)).astype(np.float32)
        ex = _filter_boxes(ex, keep)
    return ex


@dataclasses.dataclass(frozen=True)
class ColorJitter(grain.transforms.RandomMap):
    """Random brightness, contrast and saturation factors in [1-x, 1+x] and a hue shift in
    [-hue, hue] (fraction of the colour wheel). Image only: masks and boxes are untouched."""

    brightness: float = 0.1
    contrast: float = 0.1
    saturation: float = 0.1
    hue: float = 0.05

    def random_map(self, ex: Example, rng: np.random.Generator) -> Example:
        ex = dict(ex)
        img = ex["image"].astype(np.float32)
        f = lambda x: rng.uniform(max(0.0, 1 - x), 1 + x)  # noqa: E731
        b, c, s = f(self.brightness), f(self.contrast), f(self.saturation)
        h = rng.uniform(-self.hue, self.hue)
        img = img * b
        gray = img @ np.array([0.299, 0.587, 0.114], np.float32)
        img = (img - gray.mean()) * c + gray.mean()
        gray = img @ np.array([0.299, 0.587, 0.114], np.float32)
        img = (img - gray[..., None]) * s + gray[..., None]
        img = np.clip(img, 0, 255)
        if h:
            img = _shift_hue(img, h)
        img = np.rint(img).astype(np.uint8)
        ex["image"] = img
        return ex


def _shift_hue(img: np.ndarray, shift: float) -> np.ndarray:
    """Rotate the HSV hue of float RGB pixels by ``shift`` turns, keeping value and saturation
    exactly (PIL's 8-bit HSV round trip changed pixels by up to 5 levels even for a zero shift)."""
    v, m = img.max(-1), img.min(-1)
    c = v - m
    r, g, b = img[..., 0], img[..., 1], img[..., 2]
    safe = np.where(c > 0, c, 1)
    h6 = np.where(v == r, (g - b) / safe, np.where(v == g, (b - r) / safe + 2, (r - g) / safe + 4))
    h6 = (h6 + 6 * shift) % 6
    k = (np.array([5, 3, 1], np.float32) + h6[..., None]) % 6
    return v[..., None] - c[..., None] * np.clip(np.minimum(k, 4 - k), 0, 1)


@dataclasses.dataclass(frozen=True)
class ElasticDeform(grain.transforms.RandomMap):
    """Elastic deformation (Simard et al. 2003), applied with probability ``prob``: a random
    displacement field smoothed by a Gaussian of ``sigma`` pixels, scaled so that no pixel moves
    more than ``alpha`` pixels and neighbouring pixels never cross (the bound is reached when
    ``sigma`` is about ``alpha`` or more; smaller ``sigma`` gives a smaller, finer warp); image
    bilinear, mask nearest. Segmentation only (boxes cannot follow a non-rigid warp)."""

    alpha: float = 34.0
    sigma: float = 4.0
    prob: float = 1.0

    def random_map(self, ex: Example, rng: np.random.Generator) -> Example:
        from scipy import ndimage

        if "boxes" in ex:
            raise ConfigError("ElasticDeform cannot move boxes; disable elastic deformation for detection.")
        if rng.random() >= self.prob:
            return ex
        ex = dict(align_mask(ex))
        H, W = ex["image"].shape[:2]
        dy, dx = (ndimage.gaussian_filter(rng.uniform(-1, 1, (H, W)), self.sigma, mode="constant") for _ in range(2))
        # alpha bounds how far a pixel moves (the length of its move, not each axis alone) ...
        scale = self.alpha / max(float(np.hypot(dy, dx).max()), 1e-12)
        # ... and the field is flattened further where reaching alpha would fold the image over
        # itself (neighbours swapping places, a scramble rather than a deformation): alpha=34 with
        # sigma=4 moved neighbours up to ~5 px apart. A larger sigma lets a larger alpha through.
        steepest = max(float(np.abs(np.stack(np.gradient(f))).max()) for f in (dy, dx))
        scale = min(scale, MAX_ELASTIC_STRAIN / max(steepest, 1e-12))
        yy, xx = np.mgrid[0:H, 0:W].astype(np.float32)
        coords = [yy + dy * scale, xx + dx * scale]
        # Interpolated in float and rounded: map_coordinates on uint8 truncates (a 0.5 level bias).
        img = ex["image"].astype(np.float32)
        ex["image"] = np.rint(np.stack(
            [ndimage.map_coordinates(img[..., ch], coords, order=1, mode="reflect") for ch in range(3)], -1
        )).astype(np.uint8)
        if "mask" in ex:
            ex["mask"] = ndimage.map_coordinates(ex["mask"], coords, order=0, mode="reflect").astype(np.uint8)
        return ex


@dataclasses.dataclass(frozen=True)
class Pyramid(grain.transforms.Map):
    """Add coarser levels for multi-scale models: ``image_k``/``mask_k`` resized (antialiased) from
    level 0 by ``scales[k-1]``, and ``spacing_k`` (float32 (2,), y then x), the level's pixel size
    in level-0 pixels, exact for the rounded level size (e.g. (2, 2) at scale 0.5). ``spacing`` is
    level 0's (1, 1). Boxes are normalised, so they hold for every level."""

    scales: tuple[float, ...] = (0.5, 0.25)

    def map(self, ex: Example) -> Example:
        ex = dict(align_mask(ex))
        H, W = ex["image"].shape[:2]
        ex["spacing"] = np.ones(2, np.float32)
        for k, (h, w) in enumerate(self.level_shapes(H, W), start=1):
            ex[f"image_{k}"] = np.asarray(Image.fromarray(ex["image"]).resize((w, h), Image.BOX))
            if "mask" in ex:
                ex[f"mask_{k}"] = pil_resize(ex["mask"], h, w, nearest=True)
            ex[f"spacing_{k}"] = np.array([H / h, W / w], np.float32)
        return ex

    def level_shapes(self, h: int, w: int) -> list[tuple[int, int]]:
        """(h, w) of levels 1.. for a level-0 image of (h, w)."""
        return [(max(1, round(h * s)), max(1, round(w * s))) for s in self.scales]


@dataclasses.dataclass(frozen=True)
class Normalize(grain.transforms.Map):
    """uint8 ``image*`` -> float32 (x - mean) / std; ``mask*`` -> float32 (H, W, 1) in {0, 1}."""

    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD

    def map(self, ex: Example) -> Example:
        mean, std = np.asarray(self.mean, np.float32), np.asarray(self.std, np.float32)
        ex = align_mask(ex)  # a pipeline without a resize: batches need the mask on the image grid
        out = {}
        for k, v in ex.items():
            if _LEVEL_KEY.fullmatch(k) and k.startswith("image"):
                out[k] = (v.astype(np.float32) - mean) / std
            elif _LEVEL_KEY.fullmatch(k):
                out[k] = v.astype(np.float32)[..., None]
            else:
                out[k] = v
        return out


def pad_boxes(ex: Example, max_boxes: int) -> Example:
    """Fixed-size box arrays for batching: the first ``max_boxes`` boxes, zero-padded, with
    ``box_valid`` (float32) marking real ones."""
    ex = dict(ex)
    n = min(len(ex["boxes"]), max_boxes)
    for k in PER_BOX_KEYS:
        if k in ex:
            v = ex[k]
            out = np.zeros((max_boxes, *v.shape[1:]), v.dtype)
            out[:n] = v[:n]
            ex[k] = out
    ex["box_valid"] = (np.arange(max_boxes) < n).astype(np.float32)
    return ex
