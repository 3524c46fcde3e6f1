"""Rotary Spatial Embeddings (RoSE) in Flax NNX.

Port of ``RoSE.RotarySpatialEmbedding`` (PyPI ``rotary-spatial-embeddings==2025.9.27.2133``).
Token ``n`` with multi-index ``(i_1..i_sd)`` on a grid with spacing ``s`` gets the coordinate
``i_j * s'_j``, where ``s'_j = a_j * s_j**b_j + c_j * log(s_j / d_j)`` is a learnable transform of
the physical spacing. Each rotated head ``h`` and plane ``p`` (features ``2p, 2p+1`` of the head,
interleaved real/imaginary parts) is multiplied by ``exp(i * <coord, omega[h, p]>)``.

Only the first ``Hr = rotary_dim / dims_per_head`` heads are rotated (``rotary_ratio``); the others
pass through. See docs/rat.md for the scaling modes, including ``"index"``, our fix of the
reference's ``"rope"`` mode which starts with no rotation at all (docs/reference.md, flaw 4).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrat import ops
from jaxrat.ops.rotate import rotate_heads, rotation_phase

Array = jax.Array

# Initial (a, b, c, d) of the spacing transform per mode. "index" is ours: s' = 1, so the
# coordinate is the grid index, which is what the reference documents "rope" to mean.
_SCALE_INIT = {
    "log": (0.0, 1.0, 1.0, 1.0),
    "rope": (0.0, 0.0, 0.0, 1.0),
    "index": (1.0, 0.0, 0.0, 1.0),
    "identity": (1.0, 1.0, 0.0, 1.0),
    "linear": (1.0, 1.0, 0.0, 1.0),
    "power": (1.0, 1.0, 0.0, 1.0),
    None: (1.0, 1.0, 0.0, 1.0),
}
SCALING_MODES = tuple(k for k in _SCALE_INIT if k is not None)


def _frozen(x: Any) -> tuple:
    """A fixed tensor as nested tuples of floats: static, hashable, and not model state.

    Frozen RoSE tensors are not parameters (the reference keeps them as non-persistent buffers);
    storing them as constants keeps the model's state to parameters and RNG streams only.
    """
    return tuple(_frozen(v) for v in x) if np.ndim(x) else float(x)


def _value(x: Any) -> jax.Array:
    """A parameter's value or a frozen constant, as float32."""
    return jnp.asarray(x[...] if isinstance(x, nnx.Variable) else x, jnp.float32)


def rose_theta(base_theta: float, frequency_scaling: str, spatial_dims: int, feature_dims: int) -> float:
    """Base frequency of the log-spaced bands, as the reference derives it."""
    if frequency_scaling == "none":
        return base_theta
    if frequency_scaling == "linear":
        return base_theta ** (1 / spatial_dims)
    if frequency_scaling == "sqrt":
        return base_theta ** (1 / math.sqrt(spatial_dims))
    if frequency_scaling == "adaptive":
        return base_theta ** (2.0 / (spatial_dims * feature_dims))
    raise ValueError(f"Unknown frequency_scaling: {frequency_scaling!r}")


