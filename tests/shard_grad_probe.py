"""One shard's gradient from the fixed-shard step program, in a process of its own (for
``test_reduction_shards``) on the coco demo config::

    python shard_grad_probe.py 1 ONE.npz INPUTS.npz   # also writes the shard program's inputs
    python shard_grad_probe.py 8 EIGHT.npz INPUTS.npz  # reads them

The program's inputs (the initial parameters, the shard's rows and totals, its key) come from the
1-device process: what is compared is the shard program itself, and the second process skips
compiling the model's initialisation (at XLA's default flags, as long as the gradient's compile)."""

import os
import sys

devices, out, inputs = int(sys.argv[1]), sys.argv[2], sys.argv[3]
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
step = make_train_step(spec)
device = jax.devices()[-1]  # the last device: on 8 devices not the one the 1-device process uses
if not os.path.exists(inputs):
    state = jax.jit(spec.init_state, out_shardings=spec.state_shardings)(jax.random.key_data(jax.random.key(0)))
    it = task.train_iterator(0, local_batch=config.data.batch_size, process_index=0, process_count=1,
                             processes_on_host=1)
    batch = to_global(next(it), spec.batch_sharding)
    params, key_data, totals = step._prepare(state, batch)
    rows = config.data.batch_size // config.train.reduction_shards
    key = jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(key_data), 0))
    np.savez(inputs, key=np.asarray(key),
             **{f"param/{i}": np.asarray(p) for i, p in enumerate(jax.tree.leaves(params))},
             **{f"shard/{k}": np.asarray(v)[:rows] for k, v in batch.items()},
             **{f"total/{k}": np.asarray(v) for k, v in totals[0].items()})
saved = np.load(inputs)
tree = jax.tree.structure(jax.eval_shape(spec.init_state, jax.ShapeDtypeStruct((2,), np.uint32))["params"])
params = jax.tree.unflatten(tree, [saved[f"param/{i}"] for i in range(tree.num_leaves)])
shard = {k.split("/", 1)[1]: saved[k] for k in saved.files if k.startswith("shard/")}
shard[SHARD_TOTALS] = {k.split("/", 1)[1]: saved[k] for k in saved.files if k.startswith("total/")}
key = jax.random.wrap_key_data(jax.device_put(saved["key"], device))
(loss, _), grads = step._grad(jax.device_put(params, device), jax.device_put(shard, device), key)
np.savez(out, loss=np.asarray(loss), **{str(i): np.asarray(g) for i, g in enumerate(jax.tree.leaves(grads))})
