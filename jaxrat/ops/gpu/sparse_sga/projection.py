"""A sparse SGA layer's key-value projection and its layout as one Pallas (Triton) kernel, for GPUs.

:func:`jaxrat.ops.gpu.sparse_sga.api.lay_out_projection` takes the projection ``x @ W + b`` as XLA made
it: cuBLAS writes it token-major, and one more kernel reads it back to add the bias, turn the keys
(RoSE) and write keys and values head-major, as the passes read them. In the ISIC first layer,
compiled for an H100, that second kernel moved more bytes than the product itself. Here each
program multiplies a tile of :data:`TOKENS` inputs of one image by every head's columns of ``W`` (on
the tensor cores, float32 accumulation), adds the bias, turns the keys and stores each head's rows
straight into the head-major keys and values: the inputs are read once and the projection is never
written token-major.

The backward is :func:`jaxrat.ops.gpu.sparse_sga.api.projection_gradient`: the keys' pass writes the
projection's gradient token-major, keys turned back, and (inputs of at most
:data:`MAX_FEATURES_IN_PASS` channels) the inputs' gradient too, each program taking one tile of an
image through every head and multiplying each head's gradients by its columns of ``W`` on chip; XLA's
product then gives the weights' gradient. In the ISIC first layer, compiled for an H100, that drops
cuBLAS's product for the inputs' gradient, which read the projection's gradient back: the step moves
less. Wider inputs, and ``SparseSGABlocks.input_grad_features = 0``, take XLA's product.

The angles' gradient is taken from the laid-out keys, as the token-major
projection no longer exists: with g the turned-back gradient and k = R x the turned keys,
``g . J x = (R g) . J k`` (R and the quarter turn J commute), that is ``cos A + sin B`` with A and B
sums over the batch.

The kernel rounds the weights and the bias to the inputs' dtype, as the model's product does; the
caller hands it the weights rounded already (the backward's product reads them so too), the bias
float32 (the kernel's column sums give its gradient in float32).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxrat.ops.blocks import SparseSGABlocks
from jaxrat.ops.gpu.sparse_sga import api
from jaxrat.ops.gpu.sparse_sga.tiling import Tiling
from jaxrat.ops.portable.sparse_sga import Geometry

Array = jax.Array
TOKENS = 64  # inputs a program projects: the rows of its products
# Inputs of at most this many channels (and of SparseSGABlocks.input_grad_features) get their gradient from
# the keys' pass itself (its float32 sums of a tile, 64 x C, fit the registers); wider ones from XLA's product
MAX_FEATURES_IN_PASS = 256


def _pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def kernel_supports(n_in: int, features: int, dh: int, dtype) -> bool:
    """Whether the kernel takes inputs of ``features`` channels on ``n_in`` tokens into heads of ``dh``
    (otherwise the same op runs XLA's product and layout): Triton's products want powers of two of
    at least 16, and the tiles cover the tokens exactly."""
    return (jnp.dtype(dtype) in api.DTYPES and _pow2(features) and features <= 512 and _pow2(dh)
            and dh <= 128 and n_in % TOKENS == 0)


def _kernel(x_ref, w_ref, b_ref, phase_ref, k_ref, v_ref, *, heads: int, dh: int, rotated: int):
    x = x_ref[...]
    half = dh // 2
    for j, out in enumerate((k_ref, v_ref)):
        for h in range(heads):
            col = (j * heads + h) * dh
            w = w_ref[:, pl.ds(col, dh)].astype(x.dtype)  # rounded as the model's own product rounds it
            bias = b_ref[pl.ds(col, dh)].astype(x.dtype).astype(jnp.float32)
            y = jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
            y = y + bias[None, :]
            if j == 0 and h < rotated:
                angle = phase_ref[:, pl.ds(h * half, half)]
                c, s = jnp.cos(angle), jnp.sin(angle)
                re, im = jnp.unstack(y.reshape(TOKENS, half, 2), axis=-1)
                y = jnp.stack([re * c - im * s, im * c + re * s], axis=-1).reshape(TOKENS, dh)
            out[h] = y.astype(out.dtype)


def project(x: Array, w: Array, b: Array, phase: Array, heads: int, rotated: int, *,
            interpret: bool = False) -> tuple[Array, Array]:
    """Keys (turned) and values of ``x`` (B, N_in, C) by ``w`` (C, 2 H d) and ``b`` (2 H d,), head-major
    (B, H, N_in, d) in x's dtype; ``phase`` (N_in, H, d/2) float32 turns the first ``rotated`` heads."""
    bsz, n_in, c = x.shape
    dh = w.shape[1] // (2 * heads)
    flat_phase = phase.astype(jnp.float32).reshape(n_in, heads * (dh // 2))
    out = jax.ShapeDtypeStruct((bsz, heads, n_in, dh), x.dtype)
    return pl.pallas_call(
        partial(_kernel, heads=heads, dh=dh, rotated=rotated),
        grid=(n_in // TOKENS, bsz),
        in_specs=[pl.BlockSpec((None, TOKENS, c), lambda i, n: (n, i, 0)),
                  pl.BlockSpec(w.shape, lambda i, n: (0, 0)),
                  pl.BlockSpec(b.shape, lambda i, n: (0,)),
                  pl.BlockSpec((TOKENS, flat_phase.shape[1]), lambda i, n: (i, 0))],
        out_specs=[pl.BlockSpec((None, heads, TOKENS, dh), lambda i, n: (n, 0, i, 0))] * 2,
        out_shape=[out, out],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="sparse_sga_projection",
    )(x, w, b, flat_phase)


def _xla_projection(x, w, b):
    """The projection as the model's Linear computes it at x's dtype."""
    dt = x.dtype
    return jax.lax.dot_general(x, w.astype(dt), (((2,), (0,)), ((), ()))) + b.astype(dt)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _inputs_projected(x, w, b, phase, t: Tiling, rotated: int, uses: int, normalise: bool, interpret: bool):
    return _fwd(x, w, b, phase, t, rotated, uses, normalise, interpret)[0]


def _fwd(x, w, b, phase, t: Tiling, rotated: int, uses: int, normalise: bool, interpret: bool):
    x, w, b, phase = (getattr(a, "value", a) for a in (x, w, b, phase))  # CustomVJPPrimal under symbolic zeros
    bsz, n_in, _ = x.shape
    if kernel_supports(n_in, x.shape[2], t.dh, x.dtype):
        k, v = (a.reshape(bsz * t.heads, -1) for a in project(x, w, b, phase, t.heads, rotated, interpret=interpret))
    else:
        k, v = api.split_turn(_xla_projection(x, w, b), phase, t)
    return (k, v, api.blank_tapes(t, k.shape[0], k.dtype, uses, normalise)), (x, w, b, phase, k, v)


def _zero(c):
    return jnp.zeros(c.shape, c.dtype) if isinstance(c, jax.custom_derivatives.SymbolicZero) else c


def _bwd(t: Tiling, rotated: int, uses: int, normalise: bool, interpret: bool, res, cts):
    x, w, b, phase, k, v = res
    ck, cv, tapes = cts
    bsz, n_in, _ = x.shape
    heads, dh, half = t.heads, t.dh, t.dh // 2
    shape = (bsz, n_in, 2 * heads * dh)
    times_w = lambda g: jax.lax.dot_general(g, w.astype(g.dtype), (((2,), (1,)), ((), ())))
    dx = None
    if _pow2(x.shape[2]) and x.shape[2] <= min(t.input_grad_features, MAX_FEATURES_IN_PASS):  # the keys' pass writes dx
        dkv, db, dx = api.projection_gradient(k, v, phase, tapes, t, uses, normalise, interpret, shape, x.dtype,
                                            bias=True, weights=w)
    else:
        dkv, db = api.projection_gradient(k, v, phase, tapes, t, uses, normalise, interpret, shape, x.dtype,
                                        bias=True)
    if not all(isinstance(c, jax.custom_derivatives.SymbolicZero) for c in (ck, cv)):
        # the laid-out keys or values were used outside the updates too: their gradients join by autodiff
        turn = lambda kv: api.split_turn(kv, phase, t)
        extra = jax.vjp(turn, _xla_projection(x, w, b))[1]((_zero(ck), _zero(cv)))[0]
        dkv, db = dkv + extra, db + jnp.sum(extra.astype(jnp.float32), (0, 1))
        dx = None if dx is None else dx + times_w(extra)
    f32 = jnp.float32
    g = dkv[..., :rotated * dh].reshape(bsz, n_in, rotated, half, 2).astype(f32)
    turned = k.reshape(bsz, heads, n_in, half, 2)[:, :rotated].transpose(0, 2, 1, 3, 4).astype(f32)
    angle = phase[:, :rotated].astype(f32)
    cross = g[..., 1] * turned[..., 0] - g[..., 0] * turned[..., 1]
    along = g[..., 0] * turned[..., 0] + g[..., 1] * turned[..., 1]
    # one sum over the batch, the tables inside it: as two sums, XLA read both operands twice
    d_phase = jnp.sum(jnp.cos(angle) * cross + jnp.sin(angle) * along, 0)
    d_phase = jnp.pad(d_phase, ((0, 0), (0, heads - rotated), (0, 0)))
    dx = times_w(dkv) if dx is None else dx
    dw = jax.lax.dot_general(x, dkv, (((0, 1), (0, 1)), ((), ())), preferred_element_type=f32)
    return dx.astype(x.dtype), dw.astype(w.dtype), db.astype(b.dtype), d_phase.astype(phase.dtype)


_inputs_projected.defvjp(_fwd, _bwd, symbolic_zeros=True)


def lay_out_inputs(x: Array, w: Array, b: Array, phase: Array | None, geom: Geometry, heads: int, uses: int = 1,
                   normalise_columns: bool = True, *, interpret: bool = False,
                   blocks: SparseSGABlocks = SparseSGABlocks()) -> api.LaidOutKeys:
    """:func:`jaxrat.ops.gpu.sparse_sga.api.lay_out_projection` of ``x @ w + b`` (x (B, N_in, C) in the
    compute dtype, ``w`` (C, 2 H d), ``b`` (2 H d,)), the product and the layout
    in one kernel where :func:`kernel_supports` says so; differentiable in x, w, b and the angles
    ``phase`` (N_in, Hr, d/2) that turn the keys' first Hr heads (None: none)."""
    bsz, n_in, c = x.shape
    width = w.shape[1]
    dh = width // (2 * heads)
    if w.shape[0] != c or width != 2 * heads * dh or b.shape != (width,) or n_in != geom.grid[0] * geom.grid[1]:
        raise ValueError(f"weights {w.shape} and bias {b.shape} do not project {x.shape} into keys and values of "
                         f"{heads} heads on the grid {geom.grid}")
    half = dh // 2
    if phase is None:
        phase = jnp.zeros((n_in, 0, half), jnp.float32)
    if phase.shape[0] != n_in or phase.shape[1] > heads or phase.shape[2] != half:
        raise ValueError(f"RoSE angles {phase.shape} do not match {n_in} inputs of {heads} heads of {dh}")
    rotated = phase.shape[1]
    full = jnp.pad(phase.astype(jnp.float32), ((0, 0), (0, heads - rotated), (0, 0)))
    t = Tiling.of(geom, dh, dh, heads=heads, blocks=blocks)
    k, v, tapes = _inputs_projected(x, w, b, full, t, rotated, uses, normalise_columns, interpret)
    return api.LaidOutKeys(k.reshape(bsz, heads, n_in, dh), v.reshape(bsz, heads, n_in, dh),
                         tuple(tuple(a.reshape(bsz, -1) for a in tape) for tape in tapes))
