"""The jitted train step in-process on 8 simulated devices."""

import jax
import numpy as np
import pytest

from jaxrat import ops
from jaxrat.config_schema import load_config
from jaxrat.parallel.mesh import make_mesh
from jaxrat.runtime.errors import ConfigError
from jaxrat.tasks.base import load_task
from jaxrat.trainer.loop import check_batch_sizes, to_global
from jaxrat.trainer.state import make_state_spec
from jaxrat.trainer.step import make_train_step, split_microbatches


def _setup(variant="smoke", **overrides):
    config = load_config(f"configs/isic.py:{variant}")
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


def test_state_is_born_sharded_and_nonfinite_step_changes_nothing():
    config, s, state = _setup()
    assert jax.device_count() == 8
    batch = _batch(config, 8)
    batch["image"][:] = np.nan
    before = jax.device_get(state["params"])
    new_state, metrics = make_train_step(s)(state, to_global(batch, s.batch_sharding))
    assert float(metrics["train/nonfinite"]) == 1.0
    assert int(new_state["step"]) == 1
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(new_state["params"]))):
        np.testing.assert_array_equal(a, b)


def test_batch_size_errors_name_the_fix():
    config, _, _ = _setup()
    with config.unlocked():
        config.data.batch_size = 12
    with pytest.raises(ConfigError, match="multiple of 8"):
        check_batch_sizes(config, 8, 1)
    with config.unlocked():
        config.data.batch_size = 16
        config.optimizer.grad_accum_steps = 3
    with pytest.raises(ConfigError, match="grad_accum_steps=3"):
        check_batch_sizes(config, 8, 1)


def test_bfloat16_compute_keeps_float32_params():
    config, s, state = _setup(train__compute_dtype="bfloat16")
    new_state, metrics = make_train_step(s)(state, to_global(_batch(config, 8), s.batch_sharding))
    assert np.isfinite(float(metrics["train/loss"])) and float(metrics["train/nonfinite"]) == 0.0
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(new_state["params"]))


def test_microbatches_are_strided_so_no_row_leaves_its_device():
    mesh = make_mesh((("data", -1), ("fsdp", 1)))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))
    x = jax.device_put(np.arange(32, dtype=np.float32)[:, None], sharding)
    micro = jax.jit(lambda b: split_microbatches(b, 2, mesh))(x)
    np.testing.assert_array_equal(np.asarray(micro)[1, :, 0], np.arange(1, 32, 2))
    for before, after in zip(sorted(x.addressable_shards, key=lambda s: s.device.id),
                             sorted(micro.addressable_shards, key=lambda s: s.device.id)):
        # each device's micro-batch rows are rows it already held
        assert set(np.asarray(after.data).ravel()) <= set(np.asarray(before.data).ravel())
    hlo = jax.jit(lambda b: split_microbatches(b, 2, mesh)).lower(x).compile().as_text()
    assert "all-to-all" not in hlo and "all-gather" not in hlo and "collective-permute" not in hlo


@pytest.mark.parametrize("accum", [2, 4])
def test_accumulation_gives_the_unaccumulated_step(accum):
    config, s1, state1 = _setup()
    batch = _batch(config, 32, seed=3)
    _, m1 = make_train_step(s1)(state1, to_global(batch, s1.batch_sharding))
    config, s2, state2 = _setup(optimizer__grad_accum_steps=accum)
    new2, m2 = make_train_step(s2)(state2, to_global(batch, s2.batch_sharding))
    for k in ("train/loss", "train/bce", "train/dice_loss", "train/foreground_fraction", "train/grad_norm"):
        np.testing.assert_allclose(float(m2[k]), float(m1[k]), rtol=2e-6, err_msg=k)


def test_weight_decay_skips_biases_norms_positions_and_frequencies():
    from jaxrat.config_schema import base_config
    from jaxrat.trainer.optimizer import decay_mask

    rule = base_config().optimizer.weight_decay_exclude
    params = {"conv": {"kernel": np.zeros((3, 3, 4, 4)), "bias": np.zeros(4)},
              "norm": {"scale": np.zeros(4)},
              "rose": {"freqs": np.zeros((1, 8, 2))}, "abs_pos": {"table": np.zeros((4, 4, 8))},
              "query_embed": {"embedding": np.zeros((10, 8))}, "mlp": {"fc1": {"kernel": np.zeros((8, 8))}}}
    mask = decay_mask(params, rule)
    assert mask["conv"]["kernel"] and mask["mlp"]["fc1"]["kernel"]
    assert not any([mask["conv"]["bias"], mask["norm"]["scale"], mask["rose"]["freqs"], mask["abs_pos"]["table"],
                    mask["query_embed"]["embedding"]])
    assert decay_mask(params, "")["rose"]["freqs"]  # users may override the rule
    with pytest.raises(ConfigError, match="weight_decay_exclude"):
        decay_mask(params, "(")


def test_unet_variant_builds_the_baseline_on_the_isic_settings():
    from flax import nnx

    from jaxrat.models import build_model

    rat, unet = load_config("configs/isic.py"), load_config("configs/isic.py:unet")
    assert unet.model.name == "unet" and rat.model.name == "rat"
    assert (unet.data.to_dict(), unet.num_train_steps) == (rat.data.to_dict(), rat.num_train_steps)
    model = build_model(unet.model, rngs=nnx.Rngs(0), kernels=ops.resolve("auto"))
    out = model(np.zeros((1, 32, 32, 3), np.float32))
    assert out.shape == (1, 32, 32, 1)


def test_the_dropout_streams_keys_are_the_step_key_folded_with_each_leaf_s_index():
    """fresh_rest derives every stream's key in one vectorised fold_in (one kernel on a GPU, not one per
    stream): the keys are still fold_in(rng, i), so dropout draws what it drew before."""
    from jaxrat.trainer.state import _is_key, fresh_rest

    config = load_config("configs/isic.py")  # the study's RAT: MLP dropout in every SGA layer and MR block
    spec = make_state_spec(config, make_mesh(config.mesh.axes), load_task(config))
    rng = jax.random.key(7)
    leaves = jax.tree.leaves(fresh_rest(spec.abstract_rest, rng))
    keys = [(i, x) for i, x in enumerate(leaves) if _is_key(x)]
    assert len(keys) >= 8
    for i, x in keys:
        want = jax.random.key_data(jax.random.fold_in(rng, i))
        np.testing.assert_array_equal(np.asarray(jax.random.key_data(x)).reshape(-1, 2)[0], np.asarray(want))
