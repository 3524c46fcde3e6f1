"""Memory-efficient attention kernels: grouping attention (SGA) and plain softmax attention.

Both never hold the whole (batch, heads, queries, keys) tensor. The (batch x head) slices are
processed one ``slice_batch`` at a time (``lax.map``), and inside a slice the keys are processed
in chunks when ``queries x keys`` exceeds ``max_block_elements``. A ``jax.custom_vjp`` recomputes
the probabilities in the backward pass from small saved statistics, so the backward is as lean as
the forward. Plain XLA operations only: this is the portable form, and with the CPU's block and
unbatched large slices (:mod:`jaxrat.ops.cpu.cache`) the CPU form.

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
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

# Queries x keys values of one attention block on every policy but the CPU's cache-sized one: 512 Ki
# float32 (2 MB), which bounds the kernels' memory at any resolution.
DEFAULT_BLOCK_ELEMENTS = 1 << 19

Array = jax.Array

# float32 machine epsilon: the reference adds finfo(float32).eps to the column sums.
EPS = float(np.finfo(np.float32).eps)


class _Chunking(NamedTuple):
    num_chunks: int  # full chunks, streamed by a scan
    chunk: int
    tail: int  # keys left over after the full chunks, handled once after the scan (0: none)


def _chunking(num_queries: int, num_keys: int, max_block_elements: int) -> _Chunking:
    target = max(64, max_block_elements // max(num_queries, 1))
    if target >= num_keys:
        return _Chunking(1, num_keys, 0)
    # A chunk that divides the keys needs no tail step. Otherwise balanced chunks leave a tail of
    # nearly a chunk, so the one extra step is not a sliver that costs its overhead for nothing.
    for chunk in range(target, (target + 1) // 2 - 1, -1):
        if num_keys % chunk == 0:
            return _Chunking(num_keys // chunk, chunk, 0)
    chunk = math.ceil(num_keys / math.ceil(num_keys / target))
    return _Chunking(num_keys // chunk, chunk, num_keys % chunk)


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
# The keys are never padded to a whole number of chunks: padded keys would need a mask on every
# (queries x chunk) block, and on CPU each mask was one more pass over the block in memory (a
# quarter of the forward's time at the RAT's dense shapes). A shorter last chunk runs once after
# the scan instead.


def _split(x, ch: _Chunking):
    """(keys, ...) -> full chunks (num_chunks, chunk, ...) and the tail (tail, ...) or None."""
    n = ch.num_chunks * ch.chunk
    full = x[:n].reshape(ch.num_chunks, ch.chunk, *x.shape[1:])
    return full, (x[n:] if ch.tail else None)


def _scan_chunks(step, init, chunks, tails):
    """``lax.scan`` of ``step`` over the full chunks, then ``step`` once on the tail.

    Per-chunk outputs carry the keys on their last axis; they come back joined, (..., keys).
    """
    carry, ys = jax.lax.scan(step, init, chunks)
    ys = jax.tree.map(lambda y: jnp.moveaxis(y, 0, -2).reshape(*y.shape[1:-1], -1), ys)
    if tails[0] is None:
        return carry, ys
    carry, y_tail = step(carry, tails)
    return carry, jax.tree.map(lambda a, b: jnp.concatenate([a, b], -1), ys, y_tail)


def _probs(q, kk, r):
    return jnp.exp(_logits(q, kk) - r[:, None])


def _row_lse(q, k, ch):
    def step(carry, xs):
        (kk,), (m, s) = xs, carry
        logits = _logits(q, kk)
        m_new = jnp.maximum(m, logits.max(1))
        s = s * jnp.exp(m - m_new) + jnp.exp(logits - m_new[:, None]).sum(1)
        return (m_new, s), None

    init = (jnp.full((q.shape[0],), -jnp.inf, jnp.float32), jnp.zeros((q.shape[0],), jnp.float32))
    full, tail = _split(k, ch)
    (m, s), _ = _scan_chunks(step, init, (full,), (tail,))
    return m + jnp.log(s)


def _chunked_fwd(q, k, v, normalise_columns, ch):
    r = _row_lse(q, k, ch)

    def step(u, xs):
        kk, vv = xs
        p = _probs(q, kk, r)
        if normalise_columns:
            c = p.sum(0)
            return u + p @ (vv / (c + EPS)[:, None]), c
        return u + p @ vv, jnp.zeros((kk.shape[0],), jnp.float32)

    (kc, kt), (vc, vt) = _split(k, ch), _split(v, ch)
    u, c = _scan_chunks(step, jnp.zeros((q.shape[0], v.shape[1]), jnp.float32), (kc, vc), (kt, vt))
    return u, r, c


def _chunked_bwd(q, k, v, r, c, u, du, normalise_columns, ch):
    (kc, kt), (vc, vt), (cc, ct) = _split(k, ch), _split(v, ch), _split(c, ch)
    delta = jnp.sum(du * u, axis=1)
    if normalise_columns:
        # Pass 1: dV, dc per chunk, and the P @ dc part of delta, which needs every chunk.
        def pass1(acc, xs):
            kk, vv, c_ = xs
            p = _probs(q, kk, r)
            inv = 1.0 / (c_ + EPS)
            dwt = _t_matmul(p, du)  # (dh, chunk)
            dc = -jnp.sum(dwt * vv.T, axis=0) * inv * inv
            return acc + p @ dc, (dwt * inv[None, :], dc)

        pdc, (dvt, dc) = _scan_chunks(pass1, jnp.zeros_like(delta), (kc, vc, cc), (kt, vt, ct))
        delta = delta + pdc
        w = v / (c + EPS)[:, None]
    else:
        w, dc, dvt = v, jnp.zeros_like(c), None
    (wc, wt), (dcc, dct) = _split(w, ch), _split(dc, ch)

    def pass2(dq, xs):
        kk, ww, dc_ = xs
        p = _probs(q, kk, r)
        dl = p * (du @ ww.T + dc_[None, :] - delta[:, None])
        out = (_t_matmul(dl, q),) if normalise_columns else (_t_matmul(dl, q), _t_matmul(p, du))
        return dq + dl @ kk, out

    dq, outs = _scan_chunks(pass2, jnp.zeros_like(q), (kc, wc, dcc), (kt, wt, dct))
    dvt = outs[1] if not normalise_columns else dvt
    return dq, outs[0].T, dvt.T


# --------------------------------------------------------------------------- all slices


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _attention(q, k, v, normalise_columns, max_block_elements, slice_batch, unbatched_from):
    return _attention_fwd(q, k, v, normalise_columns, max_block_elements, slice_batch, unbatched_from)[0]


def _slice_fwd(q, k, v, normalise_columns, max_block_elements):
    ch = _chunking(q.shape[0], k.shape[0], max_block_elements)
    if ch.num_chunks == 1 and not ch.tail:
        return _block_fwd(q, k, v, normalise_columns)
    return _chunked_fwd(q, k, v, normalise_columns, ch)


def _slice_bwd(q, k, v, r, c, u, du, normalise_columns, max_block_elements):
    ch = _chunking(q.shape[0], k.shape[0], max_block_elements)
    if ch.num_chunks == 1 and not ch.tail:
        return _block_bwd(q, k, v, r, c, u, du, normalise_columns)
    return _chunked_bwd(q, k, v, r, c, u, du, normalise_columns, ch)


def _map_slices(f, args, num_slices, slices_per_step):
    """Apply ``f`` slice-wise: all at once (vmap) when they fit one step, else ``lax.map``."""
    if slices_per_step >= num_slices:
        return jax.vmap(f)(*args)
    if slices_per_step == 1:  # no vmap over a batch of one: its unit axis made XLA:CPU copy blocks
        return jax.lax.map(lambda a: f(*a), args)
    return jax.lax.map(lambda a: f(*a), args, batch_size=slices_per_step)


def _slices_per_step(q, k, max_block_elements, slice_batch, unbatched_from=None):
    per_slice = q.shape[1] * k.shape[1]
    if unbatched_from is not None and per_slice >= unbatched_from:
        return slice_batch
    if per_slice <= max_block_elements:  # small slices: batch several into one block
        return max(slice_batch, max_block_elements // per_slice)
    return slice_batch


def _attention_fwd(q, k, v, normalise_columns, max_block_elements, slice_batch, unbatched_from):
    dtype = q.dtype
    f = functools.partial(_slice_fwd, normalise_columns=normalise_columns, max_block_elements=max_block_elements)
    q32, k32, v32 = (a.astype(jnp.float32) for a in (q, k, v))
    step = _slices_per_step(q, k, max_block_elements, slice_batch, unbatched_from)
    u, r, c = _map_slices(f, (q32, k32, v32), q.shape[0], step)
    return u.astype(dtype), (q, k, v, r, c, u)


def _attention_bwd(normalise_columns, max_block_elements, slice_batch, unbatched_from, res, du):
    q, k, v, r, c, u = res
    f = functools.partial(_slice_bwd, normalise_columns=normalise_columns, max_block_elements=max_block_elements)
    args = tuple(a.astype(jnp.float32) for a in (q, k, v)) + (r, c, u, du.astype(jnp.float32))
    step = _slices_per_step(q, k, max_block_elements, slice_batch, unbatched_from)
    dq, dk, dv = _map_slices(f, args, q.shape[0], step)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_attention.defvjp(_attention_fwd, _attention_bwd)


def _run(q, k, v, normalise_columns, max_block_elements, slice_batch, unbatched_from):
    *lead, nq, d = q.shape
    nk = k.shape[-2]
    s = int(np.prod(lead)) if lead else 1
    out = _attention(
        q.reshape(s, nq, d), k.reshape(s, nk, d), v.reshape(s, nk, v.shape[-1]),
        normalise_columns, int(max_block_elements), int(max(1, min(slice_batch, s))), unbatched_from,
    )
    return out.reshape(*lead, nq, v.shape[-1])


def grouping_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    max_block_elements: int = DEFAULT_BLOCK_ELEMENTS,
    slice_batch: int = 1,
    unbatched_from: Optional[int] = None,
) -> Array:
    """Dense SGA update ``A_q @ V`` without materialising all (…, groups, pixels) at once.

    Args:
      q: (..., N_out, dh) group queries; logits are ``q @ k^T`` with no further scaling.
      k: (..., N_in, dh) keys.
      v: (..., N_in, dv) values.
      max_block_elements: largest groups x key-chunk block held per slice.
      slice_batch: number of (leading-axes) slices processed together at least.
      unbatched_from: slices of at least this many queries x keys run one per step instead of
        batched up to a block (the CPU form); None: small slices always batch.

    Returns:
      (..., N_out, dv): ``(P / (colsum(P) + eps)) @ v`` with ``P = softmax(q k^T, axis=-1)``.
    """
    return _run(q, k, v, True, max_block_elements, slice_batch, unbatched_from)


def softmax_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    max_block_elements: int = DEFAULT_BLOCK_ELEMENTS,
    slice_batch: int = 1,
    unbatched_from: Optional[int] = None,
) -> Array:
    """Plain softmax attention ``softmax(q k^T) v`` (scale q beforehand), memory-efficient."""
    return _run(q, k, v, False, max_block_elements, slice_batch, unbatched_from)
