"""The rotation of rotary embeddings (RoSE), in the form the kernel policy picks."""

from __future__ import annotations

import jax

from jaxrat.ops.policy import PORTABLE, KernelPolicy
from jaxrat.ops.portable.rotate import turn_heads

Array = jax.Array


def rotate_heads(x: Array, cos: Array, sin: Array, heads: int, policy: KernelPolicy = PORTABLE) -> Array:
    """:func:`turn_heads`, differentiated by autodiff, or on the cpu policy by the CPU's backward
    (:mod:`jaxrat.ops.cpu.rotate`)."""
    if policy.cpu:
        from jaxrat.ops.cpu import SCOPE
        from jaxrat.ops.cpu.rotate import rotate_heads as cpu_rotate

        with jax.named_scope(SCOPE):
            return cpu_rotate(x, cos, sin, heads)
    return turn_heads(x, cos, sin, heads)
