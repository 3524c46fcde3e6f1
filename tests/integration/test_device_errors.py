"""XLA's out-of-memory and fused-kernel failures end a command with one sentence naming the fix.

The out-of-memory errors here are real: XLA's CPU client refuses a 1 TiB buffer with the same
``JaxRuntimeError`` (``RESOURCE_EXHAUSTED``) a GPU raises for a step that does not fit it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from jaxrat.runtime import device_errors
from jaxrat.runtime.errors import UserError
from runner import REPO, SMOKE, env_with_devices


def _out_of_memory() -> jax.errors.JaxRuntimeError:
    try:
        jax.jit(lambda: jnp.ones((2**38,), jnp.float32))().block_until_ready()
    except jax.errors.JaxRuntimeError as e:
        return e
    raise AssertionError("a 1 TiB buffer was allocated")


def test_out_of_memory_names_the_batch_and_the_ways_to_fit():
    why = device_errors.explain(_out_of_memory(), "--config.data.batch_size (now 64)")
    assert isinstance(why, UserError)
    text = str(why)
    assert "\n" not in text and text.startswith("The devices ran out of memory (RESOURCE_EXHAUSTED")
    for fix in ("lower --config.data.batch_size (now 64)", "per_device_batch_size=auto", "sharding.zero=3"):
        assert fix in text


def test_a_fused_kernel_failure_points_to_the_portable_kernels():
    error = jax.errors.JaxRuntimeError("INTERNAL: Failed to compile Triton kernel sparse_sga_sweep\nptxas: ...")
    text = str(device_errors.explain(error, "unused"))
    assert "--config.model.kernels=portable" in text and "Failed to compile Triton kernel" in text
    assert "\n" not in text


@pytest.mark.parametrize("error", [RuntimeError("RESOURCE_EXHAUSTED: not XLA's"),
                                   jax.errors.JaxRuntimeError("INVALID_ARGUMENT: something else"),
                                   MemoryError("host")])
def test_other_errors_are_left_as_they_are(error):
    assert device_errors.explain(error, "unused") is None
    with pytest.raises(type(error)) as raised:
        with device_errors.in_a_sentence(lambda: "unused"):
            raise error
    assert raised.value is error


def test_in_a_sentence_turns_xla_s_out_of_memory_into_the_user_error():
    with pytest.raises(UserError, match=r"lower --batch \(now 4\)"):
        with device_errors.in_a_sentence(lambda: "--batch (now 4)"):
            jax.jit(lambda: jnp.ones((2**38,), jnp.float32))().block_until_ready()


# The smoke run with a train step whose first call asks XLA for 1 TiB, as a step too large for a GPU
# fails at its first call: what jaxrat.main prints, its exit status and the run summary.
_OOM_RUN = """
import sys
import jax, jax.numpy as jnp
import jaxrat.trainer.loop as loop

made = loop.make_train_step

def too_large(spec):
    step = made(spec)
    def call(state, batch):
        jax.jit(lambda: jnp.ones((2**38,), jnp.float32))().block_until_ready()
        return step(state, batch)
    return call

loop.make_train_step = too_large
from jaxrat.main import run
sys.argv = ["jaxrat.main"] + sys.argv[1:]
run()
"""


@pytest.mark.slow
def test_a_training_step_that_does_not_fit_ends_in_one_sentence(tmp_path):
    workdir = str(tmp_path / "run")
    proc = subprocess.run([sys.executable, "-c", _OOM_RUN, f"--config={SMOKE}", f"--workdir={workdir}"],
                          env=env_with_devices(1), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("jaxrat: error: The devices ran out of memory (RESOURCE_EXHAUSTED"), last
    assert "--config.data.batch_size (now 8)" in last and "--config.data.eval_batch_size (now 8)" in last
    assert "Traceback" not in proc.stderr
    with open(os.path.join(workdir, "summary.json")) as f:
        summary = json.load(f)
    assert summary["status"] == "failed" and "RESOURCE_EXHAUSTED" in summary["error"]
