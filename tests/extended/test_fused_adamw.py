"""The gpu policy's AdamW in a few kernels (jaxrat/optim/gpu_adamw.py, jaxrat/trainer/fused_optimizer.py)
computes what the optax chain of make_optimizer computes, in the same optimizer state.

The kernels run in Pallas interpret mode here; that they compile for an H100, and in how many kernels
the trainer's step updates its parameters there, is tests/extended/test_gpu_cost.py's and
tests/extended/test_gpu_registers.py's.
"""

import jax
import jax.numpy as jnp
import ml_collections as mlc
import numpy as np
import pytest

from jaxrat import ops
from jaxrat.optim import gpu_adamw as adamw
from jaxrat.trainer import fused_optimizer
from jaxrat.trainer.optimizer import global_norm, make_optimizer

SHAPES = {"blocks": {"0": {"attn": {"kernel": (5, 7), "bias": (7,)}}},  # layer_scales reads "blocks/<i>/"
          "big": (3, 1030), "tiny": (1,), "cube": (2, 3, 4), "norm_scale": (9,)}


def _params(seed=0):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s), jnp.float32), SHAPES,
                        is_leaf=lambda x: isinstance(x, tuple))


def _config(**over):
    opt = dict(learning_rate=1e-2, warmup_steps=2, end_learning_rate_factor=0.1, clip_norm=1.0, b1=0.9, b2=0.99,
               weight_decay=0.05, weight_decay_exclude="norm_", layer_decay=0.0, grad_accum_steps=1)
    opt.update(over)
    return mlc.ConfigDict(dict(optimizer=opt, sharding=dict(zero=0, rules=()), num_train_steps=10))


def _optax_step(tx):
    """The trainer's optax path (jaxrat/trainer/step.py): update, apply, and keep the old state unless ok."""
    def step(grads, opt_state, params, ok):
        updates, new_state = tx.update(grads, opt_state, params)
        new_params = jax.tree.map(lambda p, u: p + u, params, updates)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
        return keep(new_params, params), keep(new_state, opt_state)
    return jax.jit(step)


def _run_both(config, grad_scales, nonfinite=()):
    tx, schedule = make_optimizer(config.optimizer, config.num_train_steps, concatenate_norm=True)
    params = _params()
    state = {"params": params, "opt_state": tx.init(params)}
    fused = fused_optimizer.fused_adamw(config, ops.KernelPolicy("gpu"), state, schedule, interpret=True)
    assert fused is not None
    fused_step = jax.jit(fused.update)
    rng = np.random.default_rng(1)
    a = b = (params, state["opt_state"])
    for i, scale in enumerate(grad_scales):
        grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape) * scale, jnp.float32), params)
        ok = jnp.asarray(i not in nonfinite)
        a = _optax_step(tx)(grads, a[1], a[0], ok)
        b = fused_step(grads, b[1], b[0], ok, global_norm(grads, concatenate=True))
    return a, b


def _counts(opt_state):
    """(Adam's count, the schedule's count) wherever the chain keeps them."""
    found = [x for x in jax.tree.leaves(opt_state, is_leaf=fused_optimizer._is_state) if fused_optimizer._is_state(x)]
    return tuple(int(x.count) for x in sorted(found, key=lambda x: type(x).__name__))


def _adam(opt_state):
    return next(x for x in jax.tree.leaves(opt_state, is_leaf=fused_optimizer._is_state) if hasattr(x, "mu"))


def _assert_same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)  # the checkpointed state's tree is unchanged
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("over", [{}, {"clip_norm": 0.0}, {"layer_decay": 0.5}, {"weight_decay": 0.0},
                                  {"weight_decay_exclude": ""}])
def test_the_fused_update_is_the_optax_chain_step_after_step(over):
    """Large gradients (clipped), small ones (not), warmup and decay of the schedule, a step whose loss was
    not finite (nothing moves, counts included), layer-wise decay, masked and unmasked weight decay."""
    a, b = _run_both(_config(**over), [3.0, 0.01, 2.0, 5.0, 0.02, 1.0], nonfinite=(3,))
    _assert_same(a, b)
    assert _counts(b[1]) == (5, 5)  # six steps, one skipped


def test_a_skipped_step_leaves_everything_as_it_was():
    a, b = _run_both(_config(), [1.0], nonfinite=(0,))
    _assert_same(b[0], _params())
    assert _counts(b[1]) == (0, 0)
    assert all(float(jnp.max(jnp.abs(x))) == 0.0 for x in jax.tree.leaves(_adam(b[1]).mu))


