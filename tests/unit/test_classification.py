"""Multi-head classification: metrics against scikit-learn, class weights, shared vocabularies,
mixing (end to end on 1 and 8 devices, 2 processes and kill -9: tests/integration/test_task_runs.py)."""

import json

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from sklearn import metrics as skm

from jaxrat import ops
from jaxrat.config_schema import load_config
from jaxrat.parallel.mesh import make_mesh
from jaxrat.runtime.errors import ConfigError
from jaxrat.tasks.class_weights import class_weights
from jaxrat.tasks.classification import ClassificationTask, head_metrics
from jaxrat.tasks.mixing import mix_batch

CONFIG = "configs/classification.py"


def _task(num_classes=(3, 7)):
    config = load_config(f"{CONFIG}:smoke")
    config.task.num_classes = num_classes
    task = ClassificationTask(config)
    task.weights = tuple(np.ones(c, np.float32) for c in num_classes)
    return task


def test_eval_metrics_over_sharded_batches_equal_scikit_learn():
    rng = np.random.default_rng(0)
    task = _task()
    mesh = make_mesh((("data", -1),))
    sharding = NamedSharding(mesh, P("data"))
    step = jax.jit(lambda x, labels, valid: task.eval_step(
        lambda img: (img[:, 0, 0, :3], img[:, 0, 0, 3:]), {"image": x, "labels": labels, "valid": valid})[0])
    acc = task.new_eval()
    all_logits, all_labels = [], []
    for _ in range(4):
        logits = rng.normal(size=(16, 1, 1, 10)).astype(np.float32)
        labels = np.stack([rng.integers(0, 3, 16), rng.integers(0, 7, 16)], 1).astype(np.int32)
        labels[rng.random(16) < 0.2, 1] = -1  # missing fine labels
        valid = (rng.random(16) < 0.9).astype(np.float32)  # padding
        acc.update(step(*(jax.device_put(a, sharding) for a in (logits, labels, valid))), {}, None)
        keep = valid > 0
        all_logits.append(logits[keep, 0, 0])
        all_labels.append(labels[keep])
    got = acc.finalize()
    logits, labels = np.concatenate(all_logits), np.concatenate(all_labels)
    for h, (name, lo, hi) in enumerate((("shape", 0, 3), ("kind", 3, 10))):
        y, z = labels[:, h], logits[:, lo:hi]
        z, y = z[y >= 0], y[y >= 0]
        pred = z.argmax(1)
        c = hi - lo
        assert got[f"{name}/top1"] == pytest.approx(skm.accuracy_score(y, pred), abs=1e-9)
        assert got[f"{name}/macro_f1"] == pytest.approx(skm.f1_score(y, pred, average="macro", zero_division=0),
                                                       abs=1e-9)
        assert got[f"{name}/balanced_accuracy"] == pytest.approx(skm.balanced_accuracy_score(y, pred), abs=1e-9)
        assert got[f"{name}/topk"] == pytest.approx(
            skm.top_k_accuracy_score(y, z, k=min(5, c), labels=np.arange(c)) if c > 2 else 1.0, abs=1e-9)


def test_head_metrics_of_a_class_never_predicted_nor_present():
    confusion = np.array([[3, 1, 0], [0, 0, 0], [1, 0, 2]], np.float64)
    m = head_metrics(confusion, topk_hits=6)
    assert m["top1"] == pytest.approx(5 / 7)
    # class 1: predicted once, never true -> in macro-F1 (as 0), not in balanced accuracy
    assert m["macro_f1"] == pytest.approx(np.mean([6 / 8, 0.0, 4 / 5]))
    assert m["balanced_accuracy"] == pytest.approx(np.mean([3 / 4, 2 / 3]))


def test_class_weights_rules(tmp_path):
    labels = np.array([0] * 90 + [1] * 9 + [2] + [-1] * 5)
    none = class_weights(labels, 4, "none", "h")
    assert none.tolist() == [1, 1, 1, 1]
    inv = class_weights(labels, 4, "inverse", "h")
    assert inv[1] / inv[0] == pytest.approx(10) and inv[2] / inv[0] == pytest.approx(90) and inv[3] == 1
    seen = labels[labels >= 0]
    assert np.mean(inv[seen]) == pytest.approx(1.0)  # the loss keeps its scale
    eff = class_weights(labels, 4, "effective", "h", beta=0.99)
    assert inv[2] / inv[0] > eff[2] / eff[0] > 1  # between none and inverse frequency
    path = tmp_path / "w.json"
    path.write_text(json.dumps({"h": [1, 2, 3, 4]}))
    assert class_weights(labels, 4, str(path), "h").tolist() == [1, 2, 3, 4]
    with pytest.raises(ConfigError, match="needs 3 finite"):
        class_weights(labels, 3, str(path), "h")
    with pytest.raises(ConfigError, match="neither one of"):
        class_weights(labels, 3, "inverse_freq", "h")


