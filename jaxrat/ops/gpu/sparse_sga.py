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

Backward (custom VJP; residuals q, k, v, u, r, d: no map is kept). With w = v / d,
dA[o, p] = g_o . w_p + gd_p, where gd_p = -(sum_o A[o, p] g_o) . w_p / d_p is d's gradient, and
dl = A (dA - delta_o), delta_o = sum_p A[o, p] dA[o, p]:

1. input tiles: gw_p = sum_o A g_o, so dv = gw / d and gd (N_in floats);
2. group tiles: delta (N_out floats) and dq = sum_p dl k_p;
3. input tiles: dk = sum_o dl q_o.

Unnormalised, gd = 0: pass 2 comes first and passes 1 and 3 are one. Operands are read in their
dtype (bfloat16 on the GPU) and all arithmetic is float32; statistics are float32. See
:mod:`jaxrat.ops.gpu.sparse_sga_kernels` for the tiles, :func:`hbm_bytes` for the traffic.

The API is token-major, (B, N, H, d) as the projections make them; the kernels read head-major
slices, so the operands are transposed on the way in and the update on the way out. Kernels that
read token-major in place (no transpose) were tried and measured slower on an H100 (2026-11-27):
the first layer's forward + backward took 5.0 ms against 3.7, the ISIC step 44.1 against 40.0 ms,
more than the transposes cost (about 2 GB per layer, read once for all iterations).

On an H100 (jax 0.11.2, 2026-11-27), the ISIC first SGA layer (batch 16, 8 heads of 16, 256 x 256
inputs, kernel 7, stride 3, bf16), one call: forward 1.5 ms, forward + backward 3.7 ms, against
4.2-4.4 and 14.7-15.0 ms for the portable kernel (three runs); float32 within 1.3e-6 of it,
forward and gradients; bfloat16 closer to float32 than the portable kernel in bfloat16.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxrat.ops.gpu import sparse_sga_kernels as K
from jaxrat.ops.portable.chunked_attention import EPS
from jaxrat.ops.portable.sparse_sga import Geometry

Array = jax.Array
DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16))
MIN_HEAD_DIM, MAX_HEAD_DIM = 8, 128
MAX_GRID_AXIS = 65535  # a CUDA grid's y and z extent: the passes put rows on y, batch x heads on z


def lay_out(x: Array) -> Array:
    """Token-major keys or values (B, N, H, d) -> the kernels' head-major (B, H, N, d): done once per
    layer, for every grouping iteration (:func:`laid_out_update`)."""
    return x.transpose(0, 2, 1, 3)


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


def sparse_update(q: Array, k: Array, v: Array, geom: Geometry, normalise_columns: bool = True, *,
                  interpret: bool = False) -> Array:
    """The sparse SGA update, token-major: q (B, N_out, H, dh) scaled queries, k (B, N_in, H, dh),
    v (B, N_in, H, dv).

    Returns (B, N_out, H, dv) in q's dtype; differentiable in q, k and v (fused backward).
    ``interpret`` runs the Pallas kernels in interpret mode (any backend, for tests).
    """
    return laid_out_update(q, lay_out(k), lay_out(v), geom, normalise_columns, interpret=interpret)


def laid_out_update(q: Array, k: Array, v: Array, geom: Geometry, normalise_columns: bool = True, *,
                    interpret: bool = False) -> Array:
    """:func:`sparse_update` of token-major queries with keys and values already :func:`lay_out`:
    k (B, H, N_in, dh), v (B, H, N_in, dv)."""
    why = supports(geom, q.shape, q.dtype)
    if why is not None:
        raise ValueError(why)
    b, n_out, h, dh = q.shape
    n_in, dv = v.shape[2], v.shape[3]
    if k.shape != (b, h, n_in, dh) or v.shape[:2] != (b, h) or n_in != int(np.prod(geom.grid)):
        raise ValueError(f"keys {k.shape} and values {v.shape} (laid out) do not match queries {q.shape} on "
                         f"grid {geom.grid}")
    if not MIN_HEAD_DIM <= dv <= MAX_HEAD_DIM:
        raise ValueError(f"value dim {dv} is outside the fused kernels' {MIN_HEAD_DIM}..{MAX_HEAD_DIM}")
    flat = lambda x: x.astype(q.dtype).reshape(b * h, -1)
    u = _update(flat(lay_out(q)), flat(k), flat(v), K.Tiling.of(geom, dh, dv), normalise_columns, interpret)
    return lay_out(u.reshape(b, h, n_out, dv))  # the same swap of axes 1 and 2, back to token-major


