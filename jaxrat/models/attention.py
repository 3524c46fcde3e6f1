"""Memory-efficient attention kernels: grouping attention (SGA) and plain softmax attention.

Both never hold the whole (batch, heads, queries, keys) tensor. The (batch x head) slices are
processed one ``slice_batch`` at a time (``lax.map``), and inside a slice the keys are processed
in chunks when ``queries x keys`` exceeds ``max_block_elements``. A ``jax.custom_vjp`` recomputes
the probabilities in the backward pass from small saved statistics, so the backward is as lean as
the forward. Cache-sized key chunks (about 2 MB per block) measured fastest on CPU, ahead of
materialising each slice whole (benchmarks/rat_sga_kernels.py, docs/rat.md).

Grouping attention (``normalise_columns=True``), per slice with queries Q (groups) and keys K:

    P = softmax_keys(Q K^T)                  # A_k: each group's distribution over inputs
    c_k = sum_q P[q, k]                       # each input's total mass over groups
    U = P @ (V / (c + eps))                   # = A_q V with A_q = P / (c + eps)

computed with the streamed row log-sum-exp r (pass 1), then per key chunk P, c and the
weighted sum (pass 2). Plain attention (``normalise_columns=False``) is U = P @ V.

Gradients, with W = V / (c + eps), dW = P^T dU:
    dV = dW / (c + eps);  dc = -rowsum(dW * W) / (c + eps)
    dP = dU W^T + dc (broadcast over queries);  delta = rowsum(dU * U) + P @ dc
    dL = P * (dP - delta);  dQ = dL K;  dK = dL^T Q
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

# float32 machine epsilon: the reference adds finfo(float32).eps to the column sums.
EPS = float(np.finfo(np.float32).eps)
# Default block: 512 Ki float32 elements (2 MB, cache-sized) per (queries x key-chunk) block;
# measured fastest on CPU (docs/rat.md), and it bounds the memory at any resolution.
DEFAULT_BLOCK_ELEMENTS = 1 << 19


class _Chunking(NamedTuple):
    num_chunks: int
    chunk: int


def _chunking(num_queries: int, num_keys: int, max_block_elements: int) -> _Chunking:
    chunk = max(64, max_block_elements // max(num_queries, 1))
    if chunk >= num_keys:
        return _Chunking(1, num_keys)
    n = math.ceil(num_keys / chunk)
    return _Chunking(n, math.ceil(num_keys / n))  # balanced chunks waste the least padding


def _logits(q: Array, k: Array) -> Array:
    return jnp.einsum("qd,kd->qk", q, k, preferred_element_type=jnp.float32)


def _t_matmul(a: Array, b: Array) -> Array:
    """``(a^T @ b)^T``: (n, m) x (n, k) -> (k, m), the fast output layout on XLA:CPU."""
    return jnp.einsum("nk,nm->km", b, a)


# --------------------------------------------------------------------------- one slice, one block


def _block_fwd(q, k, v, normalise_columns):
    """Whole slice materialised: returns U, r (row lse), c (column sums)."""
    logits = _logits(q, k)
    r = jax.nn.logsumexp(logits, axis=1)
    p = jnp.exp(logits - r[:, None])
    if normalise_columns:
        c = p.sum(0)
        u = p @ (v / (c + EPS)[:, None])
    else:
        c = jnp.zeros((k.shape[0],), jnp.float32)
        u = p @ v
    return u, r, c


def _block_bwd(q, k, v, r, c, u, du, normalise_columns):
    p = jnp.exp(_logits(q, k) - r[:, None])
    if normalise_columns:
        inv = 1.0 / (c + EPS)
        w = v * inv[:, None]
        dwt = _t_matmul(p, du)
        dv = (dwt * inv[None, :]).T
        dc = -jnp.sum(dwt * w.T, axis=0) * inv
        delta = jnp.sum(du * u, axis=1) + p @ dc
        dl = p * (du @ w.T + dc[None, :] - delta[:, None])
    else:
        dv = _t_matmul(p, du).T
        delta = jnp.sum(du * u, axis=1)
        dl = p * (du @ v.T - delta[:, None])
    return dl @ k, _t_matmul(dl, q).T, dv


# --------------------------------------------------------------------------- one slice, key chunks
# Key-side results are produced transposed, (dh, chunk): XLA:CPU runs "(dh x queries) @
# (queries x chunk)" several times faster than "(chunk x queries) @ (queries x dh)".


def _chunked(k, v, ch: _Chunking):
    pad = ch.num_chunks * ch.chunk - k.shape[0]
    valid = jnp.arange(ch.num_chunks * ch.chunk) < k.shape[0]
    kc = jnp.pad(k, ((0, pad), (0, 0))).reshape(ch.num_chunks, ch.chunk, -1)
    vc = jnp.pad(v, ((0, pad), (0, 0))).reshape(ch.num_chunks, ch.chunk, -1)
    return kc, vc, valid.reshape(ch.num_chunks, ch.chunk)


def _chunk_probs(q, kc, valid, r):
    return jnp.where(valid[None, :], jnp.exp(_logits(q, kc) - r[:, None]), 0.0)


def _row_lse(q, kc, valid):
    def step(carry, xs):
        m, s = carry
        kk, vv = xs
        logits = jnp.where(vv[None, :], _logits(q, kk), -jnp.inf)
        m_new = jnp.maximum(m, logits.max(1))
        s = s * jnp.exp(m - m_new) + jnp.exp(logits - m_new[:, None]).sum(1)
        return (m_new, s), None

    init = (jnp.full((q.shape[0],), -jnp.inf, jnp.float32), jnp.zeros((q.shape[0],), jnp.float32))
    (m, s), _ = jax.lax.scan(step, init, (kc, valid))
    return m + jnp.log(s)


def _chunked_fwd(q, k, v, normalise_columns, ch):
    kc, vc, valid = _chunked(k, v, ch)
    r = _row_lse(q, kc, valid)

    def step(u, xs):
        kk, vv, ok = xs
        p = _chunk_probs(q, kk, ok, r)
        if normalise_columns:
            c = p.sum(0)
            return u + p @ (vv / (c + EPS)[:, None]), c
        return u + p @ vv, jnp.zeros((kk.shape[0],), jnp.float32)

    u, c = jax.lax.scan(step, jnp.zeros((q.shape[0], v.shape[1]), jnp.float32), (kc, vc, valid))
    return u, r, c.reshape(-1)[: k.shape[0]]


def _chunked_bwd(q, k, v, r, c, u, du, normalise_columns, ch):
    kc, vc, valid = _chunked(k, v, ch)
    cc = jnp.pad(c, (0, ch.num_chunks * ch.chunk - c.shape[0])).reshape(ch.num_chunks, ch.chunk)
    delta = jnp.sum(du * u, axis=1)
    if normalise_columns:
        # Pass 1: dV, dc per chunk, and the P @ dc part of delta, which needs every chunk.
        def pass1(acc, xs):
            kk, vv, ok, c_ = xs
            p = _chunk_probs(q, kk, ok, r)
            inv = 1.0 / (c_ + EPS)
            dwt = _t_matmul(p, du)  # (dh, chunk)
            dc = -jnp.sum(dwt * vv.T, axis=0) * inv * inv
            return acc + p @ dc, (dwt * inv[None, :], dc)

        pdc, (dvt, dcc) = jax.lax.scan(pass1, jnp.zeros_like(delta), (kc, vc, valid, cc))
        delta = delta + pdc
        wc = vc / (cc + EPS)[..., None]
    else:
        wc, dcc, dvt = vc, jnp.zeros_like(cc), None

    def pass2(dq, xs):
        kk, ww, ok, dc = xs
        p = _chunk_probs(q, kk, ok, r)
        dl = p * (du @ ww.T + dc[None, :] - delta[:, None])
        out = (_t_matmul(dl, q),) if normalise_columns else (_t_matmul(dl, q), _t_matmul(p, du))
        return dq + dl @ kk, out

    dq, outs = jax.lax.scan(pass2, jnp.zeros_like(q), (kc, wc, valid, dcc))
    dkt = outs[0]
    if not normalise_columns:
        dvt = outs[1]
    n = k.shape[0]
    # (chunks, dh, chunk) -> (keys, dh)
    dk = dkt.transpose(0, 2, 1).reshape(-1, k.shape[1])[:n]
    dv = dvt.transpose(0, 2, 1).reshape(-1, v.shape[1])[:n]
    return dq, dk, dv


# --------------------------------------------------------------------------- all slices


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _attention(q, k, v, normalise_columns, max_block_elements, slice_batch):
    return _attention_fwd(q, k, v, normalise_columns, max_block_elements, slice_batch)[0]


def _slice_fwd(q, k, v, normalise_columns, max_block_elements):
    ch = _chunking(q.shape[0], k.shape[0], max_block_elements)
    if ch.num_chunks == 1:
        return _block_fwd(q, k, v, normalise_columns)
    return _chunked_fwd(q, k, v, normalise_columns, ch)


def _slice_bwd(q, k, v, r, c, u, du, normalise_columns, max_block_elements):
    ch = _chunking(q.shape[0], k.shape[0], max_block_elements)
    if ch.num_chunks == 1:
        return _block_bwd(q, k, v, r, c, u, du, normalise_columns)
    return _chunked_bwd(q, k, v, r, c, u, du, normalise_columns, ch)


def _map_slices(f, args, num_slices, slices_per_step):
    """Apply ``f`` slice-wise: all at once (vmap) when they fit one step, else ``lax.map``."""
    if slices_per_step >= num_slices:
        return jax.vmap(f)(*args)
    return jax.lax.map(lambda a: f(*a), args, batch_size=slices_per_step)


# On CPU a slice of at least this many (queries x keys) elements runs alone in its lax.map step:
# vmapping several turns each product into a batched dot, which ran 1.4-1.6x slower than one
# slice at a time for the windowed multi-resolution tiles (256 x 256 tokens, 144 and 576 tiles),
# while slices of 16 Ki elements and below were fastest batched up to a block (4 Ki: within 15 %).
# Accelerators want wide work, so elsewhere small slices are always batched (benchmarks/
# attention_blocks.py, docs/rat.md).
CPU_UNBATCHED_SLICE_ELEMENTS = 1 << 16


def _slices_per_step(q, k, max_block_elements, slice_batch):
    per_slice = q.shape[1] * k.shape[1]
    if jax.default_backend() == "cpu" and per_slice >= CPU_UNBATCHED_SLICE_ELEMENTS:
        return slice_batch
    if per_slice <= max_block_elements:  # small slices: batch several into one block
        return max(slice_batch, max_block_elements // per_slice)
    return slice_batch


def _attention_fwd(q, k, v, normalise_columns, max_block_elements, slice_batch):
    dtype = q.dtype
    f = functools.partial(_slice_fwd, normalise_columns=normalise_columns, max_block_elements=max_block_elements)
    q32, k32, v32 = (a.astype(jnp.float32) for a in (q, k, v))
    step = _slices_per_step(q, k, max_block_elements, slice_batch)
    u, r, c = _map_slices(f, (q32, k32, v32), q.shape[0], step)
    return u.astype(dtype), (q, k, v, r, c, u)


def _attention_bwd(normalise_columns, max_block_elements, slice_batch, res, du):
    q, k, v, r, c, u = res
    f = functools.partial(_slice_bwd, normalise_columns=normalise_columns, max_block_elements=max_block_elements)
    args = tuple(a.astype(jnp.float32) for a in (q, k, v)) + (r, c, u, du.astype(jnp.float32))
    step = _slices_per_step(q, k, max_block_elements, slice_batch)
    dq, dk, dv = _map_slices(f, args, q.shape[0], step)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_attention.defvjp(_attention_fwd, _attention_bwd)


def _run(q, k, v, normalise_columns, max_block_elements, slice_batch):
    *lead, nq, d = q.shape
    nk = k.shape[-2]
    s = int(np.prod(lead)) if lead else 1
    out = _attention(
        q.reshape(s, nq, d), k.reshape(s, nk, d), v.reshape(s, nk, v.shape[-1]),
        normalise_columns, int(max_block_elements), int(max(1, min(slice_batch, s))),
    )
    return out.reshape(*lead, nq, v.shape[-1])


def grouping_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    max_block_elements: int = DEFAULT_BLOCK_ELEMENTS,
    slice_batch: int = 1,
) -> Array:
    """Dense SGA update ``A_q @ V`` without materialising all (…, groups, pixels) at once.

    Args:
      q: (..., N_out, dh) group queries; logits are ``q @ k^T`` with no further scaling.
      k: (..., N_in, dh) keys.
      v: (..., N_in, dv) values.
      max_block_elements: largest groups x key-chunk block held per slice.
      slice_batch: number of (leading-axes) slices processed together.

    Returns:
      (..., N_out, dv): ``(P / (colsum(P) + eps)) @ v`` with ``P = softmax(q k^T, axis=-1)``.
    """
    return _run(q, k, v, True, max_block_elements, slice_batch)


def softmax_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    max_block_elements: int = DEFAULT_BLOCK_ELEMENTS,
    slice_batch: int = 1,
) -> Array:
    """Plain softmax attention ``softmax(q k^T) v`` (scale q beforehand), memory-efficient."""
    return _run(q, k, v, False, max_block_elements, slice_batch)


def grouping_maps(q: Array, k: Array) -> tuple[Array, Array]:
    """Materialised (A_q, A_k) of shape (..., N_out, N_in), for returning grouping maps only."""
    a_k = jax.nn.softmax(jnp.einsum("...qd,...kd->...qk", q, k, preferred_element_type=jnp.float32), axis=-1)
    a_q = a_k / (a_k.sum(axis=-2, keepdims=True) + EPS)
    return a_q, a_k


def grouping_attention_reference(q: Array, k: Array, v: Array) -> Array:
    """Naive fully materialised SGA update, for tests and benchmarks."""
    a_q, _ = grouping_maps(q, k)
    return jnp.einsum("...qk,...kd->...qd", a_q, v.astype(jnp.float32)).astype(q.dtype)
