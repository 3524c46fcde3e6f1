"""Awkward input folders for prediction tests: odd sizes and modes, an EXIF-rotated photo, a
corrupt file, nested folders and two images sharing a name."""

from __future__ import annotations

import os

import numpy as np
from PIL import Image

# name -> (width, height) as a viewer shows the image (EXIF orientation applied)
EXPECTED_SIZES = {
    "a.jpg": (53, 37), "a.png": (40, 64), "sub/gray.png": (70, 50), "sub/rgba.png": (33, 30),
    "sub/cmyk.jpg": (61, 45), "sub/deeper/pal.png": (29, 41), "sub/deeper/i16.png": (47, 33),
    "sub/exif6.jpg": (40, 80),
}
CORRUPT = "sub/broken.jpg"


def write_inputs(root: str) -> None:
    """Write the folder described by :data:`EXPECTED_SIZES` and :data:`CORRUPT` under ``root``."""
    rng = np.random.default_rng(0)
    os.makedirs(os.path.join(root, "sub", "deeper"), exist_ok=True)

    def rgb(w: int, h: int) -> Image.Image:
        yy, xx = np.mgrid[:h, :w]
        disc = ((yy - h / 2) ** 2 + (xx - w / 2) ** 2) < (min(h, w) / 3) ** 2
        a = rng.integers(150, 230, (h, w, 3)).astype(np.uint8)
        a[disc] = rng.integers(40, 90, (int(disc.sum()), 3)).astype(np.uint8)
        return Image.fromarray(a)

    p = lambda name: os.path.join(root, *name.split("/"))  # noqa: E731
    rgb(53, 37).save(p("a.jpg"))
    rgb(40, 64).save(p("a.png"))
    rgb(70, 50).convert("L").save(p("sub/gray.png"))
    rgb(33, 30).convert("RGBA").save(p("sub/rgba.png"))
    rgb(61, 45).convert("CMYK").save(p("sub/cmyk.jpg"))
    rgb(29, 41).convert("P").save(p("sub/deeper/pal.png"))
    Image.fromarray(rng.integers(0, 65535, (33, 47)).astype(np.uint16)).save(p("sub/deeper/i16.png"))
    im = rgb(80, 40)  # stored 80 x 40, shown turned a quarter: 40 x 80
    exif = im.getexif()
    exif[0x0112] = 6
    im.save(p("sub/exif6.jpg"), exif=exif)
    with open(p(CORRUPT), "wb") as f:
        f.write(b"\xff\xd8\xff\xe0 not really a jpeg")


def snapshot(root: str) -> dict[str, bytes]:
    """Every file under ``root`` and its bytes."""
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                out[os.path.relpath(os.path.join(d, f), root)] = fh.read()
    return out
