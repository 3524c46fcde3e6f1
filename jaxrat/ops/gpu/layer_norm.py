"""Layer normalisation over the last axis as Pallas (Triton) kernels, for GPUs, with the residual
add of a post-norm block (``residual + LN(x)``) in the same kernel.

XLA:GPU makes a layer norm's forward one kernel where it can (its Triton normalisation fusion) but
five where the input arrives transposed, and its backward four: the row statistics are recomputed,
and the scale's gradient, a column sum of ``g * x_hat``, cannot hold a row reduction inside a column
one, so that float32 product goes through memory first. Here:

* forward, a program per tile of rows: the mean, then the variance about it (two sweeps over the
  tile on chip, as PyTorch and flax compute them), ``y = x_hat * scale + bias (+ residual)`` in
  float32 and rounded once; the statistics (8 bytes a row) kept for the backward;
* backward, a program per run of row tiles: ``dx`` from the kept statistics, and the run's partial
  column sums of ``g * x_hat`` and ``g`` (float32, accumulated on chip over the run); XLA adds the
  runs' partials, a few hundred rows of D.

Rows are read and written in place through masked loads and stores, so any number of tokens works
with no padding copy. The residual's gradient is the cotangent itself.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

Array = jax.Array
DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16))
MIN_DIM, MAX_DIM = 16, 4096
TILE_ELEMENTS = 4096  # rows a tile: this many elements over the (power of two) features
MAX_RUNS = 512  # the backward's programs at most: each adds its rows' column sums on chip
WARPS = 4


def supports(rows: int, dim: int, dtype) -> str | None:
    """None when the kernels take ``rows`` rows of ``dim`` features in ``dtype``, else why not."""
    if np.dtype(dtype) not in DTYPES:
        return f"the layer norm kernels take float32 or bfloat16, not {np.dtype(dtype)}"
    if dim & (dim - 1) or not MIN_DIM <= dim <= MAX_DIM:
        return f"the layer norm kernels take a power of two from {MIN_DIM} to {MAX_DIM} features, not {dim}"
    if rows * dim >= 2**31:
        return f"{rows} rows of {dim} exceed the kernels' int32 indices"
    return None


def layer_norm(x: Array, scale: Array, bias: Array, eps: float, residual: Array | None = None, *,
               interpret: bool = False) -> Array:
    """``(residual +) (x - mean) / sqrt(var + eps) * scale + bias`` over the last axis of ``x``,
    in x's dtype (statistics and arithmetic float32, rounded once); differentiable in x, scale,
    bias and the residual. ``interpret`` runs the kernels in interpret mode (any backend, tests)."""
    dim = x.shape[-1]
    rows = int(np.prod(x.shape[:-1]))
    why = supports(rows, dim, x.dtype)
    if why is not None:
        raise ValueError(why)
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"the residual {residual.shape} must have the shape of x {x.shape}")
    flat = lambda a: a.reshape(-1)
    res = None if residual is None else flat(residual.astype(x.dtype))
    y = _norm(flat(x), scale.astype(jnp.float32), bias.astype(jnp.float32), res, res is not None, rows, dim,
              float(eps), interpret)
    return y.reshape(x.shape)


def _tile(dim: int) -> int:
    return max(1, TILE_ELEMENTS // dim)


def _rows(tile: int, start, n: int):
    rows = start + jnp.arange(tile, dtype=jnp.int32)
    ok = rows < n
    return jnp.minimum(rows, n - 1), ok


def _load(ref, rows, ok, dim: int):
    idx = rows[:, None] * dim + jnp.arange(dim, dtype=jnp.int32)[None, :]
    return plgpu.load(ref.at[idx], mask=ok[:, None], other=0).astype(jnp.float32)


def _store(ref, rows, ok, dim: int, val):
    idx = rows[:, None] * dim + jnp.arange(dim, dtype=jnp.int32)[None, :]
    # masked lanes point past the end: Triton does not store them, interpret mode drops them
    idx = jnp.where(ok[:, None], idx, ref.shape[0])
    plgpu.store(ref.at[idx], val.astype(ref.dtype), mask=ok[:, None])


def _store1(ref, rows, ok, val):
    plgpu.store(ref.at[jnp.where(ok, rows, ref.shape[0])], val, mask=ok)


def _forward_kernel(*refs, n: int, dim: int, eps: float, has_residual: bool):
    x_ref, s_ref, b_ref = refs[:3]
    res_ref = refs[3] if has_residual else None
    y_ref, mean_ref, rstd_ref = refs[3 + has_residual:]
    tile = _tile(dim)
    rows, ok = _rows(tile, pl.program_id(0) * tile, n)
    x = _load(x_ref, rows, ok, dim)
    mean = jnp.sum(x, axis=1) / dim
    centred = x - mean[:, None]
    rstd = lax.rsqrt(jnp.sum(centred * centred, axis=1) / dim + eps)
    y = centred * rstd[:, None] * s_ref[...][None, :] + b_ref[...][None, :]
    if has_residual:
        y = y + _load(res_ref, rows, ok, dim)
    _store(y_ref, rows, ok, dim, y)
    _store1(mean_ref, rows, ok, mean)
    _store1(rstd_ref, rows, ok, rstd)


def _backward_kernel(x_ref, s_ref, mean_ref, rstd_ref, g_ref, dx_ref, part_ref, *, n: int, dim: int, per_run: int):
    tile = _tile(dim)
    scale = s_ref[...][None, :]
    first = pl.program_id(0) * per_run  # read outside the loop: interpret mode has no program id inside

    def body(i, sums):
        rows, ok = _rows(tile, (first + i) * tile, n)
        x, g = _load(x_ref, rows, ok, dim), _load(g_ref, rows, ok, dim)  # rows past the end: g = 0
        mean = plgpu.load(mean_ref.at[rows], mask=ok, other=0.0)
        rstd = plgpu.load(rstd_ref.at[rows], mask=ok, other=0.0)
        x_hat = (x - mean[:, None]) * rstd[:, None]
        gs = g * scale
        a = jnp.sum(gs, axis=1) / dim
        b = jnp.sum(gs * x_hat, axis=1) / dim
        _store(dx_ref, rows, ok, dim, rstd[:, None] * (gs - a[:, None] - x_hat * b[:, None]))
        return sums[0] + jnp.sum(g * x_hat, axis=0), sums[1] + jnp.sum(g, axis=0)

    zeros = jnp.zeros((dim,), jnp.float32)
    d_scale, d_bias = lax.fori_loop(0, per_run, body, (zeros, zeros))
    part_ref[0, :] = d_scale
    part_ref[1, :] = d_bias


def _whole(shape) -> pl.BlockSpec:
    return pl.BlockSpec(shape, lambda i: (0,) * len(shape))


def _forward(x, scale, bias, residual, n: int, dim: int, eps: float, interpret: bool):
    tile = _tile(dim)
    has_residual = residual is not None
    ins = [x, scale, bias] + ([residual] if has_residual else [])
    return pl.pallas_call(
        partial(_forward_kernel, n=n, dim=dim, eps=eps, has_residual=has_residual),
        grid=(pl.cdiv(n, tile),),
        in_specs=[_whole(a.shape) for a in ins],
        out_specs=[_whole(x.shape), _whole((n,)), _whole((n,))],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((n,), jnp.float32),
                   jax.ShapeDtypeStruct((n,), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=WARPS, num_stages=1),
        interpret=interpret, name="layer_norm_forward")(*ins)


# the residual (None or an array) is differentiable; whether there is one is static
@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _norm(x, scale, bias, residual, has_residual: bool, n: int, dim: int, eps: float, interpret: bool):
    return _forward(x, scale, bias, residual, n, dim, eps, interpret)[0]


def _norm_fwd(x, scale, bias, residual, has_residual, n, dim, eps, interpret):
    y, mean, rstd = _forward(x, scale, bias, residual, n, dim, eps, interpret)
    return y, (x, scale, mean, rstd)


def _norm_bwd(has_residual: bool, n: int, dim: int, eps: float, interpret: bool, res, g):
    x, scale, mean, rstd = res
    tiles = pl.cdiv(n, _tile(dim))
    per_run = pl.cdiv(tiles, min(tiles, MAX_RUNS))
    runs = pl.cdiv(tiles, per_run)
    dx, parts = pl.pallas_call(
        partial(_backward_kernel, n=n, dim=dim, per_run=per_run),
        grid=(runs,),
        in_specs=[_whole(x.shape), _whole(scale.shape), _whole(mean.shape), _whole(rstd.shape), _whole(g.shape)],
        out_specs=[_whole(x.shape), pl.BlockSpec((None, 2, dim), lambda i: (i, 0, 0))],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((runs, 2, dim), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=WARPS, num_stages=1),
        interpret=interpret, name="layer_norm_backward")(x, scale, mean, rstd, g.astype(x.dtype))
    sums = parts.sum(0)
    return dx, sums[0], sums[1], (g if has_residual else None)


_norm.defvjp(_norm_fwd, _norm_bwd)
