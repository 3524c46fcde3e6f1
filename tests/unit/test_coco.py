"""COCO 2017 source: official layout, contiguous labels mapped back for COCOeval, crowd, bad files."""

import json
import os

import numpy as np
import pytest

from jaxrat.data import pipeline
from jaxrat.data.badfiles import BadFilePolicy
from jaxrat.data.sources import coco
from jaxrat.data.synthetic import coco as synthetic_coco
from jaxrat.runtime.errors import DataError
from jaxrat.tasks.detection import coco_eval


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return synthetic_coco.write_coco(str(tmp_path_factory.mktemp("coco")), num_train=12, num_val=8, image_size=48)


def test_categories_are_the_80_coco_ones_mapped_to_contiguous_labels(root):
    assert len(synthetic_coco.COCO_CATEGORIES) == 80 and synthetic_coco.COCO_CATEGORIES[-1] == (90, "toothbrush")
    ds = coco.CocoDetection(root, "validation")
    assert ds.num_classes == 80 and ds.category_ids[11] == 13 and ds.class_names[11] == "stop sign"
    assert len(ds) == 8  # evaluation keeps images without objects
    labels = np.concatenate([r["labels"] for r in ds.records])
    assert labels.max() > 5  # non-contiguous ids (17, 34, ...) became labels 16, 32, ...
    for r in ds.records:
        assert r["boxes"].dtype == np.float32 and ((r["boxes"] >= 0) & (r["boxes"] <= 1)).all()
        assert (r["boxes"][:, 2:] > r["boxes"][:, :2]).all()


def test_boxes_are_normalised_from_the_pixel_annotations(root):
    ds = coco.CocoDetection(root, "train")
    rec = ds.records[0]
    ann = [a for a in ds.coco.imgToAnns[rec["image_id"]] if not a["iscrowd"]][0]
    x, y, w, h = ann["bbox"]
    W, H = rec["width"], rec["height"]
    np.testing.assert_allclose(rec["boxes"][0], [x / W, y / H, (x + w) / W, (y + h) / H], rtol=1e-6)
    ex = ds.loader.map(rec)
    assert ex["image"].shape == (H, W, 3)
    # The drawn object is where its box says: its centre pixel is the class colour, not background.
    cx, cy = int((x + w / 2)), int((y + h / 2))
    colour = np.random.default_rng(ann["category_id"]).integers(0, 255, 3)
    assert np.abs(ex["image"][cy, cx].astype(int) - colour).max() < 40


def test_crowd_and_empty_images(root):
    train = coco.CocoDetection(root, "train", skip_empty=True)
    every = coco.CocoDetection(root, "train")
    assert len(every) == 12 and len(train) == 11  # image #1 has no objects
    crowd_rec = next(r for r in train.records if r["is_crowd"].any())
    ex = train.loader.map(crowd_rec)
    assert not ex["is_crowd"].any() and len(ex["boxes"]) == int((crowd_rec["is_crowd"] == 0).sum())
    with_crowd = coco.DecodeCoco(include_crowd=True).map(crowd_rec)
    assert with_crowd["is_crowd"].sum() == 1 and len(with_crowd["boxes"]) == len(crowd_rec["labels"])


def test_perfect_detections_score_ap_1_and_crowd_hits_are_not_false_positives(root):
    ds = coco.CocoDetection(root, "validation", include_crowd=True)
    ids, boxes, labels, sizes, scores = [], [], [], [], []
    for r in ds.records:
        for b, lab, c in zip(r["boxes"], r["labels"], r["is_crowd"]):
            ids.append(r["image_id"]); boxes.append(b); labels.append(lab)  # noqa: E702
            sizes.append((r["width"], r["height"])); scores.append(0.9 if not c else 0.95)  # noqa: E702
    assert any(r["is_crowd"].any() for r in ds.records)
    res = coco_eval.to_coco_results(ds.category_ids, np.array(ids), np.array(boxes), np.array(scores),
                               np.array(labels), np.array(sizes))
    assert {d["category_id"] for d in res} <= {c for c, _ in synthetic_coco.COCO_CATEGORIES}
    stats = coco_eval.evaluate(ds.annotation_file, res)
    assert stats["AP"] == pytest.approx(1.0) and stats["AP50"] == pytest.approx(1.0)
    # Detections of a class absent from the set leave AP alone (COCOeval averages over classes with GT).
    wrong = [dict(d, category_id=90) for d in res] + res
    assert coco_eval.evaluate(ds.annotation_file, wrong)["AP"] == pytest.approx(1.0)
    shifted = [dict(d, bbox=[d["bbox"][0] + d["bbox"][2], *d["bbox"][1:]]) for d in res]
    assert coco_eval.evaluate(ds.annotation_file, shifted)["AP"] < 0.5


