"""Every model family converts to ONNX: built tiny with random weights and the portable kernels (what
``jaxrat export --format onnx`` traces), onnxruntime gives the JAX function's outputs at two batch sizes.

In-process, but each test compiles a whole model for the reference (seconds of XLA), hence this tier. Here
the RAT and DETR on a RAT (mask dilation, top-k, take_along_axis); tests/extended/test_onnx_model_families.py
converts the others, outside CI's time (the U-Net, binary and multi-class, and the CNN classifier also go
through ``jaxrat export --format onnx`` in test_predict.py, test_segmentation_folder.py and
test_predict_tasks.py)."""

import jax
import jax.numpy as jnp
import ml_collections as mlc
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("onnxruntime")

from jaxrat import ops  # noqa: E402
from jaxrat.inference.onnx_convert import to_onnx  # noqa: E402
from jaxrat.models import build_model  # noqa: E402
from model_configs import TINY_RAT, rat_model  # noqa: E402

TINY_VIT = dict(img_size=16, patch_size=4, embed_dim=16, depth=1, num_heads=2)
MODELS = {
    "unet": dict(name="unet", features=(4, 8), num_classes=1),
    "rat": rat_model(num_classes=3, **TINY_RAT),
    "transunet": dict(name="transunet", backbone="vit_tiny_patch16_224", backbone_fields=TINY_VIT,
                      skip_features=(4,), decoder_features=(8, 8), num_classes=1),
    "swin_unet": dict(name="swin_unet", backbone="swin_tiny_patch4_window7_224", num_classes=2,
                      backbone_fields=dict(img_size=16, embed_dim=8, depths=(1, 1), num_heads=(1, 2), window_size=2)),
    "cnn_classifier": dict(name="cnn_classifier", num_classes=(3, 2), features=(4, 8)),
    "rat_classifier": dict(name="rat_classifier", num_classes=(3, 2), pool="mean",
                           rat=dict(feature_dims=8, num_blocks=2, num_heads=2, iters=1, mlp_dropout=0.0)),
    "backbone_classifier": dict(name="backbone_classifier", backbone="beit_base_patch16_224", num_classes=(3,),
                                backbone_fields=TINY_VIT),
}
DETR = dict(name="detr", cnn_widths=(8, 16), hidden_dim=16, num_queries=6, decoder_layers=2, decoder_heads=2,
            ffn_dim=32, num_classes=4, rat=dict(feature_dims=16, num_blocks=2, num_heads=2, iters=1,
                                                sga_kernel_size=3, proj_kernel_size=3))


# Converted here; the rest of MODELS and DETR_VARIANTS in tests/extended.
HERE = ("rat",)
DETR_VARIANTS = [("rat", False), ("cnn", True)]


def agrees(fn, inputs):
    """onnxruntime runs the conversion of ``fn`` (inputs: (name, per-image shape, dtype)) within 1e-4 of
    JAX, at batch 3 and 1 (normal pixels for ``x``, a random 0/1 mask for the others)."""
    import onnxruntime

    n_out = len(jax.tree.leaves(jax.eval_shape(fn, *[jax.ShapeDtypeStruct((1, *s), jnp.float32)
                                                     for _, s, _ in inputs])))
    model = to_onnx(fn, inputs, [f"y{i}" for i in range(n_out)])
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = {name: (rng.normal(size=(3, *shape)) if name == "x" else rng.uniform(size=(3, *shape)) > 0.7
                    ).astype(np.float32) for name, shape, _ in inputs}
    want = [np.asarray(a) for a in jax.tree.leaves(jax.jit(fn)(*feeds.values()))]  # one compile: batch 3
    for n in (3, 1):  # the free batch dimension
        got = session.run(None, {k: v[:n] for k, v in feeds.items()})
        for a, b in zip(want, got):
            assert b.shape == a[:n].shape
            np.testing.assert_allclose(b, a[:n], atol=1e-4, rtol=0)


def model_converts(name):
    model = build_model(mlc.ConfigDict(MODELS[name]), rngs=nnx.Rngs(0), kernels=ops.PORTABLE)
    model.eval()
    agrees(lambda x: model(x), [("x", (16, 16, 3), np.float32)])


def detr_converts(backbone, focal):
    from jaxrat.tasks.detection.task import postprocess

    model = build_model(mlc.ConfigDict(dict(DETR, backbone=backbone, focal=focal)), rngs=nnx.Rngs(0),
                        kernels=ops.PORTABLE)
    model.eval()

    def detect(x, pad_mask):
        logits, boxes = model(x, pad_mask)
        return postprocess(logits[-1], boxes[-1], focal=focal, num_detections=5)

    agrees(detect, [("x", (16, 16, 3), np.float32), ("pad_mask", (16, 16), np.float32)])


@pytest.mark.parametrize("name", HERE)
def test_model_converts(name):
    model_converts(name)


def test_detr_on_a_rat_converts_with_its_postprocessing():
    detr_converts(*DETR_VARIANTS[0])
