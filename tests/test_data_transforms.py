"""Each transform does what its name says, moves masks and boxes with the image, and is seeded."""

import numpy as np
import pytest

from jaxrat.data import pipeline
from jaxrat.data import transforms as T
from jaxrat.errors import ConfigError


def _example(h=40, w=60, box=(10, 8, 30, 20)):
    """An image with one white rectangle, its mask, and its box (pixels x1, y1, x2, y2)."""
    x1, y1, x2, y2 = box
    img = np.zeros((h, w, 3), np.uint8)
    img[y1:y2, x1:x2] = 255
    mask = (img[..., 0] > 0).astype(np.uint8)
    boxes = np.array([[x1 / w, y1 / h, x2 / w, y2 / h]], np.float32)
    return {"image": img, "mask": mask, "boxes": boxes, "labels": np.array([3], np.int32)}


def _mask_box(mask):
    """Normalised bounding box of the foreground of ``mask``."""
    ys, xs = np.nonzero(mask)
    h, w = mask.shape
    return np.array([xs.min() / w, ys.min() / h, (xs.max() + 1) / w, (ys.max() + 1) / h])


def _rng(seed=0):
    return np.random.default_rng(seed)


def test_resize_ignoring_and_keeping_aspect():
    ex = _example()
    out = T.Resize(20).map(ex)
    assert out["image"].shape == (20, 20, 3) and out["mask"].shape == (20, 20)
    np.testing.assert_allclose(out["boxes"], ex["boxes"])  # normalised boxes are scale-free
    kept = T.Resize(30, keep_aspect=True).map(ex)  # 40x60 -> 20x30 then padded to 30x30
    assert kept["image"].shape == (30, 30, 3)
    assert kept["image"][20:].max() == 0 and kept["mask"][20:].max() == 0  # padding is background
    np.testing.assert_allclose(kept["boxes"], _mask_box(kept["mask"])[None], atol=0.04)


def test_flip_moves_mask_and_boxes_together():
    ex = _example()
    out = T.RandomFlip(horizontal=1.0, vertical=1.0).random_map(ex, _rng())
    np.testing.assert_array_equal(out["image"], ex["image"][::-1, ::-1])
    np.testing.assert_array_equal(out["mask"], ex["mask"][::-1, ::-1])
    np.testing.assert_allclose(out["boxes"][0], _mask_box(out["mask"]), atol=1e-6)
    assert T.RandomFlip(0.0, 0.0).random_map(ex, _rng())["image"] is ex["image"]


@pytest.mark.parametrize("angle", [30.0, -45.0, 90.0])
def test_rotation_moves_mask_and_box(angle):
    ex = _example(60, 60, (20, 15, 40, 30))
    out = T.rotate(ex, angle)
    assert out["image"].shape == ex["image"].shape
    assert not np.array_equal(out["mask"], ex["mask"])
    # The rotated mask's foreground lies inside the rotated box (which is the enclosing box).
    mb, bb = _mask_box(out["mask"]), out["boxes"][0]
    assert bb[0] <= mb[0] + 0.03 and bb[1] <= mb[1] + 0.03 and bb[2] >= mb[2] - 0.03 and bb[3] >= mb[3] - 0.03
    if angle == 90.0:  # a 90-degree turn keeps a box a box
        np.testing.assert_allclose(bb, mb, atol=0.03)


def test_random_rotation_stays_in_range_and_is_seeded():
    ex = _example(60, 60, (20, 15, 40, 30))
    op = T.RandomRotation(10.0)
    a, b = op.random_map(ex, _rng(1)), op.random_map(ex, _rng(1))
    np.testing.assert_array_equal(a["image"], b["image"])
    # Within +-10 degrees the rectangle's area changes little.
    assert abs(int(a["mask"].sum()) - int(ex["mask"].sum())) < 0.15 * ex["mask"].sum()


def test_crop_keeps_boxes_consistent_and_drops_empty_ones():
    ex = _example(40, 60, (10, 8, 30, 20))
    out = T.crop(ex, 10, 20, 20, 30)
    assert out["image"].shape == (20, 30, 3)
    np.testing.assert_allclose(out["boxes"][0], _mask_box(out["mask"]), atol=1e-6)
    assert out["labels"].tolist() == [3]
    gone = T.crop(ex, 25, 35, 10, 10)  # a corner without the rectangle
    assert gone["boxes"].shape == (0, 4) and gone["labels"].shape == (0,)


