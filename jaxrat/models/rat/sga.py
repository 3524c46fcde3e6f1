"""Spatial Grouping Attention (SGA) layer in Flax NNX.

Port of ``spatial_grouping_attention.DenseSpatialGroupingAttention`` (PyPI
``spatial-grouping-attention==2025.9.29.1947``) plus the variants the reference lacks:

* ``attention="dense"``: every group attends to every input token; the update is
  ``A_q V`` with ``A_k = softmax_keys(Q K^T)`` and ``A_q = A_k / (colsum(A_k) + eps)``,
  (:func:`jaxrat.ops.attention.grouping_attention`).
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

from jaxrat import ops
from jaxrat.models.layers import Mlp, conv, layer_norm, linear
from jaxrat.models.rat.config import RATConfig, as_tuple
from jaxrat.models.rat.rose import RotarySpatialEmbedding
from jaxrat.ops import attention as attn

Array = jax.Array
ATTENTION_TYPES = ("dense", "sparse", "standard")


class SGAOutput(NamedTuple):
    """One SGA layer's result for one scale."""

    x: Array  # (B, N_out, D)
    grid_shape: tuple[int, ...]
    spacing: tuple[float, ...]
    attn_q: Optional[Array]  # (B, H, N_out, N_in) of the last iteration, only when asked
    attn_k: Optional[Array]


