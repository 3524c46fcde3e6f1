"""The initialisation's XLA options: LLVM level 1 on CPU (a faster compile of a program that runs
once), the same parameters as XLA's default level, the user's XLA_FLAGS winning, nothing asked of
other platforms; the steps keep XLA's defaults."""

import jax
import numpy as np

from jaxrat.config_schema import load_config
from jaxrat.parallel.mesh import make_mesh
from jaxrat.runtime.compile_options import CPU_INIT_OPTIMIZATION_LEVEL, init_compiler_options
from jaxrat.tasks.base import load_task
from jaxrat.trainer.state import make_state_spec

LEVEL_1 = {"xla_backend_optimization_level": CPU_INIT_OPTIMIZATION_LEVEL}


def test_cpu_asks_for_level_1_unless_the_user_set_a_level(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert init_compiler_options("cpu") == LEVEL_1
    assert init_compiler_options("gpu") == {} and init_compiler_options("tpu") == {}
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=3")
    assert init_compiler_options("cpu") == {}
    monkeypatch.delenv("XLA_FLAGS")
    assert init_compiler_options("cpu") == LEVEL_1


def _spec():
    config = load_config("configs/isic.py:smoke")
    return make_state_spec(config, make_mesh(config.mesh.axes, devices=jax.devices()[:1]), load_task(config))


def test_the_run_compiles_its_initialisation_with_the_platforms_options(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    lowered = _spec().initialiser().lower(jax.random.key_data(jax.random.key(0)))
    # JAX keeps a lowering's per-compile options as key/value pairs (a private field; a JAX upgrade
    # that renames it fails here, loudly).
    assert dict(lowered._lowering._compiler_options_kvs or ()) == {
        "xla_backend_optimization_level": np.int64(CPU_INIT_OPTIMIZATION_LEVEL)}


def test_level_1_draws_the_initial_parameters_the_default_level_3_draws():
    # A run started before, or with the user's own level, must begin from the same weights.
    spec, key = _spec(), jax.random.key_data(jax.random.key(0))
    lowered = jax.jit(spec.init_state).lower(key)
    states = [lowered.compile(compiler_options={"xla_backend_optimization_level": level})(key) for level in (1, 3)]
    leaves = [[np.asarray(x) for x in jax.tree.leaves(s)] for s in states]
    assert len(leaves[0]) > 10
    assert all(np.array_equal(a, b) for a, b in zip(*leaves))
