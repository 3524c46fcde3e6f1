import os

import numpy as np
import pytest
from PIL import Image

from jaxrat.data import pipeline
from jaxrat.data.sources import isic
from jaxrat.data.synthetic import isic as synthetic_isic
from jaxrat.runtime.errors import DataError


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("isic"))
    synthetic_isic.write_dataset(d, num_train=12, num_val=5, image_size=16, seed=3)
    return d


def test_synthetic_layout_is_the_official_one(data_dir):
    pairs = isic.find_pairs(data_dir, "train")
    assert len(pairs) == 12 and len(isic.find_pairs(data_dir, "validation")) == 5
    img, mask = pairs[0]
    assert img.endswith(os.path.join("ISIC2018_Task1-2_Training_Input", "ISIC_0000000.jpg"))
    assert mask.endswith(os.path.join("ISIC2018_Task1_Training_GroundTruth", "ISIC_0000000_segmentation.png"))
    m = np.asarray(Image.open(mask))
    assert set(np.unique(m)) <= {0, 255} and m.max() == 255


def test_missing_dataset_names_the_folder_and_the_demo(tmp_path):
    with pytest.raises(DataError) as e:
        isic.find_pairs(str(tmp_path), "train")
    msg = str(e.value)
    assert "ISIC2018_Task1-2_Training_Input" in msg and str(tmp_path) in msg and "demo" in msg


def test_missing_mask_names_the_image(tmp_path):
    synthetic_isic.write_dataset(str(tmp_path), 3, 1, 16)
    victim = os.path.join(tmp_path, "ISIC2018_Task1_Training_GroundTruth", "ISIC_0000001_segmentation.png")
    os.remove(victim)
    with pytest.raises(DataError, match="ISIC_0000001.jpg"):
        isic.find_pairs(str(tmp_path), "train")


def test_stray_files_are_ignored_and_png_images_accepted(tmp_path):
    synthetic_isic.write_dataset(str(tmp_path), 3, 1, 16)
    img_dir = os.path.join(tmp_path, "ISIC2018_Task1-2_Training_Input")
    open(os.path.join(img_dir, "README.txt"), "w").write("hello")
    open(os.path.join(img_dir, "LICENSE"), "w").write("cc")
    jpg = os.path.join(img_dir, "ISIC_0000002.jpg")
    Image.open(jpg).convert("L").save(jpg.replace(".jpg", ".png"))  # grayscale PNG instead of JPEG
    os.remove(jpg)
    pairs = isic.find_pairs(str(tmp_path), "train")
    assert [os.path.basename(p[0]) for p in pairs] == ["ISIC_0000000.jpg", "ISIC_0000001.jpg", "ISIC_0000002.png"]
    ex = isic.LoadResize(8).map(pairs[2])
    assert ex["image"].shape == (8, 8, 3) and ex["mask"].shape == (8, 8)


@pytest.mark.parametrize("content", [b"", b"not an image at all", "truncated"])
def test_corrupt_image_fails_with_its_name(data_dir, tmp_path, content):
    pairs = isic.find_pairs(data_dir, "train")
    bad = str(tmp_path / "ISIC_0000099.jpg")
    if content == "truncated":
        content = open(pairs[0][0], "rb").read()[:200]
    open(bad, "wb").write(content)
    with pytest.raises(DataError, match="ISIC_0000099.jpg"):
        isic.LoadResize(8).map((bad, pairs[0][1]))


def test_mask_size_mismatch_names_both_files(data_dir, tmp_path):
    img, _ = isic.find_pairs(data_dir, "train")[0]
    mask = str(tmp_path / "m_segmentation.png")
    Image.fromarray(np.zeros((3, 3), np.uint8)).save(mask)
    with pytest.raises(DataError, match="must match"):
        isic.LoadResize(8).map((img, mask))


def _batches(pairs, n, **kw):
    it = pipeline.train_iterator(pairs, image_size=8, seed=0, num_threads=0, **kw)
    return [next(it) for _ in range(n)]