def test_random_resized_crop_and_scale_jitter_give_the_size_and_follow_boxes():
    ex = _example(80, 120, (30, 20, 90, 60))
    for seed in range(5):
        for op in (T.RandomResizedCrop(32, scale=(0.3, 1.0)), T.ScaleJitter(32, scale=(0.5, 1.5)), T.RandomCrop(32)):
            out = op.random_map(ex, _rng(seed))
            assert out["image"].shape == (32, 32, 3) and out["mask"].shape == (32, 32)
            if out["mask"].any() and len(out["boxes"]):
                np.testing.assert_allclose(out["boxes"][0], _mask_box(out["mask"]), atol=0.08)
    # Scale jitter really rescales: the foreground area varies with the draw.
    areas = {int(T.ScaleJitter(64, scale=(0.5, 1.5)).random_map(ex, _rng(s))["mask"].sum()) for s in range(6)}
    assert len(areas) > 3


def test_color_jitter_changes_colours_only():
    rng = np.random.default_rng(0)
    ex = {"image": rng.integers(0, 255, (16, 16, 3), dtype=np.uint8), "mask": np.eye(16, dtype=np.uint8)}
    out = T.ColorJitter(0.3, 0.3, 0.3, 0.1).random_map(ex, _rng(2))
    assert out["image"].dtype == np.uint8 and out["image"].shape == ex["image"].shape
    assert not np.array_equal(out["image"], ex["image"])
    np.testing.assert_array_equal(out["mask"], ex["mask"])
    same = T.ColorJitter(0, 0, 0, 0).random_map(ex, _rng(2))
    np.testing.assert_array_equal(same["image"], ex["image"])


def test_elastic_deformation_warps_image_and_mask_alike():
    with_boxes = _example(64, 64, (16, 16, 48, 48))
    ex = {k: with_boxes[k] for k in ("image", "mask")}
    out = T.ElasticDeform(alpha=6.0, sigma=4.0).random_map(ex, _rng(3))
    assert not np.array_equal(out["mask"], ex["mask"])
    assert set(np.unique(out["mask"])) <= {0, 1}
    # Image and mask follow the same field: white pixels are where the mask is.
    white = out["image"][..., 0] > 200
    assert (white & (out["mask"] == 0)).mean() < 0.01
    assert T.ElasticDeform(prob=0.0).random_map(ex, _rng(3)) is ex
    with pytest.raises(ConfigError, match="boxes"):
        T.ElasticDeform().random_map(with_boxes, _rng(3))  # it cannot move boxes


def test_pyramid_levels_and_spacing():
    ex = _example(40, 60)
    del ex["boxes"], ex["labels"]
    out = T.Pyramid((0.5, 0.25)).map(ex)
    assert out["image_1"].shape == (20, 30, 3) and out["image_2"].shape == (10, 15, 3)
    assert out["mask_2"].shape == (10, 15)
    np.testing.assert_allclose(out["spacing"], [1, 1])
    np.testing.assert_allclose(out["spacing_1"], [2, 2])
    np.testing.assert_allclose(out["spacing_2"], [4, 4])
    odd = T.Pyramid((0.5,)).map({"image": np.zeros((33, 50, 3), np.uint8)})  # 33 -> 16 rows (rounded)
    np.testing.assert_allclose(odd["spacing_1"], [33 / 16, 2.0])
    norm = T.Normalize().map(out)
    assert norm["image_2"].dtype == np.float32 and norm["mask_1"].shape == (20, 30, 1)


def test_normalize_and_pad_boxes():
    ex = _example()
    out = T.Normalize().map(ex)
    np.testing.assert_allclose(out["image"][0, 0], -np.array(T.IMAGENET_MEAN) / np.array(T.IMAGENET_STD), rtol=1e-5)
    assert out["mask"].shape == (40, 60, 1)
    padded = T.pad_boxes(ex, 4)
    assert padded["boxes"].shape == (4, 4) and padded["box_valid"].tolist() == [1, 0, 0, 0]
    assert padded["labels"].tolist() == [3, 0, 0, 0]


def test_config_switches_add_exactly_their_ops():
    base = pipeline.augment_ops(32, random_flip=False)
    assert [type(o) for o in base] == [T.Resize, T.Normalize]
    full = pipeline.augment_ops(
        32, random_flip=True, random_crop_scale=(0.5, 1.0), scale_jitter=(0.8, 1.2), rotation_degrees=15,
        color_jitter=0.1, elastic_prob=0.1, pyramid_scales=(0.5,),
    )
    assert [type(o) for o in full] == [T.RandomResizedCrop, T.ScaleJitter, T.RandomFlip, T.RandomRotation,
                                       T.ElasticDeform, T.ColorJitter, T.Pyramid, T.Normalize]
    evals = pipeline.augment_ops(32, rotation_degrees=15, color_jitter=0.1, train=False)
    assert [type(o) for o in evals] == [T.Resize, T.Normalize]
    with pytest.raises(ConfigError, match="random_crop_scale"):
        pipeline.augment_ops(32, random_crop_scale=(0.0, 1.0))
