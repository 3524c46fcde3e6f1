"""Sparse (windowed) spatial grouping attention as fused Pallas (Triton) kernels, for GPUs.

The same operation as :mod:`jaxrat.ops.portable.sparse_sga`: group o attends to the inputs p of
its strided-convolution window W(o), with logits l = q_o . k_p (q already scaled), and

    r_o = logsumexp_{p in W(o)} l[o, p]          A[o, p] = exp(l[o, p] - r_o)
    d_p = sum_{o : p in W(o)} A[o, p] + EPS      u_o = sum_p A[o, p] v_p / d_p

(d = 1 without column normalisation). The portable kernel stacks logit-sized maps in memory per
window offset; here no map leaves the chip. Forward, three passes (one when columns are not
normalised: a flash-attention pass gives u and r together):

1. group tiles: r (N_out floats);
2. input tiles: recompute each input's covering logits from q and r, sum them: d (N_in floats);
3. group tiles: u.

(2 and 3 run as one sweep down the image, :mod:`jaxrat.ops.gpu.sparse_sga.sweep`, as do 1 and 2 of
the backward: a group row needs only its window's statistics.)

Backward (custom VJP; residuals q, k, v, u, r, d: no map is kept). With w = v / d,
dA[o, p] = g_o . w_p + gd_p, where gd_p = -(sum_o A[o, p] g_o) . w_p / d_p is d's gradient, and
dl = A (dA - delta_o), delta_o = sum_p A[o, p] dA[o, p]. Per call:

1. input tiles: gd (N_in floats);
2. group tiles: delta (N_out floats) and dq = sum_p dl k_p;

and once for all the calls on one layer's keys (its grouping iterations, :func:`lay_out_keys`):

3. input tiles: dv = sum_o A g_o / d and dk = sum_o dl q_o, summed over the calls on chip.

Unnormalised, gd = 0 and pass 1 goes. A layer of three iterations thus reads its keys and values
for the backward three times, not nine, and writes their gradients once, already summed. Operands
are read in their dtype (bfloat16 on the GPU) and all arithmetic is float32; statistics are
float32. See :mod:`jaxrat.ops.gpu.sparse_sga.passes` for the tiles, ``benchmarks/sparse_sga_traffic.py`` for
the traffic.

The API is token-major, (B, N, H, d) as the projections make them. The kernels read keys and values
as head-major slices, laid out once per layer: kernels reading them token-major in place measured
slower on an H100 than the transposes cost (docs/history/gpu_h100.md). Queries, cotangents, updates and
query gradients (a group tile's rows, read or written once a pass, stride and offset by the program's
head) they take token-major in place: no transpose around a call, and the update goes straight into
the layer norm after it, which XLA then runs as one kernel instead of five.

Its parity with the portable kernel and its speed on an H100 (the ISIC step's first SGA layer):
docs/history/gpu_h100.md; ``python benchmarks/sparse_sga_gpu.py`` measures them again.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrat.ops.blocks import SparseSGABlocks
from jaxrat.ops.gpu.sparse_sga import input_grad, sweep
from jaxrat.ops.gpu.sparse_sga.passes import flat_like, group_pass, input_pass, stats
from jaxrat.ops.gpu.sparse_sga.tiling import Tiling
from jaxrat.ops.portable.chunked_attention import EPS
from jaxrat.ops.portable.sparse_sga import Geometry

Array = jax.Array
DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16))
MIN_HEAD_DIM, MAX_HEAD_DIM = 8, 128
MAX_GRID_AXIS = 65535  # a CUDA grid's y and z extent: the passes put rows on y, batch x heads on z


def lay_out(x: Array) -> Array:
    """Token-major (B, N, H, d) <-> the kernels' head-major (B, H, N, d)."""
    return x.transpose(0, 2, 1, 3)


class LaidOutKeys(NamedTuple):
    """Keys and values laid out for the kernels, once per layer, with one tape per use
    (:func:`lay_out_keys`)."""

    k: Array  # (B, H, N_in, dh)
    v: Array  # (B, H, N_in, dv)
    tapes: tuple  # per use, zeros whose cotangents carry that use's backward statistics


