"""Dense spatial grouping attention as flash-attention calls, for GPUs.

Per slice, with group queries Q (G, d), pixel keys K (N, d) and values V (N, dv):

    P = softmax_pixels(Q K^T)       c_k = sum_q P[q, k]       U = P (V / (c + eps))

The CPU kernel streams this in small chunks (tens of thousands of sequential steps per iteration at
256 px, launch-bound on a GPU). Here it is three fused attention passes and no loop:

1. r = row log-sum-exp of Q K^T: one attention pass, its log-sum-exp kept (float32).
2. log c_k = logsumexp_q(k . q - r_q): the pixels attend to the groups, with -r folded into the
   logits as extra features (pixel side [k, -1, -1], group side [q, r_hi, r_lo]); r is split into a
   high and a low part in the compute dtype so bfloat16 keeps it to ~2^-16 relative.
3. U = attention(Q, K, V / (c + eps)).

The backward (custom VJP, W = V / (c + eps)) is again attention calls and elementwise terms:

* dW = P^T dU = c * attention(pixels -> groups, the logits of pass 2, values dU);
  dV = dW / (c + eps);  dc = -rowsum(dW * W) / (c + eps);
* dQ, dK are the gradient of the plain attention O = attention(Q, K, [W, dc]) for the cotangent
  [dU, 1]: its dS = P * (dU W^T + dc - rowsum(dU * U) - P dc), exactly the SGA's dL (see
  :mod:`jaxrat.ops.portable.chunked_attention`), so one fused attention backward gives both.

Log-sum-exps and column sums stay float32 whatever the compute dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrat.ops.gpu.fused import Implementation, fused_attention

Array = jax.Array
# float32 machine epsilon, as the reference adds to the column sums.
EPS = float(np.finfo(np.float32).eps)


def _split(r: Array, dtype) -> tuple[Array, Array]:
    """r = hi + lo to the compute dtype's precision squared (lo is 0 in float32)."""
    hi = r.astype(dtype)
    return hi, (r - hi.astype(jnp.float32)).astype(dtype)


def _pixels_to_groups(q: Array, k: Array, r: Array) -> tuple[Array, Array]:
    """Queries (pixels) and keys (groups) whose logits are ``k . q - r_q``."""
    hi, lo = _split(r, q.dtype)
    minus = -jnp.ones((*k.shape[:-1], 2), q.dtype)
    return (jnp.concatenate([k.astype(q.dtype), minus], -1),
            jnp.concatenate([q, hi[..., None], lo[..., None]], -1))


def _column_log_sums(q, k, r, implementation):
    kq, gk = _pixels_to_groups(q, k, r)
    return fused_attention(kq, gk, gk, implementation=implementation, return_lse=True)[1]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _dense_sga(q, k, v, implementation, eps):
    return _fwd(q, k, v, implementation, eps)[0]


def _fwd(q, k, v, implementation, eps):
    dtype = q.dtype
    _, r = fused_attention(q, k, k, implementation=implementation, return_lse=True)
    c = jnp.exp(_column_log_sums(q, k, r, implementation))
    w = (v.astype(jnp.float32) / (c + eps)[..., None]).astype(dtype)
    u = fused_attention(q, k.astype(dtype), w, implementation=implementation)
    return u, (q, k, v, r, c)


def _bwd(implementation, eps, res, du):
    q, k, v, r, c = res
    dtype = q.dtype
    kq, gk = _pixels_to_groups(q, k, r)
    t = fused_attention(kq, gk, du.astype(dtype), implementation=implementation)  # dW / c
    dw = t.astype(jnp.float32) * c[..., None]
    inv = 1.0 / (c + eps)
    w = v.astype(jnp.float32) * inv[..., None]
    dc = -jnp.sum(dw * w, axis=-1) * inv
    v_aug = jnp.concatenate([w, dc[..., None]], -1).astype(dtype)
    _, vjp = jax.vjp(lambda q_, k_: fused_attention(q_, k_, v_aug, implementation=implementation), q,
                     k.astype(dtype))
    ones = jnp.ones((*du.shape[:-1], 1), dtype)
    dq, dk = vjp(jnp.concatenate([du.astype(dtype), ones], -1))
    return dq.astype(q.dtype), dk.astype(k.dtype), (dw * inv[..., None]).astype(v.dtype)


_dense_sga.defvjp(_fwd, _bwd)


def dense_sga(q: Array, k: Array, v: Array, *, implementation: Implementation = "auto", eps: float = EPS) -> Array:
    """Dense SGA update ``(P / (colsum(P) + eps)) @ v`` with ``P = softmax(q k^T)`` over the pixels.

    The same function as :func:`jaxrat.ops.attention.grouping_attention`, as flash-attention
    calls (module docstring), differentiable in q, k and v.

    Args:
      q: (..., G, d) group queries (logits are ``q @ k^T``, no further scaling); their dtype is the
        compute dtype of every attention call.
      k: (..., N, d) pixel keys.
      v: (..., N, dv) values.
      implementation: "auto", "cudnn", "pallas" or "xla", for every attention call
        (:func:`jaxrat.ops.gpu.fused.choose_implementation`).
      eps: added to the column sums.

    Returns:
      (..., G, dv) in q's dtype.
    """
    return _dense_sga(q, k, v, implementation, float(eps))
