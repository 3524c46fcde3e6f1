"""jaxrat's jaxpr-to-ONNX converter, rule by rule: each function below, converted and run by onnxruntime
at two batch sizes, gives JAX's numbers; what it cannot convert it names; the standalone loader keeps
exported.py's image code."""

import inspect
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("onnxruntime")

from jaxrat.inference.onnx_convert import Unsupported, to_onnx  # noqa: E402

RNG = np.random.default_rng(0)
W33 = RNG.normal(size=(3, 3, 4, 6)).astype(np.float32)  # HWIO
W_DW = RNG.normal(size=(3, 3, 1, 4)).astype(np.float32)
DENSE = RNG.normal(size=(4, 5)).astype(np.float32)


def _conv(x, w, **kw):
    return jax.lax.conv_general_dilated(x, w, dimension_numbers=("NHWC", "HWIO", "NHWC"), **kw)


def _transposed(x):  # flax's ConvTranspose: a convolution of the dilated input
    return jax.lax.conv_transpose(x, W33[:2, :2], (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _attention(x):
    # Scaled as a model's activations are: products of raw 0..255 pixels make logits of ~6e4, where
    # float32 rounds a sum differently for each dot kernel's order (onnxruntime's, XLA's on AVX-512), and a
    # near tie in the softmax then moved an output by 8e-4 relative on a Zen 5 CPU.
    q = (x / 64.0).reshape(x.shape[0], 16, 16, 4).transpose(0, 2, 1, 3)  # (B, heads, tokens, dim)
    s = jnp.einsum("bhqd,bhkd->bhqk", q, q) / 2.0
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, -1), q)


def _scan(x):
    def step(c, row):  # row: (B, W, C), one row of every image
        c = c * 0.5 + row.sum((1, 2))
        return c, row * c[:, None, None]
    return jax.lax.scan(step, jnp.zeros(x.shape[:1]), jnp.swapaxes(x, 0, 1))[1].swapaxes(0, 1)


def _take_along(x):
    scores = x.reshape(x.shape[0], -1, 4)[..., 0]
    top, idx = jax.lax.top_k(scores, 5)
    boxes = jnp.take_along_axis(x.reshape(x.shape[0], -1, 4), idx[..., None], 1)
    return top, idx, boxes, jnp.argmax(scores, -1)


def _dilate(x):  # the RAT's mask dilation: an overlapping, padded max pool
    m = x[..., 0]
    return jax.lax.reduce_window(m, -jnp.inf, jax.lax.max, (1, 3, 3), (1, 1, 1), [(0, 0), (1, 1), (1, 1)])


def _logic(x):
    big = x > 100
    y = jnp.where(big & ~(x > 200), x, -x)
    y = jnp.where(jnp.isfinite(y), y, 0.0)
    return y, jnp.sign(x - 128), jax.lax.rem(x, 7.0), (x.astype(jnp.int32) % 5).astype(jnp.float32)


def _shapes(x):
    a, b = jnp.split(x, [2], axis=-1)
    stacked = jnp.stack([a.sum(-1), b.sum(-1)], -1)
    parts = jnp.unstack(stacked, axis=-1)
    padded = jax.lax.pad(x, 0.5, [(0, 0, 0), (2, -1, 0), (-2, 3, 0), (0, 0, 0)])
    return (jnp.tile(a, (1, 1, 2, 1)), jnp.concatenate([a, b[..., ::-1]], -1), padded, *parts,
            x[:, 1:7:2, ::3].reshape(x.shape[0], -1), jnp.cumsum(x, 1), x.max((1, 2)), x.min(1), x.mean(-1))


def _math(x):
    y = x / 255.0
    return (jnp.exp(y), jnp.log(y + 1), jnp.tanh(y), jax.nn.sigmoid(y),
            jax.lax.rsqrt(y + 1), y ** 3, 1.0 / (y + 1) ** 2, jax.lax.erfc(y - 0.5),
            jax.nn.gelu(y, approximate=False), jnp.sin(y) * jnp.cos(y), jnp.clip(y, 0.2, 0.8), jnp.sqrt(y),
            jnp.power(y + 1, y))


