"""``train.reduction_shards``: the same bits on 1 or 8 devices, and the loss it stands for.

Meshes of 1 and 8 (or 2) of the 8 simulated devices live in one process, so one batch and one initial
state go through each topology's compiled step and the results are compared bit for bit.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrat.config import load_config
from jaxrat.errors import ConfigError
from jaxrat.parallel.mesh import make_mesh
from jaxrat.tasks.base import load_task
from jaxrat.trainer.loop import check_batch_sizes, to_global
from jaxrat.trainer.state import make_state_spec
from jaxrat.trainer.step import TASK_STREAM, make_train_step

SHARDS = 8


def _config(name, shards, **task):
    config = load_config(name)
    with config.unlocked():
        config.train.reduction_shards = shards
        config.data.num_workers = 0
        config.task.update(task)
    return config


def _world(config, devices, workdir):
    task = load_task(config)
    task.prepare_data(str(workdir))
    mesh = make_mesh(config.mesh.axes, devices=jax.devices()[:devices])
    spec = make_state_spec(config, mesh, task)
    state = jax.jit(spec.init_state, out_shardings=spec.state_shardings)(jax.random.key_data(jax.random.key(0)))
    return task, spec, state


def _batches(task, config, count):
    it = task.train_iterator(0, local_batch=config.data.batch_size, process_index=0, process_count=1,
                             processes_on_host=1)
    out = [next(it) for _ in range(count)]
    if hasattr(it, "close"):
        it.close()
    return out


def _train(spec, state, batches):
    step = make_train_step(spec)
    losses = []
    for b in batches:
        state, metrics = step(state, to_global(b, spec.batch_sharding))
        losses.append(np.asarray(metrics["train/loss"]))
    return jax.device_get(state["params"]), losses


def test_classification_steps_are_bit_identical_on_1_and_8_devices(tmp_path):
    config = _config("configs/classification.py:smoke", SHARDS, mixup_alpha=0.2)
    runs = {}
    for devices in (1, 8):
        task, spec, state = _world(config, devices, tmp_path)
        runs[devices] = _train(spec, state, _batches(task, config, 3))
    (params1, losses1), (params8, losses8) = runs[1], runs[8]
    np.testing.assert_array_equal(losses8, losses1)
    for a, b in zip(jax.tree.leaves(params1), jax.tree.leaves(params8)):
        np.testing.assert_array_equal(a, b)


def test_the_loss_is_the_mean_of_the_shards_losses(tmp_path):
    """Shard ``j`` is rows ``j*b:(j+1)*b`` with key ``fold_in(step key, j)``: recompute it by hand."""
    config = _config("configs/classification.py:smoke", 4)
    task, spec, state = _world(config, 2, tmp_path)
    batch = _batches(task, config, 1)[0]
    params, rng = jax.device_get(state["params"]), jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), 0)
    _, metrics = make_train_step(spec)(state, to_global(batch, spec.batch_sharding))  # donates state
    b = config.data.batch_size // 4
    by_hand = []
    for j in range(4):
        key = jax.random.fold_in(rng, j)
        shard = {k: jnp.asarray(v[j * b:(j + 1) * b]) for k, v in batch.items()}
        loss, _ = task.loss(spec.model(params, key, train=True), shard, jax.random.fold_in(key, TASK_STREAM))
        by_hand.append(float(loss))
    np.testing.assert_allclose(float(metrics["train/loss"]), np.mean(by_hand), rtol=1e-6)


def test_detection_boxes_stay_normalised_by_the_whole_batch(tmp_path):
    """With the focal loss every term divides by the batch's box count: sharding must not change it."""
    losses = {}
    for shards in (0, SHARDS):
        config = _config("configs/coco.py:smoke", shards, focal=True)
        task, spec, state = _world(config, 2, tmp_path / str(shards))
        batch = _batches(task, config, 1)[0]
        assert (batch["box_valid"] > 0).sum(1).min() != (batch["box_valid"] > 0).sum(1).max()  # uneven shards
        _, metrics = make_train_step(spec)(state, to_global(batch, spec.batch_sharding))
        losses[shards] = {k: float(v) for k, v in metrics.items() if k.startswith("train/loss")}
    assert set(losses[0]) == set(losses[SHARDS]) and len(losses[0]) >= 4
    for k in losses[0]:
        np.testing.assert_allclose(losses[SHARDS][k], losses[0][k], rtol=2e-5, err_msg=k)


@pytest.mark.parametrize("shards,devices,batch,match", [
    (4, 8, 16, "multiple of the 8 devices"),
    (16, 8, 8, "divides the micro-batch of 8"),
    (-1, 1, 8, "must be 0"),
])
def test_shard_counts_that_cannot_work_name_the_fix(shards, devices, batch, match):
    config = _config("configs/classification.py:smoke", shards)
    with config.unlocked():
        config.data.batch_size = batch
    with pytest.raises(ConfigError, match=match):
        check_batch_sizes(config, devices, 1)
