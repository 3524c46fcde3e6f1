"""Decoding images and masks from disk into numpy, with errors that name the file.

Odd but valid files are converted, never rejected: grayscale, palette, CMYK, RGBA, 16-bit and
float images all come back as uint8 RGB; PNG and JPEG are both fine whatever the extension says.
Broken files raise :class:`BadFileError` (a :class:`DataError`) naming the file and the problem,
so the bad-file policy (``jaxrat.data.badfiles``) can fail or skip them.

Every image and mask is turned by its EXIF orientation (:func:`upright`), in training, evaluation
and prediction alike: pixels and sizes are the image as viewers and annotation tools show it, so a
phone photo and the mask drawn on it line up.
"""

from __future__ import annotations

import dataclasses
import io
import os
from typing import Sequence, Union

import numpy as np
from PIL import Image, UnidentifiedImageError

from jaxrat.runtime.errors import DataError

try:  # HEIC/HEIF, iPhones' photos, through the pillow-heif plugin where it is installed (jaxrat[heic])
    import pillow_heif
except ImportError:
    HEIF = False
else:
    pillow_heif.register_heif_opener()
    HEIF = True

HEIF_EXTENSIONS = (".heic", ".heif")
RAW_EXTENSIONS = (".dng", ".cr2", ".cr3", ".nef", ".arw", ".raf", ".orf", ".rw2", ".pef", ".srw")
_HEIF_FIX = "which Pillow reads only with the pillow-heif package: pip install pillow-heif (or 'jaxrat[heic]')"
_RAW_FIX = "which jaxrat does not read: export them as JPEG, PNG or TIFF"


def photos_not_read(names: Sequence[str]) -> str:
    """What among the file ``names`` this installation cannot read however sound the files are:
    HEIC/HEIF photos without pillow-heif, camera raw files; "" when none. Listed as images by
    nobody, they would otherwise vanish from a dataset without a word."""
    heif = [n for n in names if n.lower().endswith(HEIF_EXTENSIONS)] if not HEIF else []
    raw = [n for n in names if n.lower().endswith(RAW_EXTENSIONS)]
    parts = [f"{len(found)} {what} (e.g. {os.path.basename(found[0])}), {fix}"
             for found, what, fix in ((heif, "HEIC/HEIF photo(s)", _HEIF_FIX), (raw, "camera raw file(s)", _RAW_FIX))
             if found]
    return "; ".join(parts)


_FIX = "replace or delete the file (or re-download the dataset), or set --config.data.on_bad_file=skip"
# Modes that carry more than 8 bits per sample: rescaled to 8 bits rather than clipped.
_WIDE_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I", "F")


class BadFileError(DataError):
    """A dataset file that cannot be used: ``path`` and a short ``problem`` for the skip list."""

    def __init__(self, path: str, problem: str, fix: str = _FIX):
        self.path, self.problem, self.fix = path, problem, fix
        super().__init__(f"{path}: {problem}; {fix}.")

    def __reduce__(self):
        # Grain workers send exceptions back pickled; the default would call cls(message) and fail.
        return type(self), (self.path, self.problem, self.fix)


@dataclasses.dataclass(frozen=True)
class Encoded:
    """An encoded image held in memory (e.g. a TFDS record's bytes); ``name`` is what errors show."""

    name: str
    data: bytes


Source = Union[str, Encoded]


def source_name(path: Source) -> str:
    """The path, or the name of in-memory bytes, for messages."""
    return path.name if isinstance(path, Encoded) else path


def _size_problem(path: Source) -> str | None:
    if isinstance(path, Encoded):
        return None if path.data else "file is empty"
    if not os.path.exists(path):
        return "file not found"
    if os.path.getsize(path) == 0:
        return "file is empty"
    return None


def _open(path: Source, draft_to: tuple[int, int] | None = None) -> tuple[Image.Image, tuple[int, int]]:
    """Open and fully decode ``path``, turned upright; returns (image, full upright size (w, h))."""
    problem = _size_problem(path)
    name = source_name(path)
    if problem:
        raise BadFileError(name, problem)
    try:
        img = Image.open(io.BytesIO(path.data) if isinstance(path, Encoded) else path)
        size = img.size
        if draft_to is not None and img.format == "JPEG":
            # JPEG can decode at 1/2, 1/4 or 1/8 scale for free; draft keeps the result >= draft_to
            # (asked of the stored pixels, which a quarter turn swaps; a JPEG's EXIF is in its header).
            img.draft("RGB", draft_to[::-1] if _orientation(img) in _QUARTER_TURNS else draft_to)
        img.load()  # decode now so truncated files fail here, not later
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise BadFileError(name, photos_not_read([name]) or f"not a readable image ({type(e).__name__}: {e})") from None
    orientation = _orientation(img)  # after load: a PNG may carry its EXIF after the pixels
    return upright(img, name, orientation), size[::-1] if orientation in _QUARTER_TURNS else size


# EXIF orientations that turn the image a quarter (swapping width and height).
_QUARTER_TURNS = (5, 6, 7, 8)


def _orientation(img: Image.Image) -> int:
    try:
        return int(img.getexif().get(0x0112, 1) or 1)
    except (ValueError, OSError, SyntaxError, TypeError):  # a damaged EXIF block: the pixels are still good
        return 1


def upright(img: Image.Image, name: str = "", orientation: int | None = None) -> Image.Image:
    """``img`` turned as its EXIF orientation says (as a viewer shows it): the one place jaxrat
    applies the orientation, for images and masks alike."""
    orientation = _orientation(img) if orientation is None else orientation
    if orientation == 1:
        return img
    from PIL import ImageOps

    try:
        return ImageOps.exif_transpose(img)
    except (ValueError, OSError, SyntaxError, TypeError) as e:
        raise BadFileError(name or str(getattr(img, "filename", "")),
                           f"its EXIF orientation cannot be applied ({e})") from None


