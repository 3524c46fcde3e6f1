"""Spatial Grouping Attention (SGA) layer in Flax NNX.

Port of ``spatial_grouping_attention.DenseSpatialGroupingAttention`` (PyPI
``spatial-grouping-attention==2025.9.29.1947``) plus the variants the reference lacks:

* ``attention="dense"``: every group attends to every input token; the update is
  ``A_q V`` with ``A_k = softmax_keys(Q K^T)`` and ``A_q = A_k / (colsum(A_k) + eps)``,
  computed by the memory-efficient kernel in :mod:`jaxrat.models.attention`.
* ``attention="sparse"``: each group attends only to the k^sd input window its strided
  convolution covers (out-of-image taps excluded); the column sums run over the groups whose
  window contains the token. Memory O(groups x k^sd) instead of O(groups x pixels).
* ``attention="standard"``: plain multi-head cross-attention of the groups over the inputs
  (rows sum to 1, no column renormalisation) — the "standard attention" ablation.

``reference_compat=True`` reproduces the reference's head handling of the values (flaw 1 in
rat_reference.md): V is split into heads by a plain row-major reshape of (B, N, D) and the
update is merged back the same way. The default splits and merges heads properly.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrat.models.attention import (
    DEFAULT_BLOCK_ELEMENTS,
    EPS,
    grouping_attention,
    grouping_maps,
    softmax_attention,
)
from jaxrat.models.layers import Mlp, conv, layer_norm, linear
from jaxrat.models.rose import RotarySpatialEmbedding

Array = jax.Array
ATTENTION_TYPES = ("dense", "sparse", "standard")


class SGAOutput(NamedTuple):
    """One SGA layer's result for one scale."""

    x: Array  # (B, N_out, D)
    grid_shape: tuple[int, ...]
    spacing: tuple[float, ...]
    attn_q: Optional[Array]  # (B, H, N_out, N_in) of the last iteration, only when asked
    attn_k: Optional[Array]


def as_tuple(value: Any, n: int, cast=None) -> tuple:
    """Broadcast a scalar to an n-tuple, or check a sequence has length n."""
    if isinstance(value, (int, float, str)) or value is None:
        out = (value,) * n
    else:
        out = tuple(value)
        if len(out) != n:
            raise ValueError(f"expected {n} values, got {value!r}")
    return tuple(cast(v) for v in out) if cast else out


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


