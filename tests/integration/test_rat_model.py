"""The registered RAT segmenter and backbone options (tiny dims, CPU-cheap)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrat import ops
from jaxrat.models import available_models, build_model
from jaxrat.models.rat import RATConfig, ResolutionAwareTransformer
from jaxrat.runtime.errors import ConfigError
from model_configs import rat_model

TINY = dict(feature_dims=16, num_blocks=2, num_heads=2, iters=1, decoder_dim=8)


def build(**fields):
    return build_model(rat_model(num_classes=2, **(TINY | fields)), rngs=nnx.Rngs(0), kernels=ops.resolve("auto"))


_forward = nnx.jit(lambda m, x: m(x))


def forward(model, x):
    return _forward(model, x)


def test_rat_is_registered():
    assert "rat" in available_models()


@pytest.mark.parametrize(
    "fields",
    [
        {},
        dict(head="reference"),
        dict(scales=(24, 12, 6)),
        dict(attention="sparse", positional_encoding="rope"),
        dict(attention="mixed", positional_encoding="absolute"),
        dict(attention="standard", positional_encoding="none"),
    ],
    ids=["default", "reference-head", "pyramid", "sparse-rope", "mixed-absolute", "standard-none"],
)
def test_segmenter_contract(fields):
    model = build(**fields)
    model.eval()
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 24, 20, 3))
    y = forward(model, x)
    assert y.shape == (2, 24, 20, 2) and y.dtype == jnp.float32
    assert np.isfinite(np.asarray(y)).all()


def test_dropout_follows_train_and_eval():
    model = build(mlp_dropout=0.5)
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 18, 18, 3))
    model.eval()
    np.testing.assert_array_equal(forward(model, x), forward(model, x))
    model.train()
    assert not np.allclose(forward(model, x), forward(model, x))


def test_bfloat16_compute_keeps_float32_params():
    cfg = rat_model(num_classes=1, **TINY)
    model = build_model(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), kernels=ops.resolve("auto"))
    assert {p.dtype for p in jax.tree.leaves(nnx.state(model, nnx.Param))} == {jnp.dtype("float32")}
    model.eval()
    y = forward(model, jnp.ones((1, 18, 18, 3)))
    assert y.shape == (1, 18, 18, 1) and np.isfinite(np.asarray(y, np.float32)).all()


def test_gradients_reach_every_parameter():
    model = build(scales=(12, 6), num_blocks=1)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 12, 12, 3))

    @nnx.jit
    def grads(model, x):
        return nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)

    g = grads(model, x)
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(g))[0]
    # Expected zeros: the mask embedding (no mask given) and the RoSE exponent b, whose gradient
    # a * s**b * log(s) vanishes while the "log" init has a = 0 (as in the reference).
    unused = ("mask_embedding", "scale_b")
    dead = [jax.tree_util.keystr(p) for p, v in flat
            if not np.any(np.asarray(v)) and not any(u in jax.tree_util.keystr(p) for u in unused)]
    assert not dead, dead


def test_pyramid_levels_and_spacing():
    model = build(scales=(256, 128, 64))
    levels, spacings = model.backbone.pyramid(jnp.ones((1, 32, 48, 3)))
    assert [lv.shape[1:3] for lv in levels] == [(32, 48), (16, 24), (8, 12)]
    assert spacings == [(1.0, 1.0), (2.0, 2.0), (4.0, 4.0)]
    unit = build(scales=(256, 128), pyramid_spacing="unit")
    assert unit.backbone.pyramid(jnp.ones((1, 32, 32, 3)))[1] == [(1.0, 1.0), (1.0, 1.0)]


def test_bad_config_is_a_config_error():
    with pytest.raises(ConfigError):
        build(positional_encoding="sinusoidal")
    with pytest.raises(ConfigError):
        build(attention="flash")
    with pytest.raises(ConfigError):
        build(bogus_field=1)
    with pytest.raises(ConfigError):
        build(mr_atention="windowed")  # not a RAT option: a model field the RAT segmenter does not take
    cfg = rat_model(num_classes=1, **TINY)
    cfg.rat.mr_atention = "windowed"
    with pytest.raises(ConfigError, match="did you mean mr_attention"):
        build_model(cfg, rngs=nnx.Rngs(0), kernels=ops.resolve("auto"))


def test_mixed_attention_layout():
    blocks = lambda attention, n: RATConfig(attention=attention, num_blocks=n).block_attention()
    assert blocks("mixed", 4) == ("sparse", "sparse", "dense", "dense")
    assert blocks("mixed", 3) == ("sparse", "sparse", "dense")
    assert blocks(["dense", "standard"], 2) == ("dense", "standard")


def test_backbone_outputs_per_scale_with_maps_and_leading_tokens():
    model = ResolutionAwareTransformer(input_features=1, feature_dims=16, num_blocks=2, num_heads=2, iters=1,
                                       leading_tokens=3, rngs=nnx.Rngs(0), kernels=ops.resolve("auto"))
    xs = [jnp.ones((2, 20, 20, 1)), jnp.ones((2, 10, 10, 1))]
    run = nnx.jit(lambda m, xs, mask: m(xs, input_spacing=[(1.0, 1.0), (2.0, 2.0)], mask=[mask, None],
                                          return_maps=True, return_features=True))
    out = run(model, xs, jnp.zeros((2, 20, 20)))
    assert [o.grid_shape for o in out] == [(3, 3), (2, 2)]
    assert [o.spacing for o in out] == [(9.0, 9.0), (18.0, 18.0)]
    assert out[0].attn_q.shape == (2, 2, 9, 400) and out[1].attn_k.shape == (2, 2, 4, 100)
    # chained A_q columns sum to (almost) 1: a soft partition of the input pixels over the groups
    np.testing.assert_allclose(out[0].attn_q.sum(2), 1.0, atol=1e-3)
    np.testing.assert_allclose(out[0].attn_k.sum(-1), 1.0, rtol=1e-5)
    assert out[0].leading.shape == (2, 3, 16)
    assert [f.shape[1] for f in out[0].features] == [400, 49, 9]
    assert out[0].feature_grids == ((20, 20), (7, 7), (3, 3))


def test_masked_pixels_are_replaced():
    model = ResolutionAwareTransformer(input_features=1, feature_dims=16, num_blocks=1, num_heads=2, iters=1,
                                       rngs=nnx.Rngs(0), kernels=ops.resolve("auto"))
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 12, 12, 1))
    mask = jnp.zeros((1, 12, 12)).at[0, 0, 0].set(1.0)
    run = nnx.jit(lambda m, x, mask: m(x, mask=mask)[0].tokens)
    a = run(model, x, jnp.zeros_like(mask))
    b = run(model, x, mask)
    assert not np.allclose(a, b)
    dilated = model.dilate_mask(mask)
    assert int(dilated.sum()) == 16  # the 7x7 projection window around a corner pixel: 4x4 in-image


@pytest.mark.parametrize("path", ["configs/isic.py", "configs/isic_multiscale.py"])
def test_isic_configs_build_rat(path):
    import importlib.util
    import os

    spec = importlib.util.spec_from_file_location("cfg", os.path.join(os.path.dirname(__file__), "..", "..", path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    variants = (None, "demo", "smoke") if path.endswith("multiscale.py") else (None, "demo")  # isic smoke = U-Net
    for variant in variants:
        cfg = mod.get_config(variant)
        assert cfg.model.name == "rat"
        model = nnx.eval_shape(lambda: build_model(cfg.model, rngs=nnx.Rngs(0), kernels=ops.resolve("auto")))
        assert model.backbone.num_blocks == cfg.model.rat.num_blocks
        if path.endswith("multiscale.py"):
            levels, spacings = model.backbone.pyramid(jnp.zeros((1, 256, 256, 3)))
            assert [lv.shape[1] for lv in levels] == [256, 128, 64] and spacings[2] == (4.0, 4.0)
