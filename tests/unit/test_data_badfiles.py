"""Odd but valid files are converted; bad files fail with their name or are skipped deterministically."""

import json
import os
import shutil
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from jaxrat.data import badfiles, imageio, pipeline, staging
from jaxrat.data.badfiles import BadFilePolicy
from jaxrat.data.sources import isic
from jaxrat.data.synthetic import isic as synthetic_isic
from jaxrat.runtime.errors import ConfigError, DataError

TRAIN_IMG, TRAIN_MASK = isic.SPLIT_FOLDERS["train"]


def _png16_rgb(path, arr):
    """Write a 48-bit RGB PNG by hand (PIL cannot write one)."""
    h, w, _ = arr.shape
    raw = b"".join(b"\x00" + arr[y].astype(">u2").tobytes() for y in range(h))
    chunk = lambda t, d: struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d))  # noqa: E731
    ihdr = struct.pack(">IIBBBBB", w, h, 16, 2, 0, 0, 0)
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def test_odd_but_valid_images_become_uint8_rgb(tmp_path):
    rgb = np.random.default_rng(0).integers(0, 255, (6, 5, 3), dtype=np.uint8)
    paths = {}
    paths["gray"] = str(tmp_path / "gray.png")
    Image.fromarray(rgb[..., 0]).save(paths["gray"])
    paths["cmyk"] = str(tmp_path / "cmyk.jpg")
    Image.fromarray(rgb).convert("CMYK").save(paths["cmyk"])
    paths["palette"] = str(tmp_path / "palette.png")
    pal = Image.fromarray(rgb).convert("P")
    pal.info["transparency"] = 0
    pal.save(paths["palette"], transparency=0)
    paths["rgba"] = str(tmp_path / "rgba.png")
    Image.fromarray(np.dstack([rgb, rgb[..., :1]])).save(paths["rgba"])
    paths["gray16"] = str(tmp_path / "gray16.png")
    Image.fromarray((rgb[..., 0].astype(np.uint16) * 257)).save(paths["gray16"])
    paths["rgb16"] = str(tmp_path / "rgb16.png")
    _png16_rgb(paths["rgb16"], rgb.astype(np.uint16) * 257)
    paths["png_named_jpg"] = str(tmp_path / "really_png.jpg")
    Image.fromarray(rgb).save(paths["png_named_jpg"], format="PNG")
    for name, path in paths.items():
        img = imageio.load_rgb(path)
        assert img.dtype == np.uint8 and img.shape == (6, 5, 3), name
    np.testing.assert_array_equal(imageio.load_rgb(paths["png_named_jpg"]), rgb)
    np.testing.assert_array_equal(imageio.load_rgb(paths["rgb16"]), rgb)  # 16 -> 8 bits, not clipped
    np.testing.assert_array_equal(imageio.load_rgb(paths["gray16"])[..., 0], rgb[..., 0])
    # 16-bit masks: any non-zero value is foreground.
    m16 = str(tmp_path / "m16.png")
    Image.fromarray(np.array([[0, 1], [65535, 0]], np.uint16)).save(m16)
    np.testing.assert_array_equal(imageio.load_mask(m16), [[0, 1], [1, 0]])


def test_masks_in_other_encodings_keep_their_foreground(tmp_path):
    """0/1 label maps, colour, palette and 1-bit masks: the same 9 foreground pixels, never an empty mask."""
    m = np.zeros((6, 6), np.uint8)
    m[1:4, 1:4] = 1
    red = np.zeros((6, 6, 3), np.uint8)
    red[..., 0] = m * 255
    soft = m * 255
    soft[0, 1:4], soft[4, 1:4] = 100, 60  # anti-aliased edge below half
    voc = Image.frombytes("P", (6, 6), m.tobytes())
    voc.putpalette([0, 0, 0, 128, 0, 0])  # Pascal VOC colours: class 1 is dark red
    masks = {
        "zero_one": Image.fromarray(m), "zero_255": Image.fromarray(m * 255), "antialiased": Image.fromarray(soft),
        "rgb_white": Image.fromarray(m * 255).convert("RGB"), "rgb_red": Image.fromarray(red),
        "rgba": Image.fromarray(m * 255).convert("RGBA"), "la": Image.fromarray(m * 255).convert("LA"),
        "one_bit": Image.fromarray(m.astype(bool)), "palette_voc": voc,
    }
    for name, img in masks.items():
        path = str(tmp_path / f"{name}.png")
        img.save(path)
        np.testing.assert_array_equal(imageio.load_mask(path), m, err_msg=name)
    Image.fromarray(np.zeros((6, 6), np.uint8)).save(tmp_path / "empty.png")
    assert imageio.load_mask(str(tmp_path / "empty.png")).max() == 0  # no lesion stays no lesion
    from jaxrat.data.sources.tfds import FromTfds

    got = FromTfds(label_keys=()).map({"image": np.zeros((6, 6, 3), np.uint8), "mask": m[..., None]})
    np.testing.assert_array_equal(got["mask"], m)