def test_vocabularies_are_shared_between_splits(tmp_path):
    from PIL import Image

    from jaxrat.data.datasets import resolve_classification

    for name in ("a.png", "b.png", "c.png"):
        Image.new("RGB", (8, 8)).save(tmp_path / name)
    (tmp_path / "train.csv").write_text("image,genus,n\na.png,oak,2\nb.png,pine,0\n")
    (tmp_path / "val.csv").write_text("image,genus,n\nc.png,elm,5\nb.png,pine,\n")
    config = load_config(f"{CONFIG}:smoke")
    config.data.synthetic = False
    config.data.data_dir = str(tmp_path)
    train, val, vocabs, found = resolve_classification(config.data, ("genus", "n"), str(tmp_path / "wd"), seed=0,
                                                      process_index=0)
    assert vocabs["genus"] == ["elm", "oak", "pine"] and found == (3, 6)
    assert [r["labels"].tolist() for r in train.records] == [[1, 2], [2, 0]]
    assert [r["labels"].tolist() for r in val.records] == [[0, 5], [2, -1]]


def test_mixup_and_cutmix_keep_what_they_promise():
    images = np.stack([np.full((8, 8, 1), float(i)) for i in range(4)]).astype(np.float32)
    same, none = mix_batch(images, jax.random.key(0), 0.0, 0.0)
    assert none is None and np.array_equal(same, images)
    out, (lam, partner) = mix_batch(images, jax.random.key(1), 0.4, 0.0)
    assert partner.tolist() == [1, 2, 3, 0] and 0 <= float(lam) <= 1
    np.testing.assert_allclose(out, lam * images + (1 - lam) * images[[1, 2, 3, 0]], rtol=1e-6)
    out, (lam, _) = mix_batch(images, jax.random.key(2), 0.0, 1.0)
    own = (np.asarray(out)[0] == 0).mean()  # example 0 is all 0, its partner all 1
    assert float(lam) == pytest.approx(own)


def test_loss_ignores_missing_labels_and_heads_are_checked():
    task = _task()
    logits = (np.zeros((4, 3), np.float32), np.zeros((4, 7), np.float32))
    labels = np.array([[0, -1], [1, 2], [2, -1], [0, 3]], np.int32)
    loss, parts = task.loss(lambda x: logits, {"image": np.zeros((4, 2, 2, 3), np.float32), "labels": labels},
                            jax.random.key(0))
    assert float(parts["shape/loss"]) == pytest.approx(np.log(3), rel=1e-5)
    assert float(parts["kind/loss"]) == pytest.approx(np.log(7), rel=1e-5)
    assert float(loss) == pytest.approx(np.log(3) + np.log(7), rel=1e-5)
    config = load_config(f"{CONFIG}:smoke")
    config.task.loss_weights = (1.0,)
    with pytest.raises(ConfigError, match="loss_weights"):
        ClassificationTask(config)


@pytest.mark.parametrize("pool", ["mean", "leading"])
def test_rat_classifier_gives_one_logits_array_per_head(pool):
    import ml_collections as mlc
    from flax import nnx

    from jaxrat.models import build_model

    rat = dict(feature_dims=8, num_blocks=2, num_heads=2, iters=1, mlp_dropout=0.0)
    model = build_model(mlc.ConfigDict(dict(name="rat_classifier", num_classes=(3, 5), pool=pool, rat=rat)),
                        rngs=nnx.Rngs(0), kernels=ops.resolve("auto"))
    out = model(np.zeros((2, 16, 16, 3), np.float32))
    assert [o.shape for o in out] == [(2, 3), (2, 5)] and all(np.all(np.isfinite(o)) for o in out)
    with pytest.raises(ConfigError, match="model.pool"):
        build_model(mlc.ConfigDict(dict(name="rat_classifier", num_classes=(3,), pool="max")), rngs=nnx.Rngs(0),
                    kernels=ops.resolve("auto"))


def test_a_missing_csv_names_the_field_and_the_folder_layout(tmp_path):
    from jaxrat.data.datasets import resolve_classification
    from jaxrat.runtime.errors import DataError

    config = load_config("classification")
    config.data.data_dir = str(tmp_path)
    with pytest.raises(DataError) as err:
        resolve_classification(config.data, ("label",), str(tmp_path / "wd"), seed=0, process_index=0)
    said = str(err.value)
    assert f"{tmp_path}/train.csv not found" in said
    assert "--config.data.train_csv" in said and "--config.data.source=folder" in said and "<class>" in said
    (tmp_path / "train.csv").write_text("image,label\n")
    with pytest.raises(DataError, match="--config.data.val_csv"):
        resolve_classification(config.data, ("label",), str(tmp_path / "wd"), seed=0, process_index=0)
