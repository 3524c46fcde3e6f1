"""Box ops, the matching cost and the pure-JAX Hungarian solver against numpy and scipy."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from scipy.optimize import linear_sum_assignment

from jaxrat.tasks.detection import boxes as box_ops
from jaxrat.tasks.detection.matching import hungarian_match, match_cost


def _random_boxes(rng, shape, degenerate=0.0):
    cxcy = rng.uniform(0.1, 0.9, shape + (2,))
    wh = rng.uniform(0.01, 0.5, shape + (2,))
    wh = np.where(rng.random(shape + (1,)) < degenerate, 0.0, wh)
    return np.concatenate([cxcy, wh], -1).astype(np.float32)


def _np_giou(a, b):
    """Straightforward per-pair loops, xyxy."""
    out_iou = np.zeros((len(a), len(b)))
    out_giou = np.zeros((len(a), len(b)))
    for i, p in enumerate(a.astype(np.float64)):
        for j, q in enumerate(b.astype(np.float64)):
            area = lambda r: max(r[2] - r[0], 0) * max(r[3] - r[1], 0)  # noqa: E731
            inter = max(min(p[2], q[2]) - max(p[0], q[0]), 0) * max(min(p[3], q[3]) - max(p[1], q[1]), 0)
            union = area(p) + area(q) - inter
            enc = (max(p[2], q[2]) - min(p[0], q[0])) * (max(p[3], q[3]) - min(p[1], q[1]))
            iou = inter / union if union > 0 else 0.0
            out_iou[i, j] = iou
            out_giou[i, j] = iou - ((enc - union) / enc if enc > 0 else 0.0)
    return out_iou, out_giou


def test_box_conversions_round_trip_and_match_numpy():
    b = _random_boxes(np.random.default_rng(0), (5, 7))
    xyxy = np.asarray(box_ops.cxcywh_to_xyxy(jnp.asarray(b)))
    np.testing.assert_allclose(xyxy[..., 0], b[..., 0] - b[..., 2] / 2, atol=1e-7)
    np.testing.assert_allclose(xyxy[..., 3], b[..., 1] + b[..., 3] / 2, atol=1e-7)
    np.testing.assert_allclose(np.asarray(box_ops.xyxy_to_cxcywh(jnp.asarray(xyxy))), b, atol=1e-6)


def test_iou_giou_match_numpy_including_degenerate_boxes():
    rng = np.random.default_rng(1)
    a = np.asarray(box_ops.cxcywh_to_xyxy(jnp.asarray(_random_boxes(rng, (9,), degenerate=0.3))))
    b = np.asarray(box_ops.cxcywh_to_xyxy(jnp.asarray(_random_boxes(rng, (6,), degenerate=0.3))))
    b = np.concatenate([b, np.zeros((2, 4), np.float32), a[:1]])  # padded (all-zero) boxes and a duplicate
    ref_iou, ref_giou = _np_giou(a, b)
    np.testing.assert_allclose(np.asarray(box_ops.pairwise_iou(jnp.asarray(a), jnp.asarray(b))), ref_iou, atol=1e-5)
    np.testing.assert_allclose(np.asarray(box_ops.pairwise_giou(jnp.asarray(a), jnp.asarray(b))), ref_giou, atol=1e-5)


def test_giou_properties_and_finite_gradients():
    box = jnp.array([[0.2, 0.3, 0.5, 0.6]])
    assert float(box_ops.elementwise_giou(box, box)[0]) == pytest.approx(1.0)
    far = box_ops.elementwise_giou(jnp.array([0.0, 0.0, 1e-3, 1e-3]), jnp.array([0.999, 0.999, 1.0, 1.0]))
    assert float(far) < -0.99
    zero = jnp.zeros((4,))
    assert float(box_ops.elementwise_giou(zero, zero)) == 0.0
    g = jax.grad(lambda a, b: box_ops.elementwise_giou(a, b).sum(), argnums=(0, 1))(zero, zero)
    assert all(bool(jnp.isfinite(x).all()) for x in g)
    g = jax.grad(lambda a: box_ops.pairwise_giou(a, jnp.zeros((3, 4))).sum())(jnp.concatenate([box, zero[None]]))
    assert bool(jnp.isfinite(g).all())


def _problems(rng, batch, q, t, kind):
    cost = rng.random((batch, q, t))
    if kind == "ties":
        cost = np.floor(cost * 3)
    elif kind == "scaled":
        cost = cost * 100.0 - 50.0
    counts = rng.integers(0, t + 1, batch)
    counts[:2] = [0, t]  # every shape sees no targets and all targets
    valid = np.zeros((batch, t), bool)
    for i, k in enumerate(counts):
        valid[i, rng.permutation(t)[:k]] = True  # padding scattered, not only at the end
    return cost.astype(np.float32), valid


def _check_optimal(cost, valid, pred_index):
    for c, v, p in zip(cost.astype(np.float64), valid, np.asarray(pred_index)):
        cols = np.flatnonzero(v)
        if cols.size == 0:
            continue
        assert len(set(p[cols].tolist())) == cols.size, "two targets share a query"
        r, k = linear_sum_assignment(c[:, cols])
        ref = c[:, cols][r, k].sum()
        got = c[p[cols], cols].sum()
        assert abs(got - ref) <= 1e-5 * max(1.0, abs(ref)), (got, ref)


@pytest.mark.parametrize("q,t,kind", [(12, 8, "uniform"), (12, 8, "ties"), (9, 9, "scaled"), (30, 4, "uniform"),
                                      (3, 1, "ties")])
def test_hungarian_equals_scipy_cost(q, t, kind):
    rng = np.random.default_rng(q * 100 + t)
    cost, valid = _problems(rng, 16, q, t, kind)  # 5 x 16 = 80 problems in all
    m = jax.jit(hungarian_match)(jnp.asarray(cost), jnp.asarray(valid))
    _check_optimal(cost, valid, m.pred_index)
    pi = np.asarray(m.pred_index)
    assert (pi[~valid] == 0).all()
    qm, ti = np.asarray(m.query_matched), np.asarray(m.target_index)
    assert (qm.sum(1) == valid.sum(1)).all()
    for b in range(len(cost)):
        for k in np.flatnonzero(valid[b]):
            assert qm[b, pi[b, k]] and ti[b, pi[b, k]] == k


def test_hungarian_survives_non_finite_costs():
    cost = np.random.default_rng(3).random((2, 5, 4)).astype(np.float32)
    cost[0, 1, :] = np.nan
    cost[1] = np.inf
    m = hungarian_match(jnp.asarray(cost), jnp.ones((2, 4), bool))
    for p in np.asarray(m.pred_index):
        assert len(set(p.tolist())) == 4


def test_hungarian_rejects_fewer_queries_than_targets():
    with pytest.raises(ValueError, match="at least as many queries"):
        hungarian_match(jnp.zeros((1, 3, 4)), jnp.ones((1, 4), bool))


def test_sharded_matching_equals_unsharded_without_collectives():
    devices = np.array(jax.devices()[:8])
    assert devices.size == 8, "conftest sets 8 simulated devices"
    mesh = jax.sharding.Mesh(devices.reshape(4, 2), ("data", "fsdp"))
    rng = np.random.default_rng(4)
    cost, valid = _problems(rng, 16, 12, 8, "uniform")
    sharded = NamedSharding(mesh, P(("data", "fsdp")))
    c, v = jax.device_put(cost, sharded), jax.device_put(valid, sharded)
    fn = jax.jit(functools.partial(hungarian_match, mesh=mesh))
    hlo = fn.lower(c, v).compile().as_text()
    for op in ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter"):
        assert op not in hlo, f"sharded matching communicates: {op}"
    got = fn(c, v)
    assert got.pred_index.sharding.is_equivalent_to(sharded, 2)
    want = jax.jit(hungarian_match)(jnp.asarray(cost), jnp.asarray(valid))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _np_softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("focal", [False, True])
def test_match_cost_matches_numpy(focal):
    rng = np.random.default_rng(5)
    b, q, t, k = 2, 6, 3, 4
    logits = rng.normal(size=(b, q, k if focal else k + 1)).astype(np.float32)
    pred, tgt = _random_boxes(rng, (b, q)), _random_boxes(rng, (b, t))
    labels = rng.integers(0, k, (b, t))
    valid = np.array([[True, True, False], [False, False, False]])
    got = np.asarray(match_cost(jnp.asarray(logits), jnp.asarray(pred), jnp.asarray(labels), jnp.asarray(tgt),
                                jnp.asarray(valid), focal=focal))
    for i in range(b):
        _, giou = _np_giou(np.asarray(box_ops.cxcywh_to_xyxy(pred[i])), np.asarray(box_ops.cxcywh_to_xyxy(tgt[i])))
        if focal:
            p = 1 / (1 + np.exp(-logits[i].astype(np.float64)))
            cls = 0.25 * (1 - p) ** 2 * -np.log(p) - 0.75 * p ** 2 * -np.log(1 - p)
        else:
            cls = -_np_softmax(logits[i].astype(np.float64))
        want = cls[:, labels[i]] + 5 * np.abs(pred[i][:, None] - tgt[i][None]).sum(-1) - 2 * giou
        np.testing.assert_allclose(got[i], np.where(valid[i][None], want, 0.0), rtol=1e-5, atol=1e-5)
