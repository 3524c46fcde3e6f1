"""predict and evaluate's per-image results for classification and detection (smoke runs)."""

import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxrat.tasks.detection.coco_eval import STAT_NAMES
from predict_inputs import EXPECTED_SIZES, run_exported_loader, run_onnx_loader, write_inputs
from runner import REPO, env_with_devices, losses_by_step, read_metrics, run_main

pytestmark = pytest.mark.slow


def _cmd(module, *args):
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env_with_devices(2),
                          capture_output=True, text=True, timeout=300)


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_classification_top_k_labels_and_per_image_truth(tmp_path):
    wd = str(tmp_path / "run")
    proc = run_main(wd, config=os.path.join(REPO, "configs", "classification.py") + ":smoke")
    # The run's progress lines, its curves and a confusion matrix per head on its summary page (was
    # test_run_output.py's own classification run).
    assert "epoch " in proc.stderr and " ETA " in proc.stderr
    page = open(os.path.join(wd, "summary.md")).read()
    for name in ("curves.png", "confusion_shape.png", "confusion_kind.png"):
        assert os.path.isfile(os.path.join(wd, name)) and f"]({name})" in page
    src, out = str(tmp_path / "in"), str(tmp_path / "out")
    write_inputs(src)
    proc = _cmd("jaxrat.predict", "--noprogress", f"--workdir={wd}", f"--input={src}", f"--out={out}", "--top_k=2",
                "--tta=flip")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(os.path.join(out, "predictions.csv"))
    assert [r["image"] for r in rows] == sorted(EXPECTED_SIZES)
    shapes = {"circle", "square", "triangle"}  # the synthetic data's label strings, not class numbers
    for r in rows:
        assert r["shape/top1_label"] in shapes and r["shape/top2_label"] in shapes
        assert float(r["shape/top1_probability"]) >= float(r["shape/top2_probability"])
        assert "shape/top3_label" not in r and "kind/top1_label" in r

    # The export's labels name every class of each head, and the loader, with jaxrat not importable,
    # gives predict's probabilities for a photo (EXIF-turned) without --tta.
    exp = os.path.join(str(tmp_path), "export")
    proc = _cmd("jaxrat.export", f"--workdir={wd}", f"--out={exp}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    contract = json.load(open(os.path.join(exp, "model.json")))
    assert contract["heads"] == ["shape", "kind"] and sorted(contract["labels"]["shape"]) == sorted(shapes)
    assert contract["output_shape"]["kind"] == ["batch", len(contract["labels"]["kind"])]
    out2 = str(tmp_path / "out2")
    proc = _cmd("jaxrat.predict", "--noprogress", f"--workdir={wd}", f"--input={src}", f"--out={out2}", "--top_k=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = next(r for r in _rows(os.path.join(out2, "predictions.csv")) if r["image"] == "sub/exif6.jpg")
    got = run_exported_loader(exp, os.path.join(src, "sub", "exif6.jpg"), str(tmp_path / "loaded.npz"),
                              env_with_devices(1))
    assert set(got) == {"shape", "kind"} and got["shape"].shape == (3,)
    for r in (1, 2, 3):
        label = row[f"shape/top{r}_label"]
        p = got["shape"][contract["labels"]["shape"].index(label)]
        assert p == pytest.approx(float(row[f"shape/top{r}_probability"]), abs=1e-5)
    # The ONNX export: every head's probabilities on onnxruntime alone, predict's top labels.
    onnx_exp = os.path.join(str(tmp_path), "onnx")
    proc = _cmd("jaxrat.export", f"--workdir={wd}", "--format=onnx", f"--out={onnx_exp}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    onnx_contract = json.load(open(os.path.join(onnx_exp, "model.json")))
    assert onnx_contract["labels"] == contract["labels"] and onnx_contract["heads"] == ["shape", "kind"]
    got_onnx = run_onnx_loader(onnx_exp, os.path.join(src, "sub", "exif6.jpg"), str(tmp_path / "onnx.npz"),
                               env_with_devices(1))
    for head in ("shape", "kind"):
        assert got_onnx[head].shape == got[head].shape
        assert np.max(np.abs(got_onnx[head] - got[head])) <= 1e-4
    for r in (1, 2, 3):
        label = row[f"shape/top{r}_label"]
        p = got_onnx["shape"][contract["labels"]["shape"].index(label)]
        assert p == pytest.approx(float(row[f"shape/top{r}_probability"]), abs=1e-4)

    proc = _cmd("jaxrat.evaluate", f"--workdir={wd}", "--name=cls")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.load(open(os.path.join(wd, "eval", "cls", "metrics.json")))["metrics"]
    per = _rows(os.path.join(wd, "eval", "cls", "per_image.csv"))
    assert len(per) == 16 and per[0]["shape/true"] in shapes
    top1 = sum(int(r["shape/correct"]) for r in per) / len(per)
    assert top1 == pytest.approx(metrics["eval/shape/top1"], abs=1e-6)
    proc = _cmd("jaxrat.evaluate", f"--workdir={wd}", "--split=test")
    assert proc.returncode == 2 and "--split test" in proc.stderr


def test_detection_coco_results_in_original_pixels(tmp_path):
    # The detection smoke run end to end on 2 devices (was test_detection_task.py's own run of it):
    # 4 finite train losses, evaluations with every COCO statistic; predict and evaluate read it.
    wd = str(tmp_path / "run")
    run_main(wd, config=os.path.join(REPO, "configs", "coco.py") + ":smoke", devices=2, timeout=600)
    losses = losses_by_step(wd)
    assert sorted(losses) == [1, 2, 3, 4] and all(np.isfinite(v) for v in losses.values())
    evals = [r for r in read_metrics(wd) if "eval/AP" in r]
    assert evals and all(f"eval/{n}" in evals[-1] for n in STAT_NAMES)
    src, out = str(tmp_path / "in"), str(tmp_path / "out")
    write_inputs(src)
    proc = _cmd("jaxrat.predict", "--noprogress", f"--workdir={wd}", f"--input={src}", f"--out={out}",
                "--min_score=0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    images = json.load(open(os.path.join(out, "images.json")))
    results = json.load(open(os.path.join(out, "detections.json")))
    cats = {c["id"]: c["name"] for c in images["categories"]}
    sizes = {i["id"]: (i["width"], i["height"]) for i in images["images"]}
    assert {i["file_name"] for i in images["images"]} == set(EXPECTED_SIZES) and results
    for r in results:
        assert cats[r["category_id"]] == r["category_name"]
        x, y, w, h = r["bbox"]
        W, H = sizes[r["image_id"]]
        assert -0.01 <= x <= x + w <= W + 0.01 and -0.01 <= y <= y + h <= H + 0.01
    assert len(os.listdir(os.path.join(out, "boxes"))) == 3  # a.jpg, a.png and sub/

    # The export's loader, with jaxrat not importable, gives predict's detections of a photo (EXIF-turned,
    # letterboxed): its boxes in the photo's pixels, best first.
    exp = str(tmp_path / "export")
    proc = _cmd("jaxrat.export", f"--workdir={wd}", f"--out={exp}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = run_exported_loader(exp, os.path.join(src, "sub", "exif6.jpg"), str(tmp_path / "loaded.npz"),
                              env_with_devices(1))
    photo = next(i["id"] for i in images["images"] if i["file_name"] == "sub/exif6.jpg")
    want = sorted((r for r in results if r["image_id"] == photo), key=lambda r: -r["score"])[:3]
    assert want and list(got["scores"]) == sorted(got["scores"], reverse=True)
    categories = json.load(open(os.path.join(exp, "model.json")))["categories"]
    for r, score, label, (x1, y1, x2, y2) in zip(want, got["scores"], got["labels"], got["boxes"]):
        assert score == pytest.approx(r["score"], abs=1e-4)
        assert categories[int(label)]["id"] == r["category_id"]
        assert [x1, y1, x2 - x1, y2 - y1] == pytest.approx(r["bbox"], abs=0.05)
    proc = _cmd("jaxrat.predict", f"--workdir={wd}", f"--input={src}", f"--out={tmp_path / 'o2'}", "--tta=flip")
    assert proc.returncode == 2 and "--tta is not available for detection" in proc.stderr

    proc = _cmd("jaxrat.evaluate", f"--workdir={wd}", "--name=det")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.load(open(os.path.join(wd, "eval", "det", "metrics.json")))
    assert set(result["per_category_AP"]) <= set(cats.values()) and result["per_category_AP"]
    per = _rows(os.path.join(wd, "eval", "det", "per_image.csv"))
    assert len(per) == result["metrics"]["eval/num_images"] and all(int(r["ground_truth"]) >= 0 for r in per)
