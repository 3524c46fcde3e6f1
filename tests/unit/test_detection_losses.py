"""DETR set-prediction losses: a numpy+scipy reference, edge cases, invariances, gradients, sharding."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from scipy.optimize import linear_sum_assignment

from jaxrat.tasks.detection import boxes as box_ops
from jaxrat.tasks.detection.losses import num_target_boxes, set_criterion
from jaxrat.tasks.detection.matching import hungarian_match

B, Q, T, K = 4, 10, 5, 3


def _batch(seed, counts=(0, 2, 5, 3), focal=False, layers=2):
    rng = np.random.default_rng(seed)
    outs = []
    for _ in range(layers):
        logits = rng.normal(size=(B, Q, K if focal else K + 1)).astype(np.float32)
        boxes = np.concatenate([rng.uniform(0.2, 0.8, (B, Q, 2)), rng.uniform(0.05, 0.4, (B, Q, 2))], -1)
        outs.append((jnp.asarray(logits), jnp.asarray(boxes.astype(np.float32))))
    valid = np.zeros((B, T), bool)
    for i, n in enumerate(counts):
        valid[i, :n] = True
    tboxes = np.concatenate([rng.uniform(0.2, 0.8, (B, T, 2)), rng.uniform(0.05, 0.4, (B, T, 2))], -1)
    tboxes = np.where(valid[..., None], tboxes, 0.0).astype(np.float32)  # padding is all zeros
    labels = np.where(valid, rng.integers(0, K, (B, T)), -1)
    return outs, jnp.asarray(labels), jnp.asarray(tboxes), jnp.asarray(valid)


def _np_reference(logits, pred, labels, tboxes, valid, eos_coef=0.1):
    """DETR's SetCriterion written out with scipy's matcher, float64."""
    logits, pred, tboxes = (np.asarray(x, np.float64) for x in (logits, pred, tboxes))
    labels, valid = np.asarray(labels), np.asarray(valid)
    xyxy = lambda b: np.asarray(box_ops.cxcywh_to_xyxy(jnp.asarray(b, jnp.float32)), np.float64)  # noqa: E731
    num = max(valid.sum(), 1)
    ce_num = ce_den = l1 = giou_loss = 0.0
    for b in range(len(logits)):
        e = np.exp(logits[b] - logits[b].max(-1, keepdims=True))
        prob = e / e.sum(-1, keepdims=True)
        cols = np.flatnonzero(valid[b])
        classes = np.full(len(logits[b]), logits.shape[-1] - 1)
        if cols.size:
            giou = np.asarray(box_ops.pairwise_giou(jnp.asarray(xyxy(pred[b])), jnp.asarray(xyxy(tboxes[b][cols]))))
            cost = -prob[:, labels[b][cols]] + 5 * np.abs(pred[b][:, None] - tboxes[b][cols][None]).sum(-1) - 2 * giou
            r, c = linear_sum_assignment(cost)
            classes[r] = labels[b][cols[c]]
            l1 += np.abs(pred[b][r] - tboxes[b][cols[c]]).sum()
            giou_loss += (1 - giou[r, c]).sum()
        w = np.where(classes == logits.shape[-1] - 1, eos_coef, 1.0)
        ce_num += (w * -np.log(prob[np.arange(len(classes)), classes])).sum()
        ce_den += w.sum()
    return ce_num / ce_den, l1 / num, giou_loss / num


def _loss(outs, labels, tboxes, valid, **kw):
    return set_criterion(outs, labels, tboxes, valid, num_target_boxes(valid), **kw)


def test_loss_equals_numpy_scipy_reference_and_aux_names():
    outs, labels, tboxes, valid = _batch(0)
    total, parts = jax.jit(_loss)(outs, labels, tboxes, valid)
    assert set(parts) == {"loss_ce", "loss_bbox", "loss_giou", "loss_ce_0", "loss_bbox_0", "loss_giou_0"}
    for suffix, (logits, pred) in zip(("_0", ""), outs):
        ce, l1, giou = _np_reference(logits, pred, labels, tboxes, valid)
        np.testing.assert_allclose([float(parts["loss_ce" + suffix]), float(parts["loss_bbox" + suffix]),
                                    float(parts["loss_giou" + suffix])], [ce, l1, giou], rtol=1e-5)
    want = sum(w * float(parts[n + s]) for s in ("", "_0")
               for n, w in (("loss_ce", 1.0), ("loss_bbox", 5.0), ("loss_giou", 2.0)))
    assert float(total) == pytest.approx(want, rel=1e-6)


def test_no_targets_gives_only_no_object_cross_entropy():
    outs, labels, tboxes, valid = _batch(1, counts=(0, 0, 0, 0), layers=1)
    total, parts = _loss(outs, labels, tboxes, valid)
    assert float(parts["loss_bbox"]) == 0.0 and float(parts["loss_giou"]) == 0.0
    logits = np.asarray(outs[0][0], np.float64)
    nll = -(logits[..., -1] - np.log(np.exp(logits).sum(-1)))
    assert float(total) == pytest.approx(nll.mean(), rel=1e-5)
    grads = jax.grad(lambda o: _loss(o, labels, tboxes, valid)[0])(outs)
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("focal", [False, True])
def test_permuting_target_slots_leaves_loss_unchanged_and_gradients_finite(focal):
    outs, labels, tboxes, valid = _batch(2, focal=focal)
    perm = np.random.default_rng(0).permutation(T)  # moves padding slots in front of real ones too
    loss_fn = jax.jit(functools.partial(_loss, focal=focal))
    total, parts = loss_fn(outs, labels, tboxes, valid)
    total_p, parts_p = loss_fn(outs, labels[:, perm], tboxes[:, perm], valid[:, perm])
    assert float(total) == pytest.approx(float(total_p), rel=1e-6)
    for k in parts:
        assert float(parts[k]) == pytest.approx(float(parts_p[k]), rel=1e-6, abs=1e-7)
    # A collapsed (zero-size) predicted box must not poison the gradient.
    outs = [(lg, bx.at[0, 0, 2:].set(0.0)) for lg, bx in outs]
    grads = jax.grad(lambda o: _loss(o, labels, tboxes, valid, focal=focal)[0])(outs)
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))
    assert np.isfinite(float(total)) and float(total) > 0


def test_sharded_step_loss_equals_unsharded():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
    outs, labels, tboxes, valid = _batch(3, layers=1)
    shard = NamedSharding(mesh, P("data"))
    args = jax.device_put((outs, labels, tboxes, valid), shard)
    sharded = jax.jit(functools.partial(_loss, matcher=functools.partial(hungarian_match, mesh=mesh)))
    total_s, parts_s = sharded(*args)
    total, parts = jax.jit(_loss)(outs, labels, tboxes, valid)
    assert float(total_s) == pytest.approx(float(total), rel=1e-6)
    for k in parts:
        assert float(parts_s[k]) == pytest.approx(float(parts[k]), rel=1e-6, abs=1e-7)
