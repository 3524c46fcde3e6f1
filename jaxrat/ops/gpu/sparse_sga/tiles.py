"""What both forms of the sparse SGA kernels share (:mod:`jaxrat.ops.gpu.sparse_sga.taps` the
tiles tap by tap, :mod:`jaxrat.ops.gpu.sparse_sga.products` as matrix products): loads and stores of
rows of a flat per-slice operand (or a token-major one's head, :class:`Strided`), clipped indices, the
row loop, and the products' float32 rules."""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu

from jaxrat.ops.gpu.sparse_sga.tiling import Tiling

NEG = -1e30  # masked logit: finite, so a fully masked row never makes inf - inf
TINY = 1e-30  # floor of a column denominator (real ones are >= EPS)


def ceil_div(a, s: int, bound: int):
    """ceil(a / s) for a traced int32 a >= -bound (integer division truncates: shift it first)."""
    m = bound // s + 1
    return lax.div(a + s * m + s - 1, s) - m


def loop(t: Tiling, n: int, body, init):
    """``body`` over range(n): a fori_loop, or straight-line code where the tiling says ``unroll``."""
    if not t.unroll:
        return lax.fori_loop(0, n, body, init)
    for i in range(n):
        init = body(i, init)
    return init


def clip(x, n: int):
    return jnp.minimum(jnp.maximum(x, 0), n - 1)


def feature_index(d: int, dp: int):
    feat = jnp.arange(dp, dtype=jnp.int32)
    return feat if d == dp else jnp.minimum(feat, d - 1)


class Strided(NamedTuple):
    """A token-major operand, (N, H, d) flat, seen as one head's rows: row n at ``n * stride + offset``
    (stride H*d, offset h*d). The loads and stores below take it where they take a flat (N*d) ref."""

    ref: Any
    stride: int
    offset: Any  # int32, traced: the program's head times d


# Group-level operands (queries, cotangents, updates, query gradients; a use's tape: q0, g1, ...),
# read and written token-major in place where the tiling has ``heads`` (no transposes around a call).
_GROUP_LEVEL = re.compile(r"(q|g|u|dq)\d*")


def token_major(name: str) -> bool:
    """Whether operand ``name`` is group-level (token-major where the tiling says so)."""
    return _GROUP_LEVEL.fullmatch(name) is not None


def strided_refs(refs: dict, heads: int, dims: dict, head) -> dict:
    """``refs`` with its group-level refs as :class:`Strided` views of head ``head`` of ``heads``;
    ``dims`` maps a name's first letters (q, g, u, dq) to its feature size."""
    if not heads:
        return refs
    out = dict(refs)
    for name, ref in refs.items():
        if token_major(name):
            d = dims[name.rstrip("0123456789")]
            out[name] = Strided(ref, heads * d, head * d)
    return out


def _base(ref, rows, d: int):
    """(the ref, each row's first element) for a flat or :class:`Strided` ref."""
    if isinstance(ref, Strided):
        return ref.ref, rows * ref.stride + ref.offset
    return ref, rows * d


def load(ref, rows, ok, d: int, dp: int, other=0.0):
    """(len(rows), dp) float32 from a flat (N*d) ref; masked rows and padded features read ``other``."""
    mask = ok[:, None]
    if d != dp:
        mask = mask & (jnp.arange(dp, dtype=jnp.int32) < d)[None, :]
    ref, base = _base(ref, rows, d)
    idx = base[:, None] + feature_index(d, dp)[None, :]
    return plgpu.load(ref.at[idx], mask=mask, other=other).astype(jnp.float32)


def load1(ref, rows, ok, other=0.0):
    """One float per row (a statistic) of a flat or :class:`Strided` ref."""
    ref, base = _base(ref, rows, 1)
    return plgpu.load(ref.at[base], mask=ok, other=other)


def store(ref, rows, ok, d: int, dp: int, val):
    feat = jnp.arange(dp, dtype=jnp.int32)
    mask = ok[:, None] & (feat < d)[None, :]
    ref, base = _base(ref, rows, d)
    # masked lanes point past the end: Triton does not store them, interpret mode drops them
    idx = jnp.where(mask, base[:, None] + feat[None, :], ref.shape[0])
    plgpu.store(ref.at[idx], val.astype(ref.dtype), mask=mask)


def store1(ref, rows, ok, val):
    ref, base = _base(ref, rows, 1)
    plgpu.store(ref.at[jnp.where(ok, base, ref.shape[0])], val.astype(ref.dtype), mask=ok)


def rowdot(a, b):
    return jnp.sum(a * b, axis=1)


