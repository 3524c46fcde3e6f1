"""Any segmentation dataset: the images/ + masks/ folder source (any names, split folders, a split
ratio, a CSV of pairs), class maps with an ignore index, multi-class Dice/IoU per class checked
against numpy, and a run that trains, evaluates and predicts label PNGs on such a folder."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from jaxrat.data.badfiles import BadFilePolicy
from jaxrat.data.imageio import BadFileError
from jaxrat.data.sources import segmentation_folder as sf
from jaxrat.data.synthetic import segmentation as synthetic
from jaxrat.runtime.errors import DataError
from jaxrat.tasks import segmentation_multiclass as mc
from predict_inputs import run_exported_loader, run_onnx_loader
from runner import REPO, env_with_devices


def _numpy_per_class(pred: np.ndarray, truth: np.ndarray, valid: np.ndarray, c: int) -> tuple[float, float]:
    keep = (truth != 255) & valid[:, None, None]
    tp = np.sum((pred == c) & (truth == c) & keep)
    fp = np.sum((pred == c) & (truth != c) & keep)
    fn = np.sum((pred != c) & (truth == c) & keep)
    dice = 2 * tp / (2 * tp + fp + fn) if 2 * tp + fp + fn else 1.0
    return dice, (tp / (tp + fp + fn) if tp + fp + fn else 1.0)


def test_per_class_dice_and_iou_match_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 9, 7, 4)).astype(np.float32)
    truth = rng.integers(0, 4, size=(4, 9, 7)).astype(np.uint8)
    truth[rng.random(truth.shape) < 0.1] = 255
    valid = np.array([1, 1, 1, 0], bool)
    sums = mc.eval_sums(jnp.asarray(logits), jnp.asarray(truth[..., None], jnp.float32), jnp.asarray(valid),
                        ce_weight=1.0, dice_weight=1.0)
    names = ("bg", "a", "b", "c")
    got = mc.finalize({k: float(v) for k, v in sums.items()}, names)
    pred = logits.argmax(-1)
    expected = [_numpy_per_class(pred, truth, valid, c) for c in range(4)]
    for c, name in enumerate(names):
        assert got[f"dice/{name}"] == pytest.approx(expected[c][0], abs=1e-6)
        assert got[f"iou/{name}"] == pytest.approx(expected[c][1], abs=1e-6)
    assert got["dice"] == pytest.approx(np.mean([d for d, _ in expected[1:]]), abs=1e-6)
    keep = (truth != 255) & valid[:, None, None]
    assert got["pixel_accuracy"] == pytest.approx(np.sum((pred == truth) & keep) / keep.sum(), abs=1e-6)
    assert got["num_images"] == 3


def test_per_image_rows_hold_each_images_per_class_scores():
    rng = np.random.default_rng(1)
    probs = rng.random((3, 6, 5, 3)).astype(np.float32)
    truth = rng.integers(0, 3, size=(3, 6, 5)).astype(np.uint8)
    truth[0, 0] = 255
    valid = np.array([1, 1, 0], np.float32)
    names = ("bg", "a", "b")
    acc = mc.MulticlassEval(names, log_images=False, name=lambda i: f"img{i}.png")
    sums = mc.eval_sums(jnp.log(jnp.asarray(probs)), jnp.asarray(truth[..., None], jnp.float32), jnp.asarray(valid),
                        ce_weight=1.0, dice_weight=1.0)
    # Example order, whatever the batch order; the padding row (valid 0) is left out.
    acc.update(sums, {"mask": truth[..., None], "valid": valid, "index": np.array([7, 2, 2])}, jnp.asarray(probs))
    acc.finalize()
    rows = acc.per_image()
    assert [r["image"] for r in rows] == ["img2.png", "img7.png"]
    pred = probs.argmax(-1)
    for r, i in zip(rows, (1, 0)):
        for c, name in enumerate(names):
            dice, iou = _numpy_per_class(pred[i:i + 1], truth[i:i + 1], np.ones(1, bool), c)
            assert r[f"dice/{name}"] == pytest.approx(dice) and r[f"iou/{name}"] == pytest.approx(iou)
        assert r["dice"] == pytest.approx((r["dice/a"] + r["dice/b"]) / 2)
        keep = truth[i] != 255
        assert r["pixel_accuracy"] == pytest.approx(np.mean(pred[i][keep] == truth[i][keep]))


def _pair(root, image_name, mask_name, size=(12, 10), value=1):
    os.makedirs(os.path.dirname(os.path.join(root, image_name)), exist_ok=True)
    os.makedirs(os.path.dirname(os.path.join(root, mask_name)), exist_ok=True)
    Image.fromarray(np.full((*size[::-1], 3), 90, np.uint8)).save(os.path.join(root, image_name))
    mask = np.zeros(size[::-1], np.uint8)
    mask[2:5, 3:6] = value
    Image.fromarray(mask).save(os.path.join(root, mask_name))


def test_folder_source_takes_any_names_formats_and_a_seeded_split(tmp_path):
    root = str(tmp_path)
    names = [("a b.jpg", "a b_mask.png"), ("x-1.png", "x-1.png"), ("scan.tif", "scan_segmentation.tiff"),
             ("IMG_7.JPEG", "img_7.png"), ("z.png", "z_label.png")]
    for image, mask in names:
        _pair(root, f"images/{image}", f"masks/{mask}")
    (tmp_path / "images" / "README.txt").write_text("not an image")
    train = sf.find_pairs(root, "train", val_fraction=0.4, seed=3)
    val = sf.find_pairs(root, "validation", val_fraction=0.4, seed=3)
    assert len(train) == 3 and len(val) == 2 and not {p[0] for p in train} & {p[0] for p in val}
    assert val == sf.find_pairs(root, "validation", val_fraction=0.4, seed=3)
    loader = sf.DecodeLabelPair(num_classes=2)
    for pair in train + val:
        ex = loader.map(pair)
        assert ex["image"].shape == (10, 12, 3) and set(np.unique(ex["mask"])) == {0, 1}


def test_split_folders_csv_and_missing_masks(tmp_path):
    root = str(tmp_path / "d")
    _pair(root, "train/images/one.png", "train/masks/one.png")
    _pair(root, "train/images/two.png", "train/masks/two.png")
    _pair(root, "val/images/three.png", "val/masks/three_mask.png")
    os.remove(os.path.join(root, "train/masks/two.png"))
    with pytest.raises(BadFileError, match="no mask with its name"):
        sf.find_pairs(root, "train")
    assert len(sf.find_pairs(root, "train", policy=BadFilePolicy("skip"))) == 1
    assert [os.path.basename(p[0]) for p in sf.find_pairs(root, "validation")] == ["three.png"]
    csv = tmp_path / "d" / "pairs.csv"
    csv.write_text("image,mask,split\ntrain/images/one.png,train/masks/one.png,train\n"
                   "val/images/three.png,val/masks/three_mask.png,val\n")
    assert len(sf.find_pairs(root, "validation", pairs_csv="pairs.csv")) == 1
    with pytest.raises(DataError, match="No images/ and masks/ folders"):
        sf.find_pairs(str(tmp_path), "train")


def test_label_map_ignore_and_out_of_range_values(tmp_path):
    _pair(str(tmp_path), "images/a.png", "masks/a.png", value=128)
    pair = (str(tmp_path / "images" / "a.png"), str(tmp_path / "masks" / "a.png"))
    with pytest.raises(BadFileError, match=r"label value\(s\) \[128\] but model.num_classes=3"):
        sf.DecodeLabelPair(3).map(pair)
    mask = sf.DecodeLabelPair(3, ((0, 0), (128, 2))).map(pair)["mask"]
    assert set(np.unique(mask)) == {0, 2}


def test_a_demo_variant_on_your_data_is_not_the_demo():
    from jaxrat.config_schema import load_config
    from jaxrat.data.own_data import on_own_data

    c = load_config("segmentation:demo")
    assert on_own_data(c).data.synthetic and c.task.class_names == synthetic.CLASS_NAMES  # the demo itself
    c.data.data_dir = "/my/data"
    on_own_data(c)
    assert not c.data.synthetic and c.task.class_names == ()
    assert mc.class_names(c.task.class_names, 3) == ("class_0", "class_1", "class_2")
    c = load_config("segmentation:demo")
    c.data.data_dir, c.task.class_names = "/my/data", ("sky", "tree", "road")
    assert on_own_data(c).task.class_names == ("sky", "tree", "road")  # the user's own names stay


def test_trains_evaluates_and_predicts_label_pngs_on_a_multiclass_folder(tmp_path):
    data = synthetic.write_dataset(str(tmp_path / "my data"), num_images=24, size=32, seed=5)
    work, out = tmp_path / "run", tmp_path / "pred"
    env = env_with_devices(1)

    def jaxrat(*args):
        proc = subprocess.run([sys.executable, "-m", "jaxrat", *args], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    common = [f"--config.data.data_dir={data}", "--config.data.val_fraction=0.25"]
    trained = jaxrat("train", "--config", "segmentation:smoke", f"--workdir={work}", "--config.num_train_steps=4",
                     *common)
    # On the user's folder the variant is no longer the demo: its log says so, config.json too, and the
    # classes are not the synthetic data's disc and square (no task.class_names given: class_<k>).
    assert "synthetic data off" in trained.stderr
    saved = json.loads((work / "config.json").read_text())
    assert saved["data"]["synthetic"] is False and saved["task"]["class_names"] == []
    val = sf.find_pairs(data, "validation", val_fraction=0.25, seed=0)
    listing = tmp_path / "val.txt"
    listing.write_text("\n".join(p[0] for p in val) + "\n")
    jaxrat("evaluate", f"--workdir={work}", "--name=check", "--step=latest")
    jaxrat("predict", f"--workdir={work}", f"--input={listing}", f"--out={out}", "--step=latest")
    reported = json.loads((work / "eval" / "check" / "metrics.json").read_text())["metrics"]
    preds, truths = [], []
    for image, mask in val:
        png = Image.open(out / "masks" / (os.path.splitext(os.path.basename(image))[0] + ".png"))
        assert png.mode == "P" and png.getpalette()[3:6] != [0, 0, 0]
        preds.append(np.asarray(png))
        truths.append(np.asarray(Image.open(mask)))
        assert (out / "overlays" / (os.path.splitext(os.path.basename(image))[0] + ".jpg")).is_file()
    pred, truth = np.stack(preds), np.stack(truths)
    for c, name in enumerate(("class_0", "class_1", "class_2")):
        dice, iou = _numpy_per_class(pred, truth, np.ones(len(val), bool), c)
        assert reported[f"eval/dice/{name}"] == pytest.approx(dice, abs=1e-6), name
        assert reported[f"eval/iou/{name}"] == pytest.approx(iou, abs=1e-6), name
    per_image = list(csv.DictReader(open(work / "eval" / "check" / "per_image.csv")))
    assert sorted(r["image"] for r in per_image) == sorted(os.path.basename(p[0]) for p in val)
    names = [k[len("eval/dice/"):] for k in reported if k.startswith("eval/dice/")]
    assert len(names) == 3 and all(f"dice/{n}" in per_image[0] and f"iou/{n}" in per_image[0] for n in names)

    # Tiled at each photo's own size: the windows' class probabilities blended per class, so label maps
    # and (H, W, 3) probabilities that sum to 1; evaluate --tile (binary scores) refuses before any work.
    tiled = tmp_path / "tiled"
    jaxrat("predict", f"--workdir={work}", f"--input={listing}", f"--out={tiled}", "--tile=32", "--save_probs=npy")
    for image, _ in val:
        stem = os.path.splitext(os.path.basename(image))[0]
        png = Image.open(tiled / "masks" / (stem + ".png"))
        probs = np.load(tiled / "probs" / (stem + ".npy"))
        assert png.mode == "P" and png.size == Image.open(image).size and probs.shape == (*png.size[::-1], 3)
        assert np.allclose(probs.sum(-1), 1, atol=1e-4) and (probs.argmax(-1) == np.asarray(png)).all()
    refused = subprocess.run([sys.executable, "-m", "jaxrat", "evaluate", f"--workdir={work}", "--tile=32",
                              f"--out={tmp_path / 'ev'}"], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=300)
    assert refused.returncode == 2 and "predicts several classes: drop --tile" in refused.stderr
    assert not (tmp_path / "ev").exists()  # refused before --out was claimed

    # The export: a (1, S, S, 3) class-probability program, its classes named, and the loader's
    # label map at each photo's size equal to predict's masks, in a process where jaxrat cannot import.
    exp = tmp_path / "export"
    jaxrat("export", f"--workdir={work}", f"--out={exp}", "--step=latest")
    contract = json.loads((exp / "model.json").read_text())
    assert contract["output_shape"] == ["batch", 32, 32, 3] and sorted(contract["classes"]) == sorted(names)
    assert contract["threshold"] is None and "softmax" in contract["outputs"]
    for image, _ in val[:2]:
        probs = run_exported_loader(str(exp), image, str(tmp_path / "loaded.npz"), env)["out"]
        png = np.asarray(Image.open(out / "masks" / (os.path.splitext(os.path.basename(image))[0] + ".png")))
        assert probs.shape == (*png.shape, 3) and np.allclose(probs.sum(-1), 1, atol=1e-3)
        assert np.mean(probs.argmax(-1) == png) > 0.999  # ties aside, predict's labels

    # The ONNX export, on onnxruntime with jax and jaxrat not importable: the jax export's probabilities,
    # so predict's label maps.
    onnx_exp = tmp_path / "onnx"
    jaxrat("export", f"--workdir={work}", "--format=onnx", f"--out={onnx_exp}", "--step=latest")
    onnx_contract = json.loads((onnx_exp / "model.json").read_text())
    assert onnx_contract["classes"] == contract["classes"] and onnx_contract["batch_size"] is None
    assert onnx_contract["onnx"]["outputs"][0]["shape"] == ["batch", 32, 32, 3]
    for image, _ in val[:2]:
        probs = run_exported_loader(str(exp), image, str(tmp_path / "loaded.npz"), env)["out"]
        onnx_probs = run_onnx_loader(str(onnx_exp), image, str(tmp_path / "onnx.npz"), env)["out"]
        np.testing.assert_allclose(onnx_probs, probs, atol=1e-4)
        png = np.asarray(Image.open(out / "masks" / (os.path.splitext(os.path.basename(image))[0] + ".png")))
        assert np.mean(onnx_probs.argmax(-1) == png) > 0.999
