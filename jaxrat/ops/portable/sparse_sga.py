"""Sparse (windowed) spatial grouping attention kernels.

Each output group attends only to the k^sd input window its strided convolution covers
(out-of-image taps excluded); the column sums run over the groups whose window contains the
token. Keys and values are never copied into windows (that is ~(k/s)^sd = 9 copies of k and v):
the input is cut once into stride-blocks, and for each of the ``ceil(k/s)^sd`` block offsets the
small query grid is shifted onto the blocked key grid, so every product reads k and v in place
and only logit-sized maps are stacked.

:func:`sparse_update` (what the SGA layer runs every iteration) has a custom VJP that saves only
its inputs and recomputes the logit-sized maps in the backward pass, like the chunked dense kernel
(:mod:`jaxrat.ops.portable.chunked_attention`): autodiff of the plain form would keep every
iteration's per-offset full-resolution products and their cotangents.
:func:`sparse_grouping` is the plain (autodiff) form that also returns the maps.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrat.ops.portable.chunked_attention import EPS

Array = jax.Array


def strided_grid(grid_shape: Sequence[int], kernel: Sequence[int], stride: Sequence[int]) -> tuple[int, ...]:
    """Output grid of the strider conv (pad (k-1)//2, or "same" when every stride is 1)."""
    if all(s == 1 for s in stride):
        return tuple(grid_shape)
    return tuple((n + 2 * ((k - 1) // 2) - k) // s + 1 for n, k, s in zip(grid_shape, kernel, stride))


def window_indices(grid_shape: Sequence[int], kernel: Sequence[int],
                   stride: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Each output group's window taps as flat input indices, in the layout of :func:`_windows`.

    A window is read as ``ceil(k/s)`` whole stride-blocks per axis, so it has ``ceil(k/s)*s >= k``
    taps per axis; taps beyond the kernel or outside the image are invalid. Returns
    (N_out, taps) int32 indices (invalid taps point at 0) and the bool validity.
    """
    out = strided_grid(grid_shape, kernel, stride)
    nb = [-(-k // s) for k, s in zip(kernel, stride)]
    per_axis_idx, per_axis_ok = [], []
    for n, o, k, s, b in zip(grid_shape, out, kernel, stride, nb):
        offset = np.arange(b)[:, None] * s + np.arange(s)[None, :]  # (nb, s) tap offset in the window
        pos = np.arange(o)[:, None, None] * s - (k - 1) // 2 + offset[None]  # (o, nb, s)
        per_axis_idx.append(pos)
        per_axis_ok.append((offset[None] < k) & (pos >= 0) & (pos < n))
    sd = len(grid_shape)
    strides_in = np.cumprod((1,) + tuple(grid_shape[::-1]))[:-1][::-1]
    flat = np.zeros((), np.int64)
    ok = np.ones((), bool)
    for d in range(sd):
        # layout (o_1..o_sd, nb_1..nb_sd, s_1..s_sd)
        shape = [1] * (3 * sd)
        shape[d], shape[sd + d], shape[2 * sd + d] = out[d], nb[d], stride[d]
        flat = flat + np.clip(per_axis_idx[d], 0, grid_shape[d] - 1).reshape(shape) * strides_in[d]
        ok = ok & per_axis_ok[d].reshape(shape)
    n_out = int(np.prod(out))
    ok = ok.reshape(n_out, -1)
    return np.where(ok, flat.reshape(n_out, -1), 0).astype(np.int32), ok


def _blocked(x: Array, kernel: Sequence[int], stride: Sequence[int]) -> Array:
    """(N, *grid, C) -> (N, B_1..B_sd, s_1..s_sd, C): padded input cut into stride-blocks.

    B_d = out_d + ceil(k_d/s_d) - 1; a window is ``ceil(k/s)`` consecutive blocks per axis.
    """
    grid, c = x.shape[1:-1], x.shape[-1]
    sd = len(grid)
    out = strided_grid(grid, kernel, stride)
    nb = [-(-k // s) for k, s in zip(kernel, stride)]
    cfg = [(0, 0, 0)]
    for n, o, k, s, b in zip(grid, out, kernel, stride, nb):
        lo = (k - 1) // 2
        cfg.append((lo, (o + b - 1) * s - n - lo, 0))  # negative high padding crops unused pixels
    cfg.append((0, 0, 0))
    xp = jax.lax.pad(x, jnp.zeros((), x.dtype), cfg)
    blocked_shape = [x.shape[0]]
    for o, s, b in zip(out, stride, nb):
        blocked_shape += [o + b - 1, s]
    # (N, B_1, s_1, ..., B_sd, s_sd, C) -> (N, B_1..B_sd, s_1..s_sd, C)
    perm = [0] + [1 + 2 * d for d in range(sd)] + [2 + 2 * d for d in range(sd)] + [1 + 2 * sd]
    return xp.reshape(*blocked_shape, c).transpose(perm)


def _windows(x: Array, kernel: Sequence[int], stride: Sequence[int]) -> Array:
    """(N, *grid, C) -> (N, N_out, taps, C), taps laid out as in :func:`window_indices`.

    A window is ``ceil(k/s)`` consecutive stride-blocks per axis, i.e. a few plain slices. On CPU
    this, and its transpose (a few pads), is much faster than gathers (scatter gradients), patch
    convolutions or one strided slice per tap. It copies each input ~(k/s)^sd times, so it is only
    used on one-channel maps (the column sums); q.k and a.v run per block offset instead.
    """
    n_img, c, sd = x.shape[0], x.shape[-1], x.ndim - 2
    out = strided_grid(x.shape[1:-1], kernel, stride)
    nb = [-(-k // s) for k, s in zip(kernel, stride)]
    xb = _blocked(x, kernel, stride)
    parts = []
    for j in np.ndindex(*nb):
        sl = (slice(None),) + tuple(slice(jd, jd + od) for jd, od in zip(j, out))
        parts.append(xb[sl])  # (N, o_1..o_sd, s_1..s_sd, C)
    w = jnp.stack(parts, axis=1 + sd)  # (N, o.., nbprod, s.., C)
    return w.reshape(n_img, int(np.prod(out)), -1, c)


def _window_valid(grid_shape: Sequence[int], kernel: Sequence[int], stride: Sequence[int]) -> Array:
    """(N_out, taps) validity of :func:`window_indices`, built from per-axis masks.

    Broadcasting small per-axis masks in the graph keeps a multi-megabyte constant out of the
    compiled program at 1024 px (it slowed compilation).
    """
    out = strided_grid(grid_shape, kernel, stride)
    nb = [-(-k // s) for k, s in zip(kernel, stride)]
    sd = len(grid_shape)
    ok = jnp.ones((), bool)
    for d, (n, o, k, s, b) in enumerate(zip(grid_shape, out, kernel, stride, nb)):
        offset = np.arange(b)[:, None] * s + np.arange(s)[None, :]
        pos = np.arange(o)[:, None, None] * s - (k - 1) // 2 + offset[None]
        shape = [1] * (3 * sd)
        shape[d], shape[sd + d], shape[2 * sd + d] = o, b, s
        ok = ok & jnp.asarray(((offset[None] < k) & (pos >= 0) & (pos < n)).reshape(shape))
    return ok.reshape(int(np.prod(out)), -1)


class Geometry(NamedTuple):
    """Static layout of one sparse SGA call (hashable: it is a custom-VJP static argument)."""

    grid: tuple[int, ...]
    kernel: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def out(self) -> tuple[int, ...]:
        return strided_grid(self.grid, self.kernel, self.stride)

    @property
    def offsets(self) -> list[tuple[int, ...]]:
        return list(np.ndindex(*[-(-k // s) for k, s in zip(self.kernel, self.stride)]))

    @property
    def blocks(self) -> tuple[int, ...]:
        return tuple(o + -(-k // s) - 1 for o, k, s in zip(self.out, self.kernel, self.stride))


def sparse_blocks(x: Array, geom: Geometry) -> Array:
    """(B, H, N_in, C) on ``geom.grid`` -> (B*H, blocks, prod(stride), C), the kernels' k/v layout."""
    b, h, _, c = x.shape
    xb = _blocked(x.reshape(b * h, *geom.grid, c), geom.kernel, geom.stride)
    return xb.reshape(b * h, int(np.prod(geom.blocks)), int(np.prod(geom.stride)), c)


def _shift_to_blocks(a: Array, j: tuple, geom: Geometry) -> Array:
    """(N, o.., ...) -> (N, B.., ...) with a[o] at block o + j (zeros elsewhere)."""
    sd = len(j)
    nb = [bd - od + 1 for bd, od in zip(geom.blocks, geom.out)]
    cfg = [(0, 0, 0)] + [(jd, b - 1 - jd, 0) for jd, b in zip(j, nb)] + [(0, 0, 0)] * (a.ndim - 1 - sd)
    return jax.lax.pad(a, jnp.zeros((), a.dtype), cfg)


def _take_at_offset(a: Array, j: tuple, geom: Geometry) -> Array:
    """(N, B.., ...) -> (N, o.., ...): the blocks at o + j."""
    return a[(slice(None),) + tuple(slice(jd, jd + od) for jd, od in zip(j, geom.out))]


def _offset_dots(a: Array, xb: Array, geom: Geometry) -> Array:
    """(N, o.., C) . (N, blocks, s, C) -> (N, No, taps) f32: a[o] . x[tap] for every window tap."""
    n, c, sd = a.shape[0], a.shape[-1], len(geom.grid)
    parts = []
    for j in geom.offsets:
        aj = _shift_to_blocks(a, j, geom).reshape(n, -1, c)
        lj = jnp.einsum("nbd,nbsd->nbs", aj, xb, preferred_element_type=jnp.float32)
        parts.append(_take_at_offset(lj.reshape(n, *geom.blocks, *geom.stride), j, geom))
    return jnp.stack(parts, axis=1 + sd).reshape(n, int(np.prod(geom.out)), -1)


def _offset_weighted_sum(w: Array, xb: Array, geom: Geometry) -> Array:
    """(N, No, taps) weights, (N, blocks, s, C) -> (N, o.., C) f32: sum over taps of w x[tap].

    The weights take x's dtype for the product (bfloat16 on a GPU: full-rate matmuls), which
    accumulates in float32."""
    n, sd, ns = w.shape[0], len(geom.grid), int(np.prod(geom.stride))
    w_off = w.reshape(n, *geom.out, len(geom.offsets), *geom.stride)
    u = jnp.zeros((n, *geom.out, xb.shape[-1]), jnp.float32)
    for i, j in enumerate(geom.offsets):
        wj = _shift_to_blocks(w_off[(slice(None),) * (1 + sd) + (i,)], j, geom).reshape(n, -1, ns)
        uj = jnp.einsum("nbs,nbsd->nbd", wj.astype(xb.dtype), xb, preferred_element_type=jnp.float32)
        u = u + _take_at_offset(uj.reshape(n, *geom.blocks, xb.shape[-1]), j, geom)
    return u


def _offset_outer(w: Array, a: Array, geom: Geometry) -> Array:
    """(N, No, taps) weights, (N, o.., C) -> (N, blocks, s, C) f32: each tap's sum of w a[o].

    The transpose of :func:`_offset_dots` in its second argument (and of
    :func:`_offset_weighted_sum` in ``xb``): the key and value gradients.

    One batched contraction over the offsets, not a sum of per-offset outer products, which XLA
    fuses into one scattered-order loop over every offset's inputs (docs/history/cpu.md, "CPU kernels").
    """
    n, sd, ns, c = w.shape[0], len(geom.grid), int(np.prod(geom.stride)), a.shape[-1]
    w_off = w.reshape(n, *geom.out, len(geom.offsets), *geom.stride)
    ws = jnp.stack([_shift_to_blocks(w_off[(slice(None),) * (1 + sd) + (i,)], j, geom).reshape(n, -1, ns)
                    for i, j in enumerate(geom.offsets)], axis=-1)
    aj = jnp.stack([_shift_to_blocks(a, j, geom).reshape(n, -1, c) for j in geom.offsets], axis=-2)
    return jnp.einsum("nbsj,nbjc->nbsc", ws.astype(aj.dtype), aj, preferred_element_type=jnp.float32)


def _maps(logits: Array, geom: Geometry, normalise_columns: bool) -> tuple[Array, Array, Array]:
    """Masked logits (N, No, taps) -> (A_k, column denominators, A_q)."""
    ok = _window_valid(geom.grid, geom.kernel, geom.stride)
    a_k = jax.nn.softmax(jnp.where(ok, logits, -jnp.inf), axis=-1)
    if not normalise_columns:
        return a_k, jnp.ones((), jnp.float32), a_k
    denom = _windows(_window_sums(a_k, geom), geom.kernel, geom.stride)[..., 0] + EPS
    return a_k, denom, a_k / denom


def _window_sums(a: Array, geom: Geometry) -> Array:
    """(N, No, taps) -> (N, *grid, 1): each input's total over the windows that contain it."""
    zeros = jnp.zeros((a.shape[0], *geom.grid, 1), a.dtype)
    _, transpose = jax.vjp(lambda z: _windows(z, geom.kernel, geom.stride), zeros)
    return transpose(a[..., None])[0]


def sparse_grouping(
    q: Array,
    k: Array,
    v: Array,
    grid_shape: Sequence[int],
    kernel: Sequence[int],
    stride: Sequence[int],
    normalise_columns: bool = True,
) -> tuple[Array, Array, Array]:
    """Windowed SGA with its maps (plain autodiff): q (B,H,No,dh), k/v (B,H,Ni,dh).

    Returns (update (B,H,No,dh), A_q, A_k), the maps as (B, H, No, taps) in the layout of
    :func:`window_indices`.
    """
    geom = Geometry(tuple(grid_shape), tuple(kernel), tuple(stride))
    b, h, n_out, dh = q.shape
    kb, vb = sparse_blocks(k, geom), sparse_blocks(v, geom)
    qg = q.reshape(b * h, *geom.out, dh)
    a_k, _, a_q = _maps(_offset_dots(qg, kb, geom), geom, normalise_columns)
    u = _offset_weighted_sum(a_q, vb, geom)
    shape = (b, h, n_out, a_k.shape[-1])
    return u.astype(q.dtype).reshape(b, h, n_out, v.shape[-1]), a_q.reshape(shape), a_k.reshape(shape)


def sparse_update(q: Array, kb: Array, vb: Array, geom: Geometry, normalise_columns: bool = True) -> Array:
    """The update of :func:`sparse_grouping` from blocked keys/values (:func:`sparse_blocks`).

    q (B, H, No, dh) -> (B, H, No, dh). Block k and v once and call this every iteration: the
    blocked arrays are then the only full-resolution tensors the backward pass keeps.
    """
    b, h, n_out, dh = q.shape
    u = _update(q.reshape(b * h, *geom.out, dh), kb, vb, geom, normalise_columns)
    return u.reshape(b, h, n_out, vb.shape[-1])


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _update(qg: Array, kb: Array, vb: Array, geom: Geometry, normalise_columns: bool) -> Array:
    _, _, a_q = _maps(_offset_dots(qg, kb, geom), geom, normalise_columns)
    return _offset_weighted_sum(a_q, vb, geom).astype(qg.dtype)


def _update_fwd(qg, kb, vb, geom, normalise_columns):
    return _update(qg, kb, vb, geom, normalise_columns), (qg, kb, vb)


def _update_bwd(geom, normalise_columns, res, du):
    qg, kb, vb = res
    # Make the recomputation depend on du. Otherwise XLA merges it with the forward pass's
    # identical ops (CSE) or hoists it ahead of the backward, and every iteration's logit-sized
    # maps stay alive at once (on CPU, optimization_barrier did not stop either: measured).
    # Adds an exact zero unless du is non-finite, when the gradients are non-finite anyway.
    qg = qg + (0 * jnp.sum(du[:, :1])).astype(qg.dtype)
    return _update_grads(qg, kb, vb, du, geom, normalise_columns)


def _update_grads(qg, kb, vb, du, geom, normalise_columns):
    """Gradients of :func:`_update_plain`: recomputes the maps from q, k, v."""
    a_k, denom, a_q = _maps(_offset_dots(qg, kb, geom), geom, normalise_columns)
    du = du.astype(vb.dtype)  # the products in the inputs' dtype, accumulated in float32
    d_aq = _offset_dots(du, vb, geom)  # (N, No, taps): du[o] . v[tap]
    dvb = _offset_outer(a_q, du, geom)
    if normalise_columns:  # A_q = A_k / (W(colsum(A_k)) + eps): through both A_k's
        d_ak = d_aq / denom
        d_ak = d_ak + _windows(_window_sums(-d_aq * a_q / denom, geom), geom.kernel, geom.stride)[..., 0]
    else:
        d_ak = d_aq
    d_logits = a_k * (d_ak - jnp.sum(a_k * d_ak, axis=-1, keepdims=True))
    dq = _offset_weighted_sum(d_logits, kb, geom)
    dkb = _offset_outer(d_logits, qg, geom)
    return dq.astype(qg.dtype), dkb.astype(kb.dtype), dvb.astype(vb.dtype)


_update.defvjp(_update_fwd, _update_bwd)


def scatter_window_map(a: Array, idx: np.ndarray, ok: np.ndarray, num_inputs: int) -> Array:
    """(B,H,No,taps) window weights -> dense (B,H,No,N_in) map."""
    dense = jnp.zeros(a.shape[:3] + (num_inputs,), a.dtype)
    rows = np.broadcast_to(np.arange(idx.shape[0])[:, None], idx.shape)
    return dense.at[:, :, rows, idx].add(jnp.where(ok, a, 0.0))
