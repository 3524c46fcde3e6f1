"""The RAT variants of the detection and classification demos (issue 30): they build, take a training
step that changes the parameters, and keep the RAT's full-resolution first grid off the quadratic paths."""

import jax
import numpy as np
import pytest

from jaxrat.config_schema import load_config
from jaxrat.models.rat import RATConfig
from jaxrat.parallel.mesh import make_mesh
from jaxrat.tasks.base import load_task
from jaxrat.trainer.loop import _first_batch, to_global
from jaxrat.trainer.state import make_state_spec
from jaxrat.trainer.step import make_train_step

DEMOS = ["configs/coco.py:rat_demo", "configs/classification.py:rat_demo"]


def _tiny(path):
    """The demo's model and task at a test's size: fewer images, a smaller batch and canvas."""
    config = load_config(path)
    config.data.synthetic_train, config.data.synthetic_val = 16, 8
    config.data.batch_size = 8
    config.data.num_workers, config.data.num_threads = 0, 1
    if "coco" in path:  # the 8x8 query stage needs the demo's 64 px canvas; fewer boxes keep it small
        config.task.max_boxes = 4
    return config


@pytest.mark.parametrize("path", DEMOS)
def test_rat_demo_builds_a_rat_and_trains(path, tmp_path):
    config = _tiny(path)
    task = load_task(config)
    task.prepare_data(str(tmp_path))
    spec = make_state_spec(config, make_mesh(config.mesh.axes), task)
    state = jax.jit(spec.init_state, out_shardings=spec.state_shardings)(jax.random.key_data(jax.random.key(0)))
    assert any("sga_layers" in jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(state["params"]))
    batch = _first_batch(task.train_iterator(0, local_batch=config.data.batch_size, process_index=0,
                                             process_count=1, processes_on_host=1))
    before = jax.device_get(state["params"])
    step, batch = make_train_step(spec), to_global(batch, spec.batch_sharding)
    new_state, metrics = step(*step(state, batch)[:1], batch)  # two steps: the warm-up's first rate is 0
    assert np.isfinite(float(metrics["train/loss"]))
    assert float(metrics["train/nonfinite"]) == 0.0
    changed = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before),
                                                         jax.tree.leaves(jax.device_get(new_state["params"])))]
    assert sum(changed) > len(changed) // 2


@pytest.mark.parametrize("path", DEMOS)
def test_rat_demo_keeps_the_first_grid_off_the_quadratic_paths(path):
    """The quadratic forms on the full-resolution first grid (dense SGA there doubled the RAT's
    forward and backward at 64 px, docs/history/cpu.md), the 8 shard programs per step, and for DETR
    decoder memory holding the full-resolution stage stay out of the RAT demos."""
    config = load_config(path)
    rat = RATConfig.from_mapping(dict(config.model.rat))
    assert rat.block_attention()[0] == "sparse"
    assert rat.mr_attention == "windowed"
    assert not config.train.reduction_shards
    if "coco" in path:
        assert config.model.backbone == "rat" and 0 not in config.model.feature_levels