def test_hosts_split_the_global_batch_and_the_stream_is_deterministic(data_dir):
    pairs = isic.find_pairs(data_dir, "train")
    one = _batches(pairs, 5, local_batch=4, process_index=0, process_count=1)
    again = _batches(pairs, 5, local_batch=4, process_index=0, process_count=1)
    h0 = _batches(pairs, 5, local_batch=2, process_index=0, process_count=2)
    h1 = _batches(pairs, 5, local_batch=2, process_index=1, process_count=2)
    for b, b2, x0, x1 in zip(one, again, h0, h1):
        np.testing.assert_array_equal(b["image"], b2["image"])
        # The global batch is the same examples in the same order whatever the number of hosts.
        np.testing.assert_array_equal(np.concatenate([x0["image"], x1["image"]]), b["image"])
    # Epochs (12 images, batch 4: 3 steps each) are reshuffled, not repeated.
    assert not np.array_equal(one[0]["image"], one[3]["image"])


def test_start_example_resumes_the_stream(data_dir):
    pairs = isic.find_pairs(data_dir, "train")
    full = _batches(pairs, 6, local_batch=4, process_index=0, process_count=1)
    resumed = _batches(pairs, 3, local_batch=4, process_index=0, process_count=1, start_example=12)
    for a, b in zip(full[3:], resumed):
        np.testing.assert_array_equal(a["image"], b["image"])
        np.testing.assert_array_equal(a["mask"], b["mask"])


def test_eval_pads_to_whole_batches_and_marks_padding(data_dir):
    pairs = isic.find_pairs(data_dir, "validation")
    hosts = [list(pipeline.eval_batches(pairs, image_size=8, global_batch=4, process_index=p, process_count=2,
                                        num_threads=0)) for p in range(2)]
    assert len(hosts[0]) == len(hosts[1]) == 2
    valid = sum(float(b["valid"].sum()) for h in hosts for b in h)
    assert valid == 5
    first = hosts[0][0]
    assert first["image"].shape == (2, 8, 8, 3) and first["image"].dtype == np.float32
    assert first["mask"].shape == (2, 8, 8, 1) and set(np.unique(first["mask"])) <= {0.0, 1.0}


def test_case_variants_and_stray_files_in_the_official_folders(tmp_path):
    d = str(tmp_path)
    synthetic_isic.write_dataset(d, 4, 1, 16)
    img_dir, mask_dir = (os.path.join(d, f) for f in isic.SPLIT_FOLDERS["train"])
    os.rename(os.path.join(img_dir, "ISIC_0000001.jpg"), os.path.join(img_dir, "ISIC_0000001.JPG"))
    os.rename(os.path.join(mask_dir, "ISIC_0000001_segmentation.png"),
              os.path.join(mask_dir, "ISIC_0000001_segmentation.PNG"))  # copied through a case-blind disk
    os.rename(os.path.join(img_dir, "ISIC_0000002.jpg"), os.path.join(img_dir, "isic_0000002.jpeg"))
    Image.open(os.path.join(img_dir, "ISIC_0000000.jpg")).save(os.path.join(img_dir, "ISIC_0000000.png"))  # a copy
    for stray in (".DS_Store", "._ISIC_0000000.jpg", "ISIC_0000000_superpixels.png", "metadata.csv"):
        open(os.path.join(img_dir, stray), "wb").write(b"\x00\x05\x16\x07 not an image")
    os.makedirs(os.path.join(img_dir, "ISIC_0000009.jpg"))  # a folder, even one named like an image, is no image
    os.makedirs(os.path.join(mask_dir, "old"))
    open(os.path.join(mask_dir, ".DS_Store"), "w").write("x")
    pairs = isic.find_pairs(d, "train", policy=isic.BadFilePolicy("skip"))
    names = [(os.path.basename(i), os.path.basename(m)) for i, m in pairs]
    assert names[:3] == [("ISIC_0000000.jpg", "ISIC_0000000_segmentation.png"),
                         ("ISIC_0000001.JPG", "ISIC_0000001_segmentation.PNG"),
                         ("ISIC_0000003.jpg", "ISIC_0000003_segmentation.png")]
    assert names[3] == ("isic_0000002.jpeg", "ISIC_0000002_segmentation.png") and len(names) == 4
    split = str(tmp_path / "split.json")
    open(split, "w").write('{"train": ["ISIC_0000002", "isic_0000001.jpg"]}')
    assert [os.path.basename(i) for i, _ in isic.find_pairs(d, "train", split_file=split)] == [
        "isic_0000002.jpeg", "ISIC_0000001.JPG"]


