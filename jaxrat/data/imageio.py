"""Decoding images and masks from disk into numpy, with errors that name the file."""

from __future__ import annotations

import os

import numpy as np
from PIL import Image, UnidentifiedImageError

from jaxrat.errors import DataError

_FIX = "replace or delete the file (or re-download the dataset)"


def _open(path: str) -> Image.Image:
    try:
        img = Image.open(path)
        img.load()  # decode now so truncated files fail here, not later
        return img
    except FileNotFoundError:
        raise DataError(f"File not found: {path}; check the dataset folder and --config.data.data_dir.") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        size = os.path.getsize(path) if os.path.exists(path) else 0
        what = "is empty" if size == 0 else f"is not a readable image ({e})"
        raise DataError(f"Image file {path} {what}; {_FIX}.") from None


def load_rgb(path: str) -> np.ndarray:
    """Load any PIL-readable image (grayscale, palette, CMYK, 16-bit, RGBA) as uint8 RGB (H, W, 3)."""
    img = _open(path)
    if img.mode in ("I;16", "I;16B", "I;16L", "I"):
        # 16/32-bit grayscale: rescale to 8 bits rather than clip.
        arr = np.asarray(img, dtype=np.float64)
        hi = arr.max() if arr.size and arr.max() > 0 else 1.0
        arr = (arr / hi * 255.0).round().astype(np.uint8)
        return np.repeat(arr[..., None], 3, axis=-1)
    if img.mode != "RGB":
        img = img.convert("RGB")
    return np.asarray(img, dtype=np.uint8)


def load_mask(path: str) -> np.ndarray:
    """Load a binary segmentation mask as uint8 (H, W) with values {0, 1} (foreground > 127)."""
    img = _open(path)
    if img.mode in ("I;16", "I;16B", "I;16L", "I"):
        arr = np.asarray(img) > 0
    else:
        arr = np.asarray(img.convert("L")) > 127
    return arr.astype(np.uint8)
