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
docs/reference.md): V is split into heads by a plain row-major reshape of (B, N, D) and the
update is merged back the same way. The default splits and merges heads properly.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrat.models.attention import (
    grouping_attention,
    grouping_maps,
    softmax_attention,
)
from jaxrat.models.layers import Mlp, conv, layer_norm, linear
from jaxrat.models.rose import RotarySpatialEmbedding
from jaxrat.models.sparse_sga import (  # noqa: F401  (re-exported: the kernels' public names)
    Geometry,
    scatter_window_map,
    sparse_blocks,
    sparse_grouping,
    sparse_update,
    strided_grid,
    window_indices,
)

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


class SpatialGroupingAttention(nnx.Module):
    """One SGA layer: strided-conv groups refined by ``iters`` rounds of grouping attention.

    Args follow the reference constructor; additions:
      attention: "dense" | "sparse" | "standard" (see module docstring).
      reference_compat: reproduce the reference's value-head reshaping (flaw 1).
      max_block_elements, slice_batch: memory/speed knobs of the dense kernel (block None: the
        machine's default, `attention.default_block_elements`).
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
        max_block_elements: Optional[int] = None,
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
                            dtype=dtype, rngs=rngs, cpu_fast_forms=True)
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

    def _iteration(self, xo: Array, k: Array, v: Array, geom: Geometry,
                   out_spacing: tuple[float, ...]) -> tuple[Array, Array]:
        """One grouping round: (groups (B, N_out, D), keys, values) -> (new groups, queries)."""
        b, n_out, _ = xo.shape
        h, dh = self.num_heads, self.head_dim
        q = self.rose(self.q(xo).reshape(b, n_out, h, dh), geom.out, out_spacing).transpose(0, 2, 1, 3)
        if self.attention == "sparse":  # temp moved from the keys (see __call__): same logits
            q = q * self.temp[...].astype(q.dtype)
        if self.attention == "dense":
            u = grouping_attention(q, k, v, max_block_elements=self.max_block_elements, slice_batch=self.slice_batch)
        elif self.attention == "standard":
            u = softmax_attention(q, k, v, max_block_elements=self.max_block_elements, slice_batch=self.slice_batch)
        else:
            u = sparse_update(q, k, v, geom)  # k, v blocked (sparse_blocks)
        xo = xo + self.norm2(self._merge_heads(u.astype(xo.dtype), self.reference_compat))
        return xo + self.norm3(self.mlp(xo)), q

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
        h, dh = self.num_heads, self.head_dim

        k, v = jnp.split(self.kv(x), 2, axis=-1)
        k = self.rose(k.reshape(b, n_in, h, dh), grid_shape, spacing)
        if self.attention != "sparse":
            k = k * self.temp[...].astype(k.dtype)
        # sparse scales the (9x fewer) queries instead: q.(t k) = (t q).k, and temp's gradient
        # then does not keep the full-resolution rotated keys alive until the backward pass
        k = k.transpose(0, 2, 1, 3)
        v = self._split_heads(v, self.reference_compat)

        geom = Geometry(grid_shape, self.kernel_size, self.stride)
        # sparse: k and v are blocked once and shared by every iteration (the kernel's backward
        # keeps only these and recomputes its maps)
        keys, values = ((sparse_blocks(k, geom), sparse_blocks(v, geom)) if self.attention == "sparse" and self.iters
                        else (k, v))
        q = None
        for _ in range(self.iters):
            xo, q = self._iteration(xo, keys, values, geom, out_spacing)

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
