"""Fused softmax attention over jaxrat's (..., N, d) layout: cuDNN, Pallas Triton, or plain XLA.

``fused_attention(q, k, v)`` is ``softmax(scale * q k^T) v`` per slice of the leading axes, which
are folded into the batch axis of ``jax.nn.dot_product_attention`` with one head, (B, N, 1, d).
XLA no longer rewrites plain attention into cuDNN's fused kernel by itself, so the GPU form asks
for it by name; the choice is made at trace time from static shapes and dtypes only, never from
the process's backend, so the GPU program can be lowered for CUDA on a machine without one.

``implementation="auto"`` takes, in order:

* ``"cudnn"``: cuDNN flash attention (``__cudnn$fmha*`` custom calls) when the dtype is bfloat16
  or float16 and the head dim, zero-padded to a multiple of 8, is at most
  :data:`CUDNN_MAX_HEAD_DIM`. Zero features change no logit and zero value columns are sliced
  off, so the padding is exact. Padded keys go through ``key_value_seq_lengths``: no mask is
  materialised.
* ``"pallas"``: the Pallas Triton flash attention of ``jax.experimental.pallas.ops.gpu`` when cuDNN
  refuses (float32) and its own constraints hold: no key lengths (it masks by segment ids shared
  by queries and keys), sequence lengths that are whole multiples of its 128-token blocks, and as
  many query as key blocks in its backward (in practice self-attention).
* ``"xla"``: the portable form, the materialised logits in plain XLA ops (any shape, any dtype).

A fallback is logged once per reason (``logging``, never an error at the first step).
"""

from __future__ import annotations

import functools
import logging
from typing import Literal, Optional

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
Implementation = Literal["auto", "cudnn", "pallas", "xla"]
IMPLEMENTATIONS = ("auto", "cudnn", "pallas", "xla")
# cuDNN's bound before Hopper; Hopper and later take 256, but the target GPU is not known when the
# program is traced (possibly on a host without one), so the bound every CUDA GPU accepts is used.
CUDNN_MAX_HEAD_DIM = 128
CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# cuDNN's attention kernels put the batch on a CUDA grid axis, at most 65,535 blocks; the slices
# here are images x heads (x windows), so larger batches are split into several calls.
CUDNN_MAX_BATCH = 65535
PALLAS_BLOCK = 128  # the Triton kernel's default query and key block
PALLAS_BACKWARD_BLOCK = 32  # its backward's blocks, which must tile queries and keys alike
_LOG = logging.getLogger(__name__)
_logged: set[tuple[str, str]] = set()


