import jax.numpy as jnp
import numpy as np
import pytest

from jaxrat.tasks import segmentation

KW = dict(threshold=0.5, bce_weight=0.5, dice_weight=0.5)


def _numpy_metrics(pred, mask):
    dices, ious = [], []
    for p, t in zip(pred, mask):
        tp, fp, fn = (p * t).sum(), (p * (1 - t)).sum(), ((1 - p) * t).sum()
        dices.append(1.0 if tp + fp + fn == 0 else 2 * tp / (2 * tp + fp + fn))
        ious.append(1.0 if tp + fp + fn == 0 else tp / (tp + fp + fn))
    tp, fp = (pred * mask).sum(), (pred * (1 - mask)).sum()
    fn, tn = ((1 - pred) * mask).sum(), ((1 - pred) * (1 - mask)).sum()
    return {
        "dice": np.mean(dices), "iou": np.mean(ious), "sensitivity": tp / (tp + fn),
        "specificity": tn / (tn + fp), "accuracy": (tp + tn) / pred.size,
    }


def test_metrics_match_numpy_and_are_split_invariant():
    rng = np.random.default_rng(0)
    mask = (rng.random((10, 8, 8, 1)) < 0.3).astype(np.float32)
    logits = rng.normal(size=(10, 8, 8, 1)).astype(np.float32)
    pred = (logits >= 0).astype(np.float32)
    expected = _numpy_metrics(pred, mask)
    valid = np.ones(10, np.float32)
    sums = segmentation.eval_sums
    whole = segmentation.finalize_metrics(sums(jnp.array(logits), jnp.array(mask), jnp.array(valid), **KW))
    parts = [sums(jnp.array(logits[i:i + 3]), jnp.array(mask[i:i + 3]), jnp.array(valid[i:i + 3]), **KW)
             for i in range(0, 10, 3)]
    split = segmentation.finalize_metrics({k: sum(p[k] for p in parts) for k in parts[0]})
    for k, v in expected.items():
        assert whole[k] == pytest.approx(v, rel=1e-6), k
        assert split[k] == pytest.approx(v, rel=1e-6), k
    assert whole["num_images"] == 10


def test_empty_mask_and_empty_prediction_is_perfect_not_nan():
    logits = jnp.full((2, 4, 4, 1), -5.0)
    mask = jnp.zeros((2, 4, 4, 1))
    m = segmentation.finalize_metrics(segmentation.eval_sums(logits, mask, jnp.ones(2), **KW))
    assert m["dice"] == 1.0 and m["iou"] == 1.0 and m["sensitivity"] == 1.0 and m["accuracy"] == 1.0
    assert all(np.isfinite(v) for v in m.values())


def test_padding_is_ignored():
    rng = np.random.default_rng(1)
    mask = (rng.random((4, 8, 8, 1)) < 0.5).astype(np.float32)
    logits = rng.normal(size=(4, 8, 8, 1)).astype(np.float32)
    ref = segmentation.finalize_metrics(
        segmentation.eval_sums(jnp.array(logits[:3]), jnp.array(mask[:3]), jnp.ones(3), **KW))
    padded = segmentation.finalize_metrics(
        segmentation.eval_sums(jnp.array(logits), jnp.array(mask), jnp.array([1.0, 1, 1, 0]), **KW))
    for k in ref:
        assert padded[k] == pytest.approx(ref[k], rel=1e-6)


def test_loss_weights_and_perfect_prediction():
    mask = jnp.zeros((2, 4, 4, 1)).at[:, :2].set(1.0)
    good = (mask * 2 - 1) * 20.0
    loss, parts = segmentation.loss_fn(good, mask, bce_weight=0.5, dice_weight=0.5)
    assert float(loss) < 1e-3
    bad = -good
    _, parts = segmentation.loss_fn(bad, mask, bce_weight=1.0, dice_weight=0.0)
    only_bce, _ = segmentation.loss_fn(bad, mask, bce_weight=1.0, dice_weight=0.0)
    assert float(only_bce) == pytest.approx(float(parts["bce"]))
    assert float(parts["dice_loss"]) > 0.99
