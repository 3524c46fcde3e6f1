"""The chunked MLP: same values and gradients as the plain one, less memory kept for the backward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxrat.models.layers as layers
from jaxrat import ops
from jaxrat.ops import mlp as mlp_ops
from jaxrat.ops.cpu import mlp as cpu_mlp

CPU = ops.resolve("cpu")


def _mlp(dropout: float = 0.0, kernels: ops.KernelPolicy = CPU) -> layers.Mlp:
    return layers.Mlp(8, 32, dropout=dropout, dtype=jnp.float32, rngs=nnx.Rngs(0), kernels=kernels)


def _loss(m: layers.Mlp, x: jax.Array) -> jax.Array:
    return jnp.sum(jnp.square(m(x)))


def _chunk_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mlp_ops, "CHUNK_HIDDEN_BYTES", 100)
    monkeypatch.setattr(mlp_ops, "CHUNK_TOKENS_BYTES", 1000)  # 37 tokens x 32 x 4 B -> 5 chunks, padded


def test_chunked_mlp_equals_plain_in_values_and_gradients(monkeypatch):
    m = _mlp()
    x = jax.random.normal(jax.random.key(1), (2, 37, 8))
    want, want_grad = m(x), nnx.grad(_loss)(m, x)
    _chunk_everything(monkeypatch)
    got, got_grad = nnx.jit(lambda m, x: m(x))(m, x), nnx.jit(nnx.grad(_loss))(m, x)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    for a, b in zip(jax.tree.leaves(nnx.state(want_grad)), jax.tree.leaves(nnx.state(got_grad))):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_chunked_mlp_dropout_drops_at_its_rate_and_differs_per_chunk(monkeypatch):
    _chunk_everything(monkeypatch)
    m = _mlp(dropout=0.5)
    m.train()
    x = jnp.ones((4, 37, 8))
    # fc2 mixes the hidden units, so look at the hidden layer the dropout acts on (without drop2:
    # the zeros are drop1's)
    h = mlp_ops.chunked_mlp(x, m.fc1, lambda h: h, hidden_bytes=10_000, chunks=mlp_ops.Chunks(1000, True),
                            dropout_rate=0.5, dropout_key=jax.random.key(3))
    zeros = float(jnp.mean(h == 0))
    assert 0.4 < zeros < 0.6, zeros
    # each chunk draws its own mask: the first 8 tokens' mask is not repeated in the next 8
    assert not bool(jnp.all((h[:, :8] == 0) == (h[:, 8:16] == 0)))


def test_chunked_mlp_keeps_less_for_the_backward(monkeypatch):
    m = _mlp(dropout=0.1)
    m.train()
    x = jax.ShapeDtypeStruct((2, 4096, 8), jnp.float32)

    def temp_bytes() -> int:
        graphdef, state = nnx.split(m)

        def grads(state, x):
            return nnx.grad(lambda mm: _loss(mm, x))(nnx.merge(graphdef, state))

        return jax.jit(grads).lower(state, x).compile().memory_analysis().temp_size_in_bytes

    plain = temp_bytes()
    monkeypatch.setattr(mlp_ops, "CHUNK_HIDDEN_BYTES", 2**16)
    monkeypatch.setattr(mlp_ops, "CHUNK_TOKENS_BYTES", 2**16)  # 1 MiB hidden -> 16 chunks
    chunked = temp_bytes()
    assert chunked < 0.5 * plain, (chunked, plain)


def test_cpu_runs_mid_sized_mlps_in_cache_sized_chunks_keeping_fc1(monkeypatch):
    """Between CPU_CHUNK_HIDDEN_BYTES and CHUNK_HIDDEN_BYTES: a scan of chunks keeping fc1's output."""
    m = _mlp()
    x = jax.random.normal(jax.random.key(1), (2, 37, 8))  # 9472 hidden bytes
    want, want_grad = m(x), nnx.grad(_loss)(m, x)
    plain_jaxpr = str(jax.make_jaxpr(lambda x: m(x))(x))
    assert "scan" not in plain_jaxpr  # below the threshold: one product
    monkeypatch.setattr(cpu_mlp, "CHUNK_HIDDEN_BYTES", 1000)
    monkeypatch.setattr(cpu_mlp, "CHUNK_BYTES", 2000)  # -> 5 chunks, padded
    assert "scan" not in str(jax.make_jaxpr(lambda x: _mlp(kernels=ops.PORTABLE)(x))(x))  # other forms: one product
    graphdef, state = nnx.split(m)
    grad_jaxpr = lambda: str(jax.make_jaxpr(lambda s, x: nnx.grad(_loss)(nnx.merge(graphdef, s), x))(state, x))
    text = grad_jaxpr()
    # only fc1's output is kept for the backward; GELU and dropout are recomputed per chunk
    assert "scan" in text and "policy=SaveOnlyTheseNames" in text and "mlp_fc1" in text
    got, got_grad = nnx.jit(lambda m, x: m(x))(m, x), nnx.jit(nnx.grad(_loss))(m, x)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    for a, b in zip(jax.tree.leaves(nnx.state(want_grad)), jax.tree.leaves(nnx.state(got_grad))):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    # Above CHUNK_HIDDEN_BYTES the memory rule wins: chunks are recomputed in the backward pass.
    monkeypatch.setattr(mlp_ops, "CHUNK_HIDDEN_BYTES", 5000)
    text = grad_jaxpr()
    assert "scan" in text and "policy=None" in text  # everything recomputed