def padded_head_dim(dqk: int, dv: int) -> int:
    """The common head dim the fused kernels see: max of the query/key and value dims, rounded up
    to a multiple of 8 (jax's fused attention wants one head dim for q, k and v)."""
    return -(-max(dqk, dv) // 8) * 8


def why_not(kind: str, nq: int, nk: int, dqk: int, dv: int, dtype, has_lengths: bool = False) -> Optional[str]:
    """Why ``kind`` ("cudnn", "pallas" or "xla") cannot take these shapes (one sentence), or None when
    it can; a policy may route a kernel whose calls cuDNN refuses to a memory-lean portable form."""
    return _refusal(kind, nq, nk, dqk, dv, dtype, has_lengths)


def _refusal(kind: str, nq: int, nk: int, dqk: int, dv: int, dtype, has_lengths: bool) -> Optional[str]:
    if kind == "cudnn":
        if jnp.dtype(dtype) not in CUDNN_DTYPES:
            return f"cuDNN fused attention takes bfloat16/float16, not {jnp.dtype(dtype).name}"
        if padded_head_dim(dqk, dv) > CUDNN_MAX_HEAD_DIM:
            return f"cuDNN fused attention takes head dims <= {CUDNN_MAX_HEAD_DIM}, not {max(dqk, dv)}"
        return None
    if kind == "pallas":
        if has_lengths:
            return "the Pallas flash attention cannot mask padded keys of a cross attention"
        for n in (nq, nk):
            if n % min(PALLAS_BLOCK, n):
                return f"the Pallas flash attention needs sequence lengths in whole {PALLAS_BLOCK}-blocks, not {n}"
        if nq // min(PALLAS_BACKWARD_BLOCK, nq) != nk // min(PALLAS_BACKWARD_BLOCK, nk):
            return f"the Pallas flash attention's backward needs as many query as key blocks, not {nq} vs {nk}"
        return None
    return None


def choose_implementation(
    nq: int, nk: int, dqk: int, dv: int, dtype, *, requested: Implementation = "auto", has_lengths: bool = False
) -> str:
    """The implementation ``fused_attention`` runs for these static shapes.

    Args:
      nq, nk: query and key counts per slice.
      dqk, dv: query/key and value head dims.
      dtype: the compute dtype (the queries').
      requested: "auto" (cuDNN, else Pallas, else XLA, a fallback logged once) or one by name, which
        is taken as given or refused with a ValueError saying why.
      has_lengths: whether padded keys are masked by per-slice key counts.

    Returns:
      "cudnn", "pallas" or "xla".
    """
    if requested not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={requested!r}; use one of {IMPLEMENTATIONS}.")
    args = (nq, nk, dqk, dv, dtype, has_lengths)
    if requested != "auto":
        why = _refusal(requested, *args)
        if why:
            raise ValueError(f"implementation={requested!r} cannot run this attention: {why}; use 'auto' or 'xla'.")
        return requested
    reasons = []
    for kind in ("cudnn", "pallas"):
        why = _refusal(kind, *args)
        if why is None:
            break
        reasons.append(why)
    else:
        kind = "xla"
    why = "; ".join(reasons)
    if reasons and (why, kind) not in _logged:
        _logged.add((why, kind))
        _LOG.warning("fused attention falls back to %s: %s.", kind, why)
    return kind


def _pad_last(x: Array, size: int) -> Array:
    extra = size - x.shape[-1]
    return x if extra == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


def _pad_rows(x: Array, extra: int) -> Array:
    return x if extra == 0 else jnp.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2))


def _cudnn_operands(q: Array, k: Array, v: Array, lengths: Optional[Array]) -> tuple:
    """(B, N, ..., d) operands as cuDNN takes them: one head dim, zero-padded to a multiple of 8
    (exact: zero features change no logit, zero value columns are sliced off); an odd sequence
    side padded by one row, since jax 0.10's cuDNN rule refuses odd lengths under differentiation
    (a query whose output is dropped, or a key masked by the lengths)."""
    size = padded_head_dim(q.shape[-1], v.shape[-1])
    q, k, v = (_pad_last(a, size) for a in (q, k, v))
    q = _pad_rows(q, q.shape[1] % 2)
    nk = k.shape[1]
    if nk % 2:
        k, v = _pad_rows(k, 1), _pad_rows(v, 1)
        lengths = jnp.full((q.shape[0],), nk, jnp.int32) if lengths is None else lengths
    return q, k, v, lengths


def _logits(q, k, scale, lengths):
    logits = jnp.einsum("bqd,bkd->bqk", q, k, preferred_element_type=jnp.float32) * scale
    if lengths is not None:
        valid = jnp.arange(k.shape[1])[None, None, :] < lengths[:, None, None]
        logits = jnp.where(valid, logits, -0.7 * float(jnp.finfo(jnp.float32).max))
    return logits


