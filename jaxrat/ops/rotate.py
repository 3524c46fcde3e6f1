"""The rotation of rotary embeddings (RoSE), in the form the kernel policy picks."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrat.ops.policy import PORTABLE, KernelPolicy
from jaxrat.ops.portable.rotate import turn_heads

Array = jax.Array


def rotate_heads(x: Array, phase: Array, heads: int, policy: KernelPolicy = PORTABLE) -> Array:
    """Rotate the first ``heads`` heads of ``x`` (B, N, H, dh) by the angles ``phase`` (N, heads,
    dh/2): :func:`turn_heads` of their cosines and sines in x's dtype, differentiated by autodiff, or
    on the cpu policy by the CPU's backward (:mod:`jaxrat.ops.cpu.rotate`), or on the gpu policy
    without concatenates and with the angles' gradient in one sum (:mod:`jaxrat.ops.gpu.rotate`)."""
    if policy.uses("rotate"):
        from jaxrat.ops.gpu.rotate import turn_heads as gpu_turn

        return gpu_turn(x, phase, heads)
    cos, sin = jnp.cos(phase).astype(x.dtype), jnp.sin(phase).astype(x.dtype)
    if policy.cpu:
        from jaxrat.ops.cpu import SCOPE
        from jaxrat.ops.cpu.rotate import rotate_heads as cpu_rotate

        with jax.named_scope(SCOPE):
            return cpu_rotate(x, cos, sin, heads)
    return turn_heads(x, cos, sin, heads)
