"""The global-norm clip over one concatenated vector: optax's rule, optax's state tree."""

import jax
import ml_collections as mlc
import numpy as np
import optax
import pytest

from jaxrat.config_schema import load_config
from jaxrat.trainer.optimizer import clip_by_global_norm, decay_mask, global_norm, make_optimizer, make_schedule
from jaxrat.trainer.state import concatenates_norm


def _grads():
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    return {"conv": {"kernel": jax.random.normal(ks[0], (3, 3, 4, 8)), "bias": jax.random.normal(ks[1], (8,))},
            "head": [100.0 * jax.random.normal(ks[2], (33, 7))]}


@pytest.mark.parametrize("concatenate", [True, False])
def test_the_norm_is_optax_s(concatenate):
    grads = _grads()
    want = float(optax.tree.norm(grads))
    assert float(global_norm(grads, concatenate=concatenate)) == pytest.approx(want, rel=1e-6)
    assert float(global_norm({}, concatenate=concatenate)) == 0.0


@pytest.mark.parametrize("max_norm", [1e-2, 1e6], ids=["clipped", "kept"])
@pytest.mark.parametrize("concatenate", [True, False])
def test_the_clip_is_optax_s(max_norm, concatenate):
    grads = _grads()
    got, state = jax.jit(clip_by_global_norm(max_norm, concatenate=concatenate).update)(grads, optax.EmptyState())
    want, _ = optax.clip_by_global_norm(max_norm).update(grads, optax.EmptyState())
    assert jax.tree.structure(got) == jax.tree.structure(want) and state == optax.EmptyState()
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=1e-9)
    if max_norm < 1:
        assert float(optax.tree.norm(got)) == pytest.approx(max_norm, rel=1e-5)


def test_the_optimizer_state_tree_is_the_one_checkpoints_hold():
    """Checkpoints written with optax.clip_by_global_norm in the chain restore into either form."""
    cfg = mlc.ConfigDict(dict(learning_rate=1e-2, warmup_steps=10, end_learning_rate_factor=0.01, clip_norm=1.0,
                              b1=0.9, b2=0.999, weight_decay=0.05))
    params = _grads()
    # make_optimizer's chain before its own clip: optax's, the same AdamW
    old = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(make_schedule(cfg, 100), b1=0.9, b2=0.999,
                      weight_decay=0.05, mask=lambda p: decay_mask(p, "")))
    for concatenate in (True, False):
        tx, _ = make_optimizer(cfg, 100, concatenate_norm=concatenate)
        assert jax.tree.structure(tx.init(params)) == jax.tree.structure(old.init(params))


def test_the_norm_is_concatenated_only_where_gradients_are_never_sharded():
    config = load_config("configs/isic.py:smoke")
    assert concatenates_norm(config)
    config.sharding.zero = 1
    assert concatenates_norm(config)
    config.sharding.zero = 2
    assert not concatenates_norm(config)
    config.sharding.zero = 0
    config.sharding.rules = ((".*kernel$", "fsdp"),)
    assert not concatenates_norm(config)
