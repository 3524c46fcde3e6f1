"""The steps' XLA options: LLVM level 1 on CPU (a faster compile of the same program), the user's
XLA_FLAGS winning, nothing asked of other platforms."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxrat.config_schema import load_config
from jaxrat.parallel.mesh import make_mesh
from jaxrat.runtime.compile_options import CPU_OPTIMIZATION_LEVEL, step_compiler_options
from jaxrat.tasks.base import load_task
from jaxrat.trainer import step as step_module
from jaxrat.trainer.state import make_state_spec


def test_cpu_asks_for_level_1_unless_the_user_set_a_level(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert step_compiler_options("cpu") == {"xla_backend_optimization_level": CPU_OPTIMIZATION_LEVEL}
    assert step_compiler_options("gpu") == {} and step_compiler_options("tpu") == {}
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=3")
    assert step_compiler_options("cpu") == {}
    monkeypatch.delenv("XLA_FLAGS")
    assert step_compiler_options("cpu") == {"xla_backend_optimization_level": CPU_OPTIMIZATION_LEVEL}


def _options_of(lowered) -> dict:
    # JAX keeps a lowering's per-compile options as key/value pairs (a private field; a JAX upgrade
    # that renames it fails here, loudly).
    return dict(lowered._lowering._compiler_options_kvs or ())


def test_the_train_and_eval_steps_compile_with_the_platforms_options(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    config = load_config("configs/isic.py:smoke")
    spec = make_state_spec(config, make_mesh(config.mesh.axes, devices=jax.devices()[:1]), load_task(config))
    size = config.data.image_size
    batch = {"image": jax.ShapeDtypeStruct((2, size, size, 3), jnp.float32, sharding=spec.batch_sharding),
             "mask": jax.ShapeDtypeStruct((2, size, size, 1), jnp.float32, sharding=spec.batch_sharding)}
    train = step_module.make_train_step(spec).lower(spec.abstract_with_shardings(), batch)
    valid = {"valid": jax.ShapeDtypeStruct((2,), jnp.bool_, sharding=spec.batch_sharding)}
    evaluate = step_module.make_eval_step(spec).lower(spec.abstract_with_shardings()["params"], {**batch, **valid})
    want = {"xla_backend_optimization_level": np.int64(CPU_OPTIMIZATION_LEVEL)}
    assert _options_of(train) == want and _options_of(evaluate) == want


def test_level_1_draws_the_initial_parameters_level_2_draws():
    # The run compiles its initialisation at level 1 on CPU; a run started before, or with the user's
    # own level, must begin from the same weights.
    config = load_config("configs/isic.py:smoke")
    spec = make_state_spec(config, make_mesh(config.mesh.axes, devices=jax.devices()[:1]), load_task(config))
    key = jax.random.key_data(jax.random.key(0))
    lowered = jax.jit(spec.init_state).lower(key)
    states = [lowered.compile(compiler_options={"xla_backend_optimization_level": level})(key) for level in (1, 2)]
    leaves = [[np.asarray(x) for x in jax.tree.leaves(s)] for s in states]
    assert len(leaves[0]) > 10
    assert all(np.array_equal(a, b) for a, b in zip(*leaves))
