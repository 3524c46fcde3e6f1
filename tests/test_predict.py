"""python -m jaxrat.predict and the Predictor: masks at each image's own size, awkward inputs, refusals."""

import csv
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from predict_inputs import CORRUPT, EXPECTED_SIZES, snapshot, write_inputs
from runner import REPO, env_with_devices, run_main

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A smoke segmentation run (trained once for the module)."""
    wd = str(tmp_path_factory.mktemp("predict") / "run")
    run_main(wd, "--config.task.eval_original_resolution=True", devices=1)
    return wd


def _predict(*args, devices=2):
    return subprocess.run([sys.executable, "-m", "jaxrat.predict", "--noprogress", *args], cwd=REPO,
                          env=env_with_devices(devices), capture_output=True, text=True, timeout=300)


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_predict_folder_writes_a_mask_per_readable_image_at_its_size(trained, tmp_path):
    src, out = str(tmp_path / "in"), str(tmp_path / "out")
    write_inputs(src)
    before = snapshot(src)
    proc = _predict(f"--workdir={trained}", f"--input={src}", f"--out={out}", "--save_probs=png16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "predicted 8 images" in proc.stdout and "1 skipped" in proc.stdout
    assert snapshot(src) == before  # the input folder is byte-identical
    rows = {r["image"]: r for r in _rows(os.path.join(out, "predictions.csv"))}
    assert set(rows) == set(EXPECTED_SIZES)
    masks = {}
    for d, _, files in os.walk(os.path.join(out, "masks")):
        for f in files:
            masks[os.path.relpath(os.path.join(d, f), os.path.join(out, "masks")).replace(os.sep, "/")] = f
    assert len(masks) == len(EXPECTED_SIZES)  # a.jpg and a.png keep their extensions: no collision
    for name, (w, h) in EXPECTED_SIZES.items():
        stem = name if name.startswith("a.") else os.path.splitext(name)[0]
        mask = Image.open(os.path.join(out, "masks", stem + ".png"))
        assert mask.size == (w, h), name
        m = np.asarray(mask)
        assert set(np.unique(m)) <= {0, 255}
        assert (int(rows[name]["width"]), int(rows[name]["height"])) == (w, h)
        assert float(rows[name]["foreground_fraction"]) == pytest.approx((m > 0).mean(), abs=1e-6)
        probs = np.asarray(Image.open(os.path.join(out, "probs", stem + ".png"))).astype(np.float64) / 65535
        assert probs.shape == (h, w)
        assert float(rows[name]["mean_probability"]) == pytest.approx(probs.mean(), abs=1e-4)
        assert Image.open(os.path.join(out, "overlays", stem + ".jpg")).size[0] > 0
    skipped = open(os.path.join(out, "skipped.txt")).read()
    assert os.path.join(src, *CORRUPT.split("/")) in skipped and skipped.count("\n") == 1

    proc = _predict(f"--workdir={trained}", f"--input={src}", f"--out={out}")
    assert proc.returncode == 2 and "exists and is not empty" in proc.stderr and "Traceback" not in proc.stderr
    proc = _predict(f"--workdir={trained}", f"--input={src}", f"--out={os.path.join(src, 'preds')}")
    assert proc.returncode == 2 and "inside the input folder" in proc.stderr
    assert snapshot(src) == before
    listed = tmp_path / "list.txt"
    listed.write_text(f"{src}/a.png\n{src}/sub/gray.png\n")
    proc = _predict(f"--workdir={trained}", f"--input={listed}", f"--out={out}", "--overwrite", devices=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["image"] for r in _rows(os.path.join(out, "predictions.csv"))] == ["a.png", "sub/gray.png"]
    assert not os.path.exists(os.path.join(out, "skipped.txt")) and not os.path.exists(os.path.join(out, "probs"))


def test_predictor_on_arrays_matches_the_files_it_wrote(trained, tmp_path):
    from jaxrat.inference import Predictor

    p = Predictor.from_workdir(trained)
    assert p.kind == "segmentation" and p.batch_size % 8 == 0
    rng = np.random.default_rng(1)
    images = [rng.integers(0, 255, (h, w, 3), dtype=np.uint8) for h, w in ((20, 90), (64, 64), (7, 5))]
    preds = p(images + [images[0][..., 0]])
    for im, pred in zip(images, preds):
        assert pred.probability.shape == im.shape[:2] and pred.mask.dtype == bool
        assert ((pred.probability >= p.threshold) == pred.mask).all()
    np.testing.assert_allclose(preds[3].probability, p([np.repeat(images[0][..., :1], 3, -1)])[0].probability)
    # The command's mask of a PNG (decoded at full size) is the Predictor's mask of the same pixels.
    src, out = tmp_path / "in", str(tmp_path / "out")
    src.mkdir()
    Image.fromarray(images[0]).save(src / "x.png")
    proc = _predict(f"--workdir={trained}", f"--input={src / 'x.png'}", f"--out={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = np.asarray(Image.open(os.path.join(out, "masks", "x.png"))) > 0
    assert (written == preds[0].mask).mean() > 0.999  # two device counts: float noise at the threshold at most
