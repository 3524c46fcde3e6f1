"""A user's own classification CSVs, as users write them: spaces after the commas, labels that are
numbers, a class only in validation, one class only, Windows paths. Each trains what it says, or is
refused in one sentence naming the fix; no label is dropped or renumbered without a word."""

from __future__ import annotations

import logging
import os
import re

import pytest
from PIL import Image

from jaxrat.config_schema import load_config
from jaxrat.data import datasets
from jaxrat.data.sources import folder
from jaxrat.runtime.errors import DataError


def _images(root, names):
    for name in names:
        path = os.path.join(root, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        Image.new("RGB", (8, 6), (90, 10, 10)).save(path)


def _csv_dataset(root, train: str, val: str):
    """root/train.csv and root/val.csv with the given text, and every image they name (first column)."""
    os.makedirs(root, exist_ok=True)
    for name, text in (("train.csv", train), ("val.csv", val)):
        with open(os.path.join(root, name), "w", newline="") as f:
            f.write(text)
        rows = [line.split(",")[0].strip().replace("\\", "/") for line in text.splitlines()[1:] if line.strip()]
        _images(root, rows)
    return root


def _classify(root, wd, heads=("label",)):
    config = load_config("classification")
    config.data.data_dir = str(root)
    return datasets.resolve_classification(config.data, heads, str(wd), seed=0, process_index=0)


def test_spaces_after_the_commas_and_quoted_commas_are_read(tmp_path):
    root = _csv_dataset(str(tmp_path / "d"), 'image, label\r\na.png, "big, cat"\r\nb.png, dog\r\n',
                        'image, label\r\nc.png, dog\r\n')
    train, val, vocabs, found = _classify(root, tmp_path / "wd")
    assert vocabs["label"] == ["big, cat", "dog"] and found == (2,)
    assert [r["labels"].tolist() for r in train.records] == [[0], [1]]


def test_a_class_only_in_the_validation_csv_is_said(tmp_path, caplog):
    root = _csv_dataset(str(tmp_path / "d"), "image,label\na.png,cat\nb.png,dog\n",
                        "image,label\nc.png,bird\nd.png,cat\n")
    with caplog.at_level(logging.WARNING):
        _classify(root, tmp_path / "wd")
    assert re.search(r"class\(es\) 'bird' of head 'label' are in .*val.csv but not in .*train.csv, so they cannot be "
                     r"learned and their 1 validation image\(s\) count as wrong", caplog.text)


def test_a_single_class_is_refused(tmp_path):
    root = _csv_dataset(str(tmp_path / "d"), "image,label\na.png,cat\nb.png,cat\n", "image,label\nc.png,cat\n")
    with pytest.raises(DataError, match=r"Head 'label' has one class \('cat'\) in the training split, so there is "
                                        r"nothing to tell apart"):
        _classify(root, tmp_path / "wd")
    for cls in ("cat",):
        _images(str(tmp_path / "f"), [f"train/{cls}/0.png", f"val/{cls}/1.png"])
    config = load_config("classification")
    config.data.data_dir, config.data.source = str(tmp_path / "f"), "folder"
    with pytest.raises(DataError, match="one class"):
        datasets.resolve_classification(config.data, ("label",), str(tmp_path / "wd2"), seed=0, process_index=0)


def test_negative_number_labels_are_refused_not_ignored(tmp_path):
    root = _csv_dataset(str(tmp_path / "d"), "image,label\na.png,-1\nb.png,0\nc.png,1\n", "image,label\nd.png,0\n")
    with pytest.raises(DataError, match=r"train.csv line 2: label -1 in column 'label' is negative; number the "
                                        r"classes from 0"):
        _classify(root, tmp_path / "wd")


def test_sparse_number_labels_are_refused_instead_of_a_head_of_thousands_of_classes(tmp_path):
    root = _csv_dataset(str(tmp_path / "d"), "image,label\na.png,1001\nb.png,2002\nc.png,3003\n",
                        "image,label\nd.png,2002\n")
    with pytest.raises(DataError, match=r"Head 'label' has number labels up to 3003 but only 3 different ones, so "
                                        r"it would get 3004 classes"):
        _classify(root, tmp_path / "wd")
    # Labels from 1 (one unused class 0) are numbers used as they are.
    root = _csv_dataset(str(tmp_path / "e"), "image,label\na.png,1\nb.png,2\nc.png,3\n", "image,label\nd.png,2\n")
    assert _classify(root, tmp_path / "wd")[3] == (4,)


def test_windows_paths_in_a_csv_are_read(tmp_path):
    root = _csv_dataset(str(tmp_path / "d"), "image,label\nimgs\\a.png,cat\nimgs\\b.png,dog\n",
                        "image,label\nimgs\\c.png,dog\n")
    train, _, _, _ = _classify(root, tmp_path / "wd")
    assert [os.path.relpath(r["path"], root) for r in train.records] == ["imgs/a.png", "imgs/b.png"]
    assert folder.DecodeClassification().map(train.records[0])["image"].shape == (6, 8, 3)


@pytest.mark.parametrize("sep", [";", "\t"])
def test_a_csv_from_a_european_excel_or_a_tsv_is_read(tmp_path, sep):
    root = str(tmp_path / "d")
    os.makedirs(root)
    with open(os.path.join(root, "train.csv"), "w") as f:
        f.write(f"image{sep}label\na.png{sep}cat\nb.png{sep}dog\n")
    with open(os.path.join(root, "val.csv"), "w") as f:
        f.write(f"image{sep}label\nc.png{sep}dog\n")
    _images(root, ["a.png", "b.png", "c.png"])
    train, _, vocabs, _ = _classify(root, tmp_path / "wd")
    assert vocabs["label"] == ["cat", "dog"] and len(train.records) == 2


def test_class_names_differing_only_in_case_or_spaces_are_said(tmp_path, caplog):
    root = _csv_dataset(str(tmp_path / "d"), "image,label\na.png,cat\nb.png,Cat\nc.png,dog\n",
                        "image,label\nd.png,dog\n")
    with caplog.at_level(logging.WARNING):
        _, _, vocabs, _ = _classify(root, tmp_path / "wd")
    assert vocabs["label"] == ["Cat", "cat", "dog"]  # kept apart, as written, but said
    assert "head 'label' has classes that differ only in case or spaces: 'Cat' and 'cat'" in caplog.text


def test_very_unbalanced_classes_without_class_weights_are_said(tmp_path, caplog):
    from jaxrat.tasks.classification import ClassificationTask

    rows = "".join(f"a{i}.png,cat\n" for i in range(24)) + "b.png,dog\n"
    root = _csv_dataset(str(tmp_path / "d"), "image,label\n" + rows, "image,label\nb.png,dog\na0.png,cat\n")
    config = load_config("classification")
    config.data.data_dir = root
    with caplog.at_level(logging.WARNING):
        ClassificationTask(config).prepare_data(str(tmp_path / "wd"))
    assert ("head 'label' is unbalanced: 24 training images of 'cat' against 1 of 'dog'; "
            "--config.task.class_weights=inverse") in caplog.text
    caplog.clear()
    config.task.class_weights = "inverse"
    with caplog.at_level(logging.WARNING):
        ClassificationTask(config).prepare_data(str(tmp_path / "wd"))
    assert "unbalanced" not in caplog.text


def test_csv_paths_that_start_with_the_dataset_folder_are_read(tmp_path):
    # Written from the folder above the dataset (pandas' df.to_csv of glob("mydata/images/*")).
    root = str(tmp_path / "mydata")
    _images(root, ["images/a.png", "images/b.png", "images/c.png"])
    with open(os.path.join(root, "train.csv"), "w") as f:
        f.write("image,label\nmydata/images/a.png,cat\nmydata/images/b.png,dog\n")
    with open(os.path.join(root, "val.csv"), "w") as f:
        f.write("image,label\nmydata/images/c.png,dog\n")
    train, _, _, _ = _classify(root, tmp_path / "wd")
    assert [os.path.relpath(r["path"], root) for r in train.records] == ["images/a.png", "images/b.png"]
