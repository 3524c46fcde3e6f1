"""The transformer MLP ``fc2(dropout(gelu(fc1(x))))`` as fused Pallas (Triton) kernels, for GPUs.

XLA runs the MLP as separate kernels around cuBLAS products, and its hidden activation (four times
the tokens' width) goes through memory several times: fc1's output, GELU's, the dropped-out one, and
in the backward their gradients (compiled for an H100, the SGA layers' MLPs moved about a seventh of
the ISIC step's bytes). Here the hidden activation never leaves the chip:

* forward (token tiles): ``y = sum_j drop(gelu(x W1[:, j] + b1[j])) W2[j]`` over hidden chunks j;
* backward, token tiles: ``dx = sum_j dh_j W1[:, j]^T`` with ``dh_j = (dy W2[j]^T) * mask * gelu'``,
  recomputing each chunk's pre-activation from x;
* backward, weight tiles (hidden chunk x a share of the tokens): the partial ``dW1``, ``db1``,
  ``dW2`` of those tokens, recomputed the same way, and ``db2`` (programs of their own), in one
  buffer; XLA adds the shares.

Products run on the tensor cores in the operands' dtype with float32 accumulation; GELU is the exact
(erf) form, with erf from a rational approximation good to float32 rounding (:func:`erf`).

Dropout, of the hidden units and of the output, is drawn inside the kernels (:func:`kept`: a hash of
a seed and each unit's global token and column) and drawn again, identically, by the backward ones:
no mask is drawn by XLA or kept in memory. (Drawn as ``nnx.Dropout`` draws them, the masks cost the
ISIC step, compiled for an H100, more kernels and more traffic: benchmarks/gpu_cost.py.)
Tokens are numbered over the whole batch, so a sharded batch draws the same masks as one device.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

Array = jax.Array
DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16))
CHUNK = 128  # hidden units per chunk in the forward pass
# ... and in the inputs' pass: at 128, with both dropout masks drawn in the kernel, it needs more than
# 255 registers a thread and spills, compiled for an H100; at 64 it does not (gpu_registers.py)
INPUTS_CHUNK = 64
MAX_TILE, MIN_TILE = 64, 16  # tokens per tile: a power of two dividing the (padded) tokens


@dataclasses.dataclass(frozen=True)
class WeightsPass:
    """How the weight-gradient pass is cut: hidden units per program (``chunk``: each program holds
    two float32 D x chunk accumulators over a loop of token tiles), the most shares of the tokens
    (hidden / chunk x splits programs against an H100's 132 SMs), warps and pipeline stages. A share
    has ``min_share`` token tiles (of the other passes, up to 64 tokens) at least, so the float32
    partials (2 D Hd 4 bytes a share, added by XLA) stay small beside its tokens. On an H100, at the
    ISIC first layer's MLP, 64 units x up to 64 shares ran several times faster than 128 x 16, whose
    64 programs left half the SMs idle (docs/history/gpu_h100.md). ``tile``: tokens a loop step (at
    most the other passes' tile): compiled for an H100 with both dropout masks drawn in the kernel,
    64 needs more than 255 registers a thread and spills, 32 does not (benchmarks/gpu_registers.py);
    chosen by registers alone (benchmarks/mlp_gpu.py's ``cuts`` times the cuts on a GPU)."""

    chunk: int = 64
    max_splits: int = 64
    warps: int = 4
    stages: int = 1
    min_share: int = 16
    tile: int = 32


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


# murmur3's 32-bit finaliser (each input bit flips each output bit with probability ~1/2) and odd
# multipliers that spread consecutive tokens and columns apart before it.
_M1, _M2 = np.uint32(0x85EBCA6B), np.uint32(0xC2B2AE35)
_ROW, _COL = np.uint32(0x9E3779B1), np.uint32(0x7FEB352D)


def _fmix(h: Array) -> Array:
    h = h ^ (h >> 16)
    h = h * _M1
    h = h ^ (h >> 13)
    h = h * _M2
    return h ^ (h >> 16)


def kept(seed0: Array, seed1: Array, tokens: Array, units: Array, rate: float) -> Array:
    """Dropout's draw: whether unit ``units`` of token ``tokens`` (uint32, broadcast together) is kept
    at ``rate`` for the seed (seed0, seed1), uint32 scalars. 24 bits of a hash of seed, token and unit
    against rate x 2^24, so P(kept) is 1 - rate to 6e-8. Plain jax.numpy: the kernels call it, and so
    can anyone who needs the masks they drew (tests, benchmarks/mlp_gpu.py)."""
    h = _fmix(_fmix(tokens * _ROW + seed0) ^ (units * _COL + seed1))
    return (h >> 8) >= np.uint32(round(rate * (1 << 24)))


class Drop(NamedTuple):
    """The static half of a call's dropout: the hidden units' and the output's rates. The traced half
    is the kernels' first operand, uint32 (seed0, seed1 of the hidden units, seed0, seed1 of the
    output, the first token's global index, 0, 0, 0)."""

    hidden: float = 0.0
    out: float = 0.0

    def __bool__(self) -> bool:
        return bool(self.hidden or self.out)


def _keep(drop_ref, which: int, tokens: Array, first_unit, width: int, rate: float) -> Array | None:
    """bool (tokens, width): the units kept; None without dropout."""
    if drop_ref is None or not rate:
        return None
    units = (first_unit + jnp.arange(width, dtype=jnp.int32)).astype(jnp.uint32)
    return kept(drop_ref[2 * which], drop_ref[2 * which + 1], tokens[:, None], units[None, :], rate)


def _tokens(drop_ref, first, count: int) -> Array | None:
    """The global indices (uint32) of ``count`` tokens from local row ``first``."""
    if drop_ref is None:
        return None
    return drop_ref[4] + (first + jnp.arange(count, dtype=jnp.int32)).astype(jnp.uint32)


def _hidden(x, w1, b1, keep, rate: float):
    """One chunk of the hidden layer: the (dropped) output and GELU' (times the same mask)."""
    act, slope = _gelu(_dot(x, w1) + b1.astype(jnp.float32)[None, :])
    if keep is None:
        return act, slope
    scale = 1.0 / (1.0 - rate)
    return jnp.where(keep, act * scale, 0.0), jnp.where(keep, slope * scale, 0.0)


def _masked_cotangent(g, drop_ref, tokens, rate: float):
    """The cotangent of the output before its dropout: g where kept (exact in g's dtype), and the
    1 / (1 - rate) the products' float32 results take instead."""
    keep = _keep(drop_ref, 1, tokens, 0, g.shape[1], rate)
    if keep is None:
        return g, 1.0
    return jnp.where(keep, g, jnp.zeros_like(g)), 1.0 / (1.0 - rate)


def _split(refs, drop: Drop):
    return (refs[0], refs[1:]) if drop else (None, refs)


def _forward_kernel(*refs, hidden: int, drop: Drop):
    drop_ref, (x_ref, w1_ref, b1_ref, w2_ref, b2_ref, y_ref) = _split(refs, drop)
    x = x_ref[...]
    t, d = y_ref.shape
    tokens = _tokens(drop_ref, pl.program_id(0) * t, t)

    # float32 weights take twice the registers of bfloat16 ones: half the units a step (at 128 the
    # forward spilled registers compiled for an H100, gpu_registers.py)
    c = CHUNK if w1_ref.dtype.itemsize <= 2 else CHUNK // 2

    def chunk(j, acc):  # a loop, not unrolled: Triton compiles it several times faster
        cols = pl.ds(j * c, c)
        keep = _keep(drop_ref, 0, tokens, j * c, c, drop.hidden)
        h, _ = _hidden(x, w1_ref[:, cols].astype(x.dtype), b1_ref[cols].astype(x.dtype), keep, drop.hidden)
        return acc + _dot(h.astype(x.dtype), w2_ref[cols, :].astype(x.dtype))

    y = lax.fori_loop(0, hidden // c, chunk, jnp.zeros((t, d), jnp.float32))
    y = y + b2_ref[...].astype(x.dtype).astype(jnp.float32)[None, :]
    keep = _keep(drop_ref, 1, tokens, 0, d, drop.out)
    y_ref[...] = (y if keep is None else jnp.where(keep, y * (1.0 / (1.0 - drop.out)), 0.0)).astype(y_ref.dtype)


def _inputs_kernel(*refs, hidden: int, drop: Drop):
    drop_ref, (x_ref, w1_ref, b1_ref, w2_ref, g_ref, dx_ref) = _split(refs, drop)
    x = x_ref[...]
    t = x.shape[0]
    tokens = _tokens(drop_ref, pl.program_id(0) * t, t)
    g, g_scale = _masked_cotangent(g_ref[...], drop_ref, tokens, drop.out)

    def chunk(j, acc):
        cols = pl.ds(j * INPUTS_CHUNK, INPUTS_CHUNK)
        keep = _keep(drop_ref, 0, tokens, j * INPUTS_CHUNK, INPUTS_CHUNK, drop.hidden)
        w1 = w1_ref[:, cols].astype(x.dtype)
        _, dslope = _hidden(x, w1, b1_ref[cols].astype(x.dtype), keep, drop.hidden)
        dpre = _dot(g, w2_ref[cols, :].astype(x.dtype), trans_b=True) * (dslope * g_scale)
        return acc + _dot(dpre.astype(x.dtype), w1, trans_b=True)

    acc = lax.fori_loop(0, hidden // INPUTS_CHUNK, chunk, jnp.zeros(dx_ref.shape, jnp.float32))
    dx_ref[...] = acc.astype(dx_ref.dtype)


def _weights_kernel(bounds_ref, *refs, tile: int, chunk: int, chunks: int, drop: Drop):
    """Tiles and tiles per share come as operands, not constants: one compiled kernel for every
    token count (Triton compiles each distinct kernel anew, seconds each). Programs of chunk
    ``chunks`` (one past the hidden layer's) sum b2's gradient instead: in a branch of its own, so
    its accumulator takes no registers from the others (in theirs, the kernel spilled registers
    compiled for an H100)."""
    drop_ref, (x_ref, w1_ref, b1_ref, w2_ref, g_ref, parts_ref) = _split(refs, drop)
    tiles, per_split = bounds_ref[0], bounds_ref[1]
    j, s = pl.program_id(0), pl.program_id(1)
    d = x_ref.shape[1]
    lo = s * per_split
    hi = jnp.minimum(lo + per_split, tiles)

    @pl.when(j < chunks)
    def _():
        cols = pl.ds(j * chunk, chunk)
        w1, b1, w2 = (r.astype(x_ref.dtype) for r in (w1_ref[:, cols], b1_ref[cols], w2_ref[cols, :]))

        def body(t, carry):
            dw1, db1, dw2 = carry
            rows = pl.ds(t * tile, tile)
            tokens = _tokens(drop_ref, t * tile, tile)
            x = x_ref[rows, :]
            g, g_scale = _masked_cotangent(g_ref[rows, :], drop_ref, tokens, drop.out)
            act, slope = _hidden(x, w1, b1, _keep(drop_ref, 0, tokens, j * chunk, chunk, drop.hidden), drop.hidden)
            dpre = _dot(g, w2, trans_b=True) * (slope * g_scale)
            dw2 += _dot(act.astype(x.dtype), g, trans_a=True) * g_scale
            dw1 += _dot(x, dpre.astype(x.dtype), trans_a=True)
            return dw1, db1 + jnp.sum(dpre, axis=0), dw2

        init = (jnp.zeros((d, chunk), jnp.float32), jnp.zeros((chunk,), jnp.float32),
                jnp.zeros((chunk, d), jnp.float32))
        dw1, db1, dw2 = lax.fori_loop(lo, hi, body, init)
        # one block of the share's partial sums, (2 D + 1, chunk): rows of w1's, b1's, and w2's transposed
        parts_ref[pl.ds(0, d), :] = dw1
        parts_ref[d, :] = db1
        parts_ref[pl.ds(d + 1, d), :] = dw2.T

    @pl.when(j == chunks)
    def _():
        def body(t, db2):
            rows = pl.ds(t * tile, tile)
            g, g_scale = _masked_cotangent(g_ref[rows, :], drop_ref, _tokens(drop_ref, t * tile, tile), drop.out)
            return db2 + jnp.sum(g.astype(jnp.float32), axis=0) * g_scale

        db2 = lax.fori_loop(lo, hi, body, jnp.zeros((d,), jnp.float32))
        # its block's first rows; the rest zeros (never read, but XLA's reduction adds them up)
        zeros = jnp.zeros((d, chunk), jnp.float32)
        parts_ref[pl.ds(0, d), :] = zeros
        parts_ref[d, :] = jnp.zeros((chunk,), jnp.float32)
        parts_ref[pl.ds(d + 1, d), :] = zeros
        if d >= chunk:
            parts_ref[pl.ds(0, d // chunk), :] = db2.reshape(d // chunk, chunk)
        else:
            parts_ref[0, pl.ds(0, d)] = db2


def _whole(shape):
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _params(warps: int = 4, stages: int = 1):
    return plgpu.CompilerParams(num_warps=warps, num_stages=stages)


def _forward(x, w1, b1, w2, b2, drop_words, drop: Drop, interpret: bool):
    n, d = x.shape
    hidden, t = w1.shape[1], tile_of(n)
    rows = lambda width: pl.BlockSpec((t, width), lambda i: (i, 0))
    return pl.pallas_call(
        partial(_forward_kernel, hidden=hidden, drop=drop), grid=(n // t,),
        in_specs=[_whole((8,))] * bool(drop) + [rows(d), _whole(w1.shape), _whole(b1.shape), _whole(w2.shape),
                                                _whole(b2.shape)],
        out_specs=rows(d), out_shape=jax.ShapeDtypeStruct((n, d), x.dtype), compiler_params=_params(),
        interpret=interpret, name="fused_mlp_forward")(*[drop_words] * bool(drop), x, w1, b1, w2, b2)


@partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _mlp(x, w1, b1, w2, b2, drop_words, drop: Drop, interpret: bool):
    return _forward(x, w1, b1, w2, b2, drop_words, drop, interpret)


def _mlp_fwd(x, w1, b1, w2, b2, drop_words, drop, interpret):
    return _forward(x, w1, b1, w2, b2, drop_words, drop, interpret), (x, w1, b1, w2, drop_words)


def _mlp_bwd(drop: Drop, interpret: bool, res, g):
    x, w1, b1, w2, drop_words = res
    n, d = x.shape
    hidden, t = w1.shape[1], tile_of(n)
    g = g.astype(x.dtype)
    rows = lambda width: pl.BlockSpec((t, width), lambda i: (i, 0))
    words, word_spec = [drop_words] * bool(drop), [_whole((8,))] * bool(drop)
    dx = pl.pallas_call(
        partial(_inputs_kernel, hidden=hidden, drop=drop), grid=(n // t,),
        in_specs=word_spec + [rows(d), _whole(w1.shape), _whole(b1.shape), _whole(w2.shape), rows(d)],
        out_specs=rows(d), out_shape=jax.ShapeDtypeStruct((n, d), x.dtype),
        compiler_params=_params(), interpret=interpret, name="fused_mlp_inputs")(*words, x, w1, b1, w2, g)
    cut = WEIGHTS
    wt = min(cut.tile, t)  # both powers of two, so wt divides the tokens as t does
    tiles = n // wt
    splits = max(1, min(cut.max_splits, n // t // cut.min_share))  # min_share counts the other passes' tiles
    per_split = -(-tiles // splits)
    c, chunks = cut.chunk, hidden // cut.chunk
    parts = pl.pallas_call(  # chunk ``chunks``: b2's gradient
        partial(_weights_kernel, tile=wt, chunk=c, chunks=chunks, drop=drop),
        grid=(chunks + 1, splits),
        in_specs=[_whole((2,))] + word_spec + [_whole(x.shape), _whole(w1.shape), _whole(b1.shape), _whole(w2.shape),
                                               _whole(g.shape)],
        out_specs=pl.BlockSpec((None, None, 2 * d + 1, c), lambda j, s: (s, j, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((splits, chunks + 1, 2 * d + 1, c), jnp.float32),
        compiler_params=_params(cut.warps, cut.stages),
        interpret=interpret, name="fused_mlp_weights")(jnp.array([tiles, per_split], jnp.int32), *words, x, w1, b1,
                                                       w2, g)
    # The shares' partial sums of all three gradients in one buffer: XLA adds them in one reduction (three
    # had been three kernels), and the unpacking below fuses into whatever reads the gradients next.
    sums = parts.sum(0)  # (chunks + 1, 2 D + 1, c)
    dw1 = sums[:chunks, :d, :].transpose(1, 0, 2).reshape(d, hidden)
    db1 = sums[:chunks, d, :].reshape(hidden)
    dw2 = sums[:chunks, d + 1:, :].transpose(0, 2, 1).reshape(hidden, d)
    db2 = sums[chunks, :-(-d // c), :].reshape(-1)[:d]
    zero_words = np.zeros(drop_words.shape, jax.dtypes.float0) if drop_words is not None else None
    return (dx, dw1.astype(w1.dtype), db1.astype(b1.dtype), dw2.astype(w2.dtype), db2.astype(w2.dtype),
            zero_words)


_mlp.defvjp(_mlp_fwd, _mlp_bwd)


def fused_mlp(x: Array, w1: Array, b1: Array, w2: Array, b2: Array, seed: Array | None = None,
              rates: tuple[float, float] = (0.0, 0.0), first_token: Array | int = 0, *,
              interpret: bool = False) -> Array:
    """``dropout(fc2(dropout(gelu(fc1(x)))))`` for x (..., D), w1 (D, Hd), b1 (Hd,), w2 (Hd, D), b2 (D,),
    the weights in x's dtype or in float32 (rounded to x's dtype in the kernels; their gradients come back
    in their own dtype). Dropout: ``rates`` (hidden units, output), drawn by :func:`kept` from ``seed``
    (uint32 (4,): the hidden units' seed pair, then the output's; None: no dropout) with x's tokens
    numbered from ``first_token`` (the global index of its first token when x is one device's share).
    Differentiable in x and the weights. ``interpret``: Pallas interpret mode (any backend, tests)."""
    lead, d = x.shape[:-1], x.shape[-1]
    hidden = w1.shape[1]
    n = int(np.prod(lead))
    why = supports(n, d, hidden, x.dtype)
    if why is not None:
        raise ValueError(why)
    drop = Drop(*(float(r) for r in rates)) if seed is not None else Drop()
    if any(not 0.0 <= r < 1.0 for r in drop):
        raise ValueError(f"dropout rates must be in [0, 1), got {tuple(drop)}")
    words = None
    if drop:
        first = jnp.asarray(first_token, jnp.int32).astype(jnp.uint32).reshape(1)
        words = jnp.concatenate([jnp.asarray(seed, jnp.uint32).reshape(4), first, jnp.zeros((3,), jnp.uint32)])
    # Tiles of MIN_TILE tokens at least: a ragged tail is padded with zeros (its rows' cotangents
    # are then zero, so they add nothing to the weights' gradients) and cut off again.
    pad = -n % MIN_TILE
    rows = lambda a: a if not pad else jnp.pad(a, ((0, pad), (0, 0)))
    # The weights go in as they are (float32 parameters): the kernels round them to x's dtype on chip,
    # which saves a cast kernel per weight, and their gradients come back in float32, unrounded.
    y = _mlp(rows(x.reshape(n, d)), w1, b1, w2, b2, words, drop, interpret)
    return (y[:n] if pad else y).reshape(*lead, d)