def test_lab_image_is_converted_and_an_unconvertible_mode_is_named(tmp_path, monkeypatch):
    rgb = np.random.default_rng(0).integers(0, 255, (6, 5, 3), dtype=np.uint8)
    path = str(tmp_path / "lab.tif")
    Image.fromarray(rgb).convert("LAB").save(path)
    assert Image.open(path).mode == "LAB"
    back = imageio.load_rgb(path).astype(int)
    assert back.shape == (6, 5, 3) and np.abs(back - rgb).mean() < 4  # through a colour profile, not raw channels
    monkeypatch.setattr(imageio, "_as_rgb", lambda img: img.convert("nonsense"))
    with pytest.raises(imageio.BadFileError, match="lab.tif: colour mode LAB cannot be converted"):
        imageio.load_rgb(path)

def _break(path, how):
    if how == "empty":
        open(path, "wb").close()
    elif how == "text":
        open(path, "w").write("this is not an image\n")
    elif how == "truncated":  # the header survives, the entropy-coded data is cut in half
        data = open(path, "rb").read()
        sos = data.index(b"\xff\xda")
        open(path, "wb").write(data[: sos + (len(data) - sos) // 2])


@pytest.fixture
def broken(tmp_path):
    """12 training pairs: #1 empty, #2 text, #3 truncated JPEG, #4 mask 3x3, #5 mask missing."""
    d = str(tmp_path / "isic")
    synthetic_isic.write_dataset(d, num_train=12, num_val=4, image_size=16, seed=1)
    img = lambda i: os.path.join(d, TRAIN_IMG, f"ISIC_{i:07d}.jpg")  # noqa: E731
    mask = lambda i: os.path.join(d, TRAIN_MASK, f"ISIC_{i:07d}_segmentation.png")  # noqa: E731
    _break(img(1), "empty")
    _break(img(2), "text")
    _break(img(3), "truncated")
    Image.fromarray(np.zeros((3, 3), np.uint8)).save(mask(4))
    os.remove(mask(5))
    open(os.path.join(d, TRAIN_IMG, "README.txt"), "w").write("stray file")
    return d, img, mask


@pytest.mark.parametrize("victim, problem", [(1, "empty"), (2, "not a readable image"), (4, "must match"),
                                             (5, "mask")])
def test_fail_policy_names_the_file_and_the_problem(broken, victim, problem):
    d, img, mask = broken
    for other in {1, 2, 4, 5} - {victim}:  # leave only the victim broken
        shutil.copy(img(0), img(other))
        shutil.copy(mask(0), mask(other))
    with pytest.raises(DataError) as e:
        isic.find_pairs(d, "train")
    msg = str(e.value)
    assert f"ISIC_{victim:07d}" in msg and problem in msg and "on_bad_file=skip" in msg


def test_fail_policy_lists_every_bad_file_in_one_refusal(broken, tmp_path):
    d, img, mask = broken
    with pytest.raises(DataError) as e:
        isic.find_pairs(d, "train")
    msg = str(e.value)
    assert msg.startswith("4 bad files in the dataset;") and "on_bad_file=skip" in msg
    for bad in (img(1), img(2), mask(4), img(5)):  # the truncated JPEG's header is sound: found when read
        assert f"\n  {bad}: " in msg

    from jaxrat.data import datasets
    from jaxrat.data.synthetic import segmentation as synthetic_segmentation

    # A whole dataset, both splits: 25 images without masks, named up to 20, the rest counted.
    data = synthetic_segmentation.write_dataset(str(tmp_path / "folder"), num_images=30, size=8, seed=0)
    masks = sorted(os.listdir(os.path.join(data, "masks")))
    for name in masks[:25]:
        os.remove(os.path.join(data, "masks", name))
    import ml_collections as mlc

    cfg = mlc.ConfigDict(dict(name="folder", data_dir=data, synthetic=False, synthetic_train=0, synthetic_val=0,
                              val_fraction=0.5, on_bad_file="fail"))
    with pytest.raises(DataError) as e:
        datasets.resolve_segmentation(cfg, str(tmp_path / "wd"), seed=0, process_index=0)
    msg = str(e.value)
    assert msg.startswith("25 bad files") and msg.count("no mask with its name") == 20 and msg.endswith("and 5 more")


def test_truncated_image_fails_when_read(broken):
    d, img, _ = broken
    pairs = isic.find_pairs(d, "train", policy=BadFilePolicy("skip"))
    bad = [p for p in pairs if p[0] == img(3)]
    assert bad, "a truncated JPEG has a valid header, so only decoding finds it"
    with pytest.raises(DataError, match="ISIC_0000003.jpg"):
        isic.LoadResize(8).map(bad[0])


def _stream(data, n, **kw):
    kw = {"local_batch": 4, "process_index": 0, "process_count": 1, **kw}
    it = pipeline.train_iterator(data, image_size=8, seed=0, num_threads=0, **kw)
    return [next(it) for _ in range(n)]


def test_skip_policy_is_deterministic_across_hosts_and_records_each_file_once(broken, tmp_path):
    d, img, mask = broken
    record = str(tmp_path / "wd" / badfiles.SKIPPED_FILES_NAME)
    policy = BadFilePolicy("skip", record)
    pairs = isic.find_pairs(d, "train", policy=policy)
    assert len(pairs) == 8  # 12 minus empty, text, size mismatch, missing mask; the truncated one stays
    data = pipeline.ExampleSource(pairs, policy=policy)
    one = _stream(data, 6)  # 24 elements: three epochs, so the truncated file comes up three times
    h0 = _stream(data, 6, local_batch=2, process_index=0, process_count=2)
    h1 = _stream(data, 6, local_batch=2, process_index=1, process_count=2)
    again = _stream(pipeline.ExampleSource(pairs, policy=BadFilePolicy("skip")), 6)
    for b, x0, x1, b2 in zip(one, h0, h1, again):
        assert b["image"].shape == (4, 8, 8, 3)  # batches stay full
        np.testing.assert_array_equal(b["image"], b2["image"])
        merged = np.concatenate([x0["image"], x1["image"]])
        key = lambda a: sorted(map(bytes, a.reshape(len(a), -1)))  # noqa: E731
        assert key(merged) == key(b["image"])
    rows = badfiles.read_skipped(record)
    names = sorted(os.path.basename(f) for f, _ in rows)
    assert names == ["ISIC_0000001.jpg", "ISIC_0000002.jpg", "ISIC_0000003.jpg", "ISIC_0000004_segmentation.png",
                     "ISIC_0000005.jpg"]
    assert dict((os.path.basename(f), p) for f, p in rows)["ISIC_0000001.jpg"] == "file is empty"


def test_skip_in_eval_counts_the_bad_file_as_padding(broken):
    d, img, mask = broken
    pairs = [(img(0), mask(0)), (img(3), mask(3)), (img(6), mask(6))]
    data = pipeline.ExampleSource(pairs, policy=BadFilePolicy("skip"))
    batches = list(pipeline.eval_batches(data, image_size=8, global_batch=4, process_index=0, process_count=1,
                                         num_threads=0))
    assert [b["valid"].tolist() for b in batches] == [[1.0, 0.0, 1.0, 0.0]]
    with pytest.raises(DataError, match="ISIC_0000003"):
        list(pipeline.eval_batches(pairs, image_size=8, global_batch=4, process_index=0, process_count=1,
                                   num_threads=0))


def test_all_bad_or_empty_folders_fail_clearly(tmp_path):
    d = str(tmp_path)
    for folder in isic.SPLIT_FOLDERS["train"]:
        os.makedirs(os.path.join(d, folder))
    open(os.path.join(d, TRAIN_IMG, "LICENSE"), "w").write("x")
    with pytest.raises(DataError, match="No ISIC_"):
        isic.find_pairs(d, "train")
    open(os.path.join(d, TRAIN_IMG, "ISIC_0000000.jpg"), "w").close()
    open(os.path.join(d, TRAIN_MASK, "ISIC_0000000_segmentation.png"), "w").close()
    with pytest.raises(DataError, match="Every image/mask pair"):
        isic.find_pairs(d, "train", policy=BadFilePolicy("skip"))
    with pytest.raises(ConfigError, match="on_bad_file"):
        BadFilePolicy("ignore")


def test_split_file_by_ids_and_indices(tmp_path):
    import json

    d = str(tmp_path / "isic")
    synthetic_isic.write_dataset(d, num_train=6, num_val=2, image_size=16)
    split = str(tmp_path / "split.json")
    json.dump({"train": ["ISIC_0000007", "ISIC_0000001.jpg", 0], "validation": [6]}, open(split, "w"))
    train = isic.find_pairs(d, "train", split_file=split)
    assert [os.path.basename(p[0]) for p in train] == ["ISIC_0000007.jpg", "ISIC_0000001.jpg", "ISIC_0000000.jpg"]
    assert os.path.basename(isic.find_pairs(d, "validation", split_file=split)[0][0]) == "ISIC_0000006.jpg"
    with pytest.raises(DataError, match="no 'test' entry"):
        isic.find_pairs(d, "test", split_file=split)
    json.dump({"train": ["ISIC_9999999"]}, open(split, "w"))
    with pytest.raises(DataError, match="ISIC_9999999"):
        isic.find_pairs(d, "train", split_file=split)
    open(split, "w").write("{not json")
    with pytest.raises(DataError, match="not valid JSON"):
        isic.find_pairs(d, "train", split_file=split)


def test_staging_copies_once_and_restages_on_change(tmp_path):
    src = str(tmp_path / "isic")
    synthetic_isic.write_dataset(src, num_train=3, num_val=1, image_size=16)
    local = str(tmp_path / "local")
    dest = staging.stage(src, local)
    assert dest.startswith(local) and isic.find_pairs(dest, "train")
    marker = os.path.join(dest, TRAIN_IMG, "ISIC_0000000.jpg")
    t = os.stat(marker).st_mtime_ns
    assert staging.stage(src, local) == dest and os.stat(marker).st_mtime_ns == t  # reused
    open(os.path.join(src, "NEW.txt"), "w").write("changed")
    staging.stage(src, local)
    assert os.path.exists(os.path.join(dest, "NEW.txt"))
    with pytest.raises(DataError, match="not a folder"):
        staging.stage(str(tmp_path / "nope"), local)


def test_iterator_state_is_the_global_position(tmp_path):
    d = str(tmp_path / "isic")
    synthetic_isic.write_dataset(d, num_train=10, num_val=2, image_size=16)
    pairs = isic.find_pairs(d, "train")
    it = pipeline.train_iterator(pairs, image_size=8, local_batch=2, seed=0, process_index=0, process_count=1,
                                 num_threads=0)
    full = [next(it) for _ in range(5)]
    fresh = pipeline.train_iterator(pairs, image_size=8, local_batch=2, seed=0, process_index=0, process_count=1,
                                    num_threads=0)
    fresh.set_state(b'{"next_example": 6}')
    for a in full[3:]:
        np.testing.assert_array_equal(a["image"], next(fresh)["image"])
    assert fresh.get_state() == b'{"next_example": 10}'


def test_same_batches_with_and_without_worker_processes(tmp_path):
    d = str(tmp_path / "isic")
    synthetic_isic.write_dataset(d, num_train=10, num_val=2, image_size=16)
    pairs = isic.find_pairs(d, "train")
    ops = pipeline.augment_ops(8, rotation_degrees=20, color_jitter=0.2)
    kw = dict(image_size=8, local_batch=3, seed=5, process_index=0, process_count=1, ops=ops, num_threads=0)
    ref = [next(it) for it in [pipeline.train_iterator(pairs, **kw)] for _ in range(4)]
    it = pipeline.train_iterator(pairs, num_workers=2, **kw)
    try:
        got = [next(it) for _ in range(4)]
    finally:
        it.close()
    for a, b in zip(ref, got):
        np.testing.assert_array_equal(a["image"], np.asarray(b["image"]))
        np.testing.assert_array_equal(a["mask"], np.asarray(b["mask"]))


def test_auto_worker_count_respects_cores_and_ram():
    assert pipeline.resolve_num_workers(3, 0, 1, 1) == 3
    assert pipeline.resolve_num_workers(-1, 0.0001, 1 << 20, 8) == 0  # budget below one worker
    cores = len(os.sched_getaffinity(0))
    assert pipeline.resolve_num_workers(-1, 1000, 1 << 20, 8) == cores - 1
    with pytest.raises(ConfigError, match="num_workers"):
        pipeline.resolve_num_workers(-2, 0, 1, 1)


def test_auto_worker_count_shares_the_machine_among_its_processes(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))  # not pinned
    monkeypatch.setattr(pipeline.workers, "_available_ram_bytes", lambda: 64 << 30)
    assert pipeline.resolve_num_workers(-1, 0, 1 << 20, 8) == 15
    assert pipeline.resolve_num_workers(-1, 0, 1 << 20, 8, processes_on_host=8) == 1  # 2 cores each
    assert pipeline.resolve_num_workers(-1, 0, 1 << 20, 8, processes_on_host=4) == 3
    # A quarter of 64 GiB shared by 4 processes: 4 GiB each, about 13 workers of 0.3 GiB; cores bind first.
    monkeypatch.setattr(pipeline.workers, "_available_ram_bytes", lambda: 8 << 30)
    assert pipeline.resolve_num_workers(-1, 0, 1 << 20, 8, processes_on_host=4) == 1  # 0.5 GiB each
    # Pinned by the launcher (--cpus-per-task=4): the affinity is already this process's share.
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(pipeline.workers, "_available_ram_bytes", lambda: 64 << 30)
    assert pipeline.resolve_num_workers(-1, 0, 1 << 20, 8, processes_on_host=4) == 3


def test_truncated_image_in_an_arrayrecord_is_named_and_skippable(broken, tmp_path):
    from jaxrat.data.sources import isic_arrayrecord

    d, img, _ = broken
    out = str(tmp_path / "tfds")
    isic_arrayrecord.prepare(d, out, on_bad_file="skip")  # header checks drop #1, #2, #4, #5; #3 is stored as is
    rows = badfiles.read_skipped(os.path.join(out, badfiles.SKIPPED_FILES_NAME))
    listed = sorted(os.path.basename(f) for f, _ in rows)
    assert listed == ["ISIC_0000001.jpg", "ISIC_0000002.jpg", "ISIC_0000004_segmentation.png", "ISIC_0000005.jpg"]
    data = isic_arrayrecord.example_source(out, "train", BadFilePolicy("fail"))
    assert len(data) == 8
    kw = dict(image_size=8, local_batch=4, seed=0, process_index=0, process_count=1, num_threads=0)
    with pytest.raises(DataError, match=r"isic2018_task1:train\[ISIC_0000003\] image: not a readable image"):
        it = pipeline.train_iterator(data, **kw)
        for _ in range(2):  # one epoch
            next(it)
    skip = isic_arrayrecord.example_source(out, "train", BadFilePolicy("skip"))
    it = pipeline.train_iterator(skip, **kw)
    batches = [next(it) for _ in range(4)]  # two epochs: the bad record is replaced, never returned
    assert all(b["image"].shape == (4, 8, 8, 3) for b in batches)


def test_bad_file_found_in_a_worker_process_is_raised_as_itself(broken):
    """Grain sends a worker's exception back pickled: a BadFileError must survive the trip."""
    import pickle
    import traceback

    e = pickle.loads(pickle.dumps(imageio.BadFileError("a.jpg", "file is empty", "delete it")))
    assert type(e) is imageio.BadFileError and (e.path, e.problem) == ("a.jpg", "file is empty")
    assert str(e) == "a.jpg: file is empty; delete it."
    d, img, mask = broken
    pairs = [(img(i), mask(i)) for i in (0, 3, 6, 7)]  # #3: truncated, found only when decoded
    it = pipeline.train_iterator(pairs, image_size=8, local_batch=4, seed=0, process_index=0, process_count=1,
                                 num_workers=1, num_threads=0)
    try:
        with pytest.raises(imageio.BadFileError, match="ISIC_0000003.jpg: not a readable image") as info:
            next(it)
        frames = traceback.extract_tb(info.value.__traceback__)
        assert info.value.__cause__ is None and not [f for f in frames if "grain" in f.filename]  # frees Grain's
    finally:
        it.close()


@pytest.mark.parametrize("damage, needle", [
    ("no bbox", "not valid at image id .* 'bbox'"),
    ("short bbox", "not valid at image id .* unpack"),
    ("no width", "not valid at image id .* 'width'"),
    ("no categories", "not valid at its categories"),
    ("list", "not valid .*AssertionError: annotation file format <class 'list'>"),
])
def test_coco_annotation_file_with_a_broken_entry_is_one_sentence(tmp_path, damage, needle):
    from jaxrat.data.sources import coco
    from jaxrat.data.synthetic import coco as synthetic_coco

    root = synthetic_coco.write_coco(str(tmp_path), num_train=0, num_val=2, image_size=32)
    path = coco.annotation_file(root, "validation")
    spec = json.load(open(path))
    if damage == "no bbox":
        del spec["annotations"][0]["bbox"]
    elif damage == "short bbox":
        spec["annotations"][0]["bbox"] = [1, 2]
    elif damage == "no width":
        del spec["images"][0]["width"]
    elif damage == "no categories":
        del spec["categories"]
    json.dump([spec] if damage == "list" else spec, open(path, "w"))
    with pytest.raises(DataError, match=f"COCO annotation file {path} is {needle}"):
        coco.CocoDetection(root, "validation")


def test_csv_from_excel_with_short_rows_and_empty_paths(tmp_path):
    from jaxrat.data.sources import folder

    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "a.JPG")
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(tmp_path / "b.png")
    csv_path = str(tmp_path / "labels.csv")
    # Excel's "CSV UTF-8": a byte-order mark before the header; a row without its last cell; a row without a path.
    rows = "image,diagnosis,site\na.JPG,nevus,arm\nb.png,melanoma\n,nevus,leg\n"
    open(csv_path, "w", encoding="utf-8-sig").write(rows)
    with pytest.raises(DataError, match=r"labels.csv line 4: no image path in column 'image'; fill it in"):
        folder.csv_records(csv_path, label_columns=("diagnosis", "site"))
    records, vocabs = folder.csv_records(csv_path, label_columns=("diagnosis", "site"), policy=BadFilePolicy("skip"))
    assert [r["labels"].tolist() for r in records] == [[1, 0], [0, -1]] and vocabs["site"] == ["arm", "leg"]
    with pytest.raises(DataError, match=f"CSV file {tmp_path} cannot be read"):
        folder.csv_records(str(tmp_path))