def test_the_kernel_is_the_reference_update_across_calls_blocks_and_ragged_ends(monkeypatch):
    """Leaves of 1, 1023, 1024, 1025 and 2,500 elements, three leaves a call (so four calls), each with its
    own decay and factor: every element is :func:`adamw.leaf_update` on the whole leaf (to an ulp: XLA fuses
the jitted kernel's arithmetic, not the eager reference's)."""
    monkeypatch.setattr(adamw, "LEAVES_PER_CALL", 3)
    rng = np.random.default_rng(0)
    sizes = [1, 1023, 1024, 1025, 2500, 7, 3, 2048, 5, 1]
    make = lambda: [jnp.asarray(rng.normal(size=n), jnp.float32) for n in sizes]
    p, g, mu = make(), make(), make()
    nu = [jnp.abs(x) for x in make()]
    decays = [j % 2 == 0 for j in range(len(sizes))]
    scales = [1.0 + 0.25 * j for j in range(len(sizes))]
    hyper = adamw.Hyper(0.9, 0.99, 1e-8, 0.0, 0.1, True)
    for ok, norm in ((True, 3.0), (True, 0.5), (False, 3.0)):
        s = adamw.scalars(count_inc=jnp.asarray(3), step_size=jnp.float32(-1e-2), ok=jnp.asarray(ok), hyper=hyper,
                          norm=jnp.float32(norm), max_norm=1.0)
        got = jax.jit(lambda s, p, g, mu, nu: adamw.multi_tensor_adamw(p, adamw.flatten(g), mu, nu, s, hyper, decays,
                                                                        scales, interpret=True))(s, p, g, mu, nu)
        for j in range(len(sizes)):
            want = adamw.leaf_update(p[j], g[j], mu[j], nu[j], s, hyper, decays[j], scales[j])
            for x, y in zip(want, (got[0][j], got[1][j], got[2][j])):
                np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=3e-7, atol=1e-7)  # an ulp: XLA's fusion
        if not ok:
            np.testing.assert_array_equal(np.asarray(got[0][4]), np.asarray(p[4]))


def test_on_a_mesh_of_eight_devices_every_copy_takes_the_same_step():
    """Replicated parameters under the trainer's mesh: the kernels run on each device's copy (shard_map),
    and the result is the single-device one."""
    config = _config()
    tx, schedule = make_optimizer(config.optimizer, config.num_train_steps, concatenate_norm=True)
    params = _params()
    opt_state = tx.init(params)
    fused = fused_optimizer.fused_adamw(config, ops.KernelPolicy("gpu"), {"params": params, "opt_state": opt_state},
                                        schedule, interpret=True)
    grads = jax.tree.map(lambda p: p * 0.3, params)
    args = (grads, opt_state, params, jnp.asarray(True), global_norm(grads, concatenate=True))
    one = jax.jit(fused.update)(*args)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    with jax.set_mesh(mesh):
        many = jax.jit(fused.update, out_shardings=rep)(*jax.device_put(args, rep))
    _assert_same(one, many)
    assert len(many[0]["big"].sharding.device_set) == 8


@pytest.mark.parametrize("case, reason", [
    ("portable", "the kernel policy is portable, not gpu"),
    ("zero1", "the optimizer state is sharded"),
    ("bf16", "float32 parameters and moments, not bfloat16"),
])
def test_where_it_does_not_apply_the_step_keeps_optax(case, reason):
    config = _config()
    tx, schedule = make_optimizer(config.optimizer, config.num_train_steps, concatenate_norm=True)
    params = _params()
    kernels = ops.KernelPolicy("portable" if case == "portable" else "gpu")
    if case == "zero1":
        config.sharding.zero = 1
    if case == "bf16":
        params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    state = {"params": params, "opt_state": tx.init(params)}
    assert reason in fused_optimizer.why_not(config, kernels, state)
    assert fused_optimizer.fused_adamw(config, kernels, state, schedule) is None


def test_more_than_two_to_the_31_parameters_stay_with_optax():
    """The kernels index the gradient vector in int32: a model of 2^31 parameters or more is refused
    (abstract shapes: nothing is allocated)."""
    big = [jax.ShapeDtypeStruct((2**30,), jnp.float32)] * 2
    assert "2^31" in adamw.supports(big, big)
    assert adamw.supports(big[:1], big) is None