CASES = {
    "conv": lambda x: _conv(x, W33, window_strides=(1, 1), padding="SAME"),
    "conv_strided_dilated": lambda x: _conv(x, W33, window_strides=(2, 2), padding=((1, 2), (0, 1)),
                                            rhs_dilation=(2, 1)),
    "conv_negative_padding": lambda x: _conv(x, W33, window_strides=(1, 1), padding=((-1, 1), (1, -2))),
    "conv_depthwise": lambda x: _conv(x, W_DW, window_strides=(1, 1), padding="SAME", feature_group_count=4),
    "conv_transpose": _transposed,
    "max_pool": lambda x: nnx.max_pool(x, (2, 2), strides=(2, 2)),
    "avg_pool": lambda x: nnx.avg_pool(x, (2, 2), strides=(2, 2)),
    "dilate_mask": _dilate,
    "dense": lambda x: x @ DENSE[:4],
    "attention": _attention,
    "scan": _scan,
    "top_k_take_along_axis": _take_along,
    "logic": _logic,
    "shapes": _shapes,
    "math": _math,
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_onnxruntime_gives_jax_numbers(name):
    import onnxruntime

    fn = CASES[name]
    n_out = len(jax.tree.leaves(jax.eval_shape(fn, jax.ShapeDtypeStruct((1, 16, 16, 4), jnp.float32))))
    model = to_onnx(fn, [("x", (16, 16, 4), np.float32)], [f"y{i}" for i in range(n_out)])
    assert [d.dim_param for d in model.graph.input[0].type.tensor_type.shape.dim][0] == "batch"
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for n in (1, 3):
        x = RNG.uniform(0, 255, (n, 16, 16, 4)).astype(np.float32)
        want = jax.tree.leaves(jax.jit(fn)(x))
        got = session.run(None, {"x": x})
        for a, b in zip(want, got):
            assert np.asarray(a).dtype == b.dtype and np.asarray(a).shape == b.shape
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * max(1.0, float(np.max(np.abs(a)))))


def test_constants_are_folded_and_dead_code_dropped():
    table = jnp.sin(jnp.arange(64.0)).reshape(1, 8, 8, 1)  # computed from constants only: stored, not graphed

    def fn(x):
        jax.random.split(jax.random.key(0))  # unused PRNG keys (dropout streams in eval mode)
        return x * table

    model = to_onnx(fn, [("x", (8, 8, 1), np.float32)], ["y"])
    # the per-image trace's batch of one is a reshape in and a squeeze out
    assert {n.op_type for n in model.graph.node} == {"Mul", "Identity", "Reshape", "Squeeze"}


def test_what_it_cannot_convert_it_names():
    with pytest.raises(Unsupported, match="sort"):
        to_onnx(lambda x: jnp.sort(x, -1), [("x", (4,), np.float32)], ["y"])


def test_export_refuses_an_unconvertible_model_in_one_sentence():
    from jaxrat.inference.augment import TTA
    from jaxrat.inference.onnx_export import convert
    from jaxrat.runtime.errors import UserError

    fake = SimpleNamespace(tta=TTA(), image_size=8, kind="segmentation", params={}, workdir="w", step=1,
                           config=SimpleNamespace(model=SimpleNamespace(name="mymodel")),
                           _outputs=lambda params, batch: jnp.sort(batch["image"][..., 0], -1))
    with pytest.raises(UserError, match=r"^This mymodel model cannot be exported to ONNX: .*the primitive sort; "
                                        r"export it with --format jax\.$"):
        convert(fake)


def test_the_onnx_loader_keeps_exported_py_image_code():
    # onnx_loader.py is copied alone beside model.onnx (no jax to import exported.py with): its image
    # handling is a copy, kept equal here.
    from jaxrat.inference import exported, onnx_loader

    for name in ("read_upright", "_resized"):
        assert inspect.getsource(getattr(onnx_loader, name)) == inspect.getsource(getattr(exported, name)), name
    assert (inspect.getsource(onnx_loader.OnnxModel.predict_image)
            == inspect.getsource(exported.Exported.predict_image))
    assert "import jax" not in inspect.getsource(onnx_loader)


def test_without_onnxruntime_the_export_says_what_to_install(monkeypatch):
    from jaxrat.inference.onnx_export import require_onnx
    from jaxrat.runtime.errors import UserError

    monkeypatch.setitem(__import__("sys").modules, "onnxruntime", None)
    with pytest.raises(UserError, match=r"onnxruntime is missing\); install them with pip install 'jaxrat\[onnx\]'"):
        require_onnx()