@pytest.mark.parametrize("stored_hw", [(12, 12), (8, 12)])
def test_exif_rotated_photo_is_read_upright_like_its_mask_everywhere(tmp_path, stored_hw):
    """A phone photo stored sideways with orientation 6 and a mask drawn on it as viewers show it
    (upright): training's, evaluation's and prediction's readers all see the upright photo."""
    from jaxrat.data.imageio import load_rgb_with_size
    from jaxrat.data.sources import segmentation_folder as sf

    d = str(tmp_path)
    synthetic_isic.write_dataset(d, 2, 1, 16)
    img_dir, mask_dir = (os.path.join(d, f) for f in isic.SPLIT_FOLDERS["train"])
    h, w = stored_hw
    stored = np.zeros((h, w, 3), np.uint8)
    stored[:, :4] = 255  # the left columns as stored: the top rows once turned (90 degrees clockwise)
    shown = np.rot90(stored[..., 0], -1)
    mask = np.where(shown > 127, 255, 0).astype(np.uint8)  # drawn on the upright view
    assert mask[:4].all() and not mask[4:].any()
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    Image.fromarray(stored).save(os.path.join(img_dir, "ISIC_0000000.jpg"), exif=exif, quality=95)
    Image.fromarray(mask).save(os.path.join(mask_dir, "ISIC_0000000_segmentation.png"))
    pair = isic.find_pairs(d, "train")[0]  # the sizes agree once the photo is turned
    ex = isic.DecodePair().map(pair)  # training and evaluation
    assert ex["image"].shape == (w, h, 3)
    np.testing.assert_array_equal(ex["image"][..., 0] > 127, ex["mask"] > 0)
    labels = sf.DecodeLabelPair(num_classes=2).map((pair[0], pair[1]))  # multi-class folders
    np.testing.assert_array_equal(labels["image"][..., 0] > 127, labels["mask"] > 0)
    pixels, size = load_rgb_with_size(pair[0], (4, 4))  # prediction (a reduced-scale JPEG decode)
    assert size == (h, w)
    # A mask drawn on the stored pixels of a non-square photo: named, with the reason.
    if h != w:
        Image.fromarray(np.where(stored[..., 0] > 127, 255, 0).astype(np.uint8)).save(pair[1])
        with pytest.raises(DataError, match=rf"mask is {w}x{h} but its image .* is {h}x{w} \(the mask fits the "
                                            r"image as stored"):
            isic.find_pairs(d, "train")


def test_images_unpacked_one_folder_too_deep_are_pointed_at(tmp_path):
    d = str(tmp_path)
    synthetic_isic.write_dataset(d, 2, 1, 16)
    img_dir = os.path.join(d, isic.SPLIT_FOLDERS["train"][0])
    nested = os.path.join(img_dir, isic.SPLIT_FOLDERS["train"][0])
    os.makedirs(nested)
    for name in os.listdir(img_dir):
        if name.endswith(".jpg"):
            os.rename(os.path.join(img_dir, name), os.path.join(nested, name))
    with pytest.raises(DataError, match=f"but there is a {nested}; move its contents up one level"):
        isic.find_pairs(d, "train")
