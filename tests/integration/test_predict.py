"""python -m jaxrat.predict and the Predictor: masks at each image's own size, awkward inputs, refusals."""

import csv
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from predict_inputs import CORRUPT, EXPECTED_SIZES, run_onnx_loader, run_onnx_only, snapshot, write_inputs
from runner import REPO, env_with_devices, run_main

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A smoke segmentation run (trained once for the module)."""
    wd = str(tmp_path_factory.mktemp("predict") / "run")
    # Nothing ranked: predict and evaluate default to the latest checkpoint, as the Predictor API does.
    run_main(wd, "--config.task.eval_original_resolution=True", "--config.checkpoint.best_metric=", devices=1)
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
    proc = _predict(f"--workdir={trained}", f"--input={src}", f"--out={out}", "--save-probs=png16")
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


def _evaluate(*args, devices=2):
    return subprocess.run([sys.executable, "-m", "jaxrat.evaluate", *args], cwd=REPO, env=env_with_devices(devices),
                          capture_output=True, text=True, timeout=300)


def _dice_jaccard(pred, truth):
    tp, fp, fn = (pred & truth).sum(), (pred & ~truth).sum(), (~pred & truth).sum()
    dice = 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 1.0
    iou = tp / (tp + fp + fn) if tp + fp + fn else 1.0
    return dice, (iou if iou >= 0.65 else 0.0)


def test_evaluate_per_image_equals_scores_of_the_masks_predict_writes(trained, tmp_path):
    proc = _evaluate(f"--workdir={trained}", "--save-predictions", "--name=saved")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = os.path.join(trained, "eval", "saved")
    result = __import__("json").load(open(os.path.join(out, "metrics.json")))
    logged = [r for r in __import__("runner").read_metrics(trained) if "eval/orig/dice" in r][-1]
    assert result["metrics"]["eval/dice"] == pytest.approx(logged["eval/dice"], abs=1e-6)  # as training logged
    assert result["metrics"]["eval/orig/dice"] == pytest.approx(logged["eval/orig/dice"], abs=1e-6)
    rows = _rows(os.path.join(out, "per_image.csv"))
    assert len(rows) == 8
    val = os.path.join(trained, "synthetic_data", "process_0")  # the run's own, which evaluate read
    images = os.path.join(val, "ISIC2018_Task1-2_Validation_Input")
    truth_dir = os.path.join(val, "ISIC2018_Task1_Validation_GroundTruth")
    # predict on the validation images, as a user would, at another device count and batch size
    predicted = str(tmp_path / "pred")
    proc = _predict(f"--workdir={trained}", f"--input={images}", f"--out={predicted}", "--batch=3", devices=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    dices, jaccards = [], []
    for r in rows:
        stem = os.path.splitext(r["image"])[0]
        truth = np.asarray(Image.open(os.path.join(truth_dir, stem + "_segmentation.png"))) > 127
        for where in (predicted, os.path.join(out, "predictions")):
            pred = np.asarray(Image.open(os.path.join(where, "masks", stem + ".png"))) > 0
            assert pred.shape == truth.shape
            dice, jt = _dice_jaccard(pred, truth)
            assert dice == pytest.approx(float(r["dice"]), abs=1e-4)
            assert jt == pytest.approx(float(r["jaccard_thresholded"]), abs=1e-4)
        dices.append(dice)
        jaccards.append(jt)
    assert np.mean(dices) == pytest.approx(result["metrics"]["eval/orig/dice"], abs=1e-4)
    assert np.mean(jaccards) == pytest.approx(result["metrics"]["eval/orig/jaccard_thresholded"], abs=1e-4)

    proc = _evaluate(f"--workdir={trained}", "--split=train", "--tta=flip")
    assert proc.returncode == 0, proc.stderr[-3000:]
    train = __import__("json").load(open(os.path.join(trained, "eval", "step_6_train_tta-flip", "metrics.json")))
    assert train["config"]["data"]["eval_split"] == "train" and train["metrics"]["eval/num_images"] == 32
    assert len(_rows(os.path.join(trained, "eval", "step_6_train_tta-flip", "per_image.csv"))) == 32
    proc = _evaluate(f"--workdir={trained}", "--split=test")
    assert proc.returncode == 2 and "no test split" in proc.stderr and "Traceback" not in proc.stderr


def test_tta_averages_the_mirrored_views(trained):
    from jaxrat.inference import Predictor
    from jaxrat.inference.augment import parse_tta

    plain = Predictor.from_workdir(trained)
    flip = Predictor.from_workdir(trained, tta=parse_tta("flip"))
    rng = np.random.default_rng(3)
    x = rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)  # the model's own size: no resampling
    views = [plain([x])[0].probability, plain([x[:, ::-1]])[0].probability[:, ::-1],
             plain([x[::-1]])[0].probability[::-1]]
    np.testing.assert_allclose(flip([x])[0].probability, np.mean(views, 0), atol=1e-5)
    scaled = Predictor.from_workdir(trained, tta=parse_tta("flip,scale=0.5:1")).predict([x])[0]
    assert scaled.probability.shape == (32, 32)
    assert not np.allclose(scaled.probability, flip([x])[0].probability, atol=1e-4)
    for bad in ("flop", "scale=", "scale=0:1"):
        with pytest.raises(Exception, match="--tta"):
            parse_tta(bad)


def test_tiles_cover_big_images_at_their_own_size(trained, tmp_path):
    from jaxrat.inference import Predictor
    from jaxrat.inference.augment import blend, tiles, window_starts

    for length, window, overlap in ((128, 32, 0.5), (100, 32, 0.25), (20, 32, 0.5), (33, 32, 0.9)):
        starts = window_starts(length, window, overlap)
        covered = np.zeros(max(length, window), bool)
        for s in starts:
            covered[s:s + window] = True
        assert covered[:length].all() and starts[-1] + window >= length
    corners = tiles(70, 50, 32, 0.5)
    np.testing.assert_allclose(blend(70, 50, 32, corners, [np.full((32, 32), 0.25, np.float32)] * len(corners)), 0.25,
                               rtol=1e-6)

    p = Predictor.from_workdir(trained)
    big = np.asarray(Image.open(os.path.join(trained, "synthetic_data", "process_0",
                                             "ISIC2018_Task1-2_Validation_Input", "ISIC_0000032.jpg")).convert("RGB"))
    big = np.asarray(Image.fromarray(big).resize((128, 128)))  # 4x the training size
    tiled = p.predict_tiled(big, 32, 0.5)
    assert tiled.mask.shape == (128, 128) and tiled.probability.shape == (128, 128)
    # One window as large as the image: the model run once at that size.
    whole = p.predict_tiled(big, 128, 0.5)
    direct = p.run_batch({"image": _normalised(big)[None]})[0]
    np.testing.assert_allclose(whole.probability, direct, atol=1e-5)
    proc = _evaluate(f"--workdir={trained}", "--tile=32", "--overlap=0.5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    tiled_eval = __import__("json").load(open(os.path.join(trained, "eval", "step_6_tile32", "metrics.json")))
    assert tiled_eval["tiling"] == {"tile": 32, "overlap": 0.5}
    assert tiled_eval["metrics"]["eval/orig/num_images"] == 8
    assert len(_rows(os.path.join(trained, "eval", "step_6_tile32", "per_image.csv"))) == 8
    proc = _predict(f"--workdir={trained}", f"--input={tmp_path}", f"--out={tmp_path / 'o'}", "--tile=30")
    assert proc.returncode == 2 and "--tile 30" in proc.stderr


def _normalised(image):
    from jaxrat.data.transforms import Normalize

    return Normalize().map({"image": image})["image"]


LOADER_CHECK = """
import importlib.util, json, sys
import numpy as np
spec = importlib.util.spec_from_file_location("exported", sys.argv[1] + "/exported.py")
exported = importlib.util.module_from_spec(spec)
spec.loader.exec_module(exported)
model = exported.load(sys.argv[1])
prob = model.predict_image(sys.argv[2])
np.save(sys.argv[3], prob)
print(json.dumps(sorted(m for m in sys.modules if m.startswith("jaxrat"))))
"""


def _onnx_export_matches_predict(trained, tmp_path, src, predicted):
    """``export --format onnx``: its contract, the standalone loader and docs/predict.md's example with only
    onnxruntime, numpy and PIL importable, against predict's probabilities and masks; its refusals."""
    out = str(tmp_path / "onnx")
    env = env_with_devices(1)
    proc = subprocess.run([sys.executable, "-m", "jaxrat", "export", f"--workdir={trained}", "--format=onnx",
                           f"--out={out}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "verified with onnxruntime: max difference" in proc.stdout
    assert sorted(os.listdir(out)) == [".jaxrat-outputs.json", "model.json", "model.onnx", "onnx_loader.py"]
    contract = __import__("json").load(open(os.path.join(out, "model.json")))
    assert contract["batch_size"] is None and contract["output_shape"] == ["batch", 32, 32]
    assert contract["onnx"]["opset"] == 17 and "jaxrat.inference.onnx_convert" in contract["onnx"]["converter"]
    assert contract["onnx"]["inputs"] == [{"name": "pixels", "shape": ["batch", 32, 32, 3], "dtype": "float32"}]
    assert contract["onnx"]["max_abs_diff"] <= 1e-4 and contract["threshold"] == 0.5
    for name in ("a.jpg", "sub/exif6.jpg", "sub/deeper/i16.png"):
        stem = name if name.startswith("a.") else os.path.splitext(name)[0]
        have = run_onnx_loader(out, str(src / name), str(tmp_path / "got.npz"), env)["out"]
        want = np.load(os.path.join(predicted, "probs", stem + ".npy"))
        assert have.shape == want.shape == EXPECTED_SIZES[name][::-1]
        np.testing.assert_allclose(have, want, atol=1e-4)
        mask = np.asarray(Image.open(os.path.join(predicted, "masks", stem + ".png"))) > 0
        assert np.array_equal(have >= 0.5, mask)

    # docs/predict.md's example, as written (its paths replaced).
    Image.fromarray(np.full((40, 50, 3), 120, np.uint8)).save(tmp_path / "photo.png")
    code = _docs_onnx_example().replace("EXPORT", out) + "\nprint(probs.shape, prob.shape)\n"
    assert "(32, 32) (40, 50)" in run_onnx_only(code, cwd=str(tmp_path), env=env)

    proc = subprocess.run([sys.executable, "-m", "jaxrat", "export", f"--workdir={trained}", "--format=onnx",
                           f"--out={out}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "exists and is not empty" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "jaxrat", "export", f"--workdir={trained}", "--format=onnx",
                           "--batch=2", f"--out={tmp_path / 'other'}"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and "--batch and --platforms are for --format jax" in proc.stderr
    assert not os.path.exists(tmp_path / "other")


def test_export_runs_without_jaxrat_and_matches_predict(trained, tmp_path):
    out = str(tmp_path / "export")
    proc = subprocess.run([sys.executable, "-m", "jaxrat.export", f"--workdir={trained}", f"--out={out}", "--batch=2",
                           "--platforms=cpu,cuda"], cwd=REPO, env=env_with_devices(2), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "verified: max difference" in proc.stdout
    contract = __import__("json").load(open(os.path.join(out, "model.json")))
    assert contract["image_size"] == 32 and contract["channel_order"] == "RGB" and contract["batch_size"] == 2
    assert contract["normalisation"]["mean"][0] == pytest.approx(0.485 * 255) and contract["threshold"] == 0.5
    assert contract["platforms"] == ["cpu", "cuda"]
    assert contract["output_shape"] == ["batch", 32, 32] and contract["classes"] == ["background", "foreground"]

    src = tmp_path / "in"
    write_inputs(str(src))
    predicted = str(tmp_path / "pred")
    proc = _predict(f"--workdir={trained}", f"--input={src}", f"--out={predicted}", "--save_probs=npy")
    assert proc.returncode == 0, proc.stderr[-3000:]
    env = env_with_devices(1)
    env.pop("PYTHONPATH", None)  # the loader needs jax and numpy only: no jaxrat on the path
    for name in ("a.jpg", "sub/exif6.jpg", "sub/deeper/i16.png", "sub/cmyk.jpg"):
        stem = name if name.startswith("a.") else os.path.splitext(name)[0]
        got = str(tmp_path / "got.npy")
        proc = subprocess.run([sys.executable, "-c", LOADER_CHECK, out, str(src / name), got], cwd=str(tmp_path),
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.strip().splitlines()[-1] == "[]"  # no jaxrat module was imported
        want = np.load(os.path.join(predicted, "probs", stem + ".npy"))
        have = np.load(got)
        assert have.shape == want.shape == EXPECTED_SIZES[name][::-1]
        np.testing.assert_allclose(have, want, atol=1e-5)
    _onnx_export_matches_predict(trained, tmp_path, src, predicted)

    any_batch = str(tmp_path / "any_batch")  # one symbolic batch dimension (the U-Net allows it)
    proc = subprocess.run([sys.executable, "-m", "jaxrat.export", f"--workdir={trained}", f"--out={any_batch}",
                           "--batch=0"], cwd=REPO, env=env_with_devices(1), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from jaxrat.inference import exported

    model = exported.load(any_batch)
    assert model.contract["batch_size"] is None and model.exported.in_avals[0].shape[1:] == (32, 32, 3)
    pixels = np.random.default_rng(0).uniform(0, 255, (5, 32, 32, 3)).astype(np.float32)
    np.testing.assert_allclose(model(pixels), exported.load(out)(pixels), atol=1e-5)


def _docs_onnx_example() -> str:
    """The Python block under ``<!-- onnx-example -->`` in docs/predict.md."""
    text = open(os.path.join(REPO, "docs", "predict.md")).read()
    block = text.split("<!-- onnx-example -->", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    return block


@pytest.mark.integration
def test_two_processes_split_the_images_and_process_0_merges(trained, tmp_path):
    from runner import free_port, process_env

    src, out = str(tmp_path / "in"), str(tmp_path / "out")
    write_inputs(src)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "jaxrat.predict", "--noprogress", f"--workdir={trained}",
                               f"--input={src}", f"--out={out}",
                               f"--config.distributed.coordinator_address=127.0.0.1:{port}",
                               "--config.distributed.num_processes=2", f"--config.distributed.process_id={i}"],
                              cwd=REPO, env=process_env(1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][-2000:] + logs[1][-2000:]
    assert "predicted 8 images" in logs[0] and "predicted" not in logs[1]
    assert [r["image"] for r in _rows(os.path.join(out, "predictions.csv"))] == sorted(EXPECTED_SIZES)
    assert not os.path.exists(os.path.join(out, ".parts"))
    assert open(os.path.join(out, "skipped.txt")).read().count("\n") == 1
    for name, (w, h) in EXPECTED_SIZES.items():
        stem = name if name.startswith("a.") else os.path.splitext(name)[0]
        assert Image.open(os.path.join(out, "masks", stem + ".png")).size == (w, h)
