"""One shard's gradient from the fixed-shard step program, in a process of its own (for
``test_reduction_shards``): ``python shard_grad_probe.py DEVICES OUT.npz`` on the coco demo config."""

import os
import sys

devices, out = int(sys.argv[1]), sys.argv[2]
# XLA's default flags, as users run (not tests/conftest.py's -O0): the bits across topologies are the claim.
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
os.environ["JAX_PLATFORMS"] = "cpu"

from jaxrat.parallel.cpu_client import pin_cpu_parallelism  # noqa: E402

pin_cpu_parallelism(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxrat.config_schema import load_config  # noqa: E402
from jaxrat.parallel.mesh import make_mesh  # noqa: E402
from jaxrat.tasks.base import SHARD_TOTALS, load_task  # noqa: E402
from jaxrat.trainer.loop import to_global  # noqa: E402
from jaxrat.trainer.state import make_state_spec  # noqa: E402
from jaxrat.trainer.step import make_train_step  # noqa: E402

config = load_config("configs/coco.py:demo")
config.data.num_workers = 0
task = load_task(config)
task.prepare_data(os.path.dirname(os.path.abspath(out)))
spec = make_state_spec(config, make_mesh(config.mesh.axes, devices=jax.devices()), task)
state = jax.jit(spec.init_state, out_shardings=spec.state_shardings)(jax.random.key_data(jax.random.key(0)))
it = task.train_iterator(0, local_batch=config.data.batch_size, process_index=0, process_count=1,
                         processes_on_host=1)
batch = to_global(next(it), spec.batch_sharding)
step = make_train_step(spec)
params, key_data, totals = step._prepare(state, batch)
rows = config.data.batch_size // config.train.reduction_shards
device = jax.devices()[-1]  # the last device: on 8 devices not the one the 1-device process uses
shard = {k: jax.device_put(np.asarray(v)[:rows], device) for k, v in batch.items()}
shard[SHARD_TOTALS] = jax.device_put(totals[0], device)
key = jax.device_put(jax.random.fold_in(jax.random.wrap_key_data(key_data), 0), device)
(loss, _), grads = step._grad(jax.device_put(params, device), shard, key)
np.savez(out, loss=np.asarray(loss), **{str(i): np.asarray(g) for i, g in enumerate(jax.tree.leaves(grads))})
