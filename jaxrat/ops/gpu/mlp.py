"""The transformer MLP ``fc2(dropout(gelu(fc1(x))))`` as fused Pallas (Triton) kernels, for GPUs.

XLA runs the MLP as separate kernels around cuBLAS products, and its hidden activation (four times
the tokens' width) goes through memory several times: fc1's output, GELU's, the dropped-out one, and
in the backward their gradients (the SGA layers' MLPs moved about 5.9 GB of the ISIC step's 43 GB on
an H100, docs/benchmarks.md). Here the hidden activation never leaves the chip:

* forward (token tiles): ``y = sum_j drop(gelu(x W1[:, j] + b1[j])) W2[j]`` over hidden chunks j;
* backward, token tiles: ``dx = sum_j dh_j W1[:, j]^T`` with ``dh_j = (dy W2[j]^T) * mask * gelu'``,
  recomputing each chunk's pre-activation from x;
* backward, weight tiles (hidden chunk x a share of the tokens): the partial ``dW1``, ``db1``,
  ``dW2`` of those tokens, recomputed the same way; XLA adds the shares and ``db2``.

Products run on the tensor cores in the operands' dtype with float32 accumulation; GELU is the exact
(erf) form, with erf from a rational approximation good to float32 rounding (:func:`erf`). Dropout's
mask is drawn by the caller (the same draw as ``nnx.Dropout``) and passed as int8.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

Array = jax.Array
DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16))
CHUNK = 128  # hidden units per chunk in the forward and the inputs' passes
MAX_TILE, MIN_TILE = 64, 16  # tokens per tile: a power of two dividing the (padded) tokens


@dataclasses.dataclass(frozen=True)
class WeightsPass:
    """How the weight-gradient pass is cut: hidden units per program (``chunk``: each program holds
    two float32 D x chunk accumulators over a loop of token tiles), the most shares of the tokens
    (hidden / chunk x splits programs against an H100's 132 SMs), warps and pipeline stages. A share
    has ``min_share`` token tiles at least, so the float32 partials (2 D Hd 4 bytes a share, added by
    XLA) stay small beside its tokens. Measured on an H100 at 118k tokens, D 128, Hd 512: 128 x 16
    shares took 2.9 ms a call, 64 x 64 takes 0.4 ms (docs/benchmarks.md)."""

    chunk: int = 64
    max_splits: int = 64
    warps: int = 4
    stages: int = 1
    min_share: int = 16


WEIGHTS = WeightsPass()

# erf(x) = x P(x^2) / Q(x^2) on [-4, 4] (+-1 beyond, to float32 rounding): Eigen's and XLA's float32 form.
_ALPHA = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
          -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)
_BETA = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
         -1.42647390514189e-02)


def erf(x: Array) -> Array:
    """float32 erf from elementwise arithmetic only (Triton has no erf in Pallas' lowering)."""
    x = jnp.clip(x, -4.0, 4.0)
    x2 = x * x
    alpha = functools.reduce(lambda acc, c: acc * x2 + c, _ALPHA[1:], jnp.full_like(x2, _ALPHA[0]))
    beta = functools.reduce(lambda acc, c: acc * x2 + c, _BETA[1:], jnp.full_like(x2, _BETA[0]))
    return x * alpha / beta


def _gelu(h):
    """Exact GELU and its derivative, float32."""
    cdf = 0.5 * (1.0 + erf(h * (1.0 / math.sqrt(2.0))))
    return h * cdf, cdf + h * jnp.exp(-0.5 * h * h) * (1.0 / math.sqrt(2.0 * math.pi))


def tile_of(n: int) -> int:
    """Tokens per tile for ``n`` tokens (a multiple of MIN_TILE): the largest power of two up to
    MAX_TILE dividing n."""
    t = MAX_TILE
    while n % t:
        t //= 2
    return t


def supports(n: int, d: int, hidden: int, dtype) -> str | None:
    """None when the fused kernels take ``n`` tokens of width ``d`` with ``hidden`` units, else why not."""
    if np.dtype(dtype) not in DTYPES:
        return f"the fused MLP takes float32 or bfloat16, not {np.dtype(dtype)}"
    if d < 16 or d > 256 or d & (d - 1):
        return f"the fused MLP takes a width that is a power of two in 16..256, not {d}"
    if hidden % CHUNK:
        return f"the fused MLP takes a hidden size that is a multiple of {CHUNK}, not {hidden}"
    if n < 1:
        return "the fused MLP needs at least one token"
    return None


def _dot(a, b, trans_a: bool = False, trans_b: bool = False):
    """a @ b in the operands' dtype on the tensor cores, accumulated in float32."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _hidden(x, w1_ref, b1_ref, m_ref, rows, j: int, scale: float):
    """Chunk j of the hidden layer for tokens ``rows``: the (dropped) output and GELU' (times the mask)."""
    cols = pl.ds(j * CHUNK, CHUNK)
    pre = _dot(x, w1_ref[:, cols]) + b1_ref[cols].astype(jnp.float32)[None, :]
    act, slope = _gelu(pre)
    if m_ref is None:
        return act, slope
    keep = m_ref[rows, cols].astype(jnp.float32) * scale
    return act * keep, slope * keep


def _unpack(refs, dropout: bool, weights: int):
    """(x, w1, b1, w2[, b2]), the mask ref or None, the rest (cotangent, outputs)."""
    mask = refs[weights] if dropout else None
    return refs[:weights], mask, refs[weights + dropout:]


def _forward_kernel(*refs, hidden: int, scale: float, dropout: bool):
    (x_ref, w1_ref, b1_ref, w2_ref, b2_ref), m_ref, (y_ref,) = _unpack(refs, dropout, 5)
    x = x_ref[...]

    def chunk(j, acc):  # a loop, not unrolled: Triton compiles it several times faster
        h, _ = _hidden(x, w1_ref, b1_ref, m_ref, slice(None), j, scale)
        return acc + _dot(h.astype(x.dtype), w2_ref[pl.ds(j * CHUNK, CHUNK), :])

    acc = lax.fori_loop(0, hidden // CHUNK, chunk, jnp.zeros(y_ref.shape, jnp.float32))
    y_ref[...] = (acc + b2_ref[...].astype(jnp.float32)[None, :]).astype(y_ref.dtype)


def _inputs_kernel(*refs, hidden: int, scale: float, dropout: bool):
    (x_ref, w1_ref, b1_ref, w2_ref), m_ref, (g_ref, dx_ref) = _unpack(refs, dropout, 4)
    x, g = x_ref[...], g_ref[...]

    def chunk(j, acc):
        cols = pl.ds(j * CHUNK, CHUNK)
        _, dslope = _hidden(x, w1_ref, b1_ref, m_ref, slice(None), j, scale)
        dpre = _dot(g, w2_ref[cols, :], trans_b=True) * dslope
        return acc + _dot(dpre.astype(x.dtype), w1_ref[:, cols], trans_b=True)

    acc = lax.fori_loop(0, hidden // CHUNK, chunk, jnp.zeros(dx_ref.shape, jnp.float32))
    dx_ref[...] = acc.astype(dx_ref.dtype)


def _weights_kernel(bounds_ref, *refs, tile: int, chunk: int, scale: float, dropout: bool):
    """Tiles and tiles per share come as operands, not constants: one compiled kernel for every
    token count (Triton compiles each distinct kernel anew, seconds each)."""
    (x_ref, w1_ref, b1_ref, w2_ref), m_ref, (g_ref, dw1_ref, db1_ref, dw2_ref) = _unpack(refs, dropout, 4)
    tiles, per_split = bounds_ref[0], bounds_ref[1]
    j, s = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(j * chunk, chunk)
    w1, b1, w2 = w1_ref[:, cols], b1_ref[cols].astype(jnp.float32), w2_ref[cols, :]
    d = w1.shape[0]

    def body(t, carry):
        dw1, db1, dw2 = carry
        rows = pl.ds(t * tile, tile)
        x, g = x_ref[rows, :], g_ref[rows, :]
        pre = _dot(x, w1) + b1[None, :]
        act, slope = _gelu(pre)
        if m_ref is not None:
            keep = m_ref[rows, cols].astype(jnp.float32) * scale
            act, slope = act * keep, slope * keep
        dpre = _dot(g, w2, trans_b=True) * slope
        dw2 += _dot(act.astype(x.dtype), g, trans_a=True)
        dw1 += _dot(x, dpre.astype(x.dtype), trans_a=True)
        return dw1, db1 + jnp.sum(dpre, axis=0), dw2

    lo = s * per_split
    init = (jnp.zeros((d, chunk), jnp.float32), jnp.zeros((chunk,), jnp.float32), jnp.zeros((chunk, d), jnp.float32))
    dw1, db1, dw2 = lax.fori_loop(lo, jnp.minimum(lo + per_split, tiles), body, init)
    dw1_ref[...], db1_ref[...], dw2_ref[...] = dw1, db1, dw2


def _whole(shape):
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _params(warps: int = 4, stages: int = 1):
    return plgpu.CompilerParams(num_warps=warps, num_stages=stages)


def _forward(x, w1, b1, w2, b2, mask, scale: float, interpret: bool):
    n, d = x.shape
    hidden, t = w1.shape[1], tile_of(n)
    rows = lambda width: pl.BlockSpec((t, width), lambda i: (i, 0))
    dropout = mask is not None
    return pl.pallas_call(
        partial(_forward_kernel, hidden=hidden, scale=scale, dropout=dropout), grid=(n // t,),
        in_specs=[rows(d), _whole(w1.shape), _whole(b1.shape), _whole(w2.shape), _whole(b2.shape)]
        + [rows(hidden)] * dropout,
        out_specs=rows(d), out_shape=jax.ShapeDtypeStruct((n, d), x.dtype), compiler_params=_params(),
        interpret=interpret, name="fused_mlp_forward")(x, w1, b1, w2, b2, *[mask] * dropout)


@partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _mlp(x, w1, b1, w2, b2, mask, scale: float, interpret: bool):
    return _forward(x, w1, b1, w2, b2, mask, scale, interpret)


def _mlp_fwd(x, w1, b1, w2, b2, mask, scale, interpret):
    return _forward(x, w1, b1, w2, b2, mask, scale, interpret), (x, w1, b1, w2, mask)


def _mlp_bwd(scale: float, interpret: bool, res, g):
    x, w1, b1, w2, mask = res
    n, d = x.shape
    hidden, t = w1.shape[1], tile_of(n)
    g = g.astype(x.dtype)
    rows = lambda width: pl.BlockSpec((t, width), lambda i: (i, 0))
    dropout = mask is not None
    masks = [mask] * dropout
    dx = pl.pallas_call(
        partial(_inputs_kernel, hidden=hidden, scale=scale, dropout=dropout), grid=(n // t,),
        in_specs=[rows(d), _whole(w1.shape), _whole(b1.shape), _whole(w2.shape)] + [rows(hidden)] * dropout + [rows(d)],
        out_specs=rows(d), out_shape=jax.ShapeDtypeStruct((n, d), x.dtype), compiler_params=_params(),
        interpret=interpret, name="fused_mlp_inputs")(x, w1, b1, w2, *masks, g)
    tiles, cut = n // t, WEIGHTS
    splits = max(1, min(cut.max_splits, tiles // cut.min_share))
    per_split = -(-tiles // splits)
    f32 = lambda *shape: jax.ShapeDtypeStruct((splits, *shape), jnp.float32)
    c = cut.chunk
    dw1, db1, dw2 = pl.pallas_call(
        partial(_weights_kernel, tile=t, chunk=c, scale=scale, dropout=dropout),
        grid=(hidden // c, splits),
        in_specs=[_whole((2,)), _whole(x.shape), _whole(w1.shape), _whole(b1.shape), _whole(w2.shape)]
        + [_whole((n, hidden))] * dropout + [_whole(g.shape)],
        out_specs=[pl.BlockSpec((None, d, c), lambda j, s: (s, 0, j)),
                   pl.BlockSpec((None, c), lambda j, s: (s, j)),
                   pl.BlockSpec((None, c, d), lambda j, s: (s, j, 0))],
        out_shape=[f32(d, hidden), f32(hidden), f32(hidden, d)], compiler_params=_params(cut.warps, cut.stages),
        interpret=interpret, name="fused_mlp_weights")(jnp.array([tiles, per_split], jnp.int32), x, w1, b1, w2,
                                                       *masks, g)
    db2 = jnp.sum(g.astype(jnp.float32), axis=0)
    zero_mask = np.zeros(mask.shape, jax.dtypes.float0) if dropout else None
    return (dx, dw1.sum(0).astype(w1.dtype), db1.sum(0).astype(b1.dtype), dw2.sum(0).astype(w2.dtype),
            db2.astype(w2.dtype), zero_mask)


_mlp.defvjp(_mlp_fwd, _mlp_bwd)


def fused_mlp(x: Array, w1: Array, b1: Array, w2: Array, b2: Array, keep: Array | None = None,
              rate: float = 0.0, *, interpret: bool = False) -> Array:
    """``fc2(dropout(gelu(fc1(x))))`` for x (..., D), w1 (D, Hd), b1 (Hd,), w2 (Hd, D), b2 (D,), all in
    x's dtype; ``keep`` (..., Hd) bool: dropout's kept units (None: no dropout), scaled by 1 / (1 - rate).
    Differentiable in x and the weights. ``interpret``: Pallas interpret mode (any backend, tests)."""
    lead, d = x.shape[:-1], x.shape[-1]
    hidden = w1.shape[1]
    n = int(np.prod(lead))
    why = supports(n, d, hidden, x.dtype)
    if why is not None:
        raise ValueError(why)
    if keep is None:
        mask, scale = None, 1.0
    else:
        mask, scale = keep.reshape(n, hidden).astype(jnp.int8), 1.0 / (1.0 - rate)
    # Tiles of MIN_TILE tokens at least: a ragged tail is padded with zeros (its rows' cotangents
    # are then zero, so they add nothing to the weights' gradients) and cut off again.
    pad = -n % MIN_TILE
    rows = lambda a: a if a is None or not pad else jnp.pad(a, ((0, pad), (0, 0)))
    cast = lambda a: a.astype(x.dtype)
    y = _mlp(rows(x.reshape(n, d)), cast(w1), cast(b1), cast(w2), cast(b2), rows(mask), float(scale), interpret)
    return (y[:n] if pad else y).reshape(*lead, d)
