"""The async save's snapshot: the loop may change (donate) the state right after ``save`` returns and
the checkpoint still holds the state of the save; the host digests equal the devices'."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrat.checkpointing import Checkpointer, Policy, digest


def _mesh(n=8):
    return jax.sharding.Mesh(np.array(jax.devices()[:n]), ("data",))


def _arrays():
    rng = np.random.default_rng(0)
    return {
        "f32": jnp.asarray(rng.normal(size=(37, 5)).astype(np.float32)),
        "bf16": jnp.asarray(rng.normal(size=(3, 7, 2))).astype(jnp.bfloat16),
        "i8": jnp.asarray(rng.integers(-100, 100, size=(300,)), dtype=jnp.int8),
        "bool": jnp.asarray(rng.integers(0, 2, size=(9, 3)).astype(bool)),
        "scalar": jnp.asarray(7, jnp.int32),
        "big": jnp.asarray(rng.integers(0, 2**32, size=(1 << 21) + 3, dtype=np.uint32)),  # several host chunks
        "sharded": jax.device_put(jnp.asarray(rng.normal(size=(16, 9)).astype(np.float32)),
                                  NamedSharding(_mesh(), P("data"))),
        "key": jax.random.key(3),
    }


def test_host_digest_equals_the_device_digest_for_every_dtype():
    arrays = _arrays()
    assert {n: digest.host_digest(x) for n, x in arrays.items()} == digest.digest(arrays)


def test_host_digest_of_8_byte_words_equals_the_device_digest():
    with jax.enable_x64(True):
        arrays = {"f64": jnp.asarray(np.random.default_rng(1).normal(size=(5, 3))),
                  "i64": jnp.arange(-5, 20, dtype=jnp.int64)}
        assert {n: digest.host_digest(x) for n, x in arrays.items()} == digest.digest(arrays)


@pytest.mark.parametrize("async_save", [True, False])
def test_the_checkpoint_holds_the_state_of_the_save_even_if_the_loop_donates_it(tmp_path, async_save):
    sharding = NamedSharding(_mesh(), P("data"))
    state = {"step": jnp.int32(1), "params": {"w": jax.device_put(jnp.arange(64.0 * 64).reshape(64, 64), sharding)}}
    want = jax.tree.map(np.asarray, state)
    step = jax.jit(lambda s: jax.tree.map(lambda x: x * 3 + 1, s), donate_argnums=0)
    ck = Checkpointer(str(tmp_path / "ck"), Policy(async_save=async_save, keep=2))
    blocked = ck.save(1, state, reason="steps")
    assert blocked is not None and blocked >= 0
    for _ in range(5):  # the next steps overwrite the donated buffers while the save may be writing
        state = step(state)
    ck.close()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    ck = Checkpointer(str(tmp_path / "ck"), Policy(async_save=async_save, keep=2))
    step_no, restored, _ = ck.restore_latest(abstract)  # digests checked on the way in
    ck.close()
    assert step_no == 1
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, restored), want)
