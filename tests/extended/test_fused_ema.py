"""The gpu policy's moving average of the parameters in a few kernels (jaxrat/optim/gpu_ema.py,
FusedAdamW.ema) computes what the step's leaf-by-leaf update_ema and finite guard compute.

The kernel runs in Pallas interpret mode here; the trainer's step compiled for an H100 is lowered
below for CUDA to count its calls.
"""

import jax
import jax.numpy as jnp
import ml_collections as mlc
import numpy as np
import pytest

from jaxrat import ops
from jaxrat.optim import gpu_ema as ema
from jaxrat.trainer import fused_optimizer
from jaxrat.trainer.optimizer import ema_schedule, make_optimizer, update_ema

# ragged ends, a leaf of several blocks, and more leaves than one call takes
SHAPES = [(3, 1030), (1,), (2, 3, 4), (5, 7), (9,)] + [(4, 3)] * (ema.LEAVES_PER_CALL + 2)


def _leaves(seed):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.normal(size=s), jnp.float32) for s in SHAPES]


def _reference(averages, params, decay, ok):
    new = update_ema(averages, params, decay)
    return [jnp.where(ok, n, o) for n, o in zip(new, averages)]


@pytest.mark.parametrize("ok", [True, False])
@pytest.mark.parametrize("decay", [0.999, 0.5])
def test_the_kernel_is_update_ema_with_the_finite_guard_to_an_ulp(ok, decay):
    """To one unit in the last place: XLA may contract decay * e + (1 - decay) * p into a fused
    multiply-add in one program and not the other; a skipped step leaves every average's bits."""
    averages, params = _leaves(0), _leaves(1)
    decay, ok = jnp.float32(decay), jnp.asarray(ok)
    got = jax.jit(lambda a, p, d, k: ema.multi_tensor_ema(a, p, d, k, interpret=True))(averages, params, decay, ok)
    want = jax.jit(_reference)(averages, params, decay, ok)
    assert len(got) == len(SHAPES)
    for g, w, a in zip(got, want, averages):
        assert g.shape == a.shape and g.dtype == jnp.float32
        np.testing.assert_array_max_ulp(np.asarray(g), np.asarray(w), maxulp=1)
        if not ok:
            np.testing.assert_array_equal(np.asarray(g), np.asarray(a))


def test_the_leaves_go_in_as_few_calls_as_the_kernel_takes():
    averages, params = _leaves(0), _leaves(1)
    text = str(jax.make_jaxpr(lambda a, p: ema.multi_tensor_ema(a, p, 0.9, True, interpret=True))(averages, params))
    assert text.count("pallas_call") == -(-len(SHAPES) // ema.LEAVES_PER_CALL) == 2


@pytest.mark.parametrize("averages, params, why", [
    ([jnp.zeros((3,), jnp.bfloat16)], [jnp.zeros((3,), jnp.float32)], "float32"),
    ([jnp.zeros((3,))], [jnp.zeros((4,))], "do not mirror"),
    ([jnp.zeros((3,))], [], "do not mirror"),
])
def test_what_it_does_not_take_is_refused(averages, params, why):
    assert why in ema.supports(averages, params)
    with pytest.raises(ValueError, match=why):
        ema.multi_tensor_ema(averages, params, 0.9, True, interpret=True)


def _fused(**optimizer):
    config = mlc.ConfigDict(dict(optimizer=dict(learning_rate=1e-2, warmup_steps=2, end_learning_rate_factor=0.1,
                                                clip_norm=1.0, b1=0.9, b2=0.99, weight_decay=0.05,
                                                weight_decay_exclude="", layer_decay=0.0, ema_decay=0.99,
                                                ema_warmup=True, **optimizer),
                                 sharding=dict(zero=0, rules=()), num_train_steps=10))
    params = {"w": jnp.ones((3, 5)), "b": jnp.zeros((5,)), "deep": {"k": jnp.full((2, 2, 2), 0.5)}}
    tx, schedule = make_optimizer(config.optimizer, config.num_train_steps, concatenate_norm=True)
    state = {"params": params, "opt_state": tx.init(params)}
    return config, params, fused_optimizer.fused_adamw(config, ops.KernelPolicy("gpu"), state, schedule,
                                                       interpret=True)


def test_the_fused_optimizer_averages_a_tree_as_the_step_did():
    config, params, fused = _fused()
    averages = jax.tree.map(lambda p: p * 0.0 + 0.25, params)
    new_params = jax.tree.map(lambda p: p + 1.0, params)
    for step, ok in ((0, True), (3, False), (7, True)):
        decay = ema_schedule(config.optimizer)(jnp.asarray(step))
        got = fused.ema(averages, new_params, decay, jnp.asarray(ok))
        want = jax.tree.map(lambda n, o: jnp.where(ok, n, o), update_ema(averages, new_params, decay), averages)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_max_ulp(np.asarray(g), np.asarray(w), maxulp=1)


def test_averages_the_kernel_does_not_take_go_back_to_the_leaf_by_leaf_update():
    _, params, fused = _fused()
    assert fused.ema(jax.tree.map(lambda p: p.astype(jnp.bfloat16), params), params, 0.9, True) is None
    assert fused.ema({"w": params["w"]}, params, 0.9, True) is None


def test_the_trainer_s_gpu_step_averages_in_one_kernel(monkeypatch):
    """The ISIC step (tiny RAT) on the gpu policy with ``optimizer.ema_decay``, lowered for CUDA: one
    multi-tensor average call for every parameter (the RAT's were a kernel each)."""
    from jaxrat.trainer.step import make_train_step
    from test_param_cast import _tiny_gpu_isic

    spec, batch = _tiny_gpu_isic(monkeypatch, "bfloat16", ema_decay=0.999)
    assert spec.ema
    text = make_train_step(spec).trace(spec.abstract_with_shardings(), batch).lower(
        lowering_platforms=("cuda",)).as_text()
    leaves = len(jax.tree.leaves(spec.abstract_state["params"]))
    assert text.count('name = "multi_tensor_ema"') == -(-leaves // ema.LEAVES_PER_CALL)

