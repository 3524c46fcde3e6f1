"""The keys of a fused attention call put in another order, differentiated by the inverse order.

Both padded-key forms (windowed MR's padded tiles, DETR's letterboxed images) gather each row's real
keys to the front so that cuDNN can mask the rest by length. ``take_along_axis`` differentiates to a
scatter-add into zeros the size of the keys; a permutation's gradient is the inverse permutation,
one gather (compiled for an H100: fewer bytes in the ISIC step's MR blocks, and many fewer in the
COCO step's cross-attention).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def inverse_order(order: Array) -> Array:
    """The inverse of permutations ``order`` (..., N, 1) of axis -2, in the same shape."""
    o = order[..., 0]
    iota = jnp.broadcast_to(jnp.arange(o.shape[-1], dtype=o.dtype), o.shape)
    return jnp.put_along_axis(jnp.zeros_like(o), o, iota, axis=-1, inplace=False)[..., None]


def permute_keys(a: Array, order: Array, inverse: Array) -> Array:
    """``take_along_axis(a, order, axis=-2)`` for permutations ``order`` (..., N, 1) of axis -2 (axes of
    size 1 broadcast against ``a``'s), whose gradient gathers by ``inverse`` (:func:`inverse_order`)."""
    return _permute(a, order, inverse)


@jax.custom_vjp
def _permute(a: Array, order: Array, inverse: Array) -> Array:
    return jnp.take_along_axis(a, order, axis=-2)


def _permute_fwd(a, order, inverse):
    return _permute(a, order, inverse), (order, inverse)


def _permute_bwd(res, g):
    _, inverse = res
    return jnp.take_along_axis(g, inverse, axis=-2), None, None


_permute.defvjp(_permute_fwd, _permute_bwd)