def dot(a, b, exact: bool, transpose_b: bool = False):
    """a @ b (or a @ b.T) accumulated in float32. A float32 operand (weights, gradients of logits)
    meets a bfloat16 one (keys, values, queries, cotangents of a bfloat16 step) in bfloat16, as
    FlashAttention's probabilities and their gradients do: one tensor-core product, and half the
    registers (as three TF32 products, the group tiles' gradient pass spilled registers, compiled
    for an H100). Float32 operands both go as three TF32 products (about float32's accuracy), or
    exactly where ``exact`` (interpret mode: a CPU has no TF32)."""
    if a.dtype != b.dtype:
        low = b.dtype if a.dtype == jnp.float32 else a.dtype
        a, b = a.astype(low), b.astype(low)
    precision = None
    if a.dtype == jnp.float32:
        precision = None if exact else lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    dims = (((1,), (1,)), ((), ())) if transpose_b else (((1,), (0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def load_as(ref, rows, ok, d: int, dp: int):
    """Like :func:`load`, in the ref's own dtype (a matrix product's operand)."""
    mask = ok[:, None] & (jnp.arange(dp, dtype=jnp.int32) < d)[None, :]
    ref, base = _base(ref, rows, d)
    idx = base[:, None] + feature_index(d, dp)[None, :]
    return plgpu.load(ref.at[idx], mask=mask, other=0)


def keys_over_uses(t: Tiling, uses: int, refs, input_rows, ok, zeros_v, use_body):
    """The keys' pass of either form: dk and dv (float32, (tile, d)) of the inputs ``input_rows``, summed over
    a layer's ``uses`` on chip. ``use_body(use, inv_d, gd)`` gives the loop body over the ``nt``
    covering output rows, carrying (sum_o A g_o, dk); inv_d and gd are that use's 1 / d and d's
    gradient at the inputs, (None, None) without column normalisation. A use whose backward never ran
    left d = 0: it must add nothing, not 0 / 0, hence the floor. :func:`store_keys` stores them."""
    dk, dv = jnp.zeros((zeros_v.shape[0], t.dhp), jnp.float32), zeros_v
    for use in map(str, range(uses)):
        inv_d = gd = None
        if "d" + use in refs:
            inv_d = 1.0 / jnp.maximum(load1(refs["d" + use], input_rows, ok, 1.0), TINY)
            gd = load1(refs["gd" + use], input_rows, ok)
        gw, dk = loop(t, t.nt, use_body(use, inv_d, gd), (zeros_v, dk))
        dv = dv + (gw if inv_d is None else gw * inv_d[:, None])
    return dk, dv


def store_keys(refs, t: Tiling, input_rows, ok, dk, dv, head, bias_at=None):
    """Store :func:`keys_over_uses`' sums: as dk and dv (per slice), or into the projection's gradient
    ``dkv`` (B, N_in * 2 H d), token-major, keys then values, the keys' turned back by their RoSE
    angles first (the transpose of the forward's rotation), there with the tile's column sums at
    ``bias_at`` of ``dbias`` where there is one. Returns dk as stored (turned back)."""
    if "dkv" not in refs:
        store(refs["dk"], input_rows, ok, t.dh, t.dhp, dk)
        store(refs["dv"], input_rows, ok, t.dv, t.dvp, dv)
        return dk
    width = t.heads * (t.dh + t.dv)
    dk = turn_back(dk, refs["phase"], input_rows, ok, t, head)
    store(Strided(refs["dkv"], width, head * t.dh), input_rows, ok, t.dh, t.dhp, dk)
    store(Strided(refs["dkv"], width, t.heads * t.dh + head * t.dv), input_rows, ok, t.dv, t.dvp, dv)
    if "dbias" in refs:  # the projection's bias: this tile's column sums, which XLA adds (no pass over dkv)
        _store_column_sums(refs["dbias"], bias_at, ok, t.dh, t.dhp, dk)
        _store_column_sums(refs["dbias"], bias_at + t.dh, ok, t.dv, t.dvp, dv)
    return dk


def _store_column_sums(ref, at, ok, d: int, dp: int, val) -> None:
    feat = jnp.arange(dp, dtype=jnp.int32)
    total = jnp.sum(jnp.where(ok[:, None], val, 0.0), axis=0)
    plgpu.store(ref.at[jnp.where(feat < d, at + feat, ref.shape[0])], total, mask=feat < d)


def turn_back(dk, phase_ref, input_rows, ok, t: Tiling, head):
    """R_p^T dk for each input row p of the tile: its (re, im) feature pairs turned by minus their
    angles ``phase[p, head, pair]`` (a flat (N_in * H * dh/2) float32 ref: zero for heads RoSE leaves,
    whose cos 1 and sin 0 pass them exactly)."""
    half = t.dhp // 2
    pair = jnp.arange(half, dtype=jnp.int32)
    idx = input_rows[:, None] * (t.heads * (t.dh // 2)) + head * (t.dh // 2) + jnp.minimum(pair, t.dh // 2 - 1)[None, :]
    angle = plgpu.load(phase_ref.at[idx], mask=ok[:, None] & (pair < t.dh // 2)[None, :], other=0.0)
    c, s = jnp.cos(angle), jnp.sin(angle)
    re, im = jnp.unstack(dk.reshape(dk.shape[0], half, 2), axis=-1)
    return jnp.stack([re * c + im * s, im * c - re * s], axis=-1).reshape(dk.shape)
