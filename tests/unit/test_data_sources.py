"""Folder/CSV classification sources and TFDS ArrayRecord (ISIC builder, generic reader) without TF."""

import os

import numpy as np
import pytest
from PIL import Image

from jaxrat.data import pipeline
from jaxrat.data.badfiles import BadFilePolicy
from jaxrat.data.sources import folder, isic
from jaxrat.data.synthetic import isic as synthetic_isic
from jaxrat.runtime.errors import DataError


def _img(path, value, size=(6, 5)):
    Image.fromarray(np.full((*size, 3), value, np.uint8)).save(path)


def test_folder_per_class(tmp_path):
    for cls, v in (("nevus", 10), ("melanoma", 200)):
        os.makedirs(tmp_path / cls)
        for i in range(2):
            _img(str(tmp_path / cls / f"{i}.png"), v)
    (tmp_path / "nevus" / "README").write_text("not an image")
    (tmp_path / "LICENSE").write_text("x")
    records, classes = folder.folder_records(str(tmp_path))
    assert classes == ["melanoma", "nevus"] and len(records) == 4
    ex = folder.DecodeClassification().map(records[0])
    assert ex["image"][0, 0, 0] == 200 and ex["labels"].tolist() == [0]
    with pytest.raises(DataError, match="No images"):
        folder.folder_records(str(tmp_path / "melanoma"))


def test_csv_with_several_label_columns_and_bad_rows(tmp_path):
    os.makedirs(tmp_path / "imgs")
    for i in range(3):
        _img(str(tmp_path / "imgs" / f"{i}.jpg"), 50 * i)
    open(tmp_path / "imgs" / "empty.jpg", "wb").close()
    (tmp_path / "labels.csv").write_text(
        "image,diagnosis,grade\nimgs/0.jpg,nevus,2\nimgs/1.jpg,melanoma,\nimgs/2.jpg,nevus,0\nimgs/empty.jpg,nevus,1\n")
    with pytest.raises(DataError, match="empty.jpg: file is empty"):
        folder.csv_records(str(tmp_path / "labels.csv"), label_columns=("diagnosis", "grade"))
    records, vocabs = folder.csv_records(str(tmp_path / "labels.csv"), label_columns=("diagnosis", "grade"),
                                         policy=BadFilePolicy("skip"))
    assert vocabs == {"diagnosis": ["melanoma", "nevus"], "grade": []}
    assert [r["labels"].tolist() for r in records] == [[1, 2], [0, -1], [1, 0]]  # empty cell: -1
    data = pipeline.ExampleSource(records, loader=folder.DecodeClassification())
    ops = pipeline.augment_ops(4, random_flip=True)
    batch = next(pipeline.train_iterator(data, image_size=4, local_batch=2, seed=0, process_index=0,
                                         process_count=1, ops=ops, num_threads=0))
    assert batch["image"].shape == (2, 4, 4, 3) and batch["labels"].shape == (2, 2)
    with pytest.raises(DataError, match=r"no column\(s\) \['site'\]"):
        folder.csv_records(str(tmp_path / "labels.csv"), label_columns=("site",))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    from jaxrat.data.sources import isic_arrayrecord

    src = str(tmp_path_factory.mktemp("isic"))
    synthetic_isic.write_dataset(src, num_train=6, num_val=3, image_size=16, seed=2)
    out = str(tmp_path_factory.mktemp("tfds"))
    isic_arrayrecord.prepare(src, out)
    return src, out


def test_isic_arrayrecord_stream_equals_the_files_stream(prepared):
    from jaxrat.data import datasets
    from jaxrat.data.sources import isic_arrayrecord

    src, out = prepared
    assert any(f.endswith(".array_record-00000-of-00001") or "array_record" in f
               for _, _, fs in os.walk(out) for f in fs)
    pairs = {os.path.basename(i).split(".")[0]: (i, m) for i, m in isic.find_pairs(src, "train")}
    tf_train = isic_arrayrecord.example_source(out, "train", BadFilePolicy())
    assert len(tf_train) == len(pairs) == 6
    for k in range(len(tf_train)):  # the stored bytes decode to exactly what the files give
        rec = tf_train.records[k]
        a = isic.DecodePair().map(pairs[rec["image_id"].decode() if isinstance(rec["image_id"], bytes)
                                            else rec["image_id"]])
        b = tf_train.loader.map(rec)
        np.testing.assert_array_equal(a["image"], b["image"])
        np.testing.assert_array_equal(a["mask"], b["mask"])
    batch = next(pipeline.train_iterator(tf_train, image_size=8, local_batch=3, seed=0, process_index=0,
                                         process_count=1, num_threads=0))
    assert batch["image"].shape == (3, 8, 8, 3) and batch["mask"].shape == (3, 8, 8, 1)

    class Cfg(dict):
        __getattr__ = dict.get

    cfg = Cfg(name="isic2018", source="tfds", data_dir=out, synthetic=False, on_bad_file="fail", split_file="")
    train, val = datasets.resolve_segmentation(cfg, out, seed=0, process_index=0)
    assert (len(train), len(val)) == (6, 3)


