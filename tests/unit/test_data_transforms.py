"""Each transform does what its name says, moves masks and boxes with the image, and is seeded."""

import numpy as np
import pytest

from jaxrat.data import pipeline
from jaxrat.data import transforms as T
from jaxrat.runtime.errors import ConfigError


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
        color_jitter=0.1, elastic_prob=0.1,
    )
    assert [type(o) for o in full] == [T.RandomResizedCrop, T.ScaleJitter, T.RandomFlip, T.RandomRotation,
                                       T.ElasticDeform, T.ColorJitter, T.Normalize]
    evals = pipeline.augment_ops(32, rotation_degrees=15, color_jitter=0.1, train=False)
    assert [type(o) for o in evals] == [T.Resize, T.Normalize]
    with pytest.raises(ConfigError, match="random_crop_scale"):
        pipeline.augment_ops(32, random_crop_scale=(0.0, 1.0))


# ---------------------------------------------------------------- semantic property checks


def _blob_example(h, w, seed=0):
    """An image whose content equals its mask (white where mask is 1) and the mask's box."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    cy, cx = rng.uniform(0.3, 0.7) * h, rng.uniform(0.3, 0.7) * w
    mask = (((yy - cy) / (0.2 * h)) ** 2 + ((xx - cx) / (0.12 * w)) ** 2 < 1).astype(np.uint8)
    img = np.repeat(mask[..., None] * 255, 3, axis=-1).astype(np.uint8)
    return {"image": img, "mask": mask, "boxes": _mask_box(mask)[None].astype(np.float32),
            "labels": np.array([1], np.int32)}


def test_random_flip_sometimes_flips_and_keeps_image_mask_boxes_consistent():
    ex = _example(30, 50, (0, 0, 20, 12))  # a box touching the top and left borders
    ex["boxes"] = np.concatenate([ex["boxes"], [[0.9, 0.5, 1.0, 1.0]]]).astype(np.float32)
    ex["labels"] = np.array([3, 4], np.int32)
    seen = set()
    for seed in range(40):
        out = T.RandomFlip(0.5, 0.5).random_map(ex, _rng(seed))
        cases = [(h, v) for h in (False, True) for v in (False, True)
                 if np.array_equal(out["image"], ex["image"][:: -1 if v else 1, :: -1 if h else 1])]
        assert len(cases) == 1  # exactly one of the four flips of the image
        h, v = cases[0]
        np.testing.assert_array_equal(out["mask"] * 255, out["image"][..., 0])
        np.testing.assert_allclose(out["boxes"][0], _mask_box(out["mask"]), atol=1e-6)
        b = ex["boxes"][1]
        b = [1 - b[2], b[1], 1 - b[0], b[3]] if h else b
        b = [b[0], 1 - b[3], b[2], 1 - b[1]] if v else b
        np.testing.assert_allclose(out["boxes"][1], b, atol=1e-6)
        assert out["labels"].tolist() == [3, 4]
        seen.add((h, v))
    assert seen == {(False, False), (True, False), (False, True), (True, True)}


@pytest.mark.parametrize("shape", [(48, 48), (40, 64), (64, 36)])
def test_random_rotation_angle_in_range_mask_aligned_and_box_encloses(shape):
    h, w = shape
    angles = []
    for seed in range(12):
        ex = _blob_example(h, w, seed)
        out = T.RandomRotation(20.0).random_map(ex, _rng(seed))
        # The image (bilinear) and the mask (nearest) went through the same rotation.
        # Their centroids agree to a fraction of a pixel (a half-pixel offset would show here).
        img, m = out["image"][..., 0].astype(float) / 255, out["mask"].astype(float)
        ys, xs = np.mgrid[0:h, 0:w]
        for f in (ys, xs):
            assert abs((f * img).sum() / img.sum() - (f * m).sum() / m.sum()) < 0.2
        assert ((img > 0.5) != (m > 0)).sum() <= 0.06 * m.sum()  # differences only along the outline
        # The rotated box encloses the rotated object (up to half a pixel of rasterisation).
        mb, bb = _mask_box(out["mask"]), out["boxes"][0]
        tol = np.array([1 / w, 1 / h, 1 / w, 1 / h])
        assert np.all(bb[:2] <= mb[:2] + tol[:2]) and np.all(bb[2:] >= mb[2:] - tol[2:]), (bb, mb)
        # The angle: a single off-centre dot's position about the centre (counter-clockwise on screen).
        dot = np.zeros((h, w, 3), np.uint8)
        dot[h // 2 - 1 : h // 2 + 1, w // 2 + 12 : w // 2 + 14] = 255
        rot = T.RandomRotation(20.0).random_map({"image": dot}, _rng(seed))["image"][..., 0].astype(float)
        ys, xs = np.nonzero(rot > 0)
        cy, cx = np.average(ys, weights=rot[ys, xs]) + 0.5, np.average(xs, weights=rot[ys, xs]) + 0.5
        angles.append(np.degrees(np.arctan2(-(cy - h / 2), cx - w / 2)))
    assert max(np.abs(angles)) <= 20.0 + 2.0
    assert min(angles) < -3 and max(angles) > 3  # both directions, not a fixed angle


def test_scale_jitter_scales_objects_within_range_and_keeps_the_size():
    ex = _example(40, 60, (27, 17, 33, 23))  # a 6 x 6 square at the centre
    ex["image"] = np.ascontiguousarray(ex["image"])
    ratios = []
    for seed in range(20):
        out = T.ScaleJitter((48, 40), scale=(0.6, 1.5)).random_map(ex, _rng(seed))
        assert out["image"].shape == (48, 40, 3) and out["mask"].shape == (48, 40)
        if len(out["boxes"]) and 0 < out["boxes"][0, 0] and out["boxes"][0, 2] < 1:  # not cut by the crop
            # Fitting 40 x 60 into 48 x 40 scales by 2/3, the jitter then by s in [0.6, 1.5].
            ratios.append((out["boxes"][0, 2] - out["boxes"][0, 0]) * 40 / 6 / (2 / 3))
    assert len(ratios) > 10
    assert 0.6 - 0.2 <= min(ratios) and max(ratios) <= 1.5 + 0.2  # +-1 px of rounding on a 6 px box
    assert max(ratios) - min(ratios) > 0.4


@pytest.mark.parametrize("shape", [(40, 60), (9, 7), (64, 64)])
def test_random_resized_crop_area_fraction_lies_in_range(shape):
    H, W = shape
    op = T.RandomResizedCrop(16, scale=(0.5, 0.6))
    for seed in range(200):
        y0, x0, ch, cw = op.window(H, W, _rng(seed))
        assert 0.5 <= ch * cw / (H * W) <= 0.6, (seed, ch, cw)
        assert 0 <= y0 and y0 + ch <= H and 0 <= x0 and x0 + cw <= W
    # An image far wider than the ratio range allows still gets a crop within the area bound.
    y0, x0, ch, cw = T.RandomResizedCrop(16, scale=(0.3, 0.6)).window(4, 200, _rng(0))
    assert ch * cw <= 0.6 * 800 and x0 + cw <= 200


def _hsv(img):
    import colorsys

    return np.array([colorsys.rgb_to_hsv(*(p / 255.0)) for p in img.reshape(-1, 3).astype(float)])


def test_color_jitter_factors_stay_within_their_bounds():
    rng = np.random.default_rng(0)
    img = rng.integers(60, 180, (12, 12, 3), dtype=np.uint8)  # no clipping at factors in [0.7, 1.3]
    ex = {"image": img, "mask": np.eye(12, dtype=np.uint8), "boxes": np.array([[0.1, 0.2, 0.5, 0.6]], np.float32)}
    gray = lambda a: a.astype(float) @ [0.299, 0.587, 0.114]  # noqa: E731
    b_, c_, s_, h_ = [], [], [], []
    for seed in range(15):
        out = T.ColorJitter(0.3, 0, 0, 0).random_map(ex, _rng(seed))["image"]
        b_.append(out.astype(float).mean() / img.mean())
        out = T.ColorJitter(0, 0.3, 0, 0).random_map(ex, _rng(seed))["image"]
        c_.append(gray(out).std() / gray(img).std())
        out = T.ColorJitter(0, 0, 0.3, 0).random_map(ex, _rng(seed))["image"]
        dev = lambda a: np.linalg.norm(a.astype(float) - gray(a)[..., None])  # noqa: E731
        s_.append(dev(out) / dev(img))
        o = T.ColorJitter(0, 0, 0, 0.1).random_map(ex, _rng(seed))
        assert o["mask"] is ex["mask"] and o["boxes"] is ex["boxes"]
        hi, ho = _hsv(img), _hsv(o["image"])
        shift = (ho[:, 0] - hi[:, 0] + 0.5) % 1 - 0.5
        sat = hi[:, 1] > 0.3  # hue is well defined
        np.testing.assert_allclose(ho[:, 2], hi[:, 2], atol=1 / 255)  # value kept
        h_.append(np.median(shift[sat]))
        assert np.all(np.abs(shift[sat] - h_[-1]) < 0.02)  # one shift for the whole image
    for vals, lo, hi_ in ((b_, 0.7, 1.3), (c_, 0.7, 1.3), (s_, 0.7, 1.3), (h_, -0.1, 0.1)):
        assert lo - 0.01 <= min(vals) and max(vals) <= hi_ + 0.01, vals
        assert max(vals) - min(vals) > 0.05 * (hi_ - lo)  # really random


def test_color_jitter_saturates_instead_of_overflowing_and_zero_hue_is_identity():
    ex = {"image": np.full((4, 4, 3), 250, np.uint8)}
    for seed in range(10):
        out = T.ColorJitter(0.5, 0, 0, 0).random_map(ex, _rng(seed))["image"]
        assert out.min() >= 125  # 250 * 0.5 at the least; a wrap-around would give small values
    img = np.random.default_rng(1).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    out = T.ColorJitter(0, 0, 0, 1e-6).random_map({"image": img}, _rng(0))["image"]
    assert np.abs(out.astype(int) - img).max() <= 1  # PIL's 8-bit HSV round trip changed up to 5 levels


def test_elastic_deformation_is_smooth_and_bounded_by_alpha():
    n = 64
    yy, xx = np.mgrid[0:n, 0:n]
    img = np.stack([xx * 4, yy * 4, np.zeros_like(xx)], -1).astype(np.uint8)  # the image encodes its coordinates
    for alpha, sigma in ((3.0, 8.0), (34.0, 4.0)):
        for seed in range(3):
            out = T.ElasticDeform(alpha=alpha, sigma=sigma).random_map({"image": img}, _rng(seed))["image"]
            src_x, src_y = out[..., 0] / 4.0, out[..., 1] / 4.0
            inner = (slice(10, n - 10), slice(10, n - 10))  # away from the reflected borders
            dx, dy = src_x - xx, src_y - yy
            moved = np.hypot(dx, dy)[inner]
            assert moved.max() <= alpha + 0.25, (alpha, moved.max())
            # Neighbours move alike: no folding (a neighbour's source never crosses this pixel's).
            assert np.diff(src_x, axis=1)[inner].min() > 0 and np.diff(src_y, axis=0)[inner].min() > 0
            assert np.abs(np.diff(dx, axis=1)[inner]).max() < 0.75
        if alpha == 3.0:
            assert moved.max() > 1.5  # with a smooth enough field the warp does use alpha


def test_keep_aspect_resize_of_tall_and_tiny_images_pads_and_moves_boxes():
    for h, w, box, size in ((60, 30, (5, 40, 25, 58), 20), (5, 3, (0, 0, 3, 5), 16)):
        ex = _example(h, w, box)
        out = T.Resize(size, keep_aspect=True).map(ex)
        assert out["image"].shape == (size, size, 3) and out["mask"].shape == (size, size)
        nw = round(w * size / h)
        assert out["image"][:, nw:].max() == 0 and out["mask"][:, nw:].max() == 0  # right padding is background
        np.testing.assert_allclose(out["boxes"][0], _mask_box(out["mask"]), atol=1 / size)


def test_ops_on_zero_boxes_and_crops_that_leave_slivers_give_no_nan():
    empty = {"image": np.zeros((10, 14, 3), np.uint8), "mask": np.zeros((10, 14), np.uint8),
             "boxes": np.zeros((0, 4), np.float32), "labels": np.zeros((0,), np.int32)}
    edge = _example(20, 20, (0, 0, 20, 1))  # a one-pixel strip along the top border
    for op in (T.RandomFlip(1, 1), T.RandomRotation(30), T.RandomResizedCrop(8), T.ScaleJitter(8, (0.5, 2.0)),
               T.RandomCrop(12), T.Resize(8, keep_aspect=True), T.ColorJitter()):
        for seed in range(8):
            for ex in (empty, edge):
                out = op.random_map(ex, _rng(seed)) if isinstance(op, T.grain.transforms.RandomMap) else op.map(ex)
                b = out["boxes"]
                assert b.dtype == np.float32 and b.shape[1:] == (4,) and len(b) == len(out["labels"])
                assert np.isfinite(b).all() and (b >= 0).all() and (b <= 1).all()
                assert np.all(b[:, 2] > b[:, 0]) and np.all(b[:, 3] > b[:, 1])  # degenerate ones dropped


def test_same_seed_and_index_repeat_and_other_indices_differ_through_grain():
    import grain

    ex = _blob_example(32, 32)
    ops = pipeline.augment_ops(16, random_crop_scale=(0.5, 1.0), rotation_degrees=20, color_jitter=0.2)

    def stream(seed):
        ds = grain.MapDataset.source([ex] * 6).seed(seed)
        for op in ops:
            ds = ds.random_map(op) if isinstance(op, grain.transforms.RandomMap) else ds.map(op)
        return ds

    a, b, c = stream(3), stream(3), stream(4)
    for i in range(6):
        np.testing.assert_array_equal(a[i]["image"], b[i]["image"])
    assert len({a[i]["image"].tobytes() for i in range(6)}) == 6  # same input, other index: other draw
    assert not np.array_equal(a[0]["image"], c[0]["image"])


SWITCHES = {  # config.data field -> (value, the one op it adds, what that op must carry)
    "random_crop_scale": ((0.4, 0.9), T.RandomResizedCrop, {"scale": (0.4, 0.9)}),
    "scale_jitter": ((0.7, 1.3), T.ScaleJitter, {"scale": (0.7, 1.3)}),
    "rotation_degrees": (12.0, T.RandomRotation, {"degrees": 12.0}),
    "color_jitter": (0.2, T.ColorJitter, {"brightness": 0.2, "contrast": 0.2, "saturation": 0.2, "hue": 0.1}),
    "elastic_prob": (0.3, T.ElasticDeform, {"prob": 0.3, "alpha": 34.0, "sigma": 4.0}),
}


@pytest.mark.parametrize("field", sorted(SWITCHES))
def test_each_config_switch_adds_exactly_its_op_and_eval_has_no_random_op(field):
    from jaxrat.config_schema import base_config

    cfg = base_config().data
    cfg.random_flip = False
    base = [type(o) for o in pipeline.train_options(cfg)["ops"]]
    assert base == [T.Resize, T.Normalize]  # the defaults are neutral
    value, op_type, fields = SWITCHES[field]
    setattr(cfg, field, value)
    ops = pipeline.train_options(cfg)["ops"]
    added = [o for o in ops if not isinstance(o, (T.Resize, T.Normalize))]
    assert [type(o) for o in added] == [op_type]
    assert {k: getattr(added[0], k) for k in fields} == fields
    evals = pipeline.eval_options(cfg)["ops"]
    assert not any(isinstance(o, T.grain.transforms.RandomMap) for o in evals)
    assert [type(o) for o in evals] == [T.Resize, T.Normalize]
    cfg.random_flip = True
    assert T.RandomFlip in [type(o) for o in pipeline.train_options(cfg)["ops"]]


def test_keep_aspect_ratio_also_holds_when_random_crop_is_on():
    from jaxrat.config_schema import base_config

    cfg = base_config().data
    cfg.image_size, cfg.keep_aspect_ratio, cfg.random_crop_scale, cfg.random_flip = 16, True, (1.0, 1.0), False
    first = pipeline.eval_options(cfg)["ops"][0]
    assert isinstance(first, T.Resize) and first.keep_aspect
    cfg.random_crop_scale = (0.5, 1.0)
    ops = pipeline.train_options(cfg)["ops"]
    assert isinstance(ops[0], T.Resize) and ops[0].keep_aspect and isinstance(ops[1], T.RandomResizedCrop)
    # A wide image keeps its padding through the crop: whole black rows, as evaluation sees.
    ex = {"image": np.full((10, 40, 3), 200, np.uint8), "mask": np.ones((10, 40), np.uint8)}
    out = ex
    for op in ops[:2]:
        out = op.random_map(out, _rng(0)) if isinstance(op, T.grain.transforms.RandomMap) else op.map(out)
    assert out["image"].shape == (16, 16, 3) and (out["image"].max(axis=(1, 2)) == 0).any()


@pytest.mark.parametrize("shape,scales", [((33, 50), (0.5, 0.25)), ((31, 17), (0.5, 0.3)), ((7, 64), (0.25,))])
def test_pyramid_spacing_is_level0_pixels_per_level_pixel(shape, scales):
    h, w = shape
    ex = {"image": np.zeros((h, w, 3), np.uint8), "mask": np.zeros((h, w), np.uint8)}
    out = T.Pyramid(scales).map(ex)
    for k, s in enumerate(scales, start=1):
        lh, lw = out[f"image_{k}"].shape[:2]
        assert (lh, lw) == (max(1, round(h * s)), max(1, round(w * s))) and out[f"mask_{k}"].shape == (lh, lw)
        sy, sx = out[f"spacing_{k}"]
        assert out[f"spacing_{k}"].dtype == np.float32
        np.testing.assert_allclose([sy * lh, sx * lw], [h, w], rtol=1e-6)  # the level spans level 0 exactly


def test_normalize_uses_the_imagenet_statistics():
    ex = {"image": np.array([[[124, 116, 104], [255, 0, 0]]], np.uint8)}
    out = T.Normalize().map(ex)["image"]
    mean, std = np.array([0.485, 0.456, 0.406]) * 255, np.array([0.229, 0.224, 0.225]) * 255
    np.testing.assert_allclose(out[0, 0], (np.array([124, 116, 104]) - mean) / std, rtol=1e-5)
    np.testing.assert_allclose(out[0, 1], [(255 - mean[0]) / std[0], -mean[1] / std[1], -mean[2] / std[2]], rtol=1e-5)
