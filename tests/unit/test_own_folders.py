"""A user's own folders as users leave them: a macOS archive's __MACOSX, an empty or misspelt class
folder, images one folder too deep, a converted copy beside its original, a broken link, a CSV from
Excel. Each trains what it should, or is refused in one sentence naming the folder and the fix;
nothing is dropped without a word."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
from PIL import Image

from jaxrat.config_schema import load_config
from jaxrat.data import datasets
from jaxrat.data.badfiles import BadFilePolicy
from jaxrat.data.imageio import BadFileError
from jaxrat.data.sources import segmentation_folder as sf
from jaxrat.runtime.errors import DataError


def _png(path, value=90, size=(8, 6)):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.fromarray(np.full((size[1], size[0], 3), value, np.uint8)).save(path)


def _classes(root, split_classes):
    """root/<split>/<class>/<i>.png for {split: {class: count}}."""
    for split, classes in split_classes.items():
        for name, n in classes.items():
            os.makedirs(os.path.join(root, split, name), exist_ok=True)
            for i in range(n):
                _png(os.path.join(root, split, name, f"{name}{i}.png"))
    return root


def _classify(root, wd, **kw):
    config = load_config("classification")
    config.data.data_dir, config.data.source = str(root), "folder"
    for k, v in kw.items():
        config.data[k] = v
    return datasets.resolve_classification(config.data, ("label",), str(wd), seed=0, process_index=0)


def test_a_macos_archive_folder_is_no_class(tmp_path):
    root = _classes(str(tmp_path / "d"), {"train": {"circle": 4, "square": 4}, "val": {"circle": 2, "square": 2}})
    _png(os.path.join(root, "train", "__MACOSX", "circle", "._circle0.png"))  # what unzip leaves
    _png(os.path.join(root, "train", "__MACOSX", "x.png"))
    train, val, vocabs, found = _classify(root, tmp_path / "wd")
    assert vocabs["label"] == ["circle", "square"] and found == (2,) and len(train.records) == 8


@pytest.mark.parametrize("layout, says", [
    ({"train": {"circle": 4, "hexagon": 0}, "val": {"circle": 2}},
     r"Class folder .*train/hexagon holds no usable image, so class 'hexagon' cannot be learned; add its images, "
     r"or remove the folder\."),
    ({"train": {"circle": 4, "square": 4}, "val": {"circle": 2, "Square": 2}},
     r"Class 'Square' of .*/val has no folder in .*/train \(whose classes are circle, square\), so it cannot be "
     r"learned; rename it to 'square' as in train/\."),
    ({"train": {"circle": 4}, "val": {"circle": 2, "hexagon": 2}},
     r"Class 'hexagon' .* cannot be learned; add its training images under train/, or remove it from val/\."),
])
def test_a_class_that_cannot_be_learned_is_refused_naming_it(tmp_path, layout, says):
    root = _classes(str(tmp_path / "d"), layout)
    with pytest.raises(DataError, match=says):
        _classify(root, tmp_path / "wd")


def test_images_one_folder_too_deep_are_said_and_an_only_nested_class_refused(tmp_path, caplog):
    root = _classes(str(tmp_path / "d"), {"train": {"circle": 3, "square": 3}, "val": {"circle": 1, "square": 1}})
    for i in range(2):
        _png(os.path.join(root, "train", "circle", "batch2", f"c{i}.png"))
    with caplog.at_level(logging.WARNING):
        train, *_ = _classify(root, tmp_path / "wd")
    assert len(train.records) == 6 and "2 image(s) in sub-folders of" in caplog.text and "are not read" in caplog.text
    deep = _classes(str(tmp_path / "deep"), {"train": {"square": 3}, "val": {"square": 1}})
    for i in range(3):
        _png(os.path.join(deep, "train", "circle", "batch1", f"c{i}.png"))
    with pytest.raises(DataError, match=r"train/circle holds no usable image.*its 3 image\(s\) are in sub-folders, "
                                        r"which are not read; move them into circle/ itself\."):
        _classify(deep, tmp_path / "wd2")


def test_folds_need_no_val_folder_and_without_folds_the_message_says_so(tmp_path):
    root = _classes(str(tmp_path / "d"), {"train": {"circle": 6, "square": 6}})
    with pytest.raises(DataError, match=r"has no val/ folder; add .*/val with a folder per class as in train/, or "
                                        r"validate on folds of train/ with --config.data.folds=5\."):
        _classify(root, tmp_path / "wd")
    train, val, _, _ = _classify(root, tmp_path / "wd", folds=3, fold=0)
    assert len(train.records) + len(val.records) == 12 and len(val.records) == 4


def _pairs(root, stems, image_ext=".png"):
    for stem in stems:
        _png(os.path.join(root, "images", stem + image_ext))
        mask = np.zeros((6, 8), np.uint8)
        mask[1:4, 2:6] = 1
        os.makedirs(os.path.join(root, "masks"), exist_ok=True)
        Image.fromarray(mask).save(os.path.join(root, "masks", stem + ".png"))
    return root


def test_a_converted_copy_beside_its_image_is_one_example_with_a_warning(tmp_path, caplog):
    root = _pairs(str(tmp_path / "d"), [f"im{i:02d}" for i in range(10)])
    _png(os.path.join(root, "images", "im05.jpg"))  # the same photo, converted
    with caplog.at_level(logging.WARNING):
        pairs = sf.find_pairs(root, "train", val_fraction=0.3) + sf.find_pairs(root, "validation", val_fraction=0.3)
    assert len(pairs) == 10 and len({m for _, m in pairs}) == 10  # no mask twice, so none in both splits
    assert "im05.png has the name of" in caplog.text and "im05.jpg" in caplog.text


def test_images_added_later_keep_the_split_of_those_already_there(tmp_path):
    """Adding images to a split-by-fraction folder must not reshuffle it: a resumed run (or a new run
    on the grown folder) would train on images its validation held. Each added image may move at
    most one other pair across the boundary; the split keeps its exact size."""
    root = _pairs(str(tmp_path / "d"), [f"im{i:02d}" for i in range(30)])

    def sides():
        val = {os.path.basename(i) for i, _ in sf.find_pairs(root, "validation", val_fraction=0.2, seed=4)}
        train = {os.path.basename(i) for i, _ in sf.find_pairs(root, "train", val_fraction=0.2, seed=4)}
        assert not val & train
        return val, train

    first_val, first_train = val, train = sides()
    assert len(val) == 6 and len(train) == 24
    for k in range(5):
        _pairs(root, [f"new{k}"])
        new_val, new_train = sides()
        assert len(new_val) == round(0.2 * (31 + k)) and len(new_val) + len(new_train) == 31 + k
        assert len(val & new_train) + len(train & new_val) <= 1
        val, train = new_val, new_train
    assert len(first_val & train) + len(first_train & val) <= 5
    assert sides() == (val, train)  # the same split at every call (every process, every rerun)


def test_a_broken_link_is_a_missing_file_not_a_vanished_image(tmp_path):
    root = _pairs(str(tmp_path / "d"), [f"im{i:02d}" for i in range(6)])
    os.symlink(str(tmp_path / "gone.png"), os.path.join(root, "images", "zz.png"))
    os.symlink(str(tmp_path / "gone.png"), os.path.join(root, "masks", "zz.png"))
    pairs = sf.find_pairs(root, "train", val_fraction=0.5) + sf.find_pairs(root, "validation", val_fraction=0.5)
    assert any(img.endswith("zz.png") for img, _ in pairs)  # the pipeline's bad-file policy meets it
    from jaxrat.data.sources import isic

    with pytest.raises(BadFileError, match=r"zz.png: file not found"):
        isic.check_pairs(sorted(pairs), BadFilePolicy(), "the dataset")


def test_a_pairs_csv_from_excel_with_a_byte_order_mark_is_read(tmp_path):
    root = _pairs(str(tmp_path / "d"), [f"im{i:02d}" for i in range(6)])
    rows = [f"images/im{i:02d}.png,masks/im{i:02d}.png,{'val' if i < 2 else 'train'}" for i in range(6)]
    with open(os.path.join(root, "pairs.csv"), "w", encoding="utf-8-sig") as f:
        f.write("image,mask,split\r\n" + "\r\n".join(rows) + "\r\n")
    assert len(sf.find_pairs(root, "train", pairs_csv="pairs.csv")) == 4
    assert len(sf.find_pairs(root, "validation", pairs_csv="pairs.csv")) == 2


def test_a_folder_without_a_test_split_says_so(tmp_path):
    root = _pairs(str(tmp_path / "d"), [f"im{i:02d}" for i in range(6)])
    config = load_config("segmentation")
    config.data.data_dir, config.data.eval_split = root, "test"
    with pytest.raises(DataError, match=r"has no test split \(a test/ folder holding images/ and masks/, or rows "
                                        r"with split=test in the pairs CSV\); evaluate --split validation or train"):
        datasets.resolve_segmentation(config.data, str(tmp_path / "wd"), seed=0, process_index=0, num_classes=2)


def test_the_classification_demo_on_a_folder_per_class_is_one_head():
    from jaxrat.data.own_data import on_own_data

    config = on_own_data(load_config("classification:demo"))
    assert config.task.heads == ("shape", "kind")  # the demo itself
    config.data.data_dir, config.data.source = "/my/folders", "folder"
    config = on_own_data(config)
    assert not config.data.synthetic and config.task.heads == ("label",)
    assert config.task.num_classes == (0,) and config.task.loss_weights == (1.0,)
    assert config.checkpoint.best_metric == "eval/label/balanced_accuracy"


def test_a_relative_dataset_folder_is_saved_absolute(tmp_path, monkeypatch):
    # config.json names the dataset as the run read it, so `jaxrat evaluate --workdir W` from another folder
    # finds it (a relative DIR was saved as given and not found from elsewhere).
    from jaxrat.data.own_data import on_own_data

    monkeypatch.chdir(tmp_path)
    config = load_config("segmentation")
    config.data.data_dir = "mine"
    assert on_own_data(config).data.data_dir == str(tmp_path / "mine")
    config.data.data_dir = "gs://bucket/isic"  # a URL stays as it is
    assert on_own_data(config).data.data_dir == "gs://bucket/isic"
    config.data.data_dir = ""
    assert on_own_data(config).data.data_dir == ""


def test_heic_photos_are_read_with_pillow_heif_and_named_without_it(tmp_path, caplog):
    """iPhones save HEIC: with pillow-heif installed a class folder of them trains (turned upright as
    shown); without it they were passed over as no images at all, and a class of nothing but HEIC
    said "add its images". Camera raw files are named likewise."""
    import json
    import subprocess
    import sys

    import pillow_heif  # noqa: F401 - jaxrat registers it; the test writes with it

    from jaxrat.data import imageio
    from jaxrat.data.sources.folder import folder_records
    from runner import REPO

    root = tmp_path / "train"
    _png(str(root / "cat" / "a.png"))
    image = Image.fromarray(np.full((6, 8, 3), 200, np.uint8))
    exif = Image.Exif()
    exif[0x0112] = 6  # shown a quarter turn from how it is stored
    image.save(root / "cat" / "b.heic", exif=exif.tobytes())
    os.makedirs(root / "dog")
    image.save(root / "dog" / "c.HEIC")
    (root / "dog" / "d.cr2").write_bytes(b"raw sensor data")
    with caplog.at_level(logging.WARNING):
        records, classes = folder_records(str(root))
    assert classes == ["cat", "dog"] and sorted(os.path.basename(r["path"]) for r in records) == ["a.png", "b.heic",
                                                                                                  "c.HEIC"]
    assert "1 camera raw file(s) (e.g. d.cr2), which jaxrat does not read" in caplog.text
    assert imageio.load_rgb(str(root / "cat" / "b.heic")).shape == (8, 6, 3)

    code = f"""
import json, logging, sys
sys.modules["pillow_heif"] = None  # as if not installed
from jaxrat.data import imageio
from jaxrat.data.sources.folder import folder_records
from jaxrat.runtime.errors import DataError
out = {{}}
try:
    folder_records({str(root)!r})
except DataError as e:
    out["refused"] = str(e)
try:
    imageio.load_rgb({str(root / "cat" / "b.heic")!r})
except DataError as e:
    out["read"] = str(e)
print(json.dumps(out))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["refused"] == (
        f"Class folder {root / 'dog'} holds no usable image, so class 'dog' cannot be learned; it holds 1 HEIC/HEIF "
        "photo(s) (e.g. c.HEIC), which Pillow reads only with the pillow-heif package: pip install pillow-heif (or "
        "'jaxrat[heic]'); 1 camera raw file(s) (e.g. d.cr2), which jaxrat does not read: export them as JPEG, PNG "
        "or TIFF.")
    assert "b.heic: 1 HEIC/HEIF photo(s) (e.g. b.heic), which Pillow reads only with the pillow-heif" in out["read"]
