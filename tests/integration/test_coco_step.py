"""The real ``configs/coco.py`` train step (800 px canvas, the full model, batch 16) lowers for 8
simulated devices from shapes alone; benchmarks/coco_step.py compiles it and reports its memory."""

import re

import jax
import numpy as np
import pytest

from jaxrat.config_schema import load_config
from jaxrat.parallel.mesh import make_mesh
from jaxrat.tasks.base import load_task
from jaxrat.tasks.detection.data import example_batch
from jaxrat.trainer.autotune import train_step_lowering


def test_example_batch_has_the_fields_of_a_real_train_batch(tmp_path):
    config = load_config("configs/coco.py:smoke")
    task = load_task(config)
    task.prepare_data(str(tmp_path))
    it = task.train_iterator(0, local_batch=2, process_index=0, process_count=1, processes_on_host=1)
    real = next(iter(it))
    example = example_batch(config)
    assert sorted(real) == sorted(example)
    for k, v in real.items():
        assert (v.shape[1:], v.dtype) == (example[k].shape[1:], example[k].dtype), k


@pytest.mark.slow
def test_the_real_coco_step_lowers_for_eight_devices():
    config = load_config("configs/coco.py")
    assert (config.data.image_size, config.data.batch_size, config.model.backbone) == (800, 16, "rat")
    task = load_task(config)
    task.num_classes = 80  # COCO's; prepare_data would read it from the annotations
    mesh = make_mesh(config.mesh.axes)
    assert mesh.size == jax.device_count() == 8
    lowered = train_step_lowering(config, mesh, task)(example_batch(config), 16)
    text = lowered.as_text()
    # The batch enters split over the devices, ...
    assert re.search(r'tensor<16x800x800x3xf32> \{sdy.sharding = #sdy.sharding<@mesh, \[\{"data"', text), \
        "the image batch is not an input sharded over the data axis"
    # ... and the matching runs under shard_map on each device's own 2 images (100 queries x 100
    # target slots), not on the global batch.
    assert "sdy.manual_computation" in text and "tensor<2x100x100xf32>" in text
    params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(lowered.args_info[0][0]["params"]))
    assert 10e6 < params < 30e6, params  # the real model: 14.5M parameters when written