def probe(path: str) -> tuple[int, int]:
    """(width, height) as the image is shown (EXIF orientation applied) from the file header only;
    raises BadFileError for missing, empty or non-image files. Cheap (no pixel decoding), so a whole
    dataset can be checked before training."""
    problem = _size_problem(path)
    if problem:
        raise BadFileError(path, problem)
    try:
        with Image.open(path) as img:
            return img.size[::-1] if _orientation(img) in _QUARTER_TURNS else img.size
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise BadFileError(path, photos_not_read([path]) or f"not a readable image ({type(e).__name__}: {e})") from None


def exif_orientation(path: str) -> int:
    """The EXIF orientation tag of an image file (1: upright, 5-8: turned a quarter), 1 if none."""
    try:
        with Image.open(path) as img:
            return _orientation(img)
    except (OSError, ValueError, SyntaxError):
        return 1


def to_rgb(img: Image.Image) -> np.ndarray:
    """Any PIL image as uint8 RGB (H, W, 3)."""
    if img.mode in _WIDE_MODES:
        arr = np.asarray(img, dtype=np.float64)
        lo, hi = (float(arr.min()), float(arr.max())) if arr.size else (0.0, 1.0)
        if img.mode == "F":  # no nominal range: stretch over the image's own
            arr = (arr - lo) / max(hi - lo, 1e-12)
        else:
            # Scale by the smallest common bit depth that holds the data (8, 10, 12, 16, 32 bits),
            # so 8-bit data stored in 16 bits is unchanged and 12-bit scans are not left dark.
            full = next((2.0**b - 1 for b in (8, 10, 12, 16, 32) if hi <= 2.0**b - 1), hi)
            arr = np.clip(arr, 0, None) / full
        arr = (arr * 255.0).round().astype(np.uint8)
        return np.repeat(arr[..., None], 3, axis=-1)
    return np.asarray(_as_rgb(img), dtype=np.uint8)


def _as_rgb(img: Image.Image) -> Image.Image:
    """8-bit modes as an RGB PIL image (alpha dropped)."""
    if img.mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")  # PIL warns when a palette with transparency goes straight to RGB
    if img.mode == "LAB":  # e.g. CIELAB TIFFs: PIL converts LAB only through a colour profile
        from PIL import ImageCms

        lab, srgb = ImageCms.createProfile("LAB"), ImageCms.createProfile("sRGB")
        return ImageCms.applyTransform(img, ImageCms.buildTransform(lab, srgb, "LAB", "RGB"))
    return img if img.mode == "RGB" else img.convert("RGB")


def _convert(name: str, img: Image.Image, convert):
    try:
        return convert(img)
    except (ValueError, OSError, ImportError) as e:  # a mode PIL cannot convert (LAB without littlecms): named
        raise BadFileError(name, f"colour mode {img.mode} cannot be converted ({type(e).__name__}: {e})") from None


def load_rgb_with_size(path: Source, at_least: tuple[int, int] | None = None) -> tuple[np.ndarray, tuple[int, int]]:
    """Decode ``path`` (a file or :class:`Encoded` bytes) as uint8 RGB, turned by its EXIF
    orientation; with ``at_least=(w, h)`` a JPEG may be decoded at a reduced scale that is still at
    least that large (much faster for big photos resized for training).
    Returns (pixels, (w, h) of the full-size upright image)."""
    img, size = _open(path, at_least)
    return _convert(source_name(path), img, to_rgb), size


def load_rgb(path: str) -> np.ndarray:
    """Load any PIL-readable image (grayscale, palette, CMYK, 16-bit, RGBA) as uint8 RGB (H, W, 3)."""
    return load_rgb_with_size(path)[0]


def load_mask(path: Source) -> np.ndarray:
    """Load a binary segmentation mask as uint8 (H, W) with values {0, 1}.

    8-bit masks: foreground is > 127 (official ISIC masks are 0/255; anti-aliased edges split at
    half), except that a mask whose values are all 0 or 1 is a label map and 1 is foreground.
    Colour and palette masks use their brightest colour channel (a white or red lesion on black),
    alpha is ignored. 16-bit and float masks: any non-zero value.
    """
    return binary_mask(mask_levels(path))


def mask_levels(path: Source) -> np.ndarray:
    """The 8-bit levels (H, W) that :func:`load_mask` thresholds: grey levels, a colour mask's brightest
    channel, 0/255 for a 1-bit or a 16-bit/float mask's zero/non-zero."""
    img, _ = _open(path)
    if img.mode in _WIDE_MODES:
        return np.where(np.asarray(img) > 0, 255, 0).astype(np.uint8)
    if img.mode != "L":
        img = _convert(source_name(path), img, lambda i: i.convert("L") if i.mode == "1" else _as_rgb(i))
    arr = np.asarray(img)
    return arr.max(axis=-1) if arr.ndim == 3 else arr


def binary_mask(arr: np.ndarray) -> np.ndarray:
    """An 8-bit mask array, (H, W) or (H, W, C) colour, as uint8 {0, 1} by the rule of :func:`load_mask`."""
    if arr.ndim == 3:
        arr = arr.max(axis=-1)
    return (arr > binary_threshold(int(arr.max(initial=0)))).astype(np.uint8)


def binary_threshold(top: int) -> int:
    """The level above which a binary mask whose highest level is ``top`` is foreground: 0 for 0/1 masks,
    127 otherwise (0/255 masks, anti-aliased edges split at half)."""
    return 0 if top <= 1 else 127