def supports(geom: Geometry, q_shape, dtype) -> str | None:
    """None when the fused kernels take queries of ``q_shape`` (B, N_out, H, dh), else why not (one
    sentence)."""
    if len(geom.grid) != 2:
        return f"the fused sparse SGA kernels are written for 2 spatial dims, not {len(geom.grid)}"
    if np.dtype(dtype) not in DTYPES:
        return f"the fused sparse SGA kernels take float32 or bfloat16, not {np.dtype(dtype)}"
    if len(q_shape) != 4:
        return f"queries must be (batch, groups, heads, head dim), got shape {tuple(q_shape)}"
    if not MIN_HEAD_DIM <= q_shape[-1] <= MAX_HEAD_DIM:
        return f"head dim {q_shape[-1]} is outside the fused kernels' {MIN_HEAD_DIM}..{MAX_HEAD_DIM}"
    if q_shape[1] != int(np.prod(geom.out)):
        return f"{q_shape[1]} queries do not match the output grid {geom.out}"
    if min(geom.kernel) < 1 or min(geom.stride) < 1 or min(geom.out) < 1:
        return f"kernel {geom.kernel} and stride {geom.stride} leave no groups on grid {geom.grid}"
    if q_shape[0] * q_shape[2] > MAX_GRID_AXIS or geom.grid[0] > MAX_GRID_AXIS:
        return f"{q_shape[0]} x {q_shape[2]} slices or {geom.grid[0]} rows exceed a CUDA grid axis ({MAX_GRID_AXIS})"
    return None


def lay_out_keys(k: Array, v: Array, geom: Geometry, uses: int = 1, normalise_columns: bool = True, *,
                 interpret: bool = False, blocks: SparseSGABlocks = SparseSGABlocks()) -> LaidOutKeys:
    """Lay token-major keys k (B, N_in, H, dh) and values v (B, N_in, H, dv) out for ``uses``
    :func:`laid_out_update` calls (a layer's grouping iterations), which must each pass their own
    ``use`` index.

    The calls' backward passes compute only their queries' gradients; the keys' and values'
    gradients of all of them are summed in one pass over the inputs, here, when the last call's
    backward has run. Each call hands over what that pass needs (queries, cotangent, log-sum-exps,
    denominators and their gradients: none as large as the keys) as the cotangent of its tape.
    """
    b, n_in, h, dh = k.shape
    dv = v.shape[-1]
    if v.shape[:3] != (b, n_in, h) or n_in != int(np.prod(geom.grid)) or len(geom.grid) != 2:
        raise ValueError(f"keys {k.shape} and values {v.shape} do not match the grid {geom.grid}")
    if uses < 1:
        raise ValueError(f"keys are laid out for at least one use, not {uses}")
    t = Tiling.of(geom, dh, dv, heads=h, blocks=blocks)
    flat = lambda x: lay_out(x).reshape(b * h, -1)
    kf, vf, tapes = _keys(flat(k), flat(v.astype(k.dtype)), t, uses, normalise_columns, interpret)
    # tapes travel image-major (batch first, as per_device.over_batch splits them)
    return LaidOutKeys(kf.reshape(b, h, n_in, dh), vf.reshape(b, h, n_in, dv),
                       tuple(tuple(x.reshape(b, -1) for x in tape) for tape in tapes))


