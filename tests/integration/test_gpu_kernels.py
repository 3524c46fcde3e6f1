"""The GPU kernels' numerics on CPU: fused attention, the flash decomposition of dense SGA, and
windowed multi-resolution attention, against the dense formulas and the CPU forms (float32,
implementation="xla"; bfloat16 looser; the Pallas kernel in interpret mode)."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrat.ops.attention import grouping_attention_reference
from jaxrat.ops.gpu import (
    choose_implementation,
    dense_sga,
    fused,
    fused_attention,
    masked_attention,
    multires_attention,
    why_not,
)
from jaxrat.ops.portable.chunked_attention import softmax_attention
from jaxrat.ops.portable.windowed_attention import multires_attention as cpu_multires

pytestmark = pytest.mark.usefixtures("highest_precision")


@pytest.fixture
def highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


def _normal(key, *shapes, dtype=jnp.float32):
    keys = jax.random.split(jax.random.PRNGKey(key), len(shapes))
    return [jax.random.normal(k, s, jnp.float32).astype(dtype) for k, s in zip(keys, shapes)]


def _dense_attention(q, k, v, lengths=None):
    logits = jnp.einsum("...qd,...kd->...qk", q, k)
    if lengths is not None:
        logits = jnp.where(jnp.arange(k.shape[-2]) < lengths[..., None, None], logits, -jnp.inf)
    return jax.nn.softmax(logits, -1) @ v, jax.nn.logsumexp(logits, -1)


def test_choose_implementation_takes_cudnn_then_pallas_then_xla(caplog):
    assert choose_implementation(64, 1024, 64, 64, jnp.bfloat16) == "cudnn"
    assert choose_implementation(7, 1023, 34, 3, jnp.float16, has_lengths=True) == "cudnn"  # padded to 40
    with caplog.at_level(logging.WARNING, logger=fused.__name__):
        fused._logged.clear()
        assert choose_implementation(1024, 1024, 64, 64, jnp.float32) == "pallas"
        assert choose_implementation(1024, 1024, 64, 64, jnp.float32) == "pallas"
        assert choose_implementation(256, 1024, 64, 64, jnp.float32) == "xla"
        assert choose_implementation(1000, 1000, 64, 64, jnp.float32) == "xla"
        assert choose_implementation(64, 128, 64, 64, jnp.float32, has_lengths=True) == "xla"
        assert choose_implementation(128, 128, 136, 64, jnp.bfloat16) == "pallas"
    messages = [r.getMessage() for r in caplog.records]
    assert sum("falls back to pallas: cuDNN fused attention takes bfloat16/float16" in m for m in messages) == 1
    assert any("falls back to xla" in m and "128-blocks, not 1000" in m for m in messages)
    assert any("as many query as key blocks, not 256 vs 1024" in m for m in messages)
    assert any("head dims <= 128, not 136" in m for m in messages)
    with pytest.raises(ValueError, match="implementation='cudnn' cannot run this attention: .*float32"):
        choose_implementation(64, 64, 64, 64, jnp.float32, requested="cudnn")
    assert why_not("cudnn", 64, 64, 64, 64, jnp.bfloat16) is None
    assert "bfloat16/float16" in why_not("cudnn", 64, 64, 64, 64, jnp.float32)
    assert "padded keys" in why_not("pallas", 128, 128, 64, 64, jnp.float32, has_lengths=True)
    with pytest.raises(ValueError, match="use one of"):
        choose_implementation(64, 64, 64, 64, jnp.float32, requested="flash")


def test_fused_xla_matches_dense_with_padded_keys():
    q, k, v = _normal(0, (2, 3, 5, 8), (2, 3, 11, 8), (2, 3, 11, 6))
    lengths = jnp.array([[11, 4, 1], [7, 11, 2]])
    out, lse = jax.jit(lambda *a: fused_attention(*a, kv_lengths=lengths, implementation="xla",
                                                  return_lse=True))(q, k, v)
    want, want_lse = _dense_attention(q, k, v, lengths)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6, atol=1e-6)
    assert lse.dtype == jnp.float32
    # scale multiplies the logits
    np.testing.assert_allclose(fused_attention(q, k, v, scale=0.5, implementation="xla"),
                               _dense_attention(q * 0.5, k, v)[0], rtol=1e-6, atol=1e-6)


def test_cudnn_wrapper_pads_rows_and_head_dims_exactly(monkeypatch):
    """The padding around the cuDNN call (odd lengths, head dims to multiples of 8, values to the
    query dim) with the kernel itself replaced by the XLA form, which has the same contract."""
    seen = []

    def fake_cudnn(q, k, v, scale, lengths, return_lse):
        seen.append((q.shape, k.shape, v.shape, None if lengths is None else np.asarray(lengths)))
        out, lse = fused._xla(q, k, v, scale, lengths)
        return out, (lse if return_lse else None)

    monkeypatch.setattr(fused, "_cudnn", fake_cudnn)
    q, k, v = _normal(1, (2, 7, 12), (2, 9, 12), (2, 9, 5), dtype=jnp.bfloat16)
    out, lse = fused_attention(q, k, v, return_lse=True)
    assert seen[-1][:3] == ((2, 8, 16), (2, 10, 16), (2, 10, 16))
    np.testing.assert_array_equal(seen[-1][3], [9, 9])
    want, want_lse = fused_attention(q, k, v, implementation="xla", return_lse=True)
    assert out.shape == (2, 7, 5) and lse.shape == (2, 7)
    np.testing.assert_allclose(np.float32(out), np.float32(want), atol=1e-2)
    np.testing.assert_allclose(lse, want_lse, atol=1e-3)
    lengths = jnp.array([3, 9])
    out = fused_attention(q, k, v, kv_lengths=lengths)
    np.testing.assert_array_equal(seen[-1][3], [3, 9])
    monkeypatch.setattr(fused, "CUDNN_MAX_BATCH", 1)  # one call per slice, joined
    del seen[:]
    np.testing.assert_array_equal(np.float32(fused_attention(q, k, v, kv_lengths=lengths)), np.float32(out))
    assert [s[0][0] for s in seen] == [1, 1] and [int(s[3][0]) for s in seen] == [3, 9]
    np.testing.assert_allclose(np.float32(out), np.float32(fused_attention(q, k, v, kv_lengths=lengths,
                                                                          implementation="xla")), atol=1e-2)


def test_pallas_interpret_matches_dense():
    q, k, v = _normal(2, (1, 128, 16), (1, 128, 16), (1, 128, 16))
    out, lse = fused_attention(q, k, v, implementation="pallas", return_lse=True, interpret=True)
    want, want_lse = _dense_attention(q, k, v)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-4, atol=1e-4)


def _sga_grads(f, q, k, v, g):
    return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) * g), argnums=(0, 1, 2)))(q, k, v)


@pytest.mark.parametrize("shapes", [((6, 8), (50, 8), (50, 8)), ((2, 3, 9, 16), (2, 3, 70, 16), (2, 3, 70, 5))])
def test_dense_sga_decomposition_matches_the_dense_formula(shapes):
    q, k, v = _normal(3, *shapes)
    q = q * 2.0  # peaked softmaxes: column sums far from uniform
    out = jax.jit(lambda *a: dense_sga(*a, implementation="xla"))(q, k, v)
    want = grouping_attention_reference(q, k, v)
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
    (g,) = _normal(4, want.shape)
    (_, grads) = _sga_grads(lambda *a: dense_sga(*a, implementation="xla"), q, k, v, g)
    (_, want_grads) = _sga_grads(grouping_attention_reference, q, k, v, g)
    for name, got, ref in zip("qkv", grads, want_grads):
        scale = float(jnp.max(jnp.abs(ref)))
        np.testing.assert_allclose(got / scale, ref / scale, atol=2e-5, err_msg=f"d{name}")


def test_dense_sga_in_bfloat16_keeps_close_to_float32():
    q, k, v = _normal(5, (2, 16, 32), (2, 300, 32), (2, 300, 32))
    q = q * 0.5
    want = grouping_attention_reference(q, k, v)
    out = dense_sga(*(a.astype(jnp.bfloat16) for a in (q, k, v)), implementation="xla")
    assert out.dtype == jnp.bfloat16
    rel = float(jnp.linalg.norm(out.astype(jnp.float32) - want) / jnp.linalg.norm(want))
    assert rel < 2e-2, rel
    (g,) = _normal(6, want.shape)
    _, grads = _sga_grads(lambda *a: dense_sga(*a, implementation="xla"),
                          *(a.astype(jnp.bfloat16) for a in (q, k, v)), g)
    _, want_grads = _sga_grads(grouping_attention_reference, q, k, v, g)
    for name, got, ref in zip("qkv", grads, want_grads):
        rel = float(jnp.linalg.norm(got.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
        assert rel < 5e-2, (name, rel)


def test_the_split_log_sum_exp_survives_bfloat16():
    from jaxrat.ops.gpu.dense_sga import _split

    r = jnp.array([37.123456, -5.4321, 0.001], jnp.float32)
    hi, lo = _split(r, jnp.bfloat16)
    assert hi.dtype == lo.dtype == jnp.bfloat16
    np.testing.assert_allclose(hi.astype(jnp.float32) + lo.astype(jnp.float32), r, rtol=3e-5)
    assert float(jnp.max(jnp.abs(hi.astype(jnp.float32) - r))) > 1e-2  # hi alone would lose it


SEGMENT_CASES = {
    "divisible": ([(16, (4, 4)), (64, (8, 8))], 4),
    "non-divisible+leading": ([(3, None), (63, (7, 9)), (4, (2, 2))], 4),
    "3d": ([(2, None), (90, (5, 6, 3)), (8, (2, 2, 2))], 4),
    "no-global-padded": ([(35, (5, 7)), (8, (4, 2))], 3),
    "global-form": ([(2, None), (35, (5, 7))], None),
    "all-fit": ([(2, None), (35, (5, 7))], 8),
}


@pytest.mark.parametrize("case", list(SEGMENT_CASES))
def test_gpu_multires_matches_the_cpu_form(case):
    segments, window = SEGMENT_CASES[case]
    n = sum(s[0] for s in segments)
    q, k, v = _normal(7, (2, n, 3, 8), (2, n, 3, 8), (2, n, 3, 8))
    gpu = lambda *a: multires_attention(*a, segments, window, implementation="xla")
    cpu = lambda *a: cpu_multires(*a, segments, window, attend=softmax_attention)
    np.testing.assert_allclose(jax.jit(gpu)(q, k, v), jax.jit(cpu)(q, k, v), rtol=1e-5, atol=1e-5)
    (g,) = _normal(8, q.shape)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(gpu(*a) * g), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(lambda *a: jnp.sum(cpu(*a) * g), argnums=(0, 1, 2)))(q, k, v)
    for name, got, ref in zip("qkv", grads, want):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5, err_msg=f"d{name}")


def test_keys_packed_once_then_masked_by_length_match_the_masked_dense_form():
    """DETR's decoder on the gpu policy: the memory and its positions packed once (each image's kept
    tokens to the front), then several calls whose keys and values are projections of them, masked
    by length. Values and the gradients of the queries, memory, positions and weights against the
    masked dense form on the memory as it is, to 1e-5 of the largest entry (float32: only the sums'
    order differs)."""
    from jaxrat.ops.gpu.fused import fused_attention_heads
    from jaxrat.ops.gpu.masked import pack

    q, memory, pos, wk, wv, g = _normal(11, (2, 4, 5, 8), (2, 30, 32), (2, 30, 32), (32, 32), (32, 32), (2, 4, 5, 8))
    wk, wv = wk / np.sqrt(32), wv / np.sqrt(32)
    key_ok = jnp.zeros((2, 5, 6), bool).at[0, :4, :5].set(True).at[1, 1:].set(True).reshape(2, 30)
    q, g = (x.transpose(0, 2, 1, 3) for x in (q, g))  # token-major (B, N, H, d), as projections make them
    heads = lambda x: x.reshape(2, 30, 4, 8)

    def layers(q, memory, pos, wk, wv, attend):
        out = 0.0
        for i in range(2):  # two calls on the same keys' padding, as two decoder layers
            out = out + attend(q + i * out, heads((memory + pos) @ wk), heads(memory @ wv))
        return jnp.sum(out * g)

    def dense(q, memory, pos, wk, wv):
        def attend(q, k, v):
            logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.3
            weights = jax.nn.softmax(jnp.where(key_ok[:, None, None, :], logits, -1e9), -1)
            return jnp.einsum("bhqk,bkhd->bqhd", weights, v)
        return layers(q, memory, pos, wk, wv, attend)

    def packed(q, memory, pos, wk, wv):
        lengths, (memory, pos) = pack(key_ok, (memory, pos))
        attend = lambda q, k, v: fused_attention_heads(q, k, v, scale=0.3, kv_lengths=lengths, implementation="xla")
        return layers(q, memory, pos, wk, wv, attend)

    args = (q, memory, pos, wk, wv)
    got = jax.jit(jax.value_and_grad(packed, argnums=tuple(range(5))))(*args)
    want = jax.jit(jax.value_and_grad(dense, argnums=tuple(range(5))))(*args)
    for name, a, e in zip(("value", "dq", "dmemory", "dpos", "dwk", "dwv"), jax.tree.leaves(got),
                          jax.tree.leaves(want)):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(e))), err_msg=name)


def test_masked_attention_matches_the_masked_dense_form():
    """DETR's cross-attention: a letterboxed image's key mask, interleaved in row-major order."""
    q, k, v = _normal(9, (2, 4, 5, 8), (2, 4, 30, 8), (2, 4, 30, 8))
    key_ok = jnp.zeros((2, 5, 6), bool).at[0, :4, :5].set(True).at[1].set(True).reshape(2, 1, 30)

    def dense(q, k, v):
        logits = jnp.where(key_ok[..., None, :], jnp.einsum("...qd,...kd->...qk", q, k) * 0.3, -1e9)
        return jax.nn.softmax(logits, -1) @ v

    masked = lambda q, k, v: masked_attention(q, k, v, key_ok, scale=0.3, implementation="xla")
    np.testing.assert_allclose(jax.jit(masked)(q, k, v), dense(q, k, v), rtol=1e-5, atol=1e-6)
    (g,) = _normal(10, q.shape)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(masked(*a) * g), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(lambda *a: jnp.sum(dense(*a) * g), argnums=(0, 1, 2)))(q, k, v)
    for name, got, ref in zip("qkv", grads, want):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-6, err_msg=f"d{name}")
