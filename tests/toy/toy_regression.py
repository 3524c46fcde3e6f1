"""A task of a few lines, as a user would write one: linear regression on random data.

It is not a built-in: ``config.task.name = "toy_regression:RegressionTask"`` finds it on PYTHONPATH.
"""

import json

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrat.tasks.base import EvalAccumulator, Task

DIM = 4
TRUE_W = np.arange(1, DIM + 1, dtype=np.float32) / DIM


def _examples(start, n, seed):
    rng = np.random.default_rng([seed, start])
    x = rng.normal(size=(n, DIM)).astype(np.float32)
    return {"x": x, "y": (x @ TRUE_W)[:, None].astype(np.float32)}


class _Stream:
    """Global batch ``s`` is examples ``[s*B, (s+1)*B)``; this process reads its rows of it."""

    def __init__(self, start, local_batch, process_index, process_count, seed):
        self.next, self.lb, self.p, self.pc, self.seed = start, local_batch, process_index, process_count, seed

    def __iter__(self):
        return self

    def __next__(self):
        gb = self.lb * self.pc
        batch = _examples(self.next, gb, self.seed)
        self.next += gb
        return {k: v[self.p * self.lb:(self.p + 1) * self.lb] for k, v in batch.items()}

    def get_state(self):
        return json.dumps({"next": self.next}).encode()

    def set_state(self, state):
        self.next = json.loads(state)["next"]


class _Eval(EvalAccumulator):
    def finalize(self):
        t = self.fetched_totals()
        return {"mse": t["se"] / t["n"]}


class RegressionTask(Task):
    def prepare_data(self, workdir):
        return "random regression data"

    def train_iterator(self, start_example, *, local_batch, process_index, process_count, processes_on_host):
        return _Stream(start_example, local_batch, process_index, process_count, self.config.seed)

    def eval_batches(self, *, global_batch, process_index, process_count):
        lb = global_batch // process_count
        for i in range(2):
            b = _examples(10**6 + i * global_batch, global_batch, 123)
            yield {k: v[process_index * lb:(process_index + 1) * lb] for k, v in b.items()}

    def build_model(self, *, dtype, rngs, kernels):
        return nnx.Linear(DIM, 1, rngs=rngs, dtype=dtype)

    def loss(self, model, batch, rng):
        err = model(batch["x"]) - batch["y"]
        return jnp.mean(err**2), {"abs_err": jnp.mean(jnp.abs(err))}

    def eval_step(self, model, batch):
        pred = model(batch["x"])
        return {"se": jnp.sum((pred - batch["y"]) ** 2), "n": jnp.float32(batch["x"].shape[0])}, pred

    def new_eval(self):
        return _Eval()

    @property
    def metric_names(self):
        return ("mse",)