def test_generic_tfds_reader_and_missing_dataset(prepared, tmp_path):
    from jaxrat.data.sources import isic_arrayrecord, tfds

    _, out = prepared
    isic_arrayrecord.builder_class()  # tfds reads a custom dataset's metadata through its registered builder
    data = tfds.example_source(isic_arrayrecord.NAME, "validation", out, mask_key="mask")
    ex = data.loader.map(data.records[0])
    assert ex["image"].dtype == np.uint8 and ex["image"].shape[-1] == 3 and set(np.unique(ex["mask"])) <= {0, 1}
    with pytest.raises(DataError, match="not prepared as ArrayRecord"):
        tfds.example_source("jaxrat_no_such_dataset", "train", str(tmp_path))


def test_isic_arrayrecord_with_max_side_stores_shrunk_images(tmp_path):
    from PIL import Image

    from jaxrat.data.imageio import load_rgb_with_size
    from jaxrat.data.sources import isic_arrayrecord

    src = str(tmp_path / "isic")
    synthetic_isic.write_dataset(src, num_train=4, num_val=2, image_size=24, seed=3)
    out = str(tmp_path / "tfds_small")
    isic_arrayrecord.prepare(src, out, max_side=12)
    data = isic_arrayrecord.example_source(out, "train", BadFilePolicy())
    pairs = {os.path.basename(i).split(".")[0]: (i, m) for i, m in isic.find_pairs(src, "train")}
    assert len(data) == 4
    for k in range(len(data)):
        rec = data.records[k]
        image_id = rec["image_id"].decode() if isinstance(rec["image_id"], bytes) else rec["image_id"]
        ex = data.loader.map(rec)
        full = isic.DecodePair().map(pairs[image_id])
        h, w = full["image"].shape[:2]
        scale = 12 / max(h, w)
        assert ex["image"].shape == (round(h * scale), round(w * scale), 3)
        assert ex["mask"].shape == ex["image"].shape[:2] and set(np.unique(ex["mask"])) <= {0, 1}
        drafted, _ = load_rgb_with_size(pairs[image_id][0], at_least=(12, 12))
        want = np.asarray(Image.fromarray(drafted).resize(ex["image"].shape[1::-1], Image.LANCZOS), np.float32)
        assert np.abs(ex["image"].astype(np.float32) - want).mean() < 3  # JPEG quality 95, no chroma subsampling
        want_mask = np.asarray(Image.fromarray(full["mask"]).resize(ex["mask"].shape[::-1], Image.NEAREST))
        np.testing.assert_array_equal(ex["mask"], want_mask)
    with pytest.raises(DataError, match="was prepared with .*max_side.: 12.*pass another --out"):
        isic_arrayrecord.prepare(src, out, max_side=0)
    isic_arrayrecord.prepare(src, out, max_side=12)  # the same settings again: nothing to do


def test_prepare_isic_cli_refuses_a_negative_max_side(tmp_path, capsys):
    from jaxrat.data import prepare_isic

    assert prepare_isic.main(["--src", str(tmp_path), "--out", str(tmp_path / "o"), "--max-side", "-1"]) == 2
    assert "--max-side=-1" in capsys.readouterr().err


def test_prepare_isic_command_line_converts(tmp_path):
    import subprocess
    import sys

    from jaxrat.data.sources import isic_arrayrecord

    src = str(tmp_path / "isic")
    synthetic_isic.write_dataset(src, num_train=3, num_val=2, image_size=16, seed=4)
    out = str(tmp_path / "tfds")
    cmd = [sys.executable, "-m", "jaxrat.data.prepare_isic", "--src", src, "--out", out, "--max-side", "8"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "written as ArrayRecord" in proc.stdout
    data = isic_arrayrecord.example_source(out, "validation", BadFilePolicy())
    assert len(data) == 2 and max(data.loader.map(data.records[0])["image"].shape[:2]) == 8