def lay_out_projection(kv: Array, phase: Array | None, geom: Geometry, heads: int, uses: int = 1,
                       normalise_columns: bool = True, *, interpret: bool = False,
                       blocks: SparseSGABlocks = SparseSGABlocks()) -> LaidOutKeys:
    """:func:`lay_out_keys` of a key-value projection's output ``kv`` (B, N_in, 2 H d): keys then
    values, H = ``heads`` of d each, the keys turned by RoSE's angles ``phase`` (N_in, Hr, d/2) of
    their first Hr heads (None: no rotation).

    The rotation, the split and the layout happen here, so the backward writes the projection's
    gradient whole: the keys' pass stores the keys' gradients, turned back, and the values' into one
    (B, N_in, 2 H d) array in place (a concatenate of the two, transposed and turned back, had read
    and written both again, compiled for an H100). The angles'
    gradient is then one sum over the batch of that and ``kv``: by the rotation's invariance,
    g . dR/dphase x = (R^T g) . J x with J the quarter turn of each pair."""
    b, n_in, width = kv.shape
    dh = width // (2 * heads)
    if width != 2 * heads * dh or n_in != int(np.prod(geom.grid)) or len(geom.grid) != 2:
        raise ValueError(f"a projection {kv.shape} does not hold keys and values of {heads} heads on the grid "
                         f"{geom.grid}")
    if uses < 1:
        raise ValueError(f"keys are laid out for at least one use, not {uses}")
    half = dh // 2
    if phase is None:
        phase = jnp.zeros((n_in, heads, half), jnp.float32)
    elif phase.shape[0] != n_in or phase.shape[1] > heads or phase.shape[2] != half:
        raise ValueError(f"RoSE angles {phase.shape} do not match {n_in} inputs of {heads} heads of {dh}")
    # every head gets angles: zero (cos 1, sin 0) for those RoSE leaves
    rotated = phase.shape[1]
    full = jnp.pad(phase.astype(jnp.float32), ((0, 0), (0, heads - rotated), (0, 0)))
    t = Tiling.of(geom, dh, dh, heads=heads, blocks=blocks)
    kf, vf, tapes = _projected(kv, full, t, rotated, uses, normalise_columns, interpret)
    return LaidOutKeys(kf.reshape(b, heads, n_in, dh), vf.reshape(b, heads, n_in, dh),
                       tuple(tuple(x.reshape(b, -1) for x in tape) for tape in tapes))


def sparse_update(q: Array, k: Array, v: Array, geom: Geometry, normalise_columns: bool = True, *,
                  interpret: bool = False, blocks: SparseSGABlocks = SparseSGABlocks()) -> Array:
    """The sparse SGA update, token-major: q (B, N_out, H, dh) scaled queries, k (B, N_in, H, dh),
    v (B, N_in, H, dv).

    Returns (B, N_out, H, dv) in q's dtype; differentiable in q, k and v (fused backward).
    ``interpret`` runs the Pallas kernels in interpret mode (any backend, for tests).
    """
    keys = lay_out_keys(k.astype(q.dtype), v.astype(q.dtype), geom, 1, normalise_columns, interpret=interpret,
                        blocks=blocks)
    return laid_out_update(q, keys, 0, geom, normalise_columns, interpret=interpret, blocks=blocks)


def laid_out_update(q: Array, keys: LaidOutKeys, use: int, geom: Geometry, normalise_columns: bool = True, *,
                    interpret: bool = False, blocks: SparseSGABlocks = SparseSGABlocks()) -> Array:
    """:func:`sparse_update` of token-major queries with keys and values already :func:`lay_out_keys`
    (with the same ``normalise_columns`` and ``blocks``), as their ``use``-th call."""
    why = supports(geom, q.shape, q.dtype)
    if why is not None:
        raise ValueError(why)
    b, n_out, h, dh = q.shape
    _, _, n_in, dv = keys.v.shape
    if keys.k.shape != (b, h, n_in, dh) or keys.v.shape[:2] != (b, h) or n_in != int(np.prod(geom.grid)):
        raise ValueError(f"keys {keys.k.shape} and values {keys.v.shape} (laid out) do not match queries "
                         f"{q.shape} on grid {geom.grid}")
    if not MIN_HEAD_DIM <= dv <= MAX_HEAD_DIM:
        raise ValueError(f"value dim {dv} is outside the fused kernels' {MIN_HEAD_DIM}..{MAX_HEAD_DIM}")
    if not 0 <= use < len(keys.tapes):
        raise ValueError(f"use {use} of keys laid out for {len(keys.tapes)}")
    if len(keys.tapes[use]) != len(_TAPE_NORMALISED if normalise_columns else _TAPE_PLAIN):
        raise ValueError("normalise_columns differs from the one the keys were laid out for")
    t = Tiling.of(geom, dh, dv, heads=h, blocks=blocks)
    names = _TAPE_NORMALISED if normalise_columns else _TAPE_PLAIN
    tape = tuple(x.reshape(s.shape) for x, s in zip(keys.tapes[use], _tape_shapes(t, b * h, q.dtype, names)))
    flat = lambda x: x.astype(keys.k.dtype).reshape(b * h, -1)
    u = _update(q.astype(keys.k.dtype).reshape(b, -1), flat(keys.k), flat(keys.v), tape, t, normalise_columns,
                interpret)
    return u.reshape(b, n_out, h, dv)


