"""The parameters' moving average (``optimizer.ema_decay``): born sharded like the parameters,
updated by every train step (plain, accumulated, fixed reduction shards), kept on a skipped step."""

import jax
import numpy as np
import pytest

from jaxrat.config_schema import load_config
from jaxrat.parallel.mesh import make_mesh
from jaxrat.runtime.errors import ConfigError
from jaxrat.tasks.base import load_task
from jaxrat.trainer.loop import to_global
from jaxrat.trainer.optimizer import ema_enabled, ema_schedule
from jaxrat.trainer.state import make_state_spec
from jaxrat.trainer.step import make_train_step


def _setup(**overrides):
    config = load_config("configs/isic.py:smoke")
    with config.unlocked():
        config.optimizer.ema_decay = 0.9
        config.mesh.axes = (("data", 2), ("fsdp", -1))
        for key, value in overrides.items():
            section, field = key.split("__")
            config[section][field] = value
    spec = make_state_spec(config, make_mesh(config.mesh.axes), load_task(config))
    state = jax.jit(spec.init_state, out_shardings=spec.state_shardings)(jax.random.key_data(jax.random.key(0)))
    return config, spec, state


def _batch(config, n, seed=0):
    size = config.data.image_size
    rng = np.random.default_rng(seed)
    return {"image": rng.normal(size=(n, size, size, 3)).astype(np.float32),
            "mask": (rng.random((n, size, size, 1)) < 0.3).astype(np.float32)}


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


@pytest.mark.parametrize("zero", [0, 3])
def test_the_average_is_born_sharded_like_the_params_and_follows_the_formula(zero):
    config, spec, state = _setup(sharding__zero=zero, sharding__min_size=1, optimizer__ema_warmup=False)
    assert spec.ema and set(state) == {"step", "params", "opt_state", "rng", "ema_params"}
    for e, p in zip(jax.tree.leaves(state["ema_params"]), jax.tree.leaves(state["params"])):
        assert e.sharding == p.sharding
    if zero == 3:
        assert any(not p.sharding.is_fully_replicated for p in jax.tree.leaves(state["ema_params"]))
    for a, b in zip(_leaves(state["ema_params"]), _leaves(state["params"])):
        np.testing.assert_array_equal(a, b)
    step = make_train_step(spec)
    ema = _leaves(state["ema_params"])
    for i in range(2):
        state, _ = step(state, to_global(_batch(config, 8, seed=i), spec.batch_sharding))
        ema = [0.9 * e + 0.1 * p for e, p in zip(ema, _leaves(state["params"]))]
        for a, b in zip(_leaves(state["ema_params"]), ema):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    for e, p in zip(jax.tree.leaves(state["ema_params"]), jax.tree.leaves(state["params"])):
        assert e.sharding == p.sharding


def test_the_average_moves_under_reduction_shards_and_stays_on_a_nonfinite_step():
    config, spec, state = _setup(train__reduction_shards=8)
    step = make_train_step(spec)
    before = _leaves(state["ema_params"])
    for i in range(2):  # the first step's learning rate is the warmup's 0
        state, _ = step(state, to_global(_batch(config, 8, seed=i), spec.batch_sharding))
    moved = _leaves(state["ema_params"])
    assert any(not np.array_equal(a, b) for a, b in zip(before, moved))
    bad = _batch(config, 8, seed=2)
    bad["image"][:] = np.nan
    state, metrics = step(state, to_global(bad, spec.batch_sharding))
    assert float(metrics["train/nonfinite"]) == 1.0
    for a, b in zip(_leaves(state["ema_params"]), moved):
        np.testing.assert_array_equal(a, b)


def test_the_warmup_decay_and_bad_decays():
    config = load_config("configs/isic.py:smoke")
    with config.unlocked():
        config.optimizer.ema_decay = 0.999
    decay_at = ema_schedule(config.optimizer)
    got = [float(decay_at(jax.numpy.asarray(t))) for t in (0, 10, 100000)]
    np.testing.assert_allclose(got, [2 / 11, 12 / 21, 0.999], rtol=1e-6)
    assert not ema_enabled(load_config("configs/isic.py:smoke").optimizer)
    with config.unlocked():
        config.optimizer.ema_decay = 1.0
    with pytest.raises(ConfigError, match="ema_decay=1.0"):
        ema_enabled(config.optimizer)