class SpatialGroupingAttention(nnx.Module):
    """One SGA layer: strided-conv groups refined by ``iters`` rounds of grouping attention.

    Args:
      config: the RAT (its SGA fields: feature_dims, spatial_dims, sga_kernel_size, num_heads,
        stride, iters, the MLP's and RoSE's, reference_compat).
      attention: this layer's form, "dense" | "sparse" | "standard" (see the module docstring).
      kernels: the kernel policy the attention, convolution and MLP take.
      dtype: compute dtype (params are float32).
    """

    def __init__(self, config: RATConfig, attention: str = "dense", *, kernels: ops.KernelPolicy,
                 dtype: Any = jnp.float32, rngs: nnx.Rngs) -> None:
        if attention not in ATTENTION_TYPES:
            raise ValueError(f"attention must be one of {ATTENTION_TYPES}, got {attention!r}")
        c = config
        feature_dims, sd = c.feature_dims, c.spatial_dims
        self.feature_dims = feature_dims
        self.spatial_dims = sd
        self.num_heads = c.num_heads
        self.head_dim = feature_dims // c.num_heads
        self.kernel_size = as_tuple(c.sga_kernel_size, sd, int)
        self.stride = (tuple(max(1, k // 2) for k in self.kernel_size) if c.stride is None
                       else as_tuple(c.stride, sd, int))
        self.iters = c.iters
        self.attention = attention
        self.reference_compat = c.reference_compat
        self.kernels = kernels
        padding = ("SAME" if all(s == 1 for s in self.stride)
                   else [((k - 1) // 2, (k - 1) // 2) for k in self.kernel_size])
        self.strider = conv(feature_dims, feature_dims, self.kernel_size, strides=self.stride, padding=padding,
                            dtype=dtype, rngs=rngs, kernels=kernels)
        self.kv = linear(feature_dims, 2 * feature_dims, use_bias=c.qkv_bias, dtype=dtype, rngs=rngs)
        self.q = linear(feature_dims, feature_dims, use_bias=c.qkv_bias, dtype=dtype, rngs=rngs)
        self.mlp = Mlp(feature_dims, int(feature_dims * c.mlp_ratio), dropout=c.mlp_dropout, bias=c.mlp_bias,
                       dtype=dtype, rngs=rngs, kernels=kernels)
        # temp scales the keys only and starts at 1/sqrt(D) (not 1/sqrt(dh)): reference flaw 16.
        self.temp = nnx.Param(jnp.full((1,), 1.0 / math.sqrt(feature_dims), jnp.float32))
        self.rose = RotarySpatialEmbedding.from_config(c, kernels=kernels, rngs=rngs)
        self.norm1 = layer_norm(feature_dims, 1e-5, dtype=dtype, rngs=rngs, kernels=kernels)
        self.norm2 = layer_norm(feature_dims, 1e-5, dtype=dtype, rngs=rngs, kernels=kernels)
        self.norm3 = layer_norm(feature_dims, 1e-5, dtype=dtype, rngs=rngs, kernels=kernels)
        self.mask_embedding = nnx.Param(jax.random.uniform(rngs.params(), (feature_dims,), jnp.float32))

    def out_grid_shape(self, grid_shape: Sequence[int]) -> tuple[int, ...]:
        """Grid after this layer's strided convolution."""
        return attn.window_grid(grid_shape, self.kernel_size, self.stride)

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

    def _iteration(self, xo: Array, k: Array, v: Array, keys: Optional[attn.SparseKeys], i: int,
                   window: attn.Window, out_spacing: tuple[float, ...]) -> tuple[Array, Array]:
        """Grouping round ``i``: (groups (B, N_out, D), keys, values) -> (new groups, queries).
        Sparse attention takes token-major (B, N, H, dh) operands, the others head-major."""
        b, n_out, _ = xo.shape
        h, dh = self.num_heads, self.head_dim
        q = self.rose(self.q(xo).reshape(b, n_out, h, dh), window.out, out_spacing)
        if self.attention == "sparse":  # XLA folds this transpose into _merge_heads' own
            u = attn.sparse_grouping_attention(q, keys, self.kernels, use=i, key_scale=self.temp[...])
            u = u.transpose(0, 2, 1, 3)
        else:
            q = q.transpose(0, 2, 1, 3)
            if self.attention == "dense":
                u = attn.grouping_attention(q, k, v, self.kernels)
            else:
                u = attn.softmax_attention(q, k, v, self.kernels)
        xo = self.norm2(self._merge_heads(u.astype(xo.dtype), self.reference_compat), residual=xo)
        return self.norm3(self.mlp(xo), residual=xo), q

    def _looped_iterations(self, xo: Array, keys: attn.SparseKeys, window: attn.Window,
                           out_spacing: tuple[float, ...]) -> Array:
        """The grouping rounds of the stride-blocked sparse kernel as one loop whose body, the round,
        is traced once. Unrolled, every round added its own copy of the kernel (nine block offsets,
        forward, recomputation and backward) to the program, and XLA's CPU compiler makes one
        machine-code kernel per fusion: the ISIC RAT's train step held ~5,200 of them and took
        minutes to compile on a 2-core CPU (issue 58). The same operations in the same order: the
        parameters are the loop's constants, dropout's random stream (when the MLP draws) its carry,
        advanced as the unrolled rounds advance it. The rounds' ``use`` index only matters to the gpu
        form's fused kernels, which keep the unrolled rounds."""
        graphdef, params, rest = nnx.split(self, nnx.Param, ...)
        draws = any(not d.deterministic and d.rate > 0.0 for d in (self.mlp.drop1, self.mlp.drop2))

        def round_(carry, _):
            xo, rest = carry
            layer = nnx.merge(graphdef, params, rest)
            xo, _ = layer._iteration(xo, None, None, keys, 0, window, out_spacing)
            return (xo, nnx.state(layer, nnx.Not(nnx.Param)) if draws else rest), None

        (xo, rest), _ = jax.lax.scan(round_, (xo, rest), None, length=self.iters)
        if draws:  # else nothing changed (and a layer merged from constant state could not be updated)
            nnx.update(self, rest)
        return xo

    def _keys(self, x: Array, window: attn.Window, grid_shape: tuple[int, ...], spacing: Sequence[float],
              maps: bool) -> tuple[Optional[attn.SparseKeys], Optional[Array], Optional[Array]]:
        """(sparse keys, k, v) of ``x`` for the rounds: sparse attention's keys and values laid out once
        for all rounds, with the projection itself where the maps need no keys and the value heads
        are split properly (:func:`jaxrat.ops.attention.sga_keys`: the kernel decides where temp
        multiplies); else k, rotated, and v as the rounds (and the maps) take them: token-major for
        sparse attention, head-major for the others, with temp scaling k (the reference's form)."""
        b, n_in, _ = x.shape
        h, dh = self.num_heads, self.head_dim
        if self.attention == "sparse" and not self.reference_compat and not maps:
            if not self.iters:
                return None, None, None
            bias = self.kv.bias[...] if self.kv.bias is not None else None
            keys = attn.sga_keys(x, self.kv.kernel[...], bias, window, self.kernels, heads=h, dtype=self.kv.dtype,
                                 uses=self.iters, rotation=self.rose.angles(grid_shape, spacing))
            return keys, None, None
        k, v = jnp.split(self.kv(x), 2, axis=-1)
        k = self.rose(k.reshape(b, n_in, h, dh), grid_shape, spacing)
        if self.attention == "sparse":  # token-major, as the projection makes them
            v = self._split_heads(v, True).transpose(0, 2, 1, 3) if self.reference_compat else v.reshape(b, n_in, h, dh)
            return (attn.sparse_keys(k, v, window, self.kernels, uses=self.iters) if self.iters else None), k, v
        k = (k * self.temp[...].astype(k.dtype)).transpose(0, 2, 1, 3)
        return None, k, self._split_heads(v, self.reference_compat)

    def _maps(self, q: Optional[Array], k: Array, window: attn.Window) -> tuple[Array, Array]:
        """(A_q, A_k) of the last round, materialised (B, H, N_out, N_in)."""
        if q is None:
            raise ValueError("grouping maps need iters >= 1 (the reference returns uninitialised memory)")
        if self.attention == "sparse":
            return attn.sparse_grouping_maps(q, k, window, key_scale=self.temp[...])
        if self.attention == "standard":
            a = jax.nn.softmax(jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32), -1)
            return a, a
        return attn.grouping_maps(q, k)

    def __call__(self, x: Array, grid_shape: Sequence[int], spacing: Sequence[float], mask: Optional[Array] = None,
                 return_maps: bool = False) -> SGAOutput:
        """Group ``x`` (B, N_in, D) on ``grid_shape``/``spacing``; ``mask`` (B, *grid) > 0 = masked."""
        b, n_in, d = x.shape
        grid_shape = tuple(int(g) for g in grid_shape)
        out_spacing = tuple(float(s) * st for s, st in zip(spacing, self.stride))
        if mask is not None:
            x = jnp.where(mask.reshape(b, n_in, 1) > 0, self.mask_embedding[...].astype(x.dtype), x)
        xo = self.norm1(self.strider(x.reshape(b, *grid_shape, d)).reshape(b, -1, d))
        window = attn.Window(grid_shape, self.kernel_size, self.stride)
        keys, k, v = self._keys(x, window, grid_shape, spacing, return_maps)
        q = None
        if self.iters > 1 and not return_maps and attn.rolled_rounds(keys, self.kernels):  # maps need the last q
            xo = self._looped_iterations(xo, keys, window, out_spacing)
        else:
            for i in range(self.iters):
                xo, q = self._iteration(xo, k, v, keys, i, window, out_spacing)
        maps = self._maps(q, k, window) if return_maps else (None, None)
        return SGAOutput(xo, self.out_grid_shape(grid_shape), out_spacing, *maps)