def test_detection_stream_is_box_aware_and_deterministic(root):
    ds = coco.CocoDetection(root, "train", skip_empty=True)
    ops = coco.detection_ops(32, train=True, max_boxes=6, scale_jitter=(0.7, 1.3), color_jitter=0.1)
    kw = dict(image_size=32, local_batch=4, seed=1, process_index=0, process_count=1, ops=ops, num_threads=0)
    a = [next(it) for it in [pipeline.train_iterator(ds.example_source(), **kw)] for _ in range(3)]
    b = [next(it) for it in [pipeline.train_iterator(ds.example_source(), **kw)] for _ in range(3)]
    for x, y in zip(a, b):
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])
    batch = a[0]
    assert batch["image"].shape == (4, 32, 32, 3) and batch["boxes"].shape == (4, 6, 4)
    assert batch["labels"].shape == (4, 6) and batch["box_valid"].shape == (4, 6)
    valid = batch["boxes"][batch["box_valid"] > 0]
    assert len(valid) and (valid[:, 2:] > valid[:, :2]).all() and (valid >= 0).all() and (valid <= 1).all()
    val = coco.CocoDetection(root, "validation").example_source()
    evals = list(pipeline.eval_batches(val, image_size=32, global_batch=4, process_index=0, process_count=1,
                                       num_threads=0, ops=coco.detection_ops(32, train=False, max_boxes=6)))
    assert len(evals) == 2 and evals[0]["image_id"].shape == (4,)


def test_missing_or_broken_files(root, tmp_path):
    with pytest.raises(DataError, match="instances_train2017.json not found.*jaxrat.data.download coco2017"):
        coco.CocoDetection(str(tmp_path), "train")
    bad = str(tmp_path / "bad")
    os.makedirs(os.path.join(bad, "annotations"))
    os.makedirs(os.path.join(bad, "val2017"))
    open(coco.annotation_file(bad, "validation"), "w").write('{"images": [')
    with pytest.raises(DataError, match="is not valid"):
        coco.CocoDetection(bad, "validation")
    # A listed image missing from the folder: fail names it, skip drops it.
    spec = json.load(open(coco.annotation_file(root, "validation")))
    spec["images"].append({"id": 999, "file_name": "000000000999.jpg", "width": 10, "height": 10})
    json.dump(spec, open(coco.annotation_file(bad, "validation"), "w"))
    for f in os.listdir(os.path.join(root, "val2017")):
        os.link(os.path.join(root, "val2017", f), os.path.join(bad, "val2017", f))
    with pytest.raises(DataError, match="000000000999.jpg: file not found"):
        coco.CocoDetection(bad, "validation")
    assert len(coco.CocoDetection(bad, "validation", policy=BadFilePolicy("skip"))) == 8


def test_a_photo_turned_by_exif_is_read_upright_and_annotations_of_its_stored_pixels_are_named(tmp_path):
    from PIL import Image

    from jaxrat.data.imageio import BadFileError

    path = str(tmp_path / "a.jpg")
    exif = Image.Exif()
    exif[0x0112] = 6  # stored 12 wide, 8 high; shown 8 wide, 12 high
    Image.fromarray(np.zeros((8, 12, 3), np.uint8)).save(path, exif=exif)
    rec = {"path": path, "width": 8, "height": 12, "labels": np.zeros(0, np.int32), "is_crowd": np.zeros(0, np.int32),
           "boxes": np.zeros((0, 4), np.float32), "area": np.zeros(0, np.float32), "image_id": 1}
    assert coco.DecodeCoco().map(rec)["image"].shape == (12, 8, 3)
    with pytest.raises(BadFileError, match=r"image is 8x12 but its annotations say 12x8 \(they describe it as stored"):
        coco.DecodeCoco().map({**rec, "width": 12, "height": 8})
