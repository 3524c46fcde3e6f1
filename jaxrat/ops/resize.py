"""Linear resizing of channels-last maps, in the form the kernel policy picks.

``jax.image.resize(..., "linear")`` resizes an axis as a product with a dense (out x in) weight
matrix: compiled for a GPU each upsampled axis became a padded cuBLAS call with transposes around it,
forward and backward (the RAT decoder's resizes were ~50 kernels of the ISIC step). An upsampling
axis reads only two inputs per output, so the gpu policy's form gathers them (constant indices, which
XLA fuses into the neighbouring elementwise work) and its backward gathers each input's few outputs
the same way; no scatter, so it stays deterministic. Downsampling (antialiased by jax) and the other
policies keep jax's form.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrat.ops.policy import PORTABLE, KernelPolicy

Array = jax.Array


def resize_linear(x: Array, grid: Sequence[int], policy: KernelPolicy = PORTABLE) -> Array:
    """(B, *grid_in, C) -> (B, *grid, C): linear interpolation with half-pixel centres, clamped at the
    edges (``jax.image.resize``'s "linear", PyTorch's ``align_corners=False``)."""
    grid = tuple(int(g) for g in grid)
    if tuple(x.shape[1:-1]) == grid:
        return x
    if policy.uses("resize") and all(o >= i for o, i in zip(grid, x.shape[1:-1])):
        for axis, size in enumerate(grid, start=1):
            if x.shape[axis] != size:
                x = _upsample(x, axis, size)
        return x
    return jax.image.resize(x, (x.shape[0], *grid, x.shape[-1]), "linear")


@functools.lru_cache(maxsize=64)
def _tables(n_in: int, n_out: int) -> tuple[np.ndarray, ...]:
    """For each output, its two inputs and their weights; for each input, the outputs that read it
    and with which weight (padded with weight 0)."""
    src = (np.arange(n_out, dtype=np.float64) + 0.5) * (n_in / n_out) - 0.5
    first = np.floor(src)
    frac = (src - first).astype(np.float32)
    lo = np.clip(first, 0, n_in - 1).astype(np.int32)
    hi = np.clip(first + 1, 0, n_in - 1).astype(np.int32)
    w = np.stack([1.0 - frac, frac], -1).astype(np.float32)
    readers: list[list[tuple[int, float]]] = [[] for _ in range(n_in)]
    for o in range(n_out):
        readers[lo[o]].append((o, w[o, 0]))
        readers[hi[o]].append((o, w[o, 1]))
    k = max(len(r) for r in readers)
    back_idx = np.zeros((n_in, k), np.int32)
    back_w = np.zeros((n_in, k), np.float32)
    for i, r in enumerate(readers):
        for j, (o, wt) in enumerate(r):
            back_idx[i, j], back_w[i, j] = o, wt
    return np.stack([lo, hi], -1), w, back_idx, back_w


def _weighted_gather(x: Array, axis: int, idx: np.ndarray, w: np.ndarray) -> Array:
    """sum_k x[.., idx[:, k], ..] * w[:, k] along ``axis``, in float32."""
    shape = [1] * x.ndim
    shape[axis] = idx.shape[0]
    xf = x.astype(jnp.float32)
    out = None
    for k in range(idx.shape[1]):
        term = jnp.take(xf, idx[:, k], axis=axis) * w[:, k].reshape(shape)
        out = term if out is None else out + term
    return out


def _upsample(x: Array, axis: int, size: int) -> Array:
    return _upsample_axis(x, axis, x.shape[axis], size)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _upsample_axis(x: Array, axis: int, n_in: int, size: int) -> Array:
    idx, w, _, _ = _tables(n_in, size)
    return _weighted_gather(x, axis, idx, w).astype(x.dtype)


def _upsample_fwd(x, axis, n_in, size):
    return _upsample_axis(x, axis, n_in, size), None


def _upsample_bwd(axis, n_in, size, _, g):
    _, _, back_idx, back_w = _tables(n_in, size)
    return (_weighted_gather(g, axis, back_idx, back_w).astype(g.dtype),)  # g has x's dtype, as the output


_upsample_axis.defvjp(_upsample_fwd, _upsample_bwd)