def _matmul(spec, a, b, dtype):
    return jnp.einsum(spec, a.astype(dtype), b.astype(dtype), preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _xla_attention(q, k, v, scale, lengths):
    return _xla_fwd(q, k, v, scale, lengths)[0]


def _xla_fwd(q, k, v, scale, lengths):
    logits = _logits(q, k, scale, lengths)
    lse = jax.nn.logsumexp(logits, axis=-1)
    out = _matmul("bqk,bkd->bqd", jnp.exp(logits - lse[..., None]), v, v.dtype).astype(q.dtype)
    return (out, lse), (q, k, v, lengths, out, lse)


def _xla_bwd(scale, res, cotangents):
    # Written out so that every matmul of the backward runs in the inputs' dtype (autodiff of the
    # float32 logits would run them in float32), from the saved log-sum-exp only.
    q, k, v, lengths, out, lse = res
    dout = cotangents[0]
    dtype = q.dtype
    p = jnp.exp(_logits(q, k, scale, lengths) - lse[..., None])
    dv = _matmul("bqk,bqd->bkd", p, dout, dtype)
    dp = _matmul("bqd,bkd->bqk", dout, v, dtype)
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), -1)
    ds = p * (dp - delta[..., None]) * scale
    dq = _matmul("bqk,bkd->bqd", ds, k, dtype)
    dk = _matmul("bqk,bqd->bkd", ds, q, dtype)
    dlen = None if lengths is None else np.zeros(lengths.shape, jax.dtypes.float0)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dlen


_xla_attention.defvjp(_xla_fwd, _xla_bwd)


def _xla(q, k, v, scale, lengths):
    """The portable form: materialised float32 logits, the inputs' dtype in every matmul."""
    return _xla_attention(q, k, v, float(scale), lengths)


def _cudnn(q, k, v, scale, lengths, return_lse):
    q, k, v = (a[:, :, None, :] for a in (q, k, v))  # (B, N, 1, H): one head, the slices in the batch
    if not return_lse:
        out = jax.nn.dot_product_attention(q, k, v, scale=scale, key_value_seq_lengths=lengths,
                                           implementation="cudnn")
        return out[:, :, 0], None
    # jax.nn.dot_product_attention casts the returned log-sum-exp to the inputs' dtype, and a
    # bfloat16 lse of 10 is off by 0.03 (3 % in exp); the function it wraps returns cuDNN's float32
    # softmax statistics, so that one is called directly (jax 0.10: private module).
    from jax._src.cudnn import fused_attention_stablehlo as fa

    q_len = k_len = None
    mask = fa.MaskType.NO_MASK
    if lengths is not None:
        mask = fa.MaskType.PADDING
        q_len, k_len = jnp.full(lengths.shape, q.shape[1], jnp.int32), lengths
    out, lse = fa.dot_product_attention(q, k, v, None, None, q_len, k_len, scale=scale, mask_type=mask,
                                        return_residual=True)
    return out[:, :, 0], lse.reshape(q.shape[0], q.shape[1]).astype(jnp.float32)


def _cudnn_batches(q, k, v, scale, lengths, return_lse):
    """:func:`_cudnn` in batches of at most :data:`CUDNN_MAX_BATCH` slices (windows x heads x images
    reach it at 1024 px): one call per batch, joined."""
    b = q.shape[0]
    if b <= CUDNN_MAX_BATCH:
        return _cudnn(q, k, v, scale, lengths, return_lse)
    parts = [_cudnn(q[i:i + CUDNN_MAX_BATCH], k[i:i + CUDNN_MAX_BATCH], v[i:i + CUDNN_MAX_BATCH], scale,
                    None if lengths is None else lengths[i:i + CUDNN_MAX_BATCH], return_lse)
             for i in range(0, b, CUDNN_MAX_BATCH)]
    out = jnp.concatenate([p[0] for p in parts])
    return out, (jnp.concatenate([p[1] for p in parts]) if return_lse else None)


def _pallas(q, k, v, scale, return_lse, interpret):
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    q, k, v = (a[:, :, None, :] for a in (q, k, v))
    out = pallas_attention.mha(q, k, v, None, sm_scale=scale, return_residuals=return_lse, interpret=interpret)
    if return_lse:
        out, lse = out  # the kernel works in base 2 (exp2): its log-sum-exp is log2
        return out[:, :, 0], lse[:, 0].astype(jnp.float32) * np.float32(np.log(2.0))
    return out[:, :, 0], None


