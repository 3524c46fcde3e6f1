"""The rotation of rotary embeddings (RoSE), in the form the kernel policy picks."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrat.ops import per_device
from jaxrat.ops.policy import PORTABLE, KernelPolicy
from jaxrat.ops.portable.rotate import turn_heads

Array = jax.Array


@jax.custom_vjp
def _phase(pos: Array, freqs: Array) -> Array:
    """<pos_n, omega_hp> (..., N, H, P) of positions (..., N, sd) and frequencies (H, P, sd): products and
    sums over the sd (<= 3) axes, which fuse into the rotation (as an einsum, XLA:GPU made it a cuBLAS
    call of contraction 2); the backward as two matrix products over the N positions (autodiff of the
    sums is two small reductions per axis)."""
    return sum(pos[..., None, None, d] * freqs[..., d] for d in range(pos.shape[-1]))


def _phase_fwd(pos, freqs):
    return _phase(pos, freqs), (pos, freqs)


def _phase_bwd(res, g):
    pos, freqs = res
    return (jnp.einsum("...nhp,hpd->...nd", g, freqs, preferred_element_type=jnp.float32).astype(pos.dtype),
            jnp.einsum("...nhp,...nd->hpd", g, pos, preferred_element_type=jnp.float32).astype(freqs.dtype))


_phase.defvjp(_phase_fwd, _phase_bwd)


def rotation_phase(grid: Array, scale: Array, freqs: Array) -> Array:
    """The rotation angles <grid_n * scale, omega_hp> of grid coordinates ``grid`` (N, sd) (constants),
    scaled per axis by ``scale`` (sd,), for frequencies ``freqs`` (H, P, sd): (N, H, P), or under a mesh
    of several devices (N, H, P) once per device, (devices, N, H, P). Each device then turns its own
    images by its own copy (:func:`rotate_heads`), and the angles' gradient is summed over the tokens on
    each device before the devices sum it: a few numbers per layer, where the angles themselves (the
    first SGA layer's 65,536 x 4 x 8 at 256 px) were summed over the devices."""
    pos = grid * scale if per_device.splits() == 1 else per_device.copies(grid) * scale
    return _phase(pos, freqs)


def rotate_heads(x: Array, phase: Array, heads: int, policy: KernelPolicy = PORTABLE) -> Array:
    """Rotate the first ``heads`` heads of ``x`` (B, N, H, dh) by the angles ``phase`` (N, heads,
    dh/2), or per device by its copy of them ((devices, N, heads, dh/2), :func:`rotation_phase`):
    :func:`turn_heads` of their cosines and sines in x's dtype, differentiated by autodiff, or on the
    cpu policy by the CPU's backward (:mod:`jaxrat.ops.cpu.rotate`), or on the gpu policy without
    concatenates and with the angles' gradient in one sum (:mod:`jaxrat.ops.gpu.rotate`)."""
    if phase.ndim == 4:
        return per_device.over_batch(lambda x, p: _rotate(x, p[0], heads, policy), x, phase)
    return _rotate(x, phase, heads, policy)


def _rotate(x: Array, phase: Array, heads: int, policy: KernelPolicy) -> Array:
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