def test_arrayrecord_converter_and_reader_name_a_missing_folder_and_their_own_switch(broken, tmp_path, capsys):
    from jaxrat.data import prepare_isic
    from jaxrat.data.sources import isic_arrayrecord

    d, img, mask = broken
    out = str(tmp_path / "tfds")
    with pytest.raises(DataError, match=r"ISIC 2018 data not found: looked for .*nope.*fix --src"):
        isic_arrayrecord.prepare(str(tmp_path / "nope"), out)  # tfds only asserted, with a traceback
    assert prepare_isic.main(["--src", d, "--out", out]) == 2  # fail: every bad pair listed, #5 has no mask
    err = capsys.readouterr().err.strip()
    assert f"\n  {img(5)}: its mask" in err and "or set --on-bad-file=skip to leave them out:" in err
    typo = str(tmp_path / "typo")
    with pytest.raises(DataError, match=f"not prepared as ArrayRecord in {typo} .*fix --config.data.data_dir"):
        isic_arrayrecord.example_source(typo, "train", BadFilePolicy())
    assert not os.path.exists(typo)  # tfds used to start preparing there


def test_running_count_includes_files_skipped_by_worker_processes(tmp_path, caplog):
    record = str(tmp_path / badfiles.SKIPPED_FILES_NAME)
    policy = BadFilePolicy("skip", record)
    policy.handle(imageio.BadFileError(str(tmp_path / "a.jpg"), "file is empty"))
    badfiles._append_once(record, f"{tmp_path / 'b.jpg'}\tfile is empty")  # what a worker process writes
    policy.handle(imageio.BadFileError(str(tmp_path / "c.jpg"), "file is empty"))
    assert caplog.messages[-1].endswith("c.jpg (file is empty); 3 skipped so far")
    assert len(badfiles.read_skipped(record)) == 3
