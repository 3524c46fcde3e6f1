"""The jitted train step in-process on 8 simulated devices."""

import jax
import numpy as np

from jaxrat import train
from jaxrat.parallel.mesh import make_mesh


def _setup():
    import importlib.util

    spec = importlib.util.spec_from_file_location("isic_cfg", "configs/isic.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    config = mod.get_config("smoke")
    mesh = make_mesh(config.mesh.axes)
    s = train.Setup(config, mesh)
    state = jax.jit(s.init_state, out_shardings=s.state_shardings)(jax.random.key_data(jax.random.key(0)))
    return config, s, state


def test_state_is_born_sharded_and_nonfinite_step_changes_nothing():
    config, s, state = _setup()
    assert jax.device_count() == 8
    size = config.data.image_size
    batch = {
        "image": np.full((8, size, size, 3), np.nan, np.float32),
        "mask": np.zeros((8, size, size, 1), np.float32),
    }
    before = jax.device_get(state["params"])
    step = train.make_train_step(s)
    new_state, metrics = step(state, train.to_global(batch, s.batch_sharding))
    assert float(metrics["train/nonfinite"]) == 1.0
    assert int(new_state["step"]) == 1
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(new_state["params"]))):
        np.testing.assert_array_equal(a, b)


def test_batch_size_errors_name_the_fix():
    import pytest
    from jaxrat.errors import ConfigError

    config, _, _ = _setup()
    with config.unlocked():
        config.data.batch_size = 12
    with pytest.raises(ConfigError, match="multiple of 8"):
        train.check_batch_sizes(config, 8, 1)
    with config.unlocked():
        config.data.batch_size = 16
        config.optimizer.grad_accum_steps = 3
    with pytest.raises(ConfigError, match="grad_accum_steps=3"):
        train.check_batch_sizes(config, 8, 1)


def test_bfloat16_compute_keeps_float32_params():
    import importlib.util

    spec = importlib.util.spec_from_file_location("isic_cfg", "configs/isic.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    config = mod.get_config("smoke")
    config.train.compute_dtype = "bfloat16"
    s = train.Setup(config, make_mesh(config.mesh.axes))
    state = jax.jit(s.init_state, out_shardings=s.state_shardings)(jax.random.key_data(jax.random.key(0)))
    size = config.data.image_size
    rng = np.random.default_rng(0)
    batch = {"image": rng.normal(size=(8, size, size, 3)).astype(np.float32),
             "mask": (rng.random((8, size, size, 1)) < 0.3).astype(np.float32)}
    new_state, metrics = train.make_train_step(s)(state, train.to_global(batch, s.batch_sharding))
    assert np.isfinite(float(metrics["train/loss"])) and float(metrics["train/nonfinite"]) == 0.0
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(new_state["params"]))


def test_unet_variant_builds_the_baseline_on_the_isic_settings():
    import importlib.util

    from flax import nnx

    from jaxrat.models import build_model

    spec = importlib.util.spec_from_file_location("isic_cfg", "configs/isic.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rat, unet = mod.get_config(None), mod.get_config("unet")
    assert unet.model.name == "unet" and rat.model.name == "rat"
    assert (unet.data.to_dict(), unet.num_train_steps) == (rat.data.to_dict(), rat.num_train_steps)
    model = build_model(unet.model, rngs=nnx.Rngs(0))
    out = model(np.zeros((1, 32, 32, 3), np.float32))
    assert out.shape == (1, 32, 32, 1)