def fused_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    scale: float = 1.0,
    kv_lengths: Optional[Array] = None,
    implementation: Implementation = "auto",
    return_lse: bool = False,
    interpret: bool = False,
) -> Array | tuple[Array, Array]:
    """``softmax(scale * q k^T) v`` over the last two axes, by the fused kernel the shapes allow.

    Args:
      q: (..., Nq, dqk) queries; the leading axes (heads, windows, batch) are independent slices.
      k: (..., Nk, dqk) keys, same leading axes.
      v: (..., Nk, dv) values.
      scale: logit scale; 1.0 as jaxrat's kernels (queries scaled beforehand).
      kv_lengths: int, broadcastable to the leading axes: the first ``kv_lengths`` keys of a slice
        are real, the rest padding (exactly zero weight). None: every key is real.
      implementation: "auto", "cudnn", "pallas" or "xla" (:func:`choose_implementation`).
      return_lse: also return the row log-sum-exp of the scaled logits, (..., Nq) float32, without
        a gradient (callers use it inside their own VJP).
      interpret: run the Pallas kernel in interpret mode (CPU tests only).

    Returns:
      (..., Nq, dv) in q's dtype, and the log-sum-exp when ``return_lse``.
    """
    *lead, nq, dqk = q.shape
    nk, dv = k.shape[-2], v.shape[-1]
    dtype = q.dtype
    kind = choose_implementation(nq, nk, dqk, dv, dtype, requested=implementation, has_lengths=kv_lengths is not None)
    b = int(np.prod(lead)) if lead else 1
    q3, k3, v3 = (a.astype(dtype).reshape(b, a.shape[-2], a.shape[-1]) for a in (q, k, v))
    lengths = None
    if kv_lengths is not None:
        lengths = jnp.broadcast_to(jnp.asarray(kv_lengths, jnp.int32), tuple(lead)).reshape(b)
    if kind == "xla":
        out, lse = _xla(q3, k3, v3, scale, lengths)
    else:
        if kind == "cudnn":
            q3, k3, v3, lengths = _cudnn_operands(q3, k3, v3, lengths)
            out, lse = _cudnn_batches(q3, k3, v3, scale, lengths, return_lse)
            out, lse = out[:, :nq], (None if lse is None else lse[:, :nq])
        else:
            q3, k3, v3 = (_pad_last(a, max(dqk, dv)) for a in (q3, k3, v3))
            out, lse = _pallas(q3, k3, v3, scale, return_lse, interpret)
        out = out[..., :dv]
    out = out.reshape(*lead, nq, dv)
    if return_lse:
        return out, jax.lax.stop_gradient(lse).reshape(*lead, nq)
    return out


def fused_attention_heads(q: Array, k: Array, v: Array, *, scale: float = 1.0, kv_lengths: Optional[Array] = None,
                          implementation: Implementation = "auto") -> Array:
    """:func:`fused_attention` of token-major (B, N, H, d) arrays, the layout projections make, with
    ``kv_lengths`` (B,) (None: every key real): cuDNN reads them as they are (its BTNH layout), where
    folding the heads into the batch would transpose every operand, and in a backward every
    gradient (compiled for an H100, tens of gigabytes a step in the COCO step's decoder at 800 px). Other
    implementations take the transposes. Returns (B, Nq, H, dv) in q's dtype."""
    b, nq, heads, dqk = q.shape
    nk, dv = k.shape[1], v.shape[-1]
    kind = choose_implementation(nq, nk, dqk, dv, q.dtype, requested=implementation, has_lengths=kv_lengths is not None)
    if kind != "cudnn" or b > CUDNN_MAX_BATCH:
        t = lambda a: a.transpose(0, 2, 1, 3)
        lengths = None if kv_lengths is None else jnp.broadcast_to(jnp.asarray(kv_lengths)[:, None], (b, heads))
        return t(fused_attention(t(q), t(k), t(v), scale=scale, kv_lengths=lengths, implementation=kind))
    lengths = None if kv_lengths is None else jnp.asarray(kv_lengths, jnp.int32).reshape(b)
    q, k, v, lengths = _cudnn_operands(*(a.astype(q.dtype) for a in (q, k, v)), lengths)
    out = jax.nn.dot_product_attention(q, k, v, scale=scale, key_value_seq_lengths=lengths, implementation="cudnn")
    return out[:, :nq, :, :dv]