_TAPE_PLAIN = ("q", "g", "r", "delta")  # what a use's backward hands the keys' pass
_TAPE_NORMALISED = _TAPE_PLAIN + ("d", "gd")


def _groups_like(t: Tiling, bh: int, d: int, dtype) -> jax.ShapeDtypeStruct:
    """A group-level operand as the kernels take it: token-major, all heads of an image a row (or
    per (image, head) slice where the tiling has no ``heads``, as the benchmarks' bare kernels)."""
    if not t.heads:
        return flat_like(bh, t.OY * t.OX, d, dtype)
    return flat_like(bh // t.heads, t.OY * t.OX * t.heads, d, dtype)


def _tape_shapes(t: Tiling, bh: int, dtype, names) -> list:
    n_out, n_in = t.OY * t.OX, t.Y * t.X
    shapes = dict(q=_groups_like(t, bh, t.dh, dtype), g=_groups_like(t, bh, t.dv, dtype),
                  r=stats(bh, n_out), delta=stats(bh, n_out), d=stats(bh, n_in), gd=stats(bh, n_in))
    return [shapes[name] for name in names]


def blank_tapes(t: Tiling, bh: int, dtype, uses: int, normalise: bool) -> tuple:
    """One tape of zeros per use of keys laid out for ``uses`` calls: what a layout's forward returns,
    so that each call's backward hands its statistics to the keys' pass as the tape's cotangent."""
    names = _TAPE_NORMALISED if normalise else _TAPE_PLAIN
    return tuple(tuple(jnp.zeros(s.shape, s.dtype) for s in _tape_shapes(t, bh, dtype, names)) for _ in range(uses))


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _keys(k, v, t: Tiling, uses: int, normalise: bool, interpret: bool):
    return k, v, blank_tapes(t, k.shape[0], k.dtype, uses, normalise)


def _keys_fwd(k, v, t: Tiling, uses: int, normalise: bool, interpret: bool):
    return _keys(k, v, t, uses, normalise, interpret), (k, v)


def _keys_bwd(t: Tiling, uses: int, normalise: bool, interpret: bool, res, cts):
    k, v = res
    ck, cv, tapes = cts
    bh, n_in = k.shape[0], t.Y * t.X
    names = _TAPE_NORMALISED if normalise else _TAPE_PLAIN
    ins = dict(k=k, v=v)
    for use, tape in enumerate(tapes):
        ins.update({f"{name}{use}": x for name, x in zip(names, tape)})
    outs = dict(dk=flat_like(bh, n_in, t.dh, k.dtype), dv=flat_like(bh, n_in, t.dv, k.dtype))
    out = input_pass("keys", t, ins, outs, EPS, interpret, uses=uses)
    # the calls' own cotangents of k and v are zeros (XLA drops the sums); anything else is added
    return out["dk"] + ck, out["dv"] + cv


_keys.defvjp(_keys_fwd, _keys_bwd)


def split_turn(kv, phase, t: Tiling):
    """The projection's keys, turned, and values, each laid out head-major (B*H, N_in*d)."""
    from jaxrat.ops.gpu.rotate import tables, turn

    b, n, _ = kv.shape
    h, dh = t.heads, t.dh
    k = turn(kv[..., :h * dh].reshape(b, n, h, dh), *tables(phase, kv.dtype), h)
    v = kv[..., h * dh:].reshape(b, n, h, dh)
    flat = lambda x: lay_out(x).reshape(b * h, -1)
    return flat(k), flat(v)


# ``rotated``: the heads RoSE turns (the first); the others' angles are zeros, their gradient too
@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _projected(kv, phase, t: Tiling, rotated: int, uses: int, normalise: bool, interpret: bool):
    return _projected_fwd(kv, phase, t, rotated, uses, normalise, interpret)[0]


def _projected_fwd(kv, phase, t: Tiling, rotated: int, uses: int, normalise: bool, interpret: bool):
    kv, phase = (getattr(a, "value", a) for a in (kv, phase))  # CustomVJPPrimal under symbolic zeros
    k, v = split_turn(kv, phase, t)
    return (k, v, blank_tapes(t, k.shape[0], k.dtype, uses, normalise)), (kv, phase, k, v)


def projection_gradient(k, v, phase, tapes, t: Tiling, uses: int, normalise: bool, interpret: bool,
                        shape: tuple, dtype, bias: bool = False, weights=None):
    """The keys' pass over laid-out ``k``, ``v`` (B*H, N_in*d) and the uses' ``tapes`` (their
    cotangents): the gradient of the projection ``shape`` (B, N_in, 2 H d) they were laid out from,
    keys' part turned back by ``phase`` (N_in, H, d/2); with ``bias``, also its sum over the batch and
    the inputs, float32 (2 H d,), from the tiles' partial sums. Given the projection's ``weights``
    (C, 2 H d), the pass also writes the gradient of the projection's input (B, N_in, C) in ``dtype``
    (:func:`jaxrat.ops.gpu.sparse_sga.input_grad.keys_pass_with_inputs`): returns (dkv, [dbias,] dx)."""
    names = _TAPE_NORMALISED if normalise else _TAPE_PLAIN
    ins = dict(k=k, v=v, phase=phase.reshape(1, -1))
    zero = lambda s: jnp.zeros(s.shape, s.dtype)
    for use, tape in enumerate(tapes):
        if isinstance(tape, jax.custom_derivatives.SymbolicZero):  # a use whose update got no gradient
            tape = tuple(zero(s) for s in _tape_shapes(t, k.shape[0], k.dtype, names))
        tape = tuple(zero(z) if isinstance(z, jax.custom_derivatives.SymbolicZero) else z for z in tape)
        ins.update({f"{name}{use}": x for name, x in zip(names, tape)})
    b, n_in, width = shape
    if weights is not None:
        t = input_grad.tiling_with_inputs(t, weights.shape[0])
    outs = dict(dkv=jax.ShapeDtypeStruct((b, n_in * width), dtype))
    tiles = -(-t.X // t.tx) * t.Y  # the pass's programs per (image, head)
    if bias:
        outs["dbias"] = jax.ShapeDtypeStruct((b * t.heads, tiles * (t.dh + t.dv)), jnp.float32)
    if weights is None:
        out = input_pass("keys", t, ins, outs, EPS, interpret, uses=uses)
    else:
        ins["w"] = weights.astype(dtype).reshape(1, -1)
        outs["dx"] = jax.ShapeDtypeStruct((b, n_in * weights.shape[0]), dtype)
        out = input_grad.keys_pass_with_inputs(t, ins, outs, EPS, interpret, uses)
    result = (out["dkv"].reshape(shape),)
    if bias:
        parts = out["dbias"].reshape(b, t.heads, tiles, t.dh + t.dv).sum((0, 2))
        result += (jnp.concatenate([parts[:, :t.dh].reshape(-1), parts[:, t.dh:].reshape(-1)]),)
    if weights is not None:
        result += (out["dx"].reshape(b, n_in, weights.shape[0]),)
    return result[0] if len(result) == 1 else result


def _projected_bwd(t: Tiling, rotated: int, uses: int, normalise: bool, interpret: bool, res, cts):
    kv, phase, k, v = res
    ck, cv, tapes = cts
    b, n_in, width = kv.shape
    dkv = projection_gradient(k, v, phase, tapes, t, uses, normalise, interpret, kv.shape, kv.dtype)
    if not all(isinstance(c, jax.custom_derivatives.SymbolicZero) for c in (ck, cv)):
        # the laid-out keys or values were used outside the updates too: their gradients join by autodiff
        dkv = dkv + jax.vjp(lambda kv: split_turn(kv, phase, t), kv)[1](
            tuple(jnp.zeros(s.shape, s.dtype) if isinstance(s, jax.custom_derivatives.SymbolicZero) else s
                  for s in (ck, cv)))[0]
    # the angles' gradient: sum over the batch of (R^T g) . J x per pair, J the quarter turn (over
    # the turned heads only; the padding's is zero)
    half = t.dh // 2
    pairs = lambda a: a[..., :rotated * t.dh].reshape(b, n_in, rotated, half, 2).astype(jnp.float32)
    g, x = pairs(dkv), pairs(kv)
    d_phase = jnp.sum(g[..., 1] * x[..., 0] - g[..., 0] * x[..., 1], 0)
    return dkv, jnp.pad(d_phase, ((0, 0), (0, t.heads - rotated), (0, 0)))


_projected.defvjp(_projected_fwd, _projected_bwd, symbolic_zeros=True)


def _forward(q, k, v, t: Tiling, normalise: bool, interpret: bool):
    bh, n_out, n_in = k.shape[0], t.OY * t.OX, t.Y * t.X
    u_shape = _groups_like(t, bh, t.dv, q.dtype)
    if not normalise:
        out = group_pass("lse", t, dict(q=q, k=k, v=v), dict(r=stats(bh, n_out), u=u_shape), interpret)
        return out["u"], out["r"], None
    r = group_pass("lse", t, dict(q=q, k=k), dict(r=stats(bh, n_out)), interpret)["r"]
    if sweep.applies(t):
        out = sweep.sweep(("colsum", "update"), t, dict(q=q, k=k, v=v, r=r), dict(d=stats(bh, n_in), u=u_shape),
                      EPS, interpret)
        return out["u"], r, out["d"]
    d = input_pass("colsum", t, dict(q=q, k=k, r=r), dict(d=stats(bh, n_in)), EPS, interpret)["d"]
    u = group_pass("update", t, dict(q=q, k=k, v=v, r=r, d=d), dict(u=u_shape), interpret)["u"]
    return u, r, d


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _update(q, k, v, tape, t: Tiling, normalise: bool, interpret: bool):
    return _forward(q, k, v, t, normalise, interpret)[0]


def _update_fwd(q, k, v, tape, t: Tiling, normalise: bool, interpret: bool):
    u, r, d = _forward(q, k, v, t, normalise, interpret)
    return u, (q, k, v, u, r, d)


def _update_bwd(t: Tiling, normalise: bool, interpret: bool, res, g):
    """dq, and for k and v zeros: their gradients come from :func:`_keys_bwd`, given this call's
    statistics as the tape's cotangent."""
    q, k, v, u, r, d = res
    bh, n_out, n_in = k.shape[0], t.OY * t.OX, t.Y * t.X
    g = g.astype(q.dtype)
    outs = dict(dq=_groups_like(t, bh, t.dh, q.dtype), delta=stats(bh, n_out))
    base = dict(q=q, k=k, v=v, r=r, g=g)
    if normalise and sweep.applies(t):
        out = sweep.sweep(("gd", "grad"), t, dict(base, u=u, d=d), dict(gd=stats(bh, n_in), **outs), EPS, interpret)
        tape = (q, g, r, out["delta"], d, out["gd"])
    elif normalise:
        gd = input_pass("gd", t, dict(base, d=d), dict(gd=stats(bh, n_in)), EPS, interpret)["gd"]
        out = group_pass("grad", t, dict(base, u=u, d=d, gd=gd), outs, interpret)
        tape = (q, g, r, out["delta"], d, gd)
    else:
        out = group_pass("grad", t, dict(base, u=u), outs, interpret)
        tape = (q, g, r, out["delta"])
    return out["dq"], None, None, tape  # None: symbolic zeros, which the keys' backwards skip


_update.defvjp(_update_fwd, _update_bwd)