def sparse_grouping(
    q: Array,
    k: Array,
    v: Array,
    grid_shape: Sequence[int],
    kernel: Sequence[int],
    stride: Sequence[int],
    normalise_columns: bool = True,
) -> tuple[Array, Array, Array]:
    """Windowed SGA: each group attends to the k^sd inputs its strided conv window covers.

    q (B, H, No, dh), k/v (B, H, Ni, dh) -> (update (B,H,No,dh), A_q, A_k), the maps as
    (B, H, No, taps) in the layout of :func:`window_indices`.

    Keys and values are never copied into windows (that was ~(k/s)^sd = 9 copies of k and of v,
    plus their saved residuals and cotangents: 3.2 GiB of temporaries at 256 px). Instead, for
    each of the ``ceil(k/s)^sd`` block offsets the small query grid is shifted onto the blocked
    key grid, so every product reads k and v in place; only logit-sized maps are stacked.
    """
    b, h, n_in, dh = k.shape
    n_out = q.shape[2]
    n = b * h
    sd = len(grid_shape)
    out = strided_grid(grid_shape, kernel, stride)
    nb = [-(-kk // s) for kk, s in zip(kernel, stride)]
    to_img = lambda a: a.reshape(n, *grid_shape, a.shape[-1])
    kb = _blocked(to_img(k), kernel, stride)  # (N, B.., s.., dh)
    vb = _blocked(to_img(v), kernel, stride)
    nblk, ns = int(np.prod(kb.shape[1:1 + sd])), int(np.prod(stride))
    kb2, vb2 = kb.reshape(n, nblk, ns, dh), vb.reshape(n, nblk, ns, dh)
    qg = q.reshape(n, *out, dh)
    offsets = list(np.ndindex(*nb))

    def shift_to_blocks(a: Array, j: tuple) -> Array:  # (N, o.., C) -> (N, B.., C), a[o] at B = o + j
        cfg = [(0, 0, 0)] + [(jd, bd - 1 - jd, 0) for jd, bd in zip(j, nb)] + [(0, 0, 0)] * (a.ndim - 1 - sd)
        return jax.lax.pad(a, jnp.zeros((), a.dtype), cfg)

    def take_at_offset(a: Array, j: tuple) -> Array:  # (N, B.., ...) -> (N, o.., ...)
        return a[(slice(None),) + tuple(slice(jd, jd + od) for jd, od in zip(j, out))]

    parts = []
    for j in offsets:
        qs = shift_to_blocks(qg, j).reshape(n, nblk, dh)
        lj = jnp.einsum("nbd,nbsd->nbs", qs, kb2, preferred_element_type=jnp.float32)
        parts.append(take_at_offset(lj.reshape(n, *kb.shape[1:1 + sd], *stride), j))
    logits = jnp.stack(parts, axis=1 + sd).reshape(n, n_out, -1)  # (N, No, taps)
    ok = _window_valid(grid_shape, kernel, stride)
    a_k = jax.nn.softmax(jnp.where(ok, logits, -jnp.inf), axis=-1)
    if normalise_columns:
        zeros = jnp.zeros((n, *grid_shape, 1), jnp.float32)
        _, transpose = jax.vjp(lambda z: _windows(z, kernel, stride), zeros)
        col = transpose(a_k[..., None])[0]  # (N, *grid, 1): each input's mass over its groups
        a_q = a_k / (_windows(col, kernel, stride)[..., 0] + EPS)
    else:
        a_q = a_k
    a_off = a_q.reshape(n, *out, len(offsets), *stride)
    u = jnp.zeros((n, *out, dh), jnp.float32)
    for i, j in enumerate(offsets):
        aj = shift_to_blocks(a_off[(slice(None),) * (1 + sd) + (i,)], j).reshape(n, nblk, ns)
        wj = jnp.einsum("nbs,nbsd->nbd", aj, vb2.astype(jnp.float32))
        u = u + take_at_offset(wj.reshape(n, *kb.shape[1:1 + sd], dh), j)
    shape = (b, h, n_out, a_k.shape[-1])
    return u.astype(q.dtype).reshape(b, h, n_out, dh), a_q.reshape(shape), a_k.reshape(shape)


def scatter_window_map(a: Array, idx: np.ndarray, ok: np.ndarray, num_inputs: int) -> Array:
    """(B,H,No,taps) window weights -> dense (B,H,No,N_in) map."""
    dense = jnp.zeros(a.shape[:3] + (num_inputs,), a.dtype)
    rows = np.broadcast_to(np.arange(idx.shape[0])[:, None], idx.shape)
    return dense.at[:, :, rows, idx].add(jnp.where(ok, a, 0.0))


class SpatialGroupingAttention(nnx.Module):
    """One SGA layer: strided-conv groups refined by ``iters`` rounds of grouping attention.

    Args follow the reference constructor; additions:
      attention: "dense" | "sparse" | "standard" (see module docstring).
      reference_compat: reproduce the reference's value-head reshaping (flaw 1).
      max_block_elements, slice_batch: memory/speed knobs of the dense kernel.
      dtype: compute dtype (params are float32).
    """

    def __init__(
        self,
        feature_dims: int = 128,
        spatial_dims: int = 2,
        kernel_size: int | Sequence[int] = 7,
        num_heads: int = 16,
        stride: Optional[int | Sequence[int]] = None,
        iters: int = 3,
        mlp_ratio: float = 4,
        mlp_dropout: float = 0.0,
        mlp_bias: bool = True,
        qkv_bias: bool = True,
        base_theta: float = 1e4,
        learnable_rose: bool = True,
        init_jitter_std: float = 0.02,
        rotary_ratio: float = 0.5,
        frequency_scaling: str = "sqrt",
        learnable_rose_scaling: bool = True,
        rose_initial_scaling: Optional[str] = "log",
        attention: str = "dense",
        reference_compat: bool = False,
        max_block_elements: int = DEFAULT_BLOCK_ELEMENTS,
        slice_batch: int = 1,
        dtype: Any = jnp.float32,
        *,
        rngs: nnx.Rngs,
    ) -> None:
        if attention not in ATTENTION_TYPES:
            raise ValueError(f"attention must be one of {ATTENTION_TYPES}, got {attention!r}")
        if iters < 0:
            raise ValueError(f"iters must be >= 0, got {iters}")
        self.feature_dims = feature_dims
        self.spatial_dims = spatial_dims
        self.num_heads = num_heads
        self.head_dim = feature_dims // num_heads
        self.kernel_size = as_tuple(kernel_size, spatial_dims, int)
        self.stride = (tuple(max(1, k // 2) for k in self.kernel_size) if stride is None
                       else as_tuple(stride, spatial_dims, int))
        self.iters = iters
        self.attention = attention
        self.reference_compat = reference_compat
        self.max_block_elements = max_block_elements
        self.slice_batch = slice_batch
        padding = ("SAME" if all(s == 1 for s in self.stride)
                   else [((k - 1) // 2, (k - 1) // 2) for k in self.kernel_size])
        self.strider = conv(feature_dims, feature_dims, self.kernel_size, strides=self.stride, padding=padding,
                            dtype=dtype, rngs=rngs)
        self.kv = linear(feature_dims, 2 * feature_dims, use_bias=qkv_bias, dtype=dtype, rngs=rngs)
        self.q = linear(feature_dims, feature_dims, use_bias=qkv_bias, dtype=dtype, rngs=rngs)
        self.mlp = Mlp(feature_dims, int(feature_dims * mlp_ratio), dropout=mlp_dropout, bias=mlp_bias, dtype=dtype,
                       rngs=rngs)
        # temp scales the keys only and starts at 1/sqrt(D) (not 1/sqrt(dh)): reference flaw 16.
        self.temp = nnx.Param(jnp.full((1,), 1.0 / math.sqrt(feature_dims), jnp.float32))
        self.rose = RotarySpatialEmbedding(
            feature_dims, num_heads, spatial_dims, base_theta, learnable_rose, init_jitter_std,
            frequency_scaling, rotary_ratio, learnable_rose_scaling, rose_initial_scaling, rngs=rngs,
        )
        self.norm1 = layer_norm(feature_dims, 1e-5, dtype=dtype, rngs=rngs)
        self.norm2 = layer_norm(feature_dims, 1e-5, dtype=dtype, rngs=rngs)
        self.norm3 = layer_norm(feature_dims, 1e-5, dtype=dtype, rngs=rngs)
        self.mask_embedding = nnx.Param(jax.random.uniform(rngs.params(), (feature_dims,), jnp.float32))

    def out_grid_shape(self, grid_shape: Sequence[int]) -> tuple[int, ...]:
        """Grid after this layer's strided convolution."""
        return strided_grid(grid_shape, self.kernel_size, self.stride)

    def output_geometry(self, x: Array, grid_shape: Sequence[int], spacing: Sequence[float]) -> SGAOutput:
        """Wrap already computed tokens with this layer's output grid and spacing (no maps)."""
        out_spacing = tuple(float(s) * st for s, st in zip(spacing, self.stride))
        return SGAOutput(x, self.out_grid_shape(grid_shape), out_spacing, None, None)

    def _split_heads(self, x: Array, compat: bool) -> Array:
        b, n, _ = x.shape
        if compat:  # the reference's plain reshape (B, N, D) -> (B, H, N, dh)
            return x.reshape(b, self.num_heads, n, self.head_dim)
        return x.reshape(b, n, self.num_heads, self.head_dim).transpose(0, 2, 1, 3)

    def _merge_heads(self, u: Array, compat: bool) -> Array:
        b, h, n, dh = u.shape
        if compat:
            return u.reshape(b, n, h * dh)
        return u.transpose(0, 2, 1, 3).reshape(b, n, h * dh)

    def __call__(
        self,
        x: Array,
        grid_shape: Sequence[int],
        spacing: Sequence[float],
        mask: Optional[Array] = None,
        return_maps: bool = False,
    ) -> SGAOutput:
        """Group ``x`` (B, N_in, D) on ``grid_shape``/``spacing``; ``mask`` (B, *grid) > 0 = masked."""
        b, n_in, d = x.shape
        grid_shape = tuple(int(g) for g in grid_shape)
        out_grid = self.out_grid_shape(grid_shape)
        out_spacing = tuple(float(s) * st for s, st in zip(spacing, self.stride))
        if mask is not None:
            x = jnp.where(mask.reshape(b, n_in, 1) > 0, self.mask_embedding[...].astype(x.dtype), x)

        xo = self.strider(x.reshape(b, *grid_shape, d))
        xo = self.norm1(xo.reshape(b, -1, d))
        n_out = xo.shape[1]
        h, dh = self.num_heads, self.head_dim

        k, v = jnp.split(self.kv(x), 2, axis=-1)
        k = self.rose(k.reshape(b, n_in, h, dh), grid_shape, spacing) * self.temp[...].astype(k.dtype)
        k = k.transpose(0, 2, 1, 3)
        v = self._split_heads(v, self.reference_compat)

        q = None
        for _ in range(self.iters):
            q = self.rose(self.q(xo).reshape(b, n_out, h, dh), out_grid, out_spacing).transpose(0, 2, 1, 3)
            if self.attention == "dense":
                u = grouping_attention(q, k, v, max_block_elements=self.max_block_elements,
                                       slice_batch=self.slice_batch)
            elif self.attention == "standard":
                u = softmax_attention(q, k, v, max_block_elements=self.max_block_elements, slice_batch=self.slice_batch)
            else:
                u = sparse_grouping(q, k, v, grid_shape, self.kernel_size, self.stride)[0]
            xo = xo + self.norm2(self._merge_heads(u.astype(xo.dtype), self.reference_compat))
            xo = xo + self.norm3(self.mlp(xo))

        attn_q = attn_k = None
        if return_maps:
            if q is None:
                raise ValueError("grouping maps need iters >= 1 (the reference returns uninitialised memory)")
            if self.attention == "sparse":
                _, aq, ak = sparse_grouping(q, k, v, grid_shape, self.kernel_size, self.stride)
                idx, ok = window_indices(grid_shape, self.kernel_size, self.stride)
                attn_q, attn_k = (scatter_window_map(a, idx, ok, n_in) for a in (aq, ak))
            elif self.attention == "standard":
                attn_k = jax.nn.softmax(jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32), -1)
                attn_q = attn_k
            else:
                attn_q, attn_k = grouping_maps(q, k)
        return SGAOutput(xo, out_grid, out_spacing, attn_q, attn_k)