def hbm_bytes(geom: Geometry, q_shape, dv: int, dtype, normalise_columns: bool = True) -> dict[str, int]:
    """Bytes each pass reads and writes in device memory for queries of ``q_shape`` (B, N_out, H, dh),
    counting every operand it touches once (the transposes around the passes not included).

    That is the traffic when a tile's halo (the key rows its neighbours read too) comes from the
    L2 cache; tiles of neighbouring rows run together, so it does. Without that reuse the group
    passes would read keys and values ``ky/sy`` times over (each input row is in that many output
    rows' windows).
    """
    b, n_out, h, dh = q_shape
    n_in, bh, e = int(np.prod(geom.grid)), b * h, np.dtype(dtype).itemsize
    size = dict(q=n_out * dh * e, g=n_out * dv * e, u=n_out * dv * e, dq=n_out * dh * e, r=n_out * 4,
                delta=n_out * 4, k=n_in * dh * e, v=n_in * dv * e, dk=n_in * dh * e, dv=n_in * dv * e,
                d=n_in * 4, gd=n_in * 4)
    if normalise_columns:
        passes = {"fwd groups lse": "q k | r", "fwd inputs colsum": "q k r | d", "fwd groups update": "q k v r d | u",
                  "bwd inputs dv": "q k v r g d | dv gd", "bwd groups dq": "q k v u r g d gd | dq delta",
                  "bwd inputs dk": "q k v r g d gd delta | dk"}
    else:
        passes = {"fwd groups flash": "q k v | r u", "bwd groups dq": "q k v u r g | dq delta",
                  "bwd inputs dv dk": "q k v r g delta | dv dk"}
    return {name: bh * sum(size[x] for x in names.replace("|", " ").split()) for name, names in passes.items()}


def _forward(q, k, v, t: K.Tiling, normalise: bool, interpret: bool):
    bh, n_out, n_in = q.shape[0], t.OY * t.OX, t.Y * t.X
    u_shape = K.flat_like(bh, n_out, t.dv, q.dtype)
    if not normalise:
        out = K.group_pass("lse", t, dict(q=q, k=k, v=v), dict(r=K.stats(bh, n_out), u=u_shape), interpret)
        return out["u"], out["r"], None
    r = K.group_pass("lse", t, dict(q=q, k=k), dict(r=K.stats(bh, n_out)), interpret)["r"]
    d = K.input_pass("colsum", t, dict(q=q, k=k, r=r), dict(d=K.stats(bh, n_in)), EPS, interpret)["d"]
    u = K.group_pass("update", t, dict(q=q, k=k, v=v, r=r, d=d), dict(u=u_shape), interpret)["u"]
    return u, r, d


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _update(q, k, v, t: K.Tiling, normalise: bool, interpret: bool):
    return _forward(q, k, v, t, normalise, interpret)[0]


def _update_fwd(q, k, v, t, normalise, interpret):
    u, r, d = _forward(q, k, v, t, normalise, interpret)
    return u, (q, k, v, u, r, d)


def _update_bwd(t: K.Tiling, normalise: bool, interpret: bool, res, g):
    q, k, v, u, r, d = res
    bh, n_out, n_in = q.shape[0], t.OY * t.OX, t.Y * t.X
    g = g.astype(q.dtype)
    dq_s, dk_s, dv_s = (K.flat_like(bh, n, dim, q.dtype) for n, dim in ((n_out, t.dh), (n_in, t.dh), (n_in, t.dv)))
    base = dict(q=q, k=k, v=v, r=r, g=g)
    grad_ins = dict(base, u=u)
    if normalise:
        out = K.input_pass("dv", t, dict(base, d=d), dict(dv=dv_s, gd=K.stats(bh, n_in)), EPS, interpret)
        dv, gd = out["dv"], out["gd"]
        out = K.group_pass("grad", t, dict(grad_ins, d=d, gd=gd), dict(dq=dq_s, delta=K.stats(bh, n_out)), interpret)
        dq, delta = out["dq"], out["delta"]
        dk = K.input_pass("dk", t, dict(base, d=d, gd=gd, delta=delta), dict(dk=dk_s), EPS, interpret)["dk"]
    else:
        out = K.group_pass("grad", t, grad_ins, dict(dq=dq_s, delta=K.stats(bh, n_out)), interpret)
        dq, delta = out["dq"], out["delta"]
        out = K.input_pass("dvdk", t, dict(base, delta=delta), dict(dv=dv_s, dk=dk_s), EPS, interpret)
        dv, dk = out["dv"], out["dk"]
    return dq, dk, dv


_update.defvjp(_update_fwd, _update_bwd)