def rotary_heads(feature_dims: int, num_heads: int, rotary_ratio: float) -> int:
    """Number of rotated heads: int(D * ratio) rounded down to whole (even-sized) heads."""
    if feature_dims % num_heads:
        raise ValueError(f"feature_dims {feature_dims} must be divisible by num_heads {num_heads}")
    dh = feature_dims // num_heads
    if dh % 2:
        raise ValueError(f"dims per head ({dh}) must be even for rotary embeddings")
    if not 0.0 <= rotary_ratio <= 1.0:
        raise ValueError(f"rotary_ratio must be in [0, 1], got {rotary_ratio}")
    rotary_dim = (int(feature_dims * rotary_ratio) // dh) * dh
    return rotary_dim // dh


def grid_indices(grid_shape: Sequence[int]) -> np.ndarray:
    """(N, sd) float32 multi-indices of a row-major grid (first axis slowest)."""
    idx = np.stack(np.unravel_index(np.arange(int(np.prod(grid_shape))), tuple(grid_shape)), -1)
    return idx.astype(np.float32)


class RotarySpatialEmbedding(nnx.Module):
    """Rotary spatial embedding of per-head features at physical grid positions.

    Args:
      feature_dims: total feature size D (= num_heads * dims_per_head).
      num_heads: number of heads H.
      spatial_dims: 1, 2 or 3.
      base_theta, frequency_scaling: band layout, as in the reference ("sqrt" default).
      learnable: frequencies are an ``nnx.Param`` (with log-normal init jitter) or a fixed buffer.
      init_jitter_std: std of the jitter added to log frequencies at init.
      rotary_ratio: fraction of D (rounded to whole heads) that is rotated.
      learnable_scale: the spacing transform a, b, c, d is trainable.
      initial_scaling: "log", "rope", "index" (ours), "identity"/"linear"/"power" or None.
      kernels: the kernel policy of the rotation (:func:`jaxrat.ops.rotate.rotate_heads`).
      rngs: randomness for the jitter.
    """

    def __init__(
        self,
        feature_dims: int,
        num_heads: int,
        spatial_dims: int = 2,
        base_theta: float = 1e4,
        learnable: bool = True,
        init_jitter_std: float = 0.02,
        frequency_scaling: str = "sqrt",
        rotary_ratio: float = 1.0,
        learnable_scale: bool = False,
        initial_scaling: Optional[str] = None,
        *,
        kernels: ops.KernelPolicy,
        rngs: nnx.Rngs,
    ) -> None:
        if initial_scaling not in _SCALE_INIT:
            raise ValueError(f"initial_scaling must be one of {SCALING_MODES} or None, got {initial_scaling!r}")
        self.kernels = kernels
        self.feature_dims = feature_dims
        self.num_heads = num_heads
        self.spatial_dims = spatial_dims
        self.dims_per_head = feature_dims // num_heads
        self.num_rotary_heads = rotary_heads(feature_dims, num_heads, rotary_ratio)
        self.num_planes = self.dims_per_head // 2
        # The reference applies the transform whenever either flag is truthy.
        self.use_scale = bool(learnable_scale or initial_scaling)

        if self.num_rotary_heads > 0:
            theta = rose_theta(base_theta, frequency_scaling, spatial_dims, feature_dims)
            m = self.num_rotary_heads * self.num_planes
            # Same float32 arithmetic as the reference so frozen frequencies match exactly.
            exponents = np.arange(m, dtype=np.float32) * np.float32(2.0) / np.float32(m * 2)
            f = np.exp(-exponents * np.float32(math.log(theta)))
            freqs = np.repeat(f[:, None], spatial_dims, 1)
            freqs = jnp.asarray(freqs.reshape(self.num_rotary_heads, self.num_planes, spatial_dims))
            if learnable:
                if init_jitter_std > 0:
                    eps = jax.random.normal(rngs.params(), freqs.shape) * init_jitter_std
                    freqs = jnp.exp(jnp.clip(jnp.log(freqs) + eps, -10.0, 10.0))
                self.freqs = nnx.Param(freqs)
            else:
                self.freqs = _frozen(np.asarray(freqs))
        else:
            self.freqs = None

        if self.use_scale:
            init = _SCALE_INIT[initial_scaling]
            for name, value in zip(("scale_a", "scale_b", "scale_c", "scale_d"), init):
                if learnable_scale:
                    setattr(self, name, nnx.Param(jnp.full((spatial_dims,), value, jnp.float32)))
                else:
                    setattr(self, name, (float(value),) * spatial_dims)

    @classmethod
    def from_config(cls, config: Any, *, kernels: ops.KernelPolicy,
                    rngs: nnx.Rngs) -> "RotarySpatialEmbedding":
        """The RoSE of a RAT (:class:`jaxrat.models.rat.config.RATConfig`), as its SGA layers and
        multi-resolution blocks each have one."""
        c = config
        return cls(c.feature_dims, c.num_heads, c.spatial_dims, c.base_theta, c.learnable_rose, c.init_jitter_std,
                   c.frequency_scaling, c.rotary, c.learnable_rose_scaling, c.rose_scaling, kernels=kernels, rngs=rngs)

    def positions(self, grid_shape: Sequence[int], spacing: Sequence[float]) -> Array:
        """(N, sd) float32 coordinates after the learnable spacing transform."""
        grid, scale = self._coordinates(grid_shape, spacing)
        return grid * scale

    def _coordinates(self, grid_shape: Sequence[int], spacing: Sequence[float]) -> tuple[Array, Array]:
        """The positions as (grid coordinates i * s (N, sd), constants; the transform's factor s'/s (sd,))."""
        spacing_np = np.asarray(spacing, np.float32)
        pos = jnp.asarray(grid_indices(grid_shape) * spacing_np[None])
        if not self.use_scale:
            return pos, jnp.ones((len(spacing_np),), jnp.float32)
        s = jnp.asarray(spacing_np)
        positive = s > 0
        safe = jnp.where(positive, s, 1.0)
        a, b, c, d = (_value(getattr(self, n)) for n in ("scale_a", "scale_b", "scale_c", "scale_d"))
        d = jnp.maximum(d, 1e-8)
        log_term = jnp.where(positive, jnp.log(safe / d), 0.0)
        pow_term = jnp.where(positive, jnp.power(safe, b), 0.0)
        scaled = a * pow_term + c * log_term
        # The reference rescales i*s by s'/s (not i by s'), falling back to 1 where undefined.
        factor = jnp.where(s != 0, scaled / jnp.where(s != 0, s, 1.0), 1.0)
        return pos, jnp.where(jnp.isfinite(factor), factor, 1.0)

    def angles(self, grid_shape: Sequence[int], spacing: Sequence[float]) -> Optional[tuple[Array, int]]:
        """(angles (N, Hr, dims_per_head / 2), Hr) of the rotated heads' feature pairs at the grid's
        positions, or None when no head is rotated: what :func:`jaxrat.ops.rotate.rotate_heads` takes
        (under a mesh, one copy of the angles per device: :func:`jaxrat.ops.rotate.rotation_phase`)."""
        hr = self.num_rotary_heads
        if hr == 0:
            return None
        return rotation_phase(*self._coordinates(grid_shape, spacing), _value(self.freqs)), hr

    def __call__(self, x: Array, grid_shape: Sequence[int], spacing: Sequence[float]) -> Array:
        """Rotate ``x`` of shape (B, N, H, dims_per_head); N = prod(grid_shape)."""
        rotation = self.angles(grid_shape, spacing)
        return x if rotation is None else rotate_heads(x, *rotation, self.kernels)
