"""The detection task: COCOeval through the task against pycocotools directly, the DETR head's shapes,
the loss with no targets, the letterboxed batches, and the task end to end through jaxrat.main."""

import contextlib
import io

import jax
import jax.numpy as jnp
import ml_collections as mlc
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrat import ops
from jaxrat.checkpointing.named_arrays import named_leaves
from jaxrat.config_schema import load_config
from jaxrat.models import build_model
from jaxrat.parallel.mesh import make_mesh
from jaxrat.runtime.errors import ConfigError
from jaxrat.tasks.base import load_task
from jaxrat.tasks.detection.coco_eval import STAT_NAMES

CONFIG = "configs/coco.py"


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    config = load_config(f"{CONFIG}:smoke")
    t = load_task(config)
    t.prepare_data(str(tmp_path_factory.mktemp("det")))
    return t


def _eval_rows(task):
    return list(task.eval_batches(global_batch=8, process_index=0, process_count=1))


def test_eval_batches_letterbox_and_map_back(task):
    batches = _eval_rows(task)
    b = batches[0]
    s = task.config.data.image_size
    assert b["image"].shape == (8, s, s, 3) and b["pad_mask"].shape == (8, s, s)
    assert b["boxes"].shape == (8, task.config.task.max_boxes, 4)
    for i in range(8):
        w, h = b["orig_size"][i]
        cw, ch = b["content_size"][i]
        assert max(cw, ch) == s and cw / ch == pytest.approx(w / h, rel=0.1)
        assert b["pad_mask"][i, : int(ch), : int(cw)].max() == 0 and b["pad_mask"][i].sum() == s * s - cw * ch
        rec = task._val.records[i]
        n = int(b["box_valid"][i].sum())
        real = rec["boxes"][rec["is_crowd"] == 0]  # crowd regions are not targets
        assert n == len(real)
        cx, cy, bw, bh = b["boxes"][i, :n].T
        canvas = np.stack([cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2], -1)
        back = canvas * s / np.array([cw, ch, cw, ch])
        np.testing.assert_allclose(back, real, atol=1.5 / min(cw, ch))


