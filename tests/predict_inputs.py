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


# Runs exported.py from an export folder in a process where importing jaxrat fails, and saves what
# predict_image returns (an array, or {head: array} as an .npz).
_LOADER = """
import importlib.util, json, sys
sys.modules["jaxrat"] = None  # any import of jaxrat now raises ImportError
import numpy as np
spec = importlib.util.spec_from_file_location("exported", sys.argv[1] + "/exported.py")
exported = importlib.util.module_from_spec(spec)
spec.loader.exec_module(exported)
out = exported.load(sys.argv[1]).predict_image(sys.argv[2])
np.savez(sys.argv[3], **(out if isinstance(out, dict) else {"out": out}))
"""


def run_exported_loader(export_dir: str, image: str, save_to: str, env: dict) -> dict:
    """``exported.load(export_dir).predict_image(image)`` without jaxrat importable; the arrays it
    returned by name (``out`` for one array)."""
    import subprocess
    import sys

    env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", _LOADER, export_dir, image, save_to], cwd=os.path.dirname(save_to),
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(save_to) as f:
        return dict(f)


# Runs Python code in a process that has only the standard library, numpy, onnxruntime and PIL: importing
# jax, jaxlib, flax or jaxrat raises ImportError (so a loader that reached for them fails), and the
# process prints, last, the jax/flax/jaxrat modules it ended up with (none).
_ONNX_ONLY = """
import json, sys
for name in ("jax", "jaxlib", "flax", "jaxrat"):
    sys.modules[name] = None
exec(compile(sys.argv[1], "<onnx-only>", "exec"), {"__name__": "__main__", "ARGS": sys.argv[2:]})
print(json.dumps(sorted(m for m, v in sys.modules.items() if v is not None and m.split(".")[0] in
                        ("jax", "jaxlib", "flax", "jaxrat"))))
"""


def run_onnx_only(code: str, *args: str, cwd: str, env: dict) -> str:
    """Run ``code`` (``ARGS`` holds ``args``) where jax, flax and jaxrat cannot be imported; its stdout.
    Fails unless it exits 0 having imported none of them."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", _ONNX_ONLY, code, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []
    return proc.stdout


ONNX_LOADER = """
import importlib.util, numpy as np
export, image, save_to = ARGS
spec = importlib.util.spec_from_file_location("onnx_loader", export + "/onnx_loader.py")
loader = importlib.util.module_from_spec(spec)
spec.loader.exec_module(loader)
out = loader.load(export).predict_image(image)
np.savez(save_to, **(out if isinstance(out, dict) else {"out": out}))
"""


def run_onnx_loader(export_dir: str, image: str, save_to: str, env: dict) -> dict:
    """``onnx_loader.load(export_dir).predict_image(image)`` with only onnxruntime, numpy and PIL
    importable; the arrays it returned by name (``out`` for one array)."""
    import numpy as np

    run_onnx_only(ONNX_LOADER, export_dir, image, save_to, cwd=os.path.dirname(save_to), env=env)
    with np.load(save_to) as f:
        return dict(f)
