"""Attention operations of the RAT, dispatched on the kernel policy (:mod:`jaxrat.ops.policy`).

* :func:`grouping_attention`: dense SGA's update ``(P / (colsum(P) + eps)) @ V`` with
  ``P = softmax(q k^T)`` over the keys.
* :func:`softmax_attention`: plain attention ``softmax(q k^T) @ V`` (queries scaled beforehand).
* :func:`multires_attention`: the multi-resolution block's joint attention over all scales, global
  or windowed (:mod:`jaxrat.ops.windowed_attention`).

The ``cpu`` and ``portable`` forms are the memory-bounded chunked kernels of
:mod:`jaxrat.ops.chunked_attention` (the cpu form with the CPU's block and slice batching);
the ``gpu`` form is the portable one until fused kernels are registered for it.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from jaxrat.ops import chunked_attention as chunked
from jaxrat.ops.chunked_attention import EPS
from jaxrat.ops.policy import PORTABLE, KernelPolicy
from jaxrat.ops.windowed_attention import multires_attention as _windowed

Array = jax.Array
__all__ = ["EPS", "grouping_attention", "softmax_attention", "multires_attention", "grouping_maps",
           "grouping_attention_reference"]


def _chunked(kernel, q: Array, k: Array, v: Array, policy: KernelPolicy) -> Array:
    if not policy.cpu:
        return kernel(q, k, v, max_block_elements=policy.block_elements, slice_batch=policy.slice_batch)
    from jaxrat.ops.cpu import SCOPE
    from jaxrat.ops.cpu.cache import UNBATCHED_SLICE_ELEMENTS

    with jax.named_scope(SCOPE):
        return kernel(q, k, v, max_block_elements=policy.block_elements, slice_batch=policy.slice_batch,
                      unbatched_from=UNBATCHED_SLICE_ELEMENTS)


def grouping_attention(q: Array, k: Array, v: Array, policy: KernelPolicy = PORTABLE) -> Array:
    """Dense SGA update: q (..., N_out, dh) groups, k (..., N_in, dh), v (..., N_in, dv) ->
    (..., N_out, dv); logits ``q @ k^T`` unscaled."""
    return _chunked(chunked.grouping_attention, q, k, v, policy)


def softmax_attention(q: Array, k: Array, v: Array, policy: KernelPolicy = PORTABLE) -> Array:
    """Plain softmax attention over the last two axes, (..., Nq, d) x (..., Nk, d) -> (..., Nq, dv)."""
    return _chunked(chunked.softmax_attention, q, k, v, policy)


def multires_attention(q: Array, k: Array, v: Array, segments: Sequence[tuple[int, Optional[Sequence[int]]]],
                       window: Optional[int], policy: KernelPolicy = PORTABLE) -> Array:
    """Joint attention over concatenated segments, (B, N, H, dh) each, queries scaled and rotated;
    ``window`` None is the reference's global form (:func:`jaxrat.ops.windowed_attention.multires_attention`)."""
    return _windowed(q, k, v, segments, window, attend=lambda a, b, c: softmax_attention(a, b, c, policy))


def grouping_maps(q: Array, k: Array) -> tuple[Array, Array]:
    """Materialised (A_q, A_k) of shape (..., N_out, N_in), for returning grouping maps only."""
    a_k = jax.nn.softmax(jnp.einsum("...qd,...kd->...qk", q, k, preferred_element_type=jnp.float32), axis=-1)
    a_q = a_k / (a_k.sum(axis=-2, keepdims=True) + EPS)
    return a_q, a_k


def grouping_attention_reference(q: Array, k: Array, v: Array) -> Array:
    """Naive fully materialised SGA update, for tests and benchmarks."""
    a_q, _ = grouping_maps(q, k)
    return jnp.einsum("...qk,...kd->...qd", a_q, v.astype(jnp.float32)).astype(q.dtype)
