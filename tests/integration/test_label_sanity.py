"""Unusable labels are refused before training, each in one sentence naming the fix: a split with no
labelled pixel, 0/255 or 1-bit masks with several classes, unknown split values in a pairs CSV, two
candidate masks for one image; a mostly ignored split is warned about with the count. Masks are read
once (a sample when they look fine) and their histograms cached in the workdir."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from PIL import Image

from jaxrat.data import datasets, label_check
from jaxrat.data.sources import segmentation_folder as sf
from jaxrat.runtime.errors import DataError


class Cfg(dict):
    __getattr__ = dict.get


def _cfg(data_dir, **kw):
    return Cfg(name="folder", source="files", data_dir=data_dir, synthetic=False, synthetic_train=0, synthetic_val=0,
               image_size=16, on_bad_file="fail", val_fraction=0.25, **kw)


def _dataset(root, masks, mode="L", mask_name="{}.png"):
    """images/imNN.png (8x6) and masks/<mask_name> from the given (6, 8) arrays."""
    os.makedirs(os.path.join(root, "images"), exist_ok=True)
    os.makedirs(os.path.join(root, "masks"), exist_ok=True)
    for i, mask in enumerate(masks):
        Image.fromarray(np.full((6, 8, 3), 80, np.uint8)).save(os.path.join(root, "images", f"im{i:02d}.png"))
        img = Image.fromarray(mask.astype(np.uint8))
        (img.convert("1") if mode == "1" else img).save(os.path.join(root, "masks", mask_name.format(f"im{i:02d}")))
    return root


def _lesion(value, background=0):
    m = np.full((6, 8), background, np.uint8)
    m[1:4, 2:6] = value
    return m


def _resolve(root, wd, num_classes, **kw):
    return datasets.resolve_segmentation(_cfg(root, **kw), str(wd), seed=0, process_index=0, num_classes=num_classes)


def test_a_split_with_every_pixel_ignored_is_refused(tmp_path):
    root = _dataset(str(tmp_path / "d"), [np.full((6, 8), 255, np.uint8)] * 8)
    with pytest.raises(DataError, match=r"Every pixel of the \d+ mask\(s\) of the train split is 255 \(ignore\)"):
        _resolve(root, tmp_path / "wd", num_classes=2)


@pytest.mark.parametrize("mode, num_classes", [("L", 2), ("1", 3)])
def test_zero_255_and_one_bit_masks_with_several_classes_are_refused(tmp_path, mode, num_classes):
    root = _dataset(str(tmp_path / "d"), [_lesion(255)] * 8, mode=mode)
    with pytest.raises(DataError, match="hold only 0 and 255.*num_classes=1, or map 255 to class 1") as err:
        _resolve(root, tmp_path / "wd", num_classes=num_classes)
    assert f"num_classes={num_classes} every foreground pixel would be ignored" in str(err.value)
    # The fix the sentence names works: the same masks train as two classes through the label map.
    train, val = _resolve(root, tmp_path / "wd", num_classes=num_classes, label_map=((0, 0), (255, 1)))
    assert set(np.unique(train.loader.map(train.records[0])["mask"])) == {0, 1}


def test_a_zero_255_sample_is_not_refused_when_a_later_mask_has_a_class(tmp_path, monkeypatch):
    monkeypatch.setattr(label_check, "SAMPLE", 2)
    root = _dataset(str(tmp_path / "d"), [_lesion(255)] * 7 + [_lesion(1)])
    pairs = [(f"i{i}", os.path.join(root, "masks", f"im{i:02d}.png")) for i in range(8)]
    label_check.check_split(pairs, "train", 2, None, label_check.HistogramCache(None))  # im07 holds class 1
    with pytest.raises(DataError, match="hold only 0 and 255"):
        label_check.check_split(pairs[:7], "train", 2, None, label_check.HistogramCache(None))


def test_mostly_ignored_pixels_are_warned_with_the_count(tmp_path, caplog):
    root = _dataset(str(tmp_path / "d"), [_lesion(1, background=255)] * 8)  # 12 of 48 pixels labelled
    with caplog.at_level("WARNING"):
        _resolve(root, tmp_path / "wd", num_classes=2)
    assert "data: 216 of 288 pixels (75%) in the 6 mask(s) of the train split are 255 (ignore)" in caplog.text
    caplog.clear()
    root2 = _dataset(str(tmp_path / "d2"), [_lesion(1)] * 8)
    with caplog.at_level("WARNING"):
        _resolve(root2, tmp_path / "wd2", num_classes=2)
    assert "ignore" not in caplog.text


def test_mask_histograms_are_read_once_and_again_when_a_mask_changes(tmp_path, monkeypatch):
    root = _dataset(str(tmp_path / "d"), [_lesion(1)] * 8)
    reads = []
    real = label_check.load_stored
    monkeypatch.setattr(label_check, "load_stored", lambda p: reads.append(p) or real(p))
    _resolve(root, tmp_path / "wd", num_classes=2)
    assert len(reads) == 8  # 6 train + 2 validation masks
    with open(tmp_path / "wd" / label_check.LABEL_STATS_NAME) as f:
        assert len(json.load(f)["masks"]) == 8
    reads.clear()
    _resolve(root, tmp_path / "wd", num_classes=2)  # a resumed run reads no mask
    assert reads == []
    mask = os.path.join(root, "masks", "im00.png")
    Image.fromarray(np.full((6, 8), 255, np.uint8)).save(mask)
    st = os.stat(mask)
    os.utime(mask, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # a changed mask, whatever the clock
    _resolve(root, tmp_path / "wd", num_classes=2)
    assert reads == [mask]


def test_unknown_csv_split_values_are_refused_not_dropped(tmp_path):
    root = _dataset(str(tmp_path / "d"), [_lesion(1)] * 10)
    rows = [f"images/im{i:02d}.png,masks/im{i:02d}.png,{s}"
            for i, s in enumerate(["train"] * 4 + ["val"] * 2 + ["Training set"] * 4)]
    (tmp_path / "d" / "pairs.csv").write_text("image,mask,split\n" + "\n".join(rows) + "\n")
    with pytest.raises(DataError, match=r"pairs.csv line 8: split 'Training set' is not a split; write one of "):
        sf.find_pairs(root, "train", pairs_csv="pairs.csv")
    rows[6:] = [r.replace("Training set", "") for r in rows[6:]]
    (tmp_path / "d" / "pairs.csv").write_text("image,mask,split\n" + "\n".join(rows) + "\n")
    with pytest.raises(DataError, match=r"4 of 10 rows \(first at line 8\) have no split while the others have one"):
        sf.find_pairs(root, "train", pairs_csv="pairs.csv")
    rows[6:] = [r + "Training" for r in rows[6:]]  # a known spelling, in any case
    (tmp_path / "d" / "pairs.csv").write_text("image,mask,split\n" + "\n".join(rows) + "\n")
    assert len(sf.find_pairs(root, "train", pairs_csv="pairs.csv")) == 8


def test_an_image_with_two_candidate_masks_is_refused(tmp_path):
    root = _dataset(str(tmp_path / "d"), [_lesion(1)] * 4)
    Image.fromarray(_lesion(1)).save(os.path.join(root, "masks", "im00_mask.png"))
    with pytest.raises(DataError, match=r"im00.png has 2 candidate masks in .*masks \(im00.png and im00_mask.png\); "
                                        r"remove or rename all but one"):
        sf.find_pairs(root, "train", val_fraction=0.25)
    os.remove(os.path.join(root, "masks", "im00.png"))
    assert len(sf.find_pairs(root, "train", val_fraction=0.25)) == 3


def _discs(root, n, suffix, extra_class=False):
    """images/imNN.png and masks/imNN<suffix> of 64 px: a disc of 1s (and a square of 2s) on 0."""
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[:64, :64]
    for sub in ("images", "masks"):
        os.makedirs(os.path.join(root, sub), exist_ok=True)
    for i in range(n):
        cy, cx = rng.integers(16, 48, 2)
        mask = (((yy - cy) ** 2 + (xx - cx) ** 2) < 144).astype(np.uint8)
        if extra_class:
            mask[4:14, 4:14] = 2
        Image.fromarray(np.full((64, 64, 3), 60, np.uint8)).save(os.path.join(root, "images", f"im{i:02d}.png"))
        Image.fromarray(mask).save(os.path.join(root, "masks", f"im{i:02d}{suffix}"))
    return root


@pytest.mark.parametrize("suffix, extra_class", [(".png", True), (".jpg", False)])
def test_binary_masks_of_small_values_that_would_read_empty_are_refused(tmp_path, suffix, extra_class):
    # A class map (0/1/2) trained binary, or 0/1 masks saved as JPEG (compression adds 2s and 3s):
    # thresholded above 127, such masks read as background and the run scored Dice 1.0, silently.
    root = _discs(str(tmp_path / "d"), 20, suffix, extra_class)
    tops = [np.asarray(Image.open(os.path.join(root, "masks", f"im{i:02d}{suffix}"))).max() for i in range(20)]
    assert any(1 < t <= 127 for t in tops)  # what such masks hold
    with pytest.raises(DataError, match=r"masks/im\d\d\.(png|jpg) holds the values \[0, 1, 2.*none above 127, "
                                        r"which a binary run \(model.num_classes=1\) reads as all background; for "
                                        r"class maps set --config.model.num_classes to the number of classes"):
        _resolve(root, tmp_path / "wd", num_classes=1)
    if extra_class:  # the fix the sentence names: as a class map, the 0/1/2 masks are fine
        train, _ = _resolve(root, tmp_path / "wd3", num_classes=3)
        assert set(np.unique(train.loader.map(train.records[0])["mask"])) == {0, 1, 2}


@pytest.mark.parametrize("mask", [_lesion(255), _lesion(1), np.stack([_lesion(255), _lesion(0), _lesion(0)], -1)])
def test_usable_binary_masks_pass_and_read_as_before(tmp_path, mask):
    from jaxrat.data.imageio import load_mask

    root = _dataset(str(tmp_path / "d"), [mask] * 8)  # 0/255, 0/1, a red lesion on black
    train, val = _resolve(root, tmp_path / "wd", num_classes=1)
    assert len(train.records) + len(val.records) == 8
    assert load_mask(os.path.join(root, "masks", "im00.png")).sum() == 12
    with open(tmp_path / "wd" / label_check.LABEL_STATS_NAME) as f:
        entries = json.load(f)["masks"]
    assert len(entries) == 8 and {e["kind"] for e in entries.values()} == {"levels"}


def test_a_binary_training_split_without_foreground_is_refused_and_an_empty_validation_warned(tmp_path, caplog):
    root = _dataset(str(tmp_path / "d"), [np.zeros((6, 8), np.uint8)] * 8)
    with pytest.raises(DataError, match=r"No mask of the train split \(6 read\) has a foreground pixel .*nothing to "
                                        r"learn"):
        _resolve(root, tmp_path / "wd", num_classes=1)
    pairs = [(f"i{i}", os.path.join(root, "masks", f"im{i:02d}.png")) for i in range(2)]
    with caplog.at_level("WARNING"):
        label_check.check_binary_split(pairs, "validation", label_check.HistogramCache(None, binary=True))
    assert "No mask of the validation split (2 read) has a foreground pixel" in caplog.text
    assert "only score empty predictions" in caplog.text


def test_a_class_map_saved_as_jpeg_names_the_compression_not_num_classes(tmp_path):
    from jaxrat.data.imageio import BadFileError

    root = _discs(str(tmp_path / "d"), 6, ".jpg", extra_class=True)
    messages = []
    for i in range(6):
        try:
            sf.load_labels(os.path.join(root, "masks", f"im{i:02d}.jpg"), None, 3)
        except BadFileError as e:
            messages.append(str(e))
    assert messages  # JPEG's rounding put values 3+ into some of the masks
    assert all("and is a JPEG, whose compression changes class values near edges; save the class maps as PNG."
               in m and "model.num_classes=3, and is a JPEG" in m for m in messages)