def test_coco_eval_through_task_equals_pycocotools(task):
    """Known predictions (original pixels, category ids) scored by the task's accumulator from sharded
    outputs equal COCOeval run directly on the same boxes."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    rng = np.random.default_rng(0)
    s, k = task.config.data.image_size, 6
    mesh = make_mesh((("data", -1),))
    sharding = NamedSharding(mesh, P("data"))
    acc = task.new_eval()
    direct = []
    cats = task._val.category_ids
    for b in _eval_rows(task):
        n = len(b["image_id"])
        scores = rng.random((n, k)).astype(np.float32)
        labels = rng.integers(0, 5, (n, k)).astype(np.int32)
        labels = np.array([[task._val.category_ids.index(c) for c in cats[:: 16][:5]][j] for j in labels.ravel()],
                          np.int32).reshape(n, k)
        pix = np.zeros((n, k, 4), np.float32)
        for i in range(n):
            w, h = b["orig_size"][i]
            rec = task._val.records[min(i, len(task._val.records) - 1)]
            for j in range(k):
                if j < len(rec["boxes"]):  # near a ground-truth box, so AP is not trivially 0
                    x1, y1, x2, y2 = rec["boxes"][j] * np.array([w, h, w, h]) + rng.normal(0, 1.5, 4)
                    labels[i, j] = rec["labels"][j] if rng.random() < 0.8 else labels[i, j]
                else:
                    x1, y1 = rng.uniform(0, w / 2), rng.uniform(0, h / 2)
                    x2, y2 = x1 + rng.uniform(2, w / 2), y1 + rng.uniform(2, h / 2)
                x1, y1, x2, y2 = np.clip([x1, y1, x2, y2], 0, [w, h, w, h])
                pix[i, j] = x1, y1, max(x2, x1 + 1), max(y2, y1 + 1)
                if b["valid"][i] > 0:
                    direct.append({"image_id": int(b["image_id"][i]), "category_id": int(cats[labels[i, j]]),
                                   "bbox": [float(x1), float(y1), float(pix[i, j, 2] - x1), float(pix[i, j, 3] - y1)],
                                   "score": float(scores[i, j])})
        # Into the canvas the model sees: original pixels -> normalised -> letterboxed.
        wh = np.tile(b["orig_size"], 2)[:, None]
        canvas = pix / wh * np.tile(b["content_size"], 2)[:, None] / s
        outputs = {"scores": scores, "labels": labels, "boxes": canvas.astype(np.float32)}
        outputs = {name: jax.device_put(v, sharding) for name, v in outputs.items()}
        acc.update({"num_images": jnp.asarray(b["valid"].sum())}, b, outputs)
    got = acc.finalize()
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(task._val.annotation_file)
        ev = COCOeval(gt, gt.loadRes(direct), "bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    want = dict(zip(STAT_NAMES, ev.stats))
    assert want["AP50"] > 0.1
    for name in STAT_NAMES:
        assert got[name] == pytest.approx(want[name], abs=1e-6), name
    assert got["num_images"] == len(task._val)


def test_eval_images_show_true_boxes_green_and_detections_red(task):
    from jaxrat.tasks.detection.task import DetectionEval

    b = _eval_rows(task)[0]
    s = task.config.data.image_size
    cx, cy, bw, bh = np.moveaxis(b["boxes"], -1, 0)
    xyxy = np.stack([cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2], -1).astype(np.float32)
    scores = np.zeros(xyxy.shape[:2], np.float32)
    scores[:, 0] = 0.9  # each image's first true box is also detected; the rest only drawn as truth
    outputs = {"scores": scores, "labels": np.zeros_like(scores, np.int32), "boxes": xyxy}
    acc = DetectionEval(task._val.annotation_file, task._val.category_ids, log_images=True)
    acc.update({"num_images": jnp.asarray(b["valid"].sum())}, b, {k: jnp.asarray(v) for k, v in outputs.items()})
    acc.update({"num_images": jnp.asarray(b["valid"].sum())}, b, {k: jnp.asarray(v) for k, v in outputs.items()})
    images = acc.images()
    assert images["eval/boxes"].shape == images["eval/input"].shape == (4, s, s, 3)
    corner = lambda i, j: tuple((xyxy[i, j, 1::-1] * (s - 1)).astype(int))  # noqa: E731  (row, col) top-left
    with_two = [i for i in range(4) if b["box_valid"][i, :2].all()]
    assert with_two, "the synthetic COCO has images with two boxes"
    for i in with_two:
        img = images["eval/boxes"][i]
        assert tuple(img[corner(i, 0)]) == (1.0, 0.0, 0.0)  # the detection, drawn over its true box
        assert (img == (0.0, 1.0, 0.0)).all(-1).any()  # the true boxes nothing detected
    untouched = images["eval/boxes"] == images["eval/input"]
    assert untouched.mean() > 0.5  # outlines only


def _tiny_detr(backbone="cnn", focal=False, **extra):
    cfg = dict(name="detr", backbone=backbone, cnn_widths=(8, 16), hidden_dim=16, num_queries=10, decoder_layers=3,
               decoder_heads=2, ffn_dim=32, num_classes=4, focal=focal, **extra,
               rat=dict(feature_dims=16, num_blocks=2, num_heads=2, iters=1, sga_kernel_size=3, proj_kernel_size=3))
    return build_model(mlc.ConfigDict(cfg), rngs=nnx.Rngs(0), kernels=ops.resolve("auto"))


@pytest.mark.parametrize("backbone,focal,extra", [("cnn", False, {}), ("cnn", True, {"box_refine": True}),
                                                  ("rat", False, {}), ("cnn", False, {"head": "reference"})])
def test_detr_output_shapes(backbone, focal, extra):
    model = _tiny_detr(backbone, focal, **extra)
    images = jnp.ones((2, 16, 16, 3))
    pad = jnp.zeros((2, 16, 16)).at[1, :, 10:].set(1.0)
    logits, boxes = model(images, pad)
    layers = 1 if extra.get("head") == "reference" else 3
    assert logits.shape == (layers, 2, 10, 4 if focal else 5) and boxes.shape == (layers, 2, 10, 4)
    assert bool(jnp.all((boxes >= 0) & (boxes <= 1))) and bool(jnp.isfinite(logits).all())


def test_token_queries_start_at_their_cells():
    # query_level: one query per cell of that stage (16 px / stride 4 = 4x4), its first box centred on
    # the cell; a stage outside feature_levels is one sentence.
    model = _tiny_detr(box_refine=True, query_level=1, focal=True)
    logits, boxes = model(jnp.ones((2, 16, 16, 3)))
    assert logits.shape == (3, 2, 16, 4) and boxes.shape == (3, 2, 16, 4)
    assert jnp.allclose(boxes[0, 0, :5, :2], jnp.array([[0.125, 0.125], [0.375, 0.125], [0.625, 0.125],
                                                         [0.875, 0.125], [0.125, 0.375]]), atol=1e-5)
    with pytest.raises(ConfigError, match="query_level"):
        _tiny_detr(box_refine=True, query_level=1, feature_levels=(0,))


def test_box_refine_starts_at_the_anchors():
    # The box head's last layer starts at zero, so every layer's first boxes are the learned anchors,
    # spread over the canvas rather than all at its centre.
    model = _tiny_detr(box_refine=True)
    _, boxes = model(jnp.ones((1, 16, 16, 3)))
    anchors = jax.nn.sigmoid(model.anchors[...])
    assert jnp.allclose(boxes, jnp.broadcast_to(anchors, boxes.shape), atol=1e-5)
    assert float(anchors[:, :2].std()) > 0.1


def test_the_demo_state_starts_strongly_typed_so_step_two_does_not_compile_again(tmp_path):
    """A weakly typed leaf (a parameter made from a Python float, as DETR's anchor_size was) differs
    from the step's strongly typed output, and jit traces and compiles the whole step again."""
    from jaxrat.trainer.state import make_state_spec

    config = load_config("configs/coco.py:demo")
    mesh = make_mesh(config.mesh.axes, devices=jax.devices()[:1])
    task = load_task(config)
    task.prepare_data(str(tmp_path))  # the synthetic data's class count sizes the classifier
    spec = make_state_spec(config, mesh, task)
    shapes = jax.eval_shape(spec.init_state, jax.random.key_data(jax.random.key(0)))
    weak = [name for name, leaf in named_leaves(shapes).items() if leaf.weak_type]
    assert not weak, weak


@pytest.mark.parametrize("focal", [False, True])
def test_loss_and_gradients_finite_without_targets(task, focal):
    task.t.focal = focal
    try:
        model = _tiny_detr(focal=focal)
        b, t = 2, task.config.task.max_boxes
        batch = {"image": jnp.ones((b, 16, 16, 3)), "pad_mask": jnp.zeros((b, 16, 16)),
                 "boxes": jnp.zeros((b, t, 4)), "labels": jnp.zeros((b, t), jnp.int32), "box_valid": jnp.zeros((b, t))}

        def f(m):
            return task.loss(m, batch, jax.random.key(0))

        # Jitted: one compile of the loss and its gradients instead of one per eager op (86 s -> seconds).
        (loss, parts), grads = nnx.jit(nnx.value_and_grad(f, has_aux=True))(model)
        assert bool(jnp.isfinite(loss)) and all(bool(jnp.isfinite(v)) for v in parts.values())
        assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))
        assert float(parts["loss_bbox"]) == 0.0 and float(parts["loss_giou"]) == 0.0
    finally:
        task.t.focal = False


# The detection smoke run end to end (2 devices) is test_predict_tasks.py's, whose predict and evaluate read it.
