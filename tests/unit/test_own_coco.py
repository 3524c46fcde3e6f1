"""A user's own COCO-format detection files, as users write them: categories that differ between
the splits, annotations of categories the file does not list, a JSON that is not COCO's, their own
layout, boxes with no area. Each trains what it says, or is refused in one sentence naming the fix;
no box or label is dropped or renumbered without a word."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from PIL import Image

from jaxrat.config_schema import load_config
from jaxrat.data.sources import coco
from jaxrat.runtime.errors import DataError


def _images(root, names):
    for name in names:
        path = os.path.join(root, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        Image.new("RGB", (8, 6), (90, 10, 10)).save(path)


def _coco(root, split, categories, annotations, images=None):
    """A COCO-layout split under root with 8x6 images 1 and 2."""
    folder_name = coco.SPLITS[split]
    images = images if images is not None else [{"id": i, "file_name": f"{i}.jpg", "width": 8, "height": 6}
                                                for i in (1, 2)]
    _images(os.path.join(root, folder_name), [im["file_name"] for im in images if "file_name" in im])
    os.makedirs(os.path.join(root, "annotations"), exist_ok=True)
    with open(coco.annotation_file(root, split), "w") as f:
        json.dump({"images": images, "annotations": annotations, "categories": categories}, f)


def _ann(i, image_id, category_id, bbox=(1, 1, 4, 3)):
    return {"id": i, "image_id": image_id, "category_id": category_id, "bbox": list(bbox), "area": 12, "iscrowd": 0}


CATS = [{"id": 3, "name": "apple"}, {"id": 7, "name": "pear"}, {"id": 42, "name": "plum"}]


def _resolve(root, wd):
    from jaxrat.tasks.detection.data import resolve_coco

    config = load_config("coco")
    config.data.data_dir = str(root)
    return resolve_coco(config.data, str(wd), seed=0, process_index=0)


def test_validation_labels_are_the_training_categories_even_when_its_file_lists_fewer(tmp_path):
    root = str(tmp_path / "d")
    _coco(root, "train", CATS, [_ann(1, 1, 3), _ann(2, 1, 7), _ann(3, 2, 42)])
    _coco(root, "validation", CATS[1:], [_ann(1, 1, 42), _ann(2, 2, 7)])
    train, val = _resolve(root, tmp_path / "wd")
    assert val.category_ids == train.category_ids == [3, 7, 42] and val.class_names == ["apple", "pear", "plum"]
    assert [r["labels"].tolist() for r in val.records] == [[2], [1]]  # plum is label 2, as in training


def test_a_validation_category_unknown_to_training_is_refused(tmp_path):
    root = str(tmp_path / "d")
    _coco(root, "train", CATS[:2], [_ann(1, 1, 3), _ann(2, 2, 7)])
    _coco(root, "validation", CATS, [_ann(1, 1, 42)])
    with pytest.raises(DataError, match=r"Category 42 \('plum'\) of .*instances_val2017.json is not among the "
                                        r"categories of .*instances_train2017.json"):
        _resolve(root, tmp_path / "wd")


def test_an_annotation_of_a_category_the_file_does_not_list_is_refused(tmp_path):
    root = str(tmp_path / "d")
    _coco(root, "train", CATS, [_ann(1, 1, 3), _ann(2, 2, 43)])
    with pytest.raises(DataError, match=r"instances_train2017.json: annotation 2 \(image 2\) has category_id 43, "
                                        r"which its categories do not list"):
        coco.CocoDetection(root, "train")


@pytest.mark.parametrize("spec, says", [
    ([{"image": "a.jpg"}], r"not supported\): a COCO instances file is an object with images, annotations and "
                           r"categories; convert it to COCO format\."),
    ({"version": "5.0", "shapes": [], "imagePath": "a.jpg"},
     r"is not a COCO instances file: it has no 'images', 'annotations', 'categories' \(its keys are version, shapes, "
     r"imagePath\)"),
    ({"images": [{"file_name": "1.jpg", "width": 8, "height": 6}], "annotations": [], "categories": CATS},
     r"is not valid at images\[0\]: it has no 'id'"),
])
def test_a_json_that_is_not_coco_is_named_as_such(tmp_path, spec, says):
    root = str(tmp_path / "d")
    _coco(root, "train", CATS, [])
    with open(coco.annotation_file(root, "train"), "w") as f:
        json.dump(spec, f)
    with pytest.raises(DataError, match=says):
        coco.CocoDetection(root, "train")


def test_own_annotations_in_another_layout_are_told_the_layout(tmp_path):
    root = str(tmp_path / "d")
    _images(os.path.join(root, "images"), ["1.jpg"])
    with open(os.path.join(root, "annotations.json"), "w") as f:
        json.dump({"images": [], "annotations": [], "categories": []}, f)
    with pytest.raises(DataError, match=r"not found; .*holds annotations.json: jaxrat reads COCO 2017's layout, so "
                                        r"move it to .*annotations/instances_train2017.json and its images to "
                                        r".*train2017/"):
        coco.CocoDetection(root, "train")


def test_boxes_that_cannot_be_learned_are_counted_in_a_warning(tmp_path, caplog):
    root = str(tmp_path / "d")
    _coco(root, "train", CATS, [_ann(1, 1, 3), _ann(2, 1, 3, (2, 2, 0, 3)), _ann(3, 2, 7, (20, 20, 4, 4)),
                                _ann(4, 2, 7, (1, 1, -3, 2)), _ann(5, 2, 7)])
    ds = coco.CocoDetection(root, "train")
    assert [len(r["labels"]) for r in ds.records] == [1, 1]
    assert "3 of 5 boxes in" in caplog.text and "have no area inside their image" in caplog.text
    assert np.isfinite(np.concatenate([r["boxes"] for r in ds.records])).all()


def test_an_image_of_another_size_than_its_annotations_names_the_annotation_file_as_the_fix(tmp_path):
    root = str(tmp_path / "d")
    _coco(root, "train", CATS, [_ann(1, 1, 3)],
          images=[{"id": 1, "file_name": "1.jpg", "width": 640, "height": 480}])
    ds = coco.CocoDetection(root, "train")
    with pytest.raises(DataError, match=r"1.jpg: image is 8x6 but its annotations say 640x480; correct its width and "
                                        r"height in the annotation file \(or replace the image\), or set "
                                        r"--config.data.on_bad_file=skip"):
        ds.loader.map(ds.records[0])
