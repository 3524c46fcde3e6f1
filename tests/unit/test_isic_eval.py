"""ISIC results comparable with the literature: the challenge's thresholded Jaccard, per-image and
pooled sensitivity/specificity/accuracy, metrics at each image's original resolution, masks resized
once from their stored size, and the multi-scale (every pyramid level) loss."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from PIL import Image

from jaxrat import ops
from jaxrat.config_schema import load_config
from jaxrat.data import pipeline
from jaxrat.data.pipeline import ExampleSource
from jaxrat.runtime.errors import ConfigError
from jaxrat.tasks import segmentation
from jaxrat.tasks.segmentation_metrics import JACCARD_THRESHOLD

KW = dict(threshold=0.5, bce_weight=0.5, dice_weight=0.5)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _isic_score(pred: np.ndarray, mask: np.ndarray) -> dict[str, float]:
    """An independent per-image implementation of the ISIC 2018 Task 1 scores (booleans, float64)."""
    jac, sens, spec, acc = [], [], [], []
    for p, t in zip(pred.astype(bool), mask.astype(bool)):
        inter, union = np.logical_and(p, t).sum(), np.logical_or(p, t).sum()
        j = inter / union if union else 1.0
        jac.append(j)
        sens.append(inter / t.sum() if t.sum() else 1.0)
        spec.append((~p & ~t).sum() / (~t).sum() if (~t).sum() else 1.0)
        acc.append((p == t).mean())
    jac = np.array(jac)
    return {"jaccard": jac, "jaccard_thresholded": np.where(jac < 0.65, 0.0, jac).mean(),
            "sensitivity_per_image": np.mean(sens), "specificity_per_image": np.mean(spec),
            "accuracy_per_image": np.mean(acc)}


def test_thresholded_jaccard_and_per_image_rates_match_an_independent_implementation():
    rng = np.random.default_rng(7)
    n, size = 12, 24
    mask = np.zeros((n, size, size, 1), np.float32)
    pred = np.zeros_like(mask)
    for i in range(n - 1):  # random rectangles, the prediction a shifted and resized copy
        y, x, h, w = rng.integers(2, 8, 4) + np.array([0, 0, 6, 6])
        mask[i, y : y + h, x : x + w] = 1
        dy, dx, dh, dw = rng.integers(-3, 4, 4)
        pred[i, max(0, y + dy) : y + dy + h + dh, max(0, x + dx) : x + dx + w + dw] = 1
    flip = rng.random(mask.shape) < 0.02  # and some scattered errors
    pred = np.where(flip, 1 - pred, pred)
    pred[-1], mask[-1] = 0, 0  # an image without lesion, predicted empty: Jaccard 1
    logits = np.where(pred > 0, 4.0, -4.0).astype(np.float32)
    want = _isic_score(pred[..., 0], mask[..., 0])
    assert (want["jaccard"] < JACCARD_THRESHOLD).sum() >= 3 and (want["jaccard"] >= JACCARD_THRESHOLD).sum() >= 3

    whole = segmentation.finalize_metrics(segmentation.eval_sums(jnp.array(logits), jnp.array(mask), jnp.ones(n), **KW))
    for k in ("jaccard_thresholded", "sensitivity_per_image", "specificity_per_image", "accuracy_per_image"):
        assert whole[k] == pytest.approx(want[k], abs=1e-6), k
    assert whole["iou"] == pytest.approx(want["jaccard"].mean(), abs=1e-6)
    tp, fp = (pred * mask).sum(), (pred * (1 - mask)).sum()
    fn, tn = ((1 - pred) * mask).sum(), ((1 - pred) * (1 - mask)).sum()
    assert whole["sensitivity"] == pytest.approx(tp / (tp + fn), abs=1e-6)
    assert whole["specificity"] == pytest.approx(tn / (tn + fp), abs=1e-6)
    assert whole["accuracy"] == pytest.approx((tp + tn) / pred.size, abs=1e-6)
    assert whole["iou_global"] == pytest.approx(tp / (tp + fp + fn), abs=1e-6)

    # Batches of 5 with padding rows (valid 0, holding garbage) add up to the same numbers.
    parts = []
    for s in range(0, n, 5):
        lg, mk = np.zeros((5, size, size, 1), np.float32) + 3, np.zeros((5, size, size, 1), np.float32)
        k = min(5, n - s)
        lg[:k], mk[:k] = logits[s : s + k], mask[s : s + k]
        parts.append(segmentation.eval_sums(jnp.array(lg), jnp.array(mk), jnp.array(np.arange(5) < k), **KW))
    split = segmentation.finalize_metrics({k: sum(p[k] for p in parts) for k in parts[0]})
    for k, v in whole.items():
        assert split[k] == pytest.approx(v, abs=1e-6), k


def _write_pairs(root, shapes):
    """JPEG images (some decoded at reduced scale) with PNG masks of their left half."""
    pairs = []
    os.makedirs(root, exist_ok=True)
    for i, (h, w) in enumerate(shapes):
        rng = np.random.default_rng(i)
        img = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
        m = np.zeros((h, w), np.uint8)
        m[:, : w // 2] = 255
        ip, mp = os.path.join(root, f"ISIC_{i:07d}.jpg"), os.path.join(root, f"ISIC_{i:07d}_segmentation.png")
        Image.fromarray(img).save(ip, quality=90)
        Image.fromarray(m).save(mp)
        pairs.append((ip, mp))
    return pairs


@pytest.mark.parametrize("keep_aspect", [False, True])
def test_original_resolution_metrics_on_images_of_different_sizes(tmp_path, keep_aspect):
    shapes = [(40, 80), (64, 32), (90, 90)]  # half widths map exactly onto the 16-px grid (8 px) and back
    pairs = _write_pairs(str(tmp_path), shapes)
    config = load_config(f"{REPO}/configs/isic.py:smoke")
    config.data.image_size, config.data.keep_aspect_ratio = 16, keep_aspect
    config.task.eval_original_resolution = True
    task = segmentation.SegmentationTask(config)
    task.val_source = ExampleSource(pairs)
    assert "orig/jaccard_thresholded" in task.metric_names

    def run(predict):
        acc = task.new_eval()
        for batch in task.eval_batches(global_batch=2, process_index=0, process_count=1):  # 2 batches, 1 padding row
            probs = predict(batch)
            logits = jnp.log(jnp.clip(probs, 1e-6, 1 - 1e-6) / jnp.clip(1 - probs, 1e-6, 1))
            sums = segmentation.eval_sums(logits, jnp.array(batch["mask"]), jnp.array(batch["valid"]), **KW)
            acc.update(sums, batch, probs)
        return acc.finalize()

    # The model-resolution mask as the prediction, resized back: exactly the stored mask again.
    m = run(lambda b: jnp.array(b["mask"]))
    assert m["orig/num_images"] == 3 and m["num_images"] == 3
    for k in ("dice", "iou", "jaccard_thresholded", "sensitivity", "specificity", "accuracy"):
        assert m[f"orig/{k}"] == 1.0, k
    # Everything predicted as lesion (padding included): counts of the stored masks, letterbox cropped.
    m = run(lambda b: jnp.ones_like(jnp.array(b["mask"])))
    assert m["orig/iou"] == 0.5 and m["orig/jaccard_thresholded"] == 0.0  # below 0.65 counts 0
    assert m["orig/sensitivity"] == 1.0 and m["orig/specificity"] == 0.0 and m["orig/accuracy"] == 0.5
    assert m["orig/dice_global"] == pytest.approx(2 / 3) and m["orig/accuracy_per_image"] == 0.5


def test_mask_is_resized_once_from_its_stored_size(tmp_path):
    """A JPEG decoded at reduced scale (333x410 -> 84x103 for a 48 px target) once dragged its mask
    through that size too: nearest twice moved the rectangle's top edge by a row. Now the mask goes
    straight from 333x410 to 48x48, and its edges are exactly where nearest resampling puts them."""
    H, W, y0, y1, x0, x1 = 333, 410, 53, 247, 41, 301
    img, m = np.zeros((H, W, 3), np.uint8), np.zeros((H, W), np.uint8)
    img[y0:y1, x0:x1], m[y0:y1, x0:x1] = 220, 255
    Image.fromarray(img).save(tmp_path / "a.jpg", quality=95)
    Image.fromarray(m).save(tmp_path / "a.png")
    pair = (str(tmp_path / "a.jpg"), str(tmp_path / "a.png"))
    for keep_aspect, (nh, nw) in ((False, (48, 48)), (True, (39, 48))):  # letterboxed: 333x410 -> 39x48
        batch = next(pipeline.eval_batches([pair], image_size=48, global_batch=1, process_index=0, process_count=1,
                                           ops=pipeline.augment_ops(48, keep_aspect_ratio=keep_aspect, train=False)))
        got = batch["mask"][0, ..., 0] > 0
        rows = [i for i in range(nh) if y0 <= int((i + 0.5) * H / nh) < y1]  # PIL nearest: pixel centres
        cols = [j for j in range(nw) if x0 <= int((j + 0.5) * W / nw) < x1]
        want = np.zeros((48, 48), bool)
        want[rows[0] : rows[-1] + 1, cols[0] : cols[-1] + 1] = True
        np.testing.assert_array_equal(got, want)
    # A resized crop takes the same window from the stored mask in one step as well.
    from jaxrat.data import transforms as T
    from jaxrat.data.sources.isic import DecodePair

    ex = DecodePair(at_least=(48, 48)).map(pair)
    assert ex["image"].shape[:2] != ex["mask"].shape
    rrc = T.RandomResizedCrop(48, scale=(0.5, 0.5), ratio=(1.0, 1.0))
    out = rrc.random_map(ex, np.random.default_rng(0))
    y, x, ch, cw = rrc.window(*ex["image"].shape[:2], np.random.default_rng(0))
    sy, sx = H / ex["image"].shape[0], W / ex["image"].shape[1]
    want = np.asarray(Image.fromarray(m).resize((48, 48), Image.NEAREST, box=(x * sx, y * sy, (x + cw) * sx,
                                                                              (y + ch) * sy))) > 0
    np.testing.assert_array_equal(out["mask"] > 0, want)
    assert out["image"].shape == (48, 48, 3)


class _ThreeLevels(nnx.Module):
    """A stand-in multi-scale segmenter: one 1x1 conv applied to the input and to its 2x and 4x
    average-pooled copies (the RAT's own levels are checked below, once compiled)."""

    def __init__(self):
        self.conv = nnx.Conv(3, 1, (1, 1), rngs=nnx.Rngs(0))

    def __call__(self, x, *, all_levels=False):
        levels = [self.conv(nnx.avg_pool(x, (f, f), (f, f)) if f > 1 else x) for f in (1, 2, 4)]
        return levels if all_levels else levels[0]


def test_multiscale_loss_is_the_mean_of_the_per_level_losses():
    config = load_config(f"{REPO}/configs/isic_multiscale.py:smoke")
    config.task.multiscale_loss = True
    task = segmentation.SegmentationTask(config)
    model = _ThreeLevels()
    rng = np.random.default_rng(0)
    images = jnp.array(rng.normal(size=(2, 16, 16, 3)).astype(np.float32))
    mask = np.zeros((2, 16, 16, 1), np.float32)
    mask[0, 2:10, 5:14], mask[1, 7:15, 1:8] = 1, 1
    # Nearest resize by 2 and 4 picks the pixel centres 1, 3, 5, ... and 2, 6, 10, ... (here by hand).
    targets = [mask, mask[:, 1::2, 1::2], mask[:, 2::4, 2::4]]
    per_level = [float(segmentation.loss_fn(lv, jnp.array(t), bce_weight=0.5, dice_weight=0.5)[0])
                 for lv, t in zip(model(images, all_levels=True), targets)]
    batch = {"image": images, "mask": jnp.array(mask)}
    loss, parts = task.loss(model, batch, jax.random.key(0))
    assert float(loss) == pytest.approx(np.mean(per_level), rel=1e-6)
    for k, v in enumerate(per_level):
        assert float(parts[f"loss_level_{k}"]) == pytest.approx(v, rel=1e-6)
    assert len({round(v, 6) for v in per_level}) == 3  # the levels differ: the mean is no accident
    config.task.multiscale_loss = False
    loss0, _ = segmentation.SegmentationTask(config).loss(model, batch, jax.random.key(0))
    assert float(loss0) == pytest.approx(per_level[0], rel=1e-6)


def test_rat_predicts_every_pyramid_level_and_level_0_is_its_output():
    from jaxrat.models import build_model

    config = load_config(f"{REPO}/configs/isic_multiscale.py:smoke")
    model = build_model(config.model, rngs=nnx.Rngs(0), kernels=ops.resolve("auto"))
    model.eval()
    images = jnp.array(np.random.default_rng(0).normal(size=(1, 16, 16, 3)).astype(np.float32))
    levels, full = nnx.jit(lambda m, x: (m(x, all_levels=True), m(x)))(model, images)  # one compile
    assert [lv.shape[1:3] for lv in levels] == [(16, 16), (8, 8), (4, 4)]  # scales (256, 128, 64)
    np.testing.assert_allclose(levels[0], full, atol=1e-6)


def test_multiscale_loss_needs_a_multiscale_model():
    from jaxrat.models import build_model

    config = load_config(f"{REPO}/configs/isic.py:smoke")  # a U-Net: one level
    config.task.multiscale_loss = True
    task = segmentation.SegmentationTask(config)
    model = build_model(config.model, rngs=nnx.Rngs(0), kernels=ops.resolve("auto"))
    batch = {"image": jnp.zeros((1, 16, 16, 3)), "mask": jnp.zeros((1, 16, 16, 1))}
    with pytest.raises(ConfigError, match="multiscale_loss=True needs a model that predicts several pyramid levels"):
        task.loss(model, batch, jax.random.key(0))
    assert len(model(batch["image"], all_levels=True)) == 1
