"""Multi-resolution attention (global and windowed) as fused attention calls, for GPUs.

The same function as :func:`jaxrat.ops.portable.windowed_attention.multires_attention`: global tokens
attend to every token; a large scale's tokens attend to their own ``window^sd`` tile plus every
global token. Here the tiles move into the batch axis of one fused attention call per large
scale, each tile's keys followed by the global tokens. Tiles padded to whole windows put their
padding keys last (one static permutation per tile) and pass their real key count as
``kv_lengths``, instead of the CPU form's extra masking feature: cuDNN masks by sequence lengths
without materialising a mask, and the head dim keeps its size (a multiple of 8).
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrat.ops.gpu.fused import Implementation, fused_attention
from jaxrat.ops.gpu.permute import permute_keys
from jaxrat.ops.portable.windowed_attention import (
    broadcast_global,
    from_windows,
    real_tokens,
    segment_attention,
    to_windows,
)

Array = jax.Array


def _windowed(q, k, v, kg, vg, grid, window, *, attend):
    qw, kw, vw = (to_windows(a, grid, window) for a in (q, k, v))
    b, nw = qw.shape[:2]
    real = real_tokens(grid, window)
    if kg.shape[1]:  # every tile also sees the global tokens, after its own
        kw = jnp.concatenate([kw, broadcast_global(kg, b, nw)], axis=3)
        vw = jnp.concatenate([vw, broadcast_global(vg, b, nw)], axis=3)
        real = np.concatenate([real, np.ones((nw, kg.shape[1]), bool)], axis=1)
    lengths = None
    if not real.all():
        # A stable sort puts each tile's real keys first, in order; the padding follows, masked by length.
        order = np.argsort(~real, axis=1, kind="stable")  # static: its inverse too
        forward, inverse = (jnp.asarray(o)[None, :, None, :, None] for o in (order, np.argsort(order, axis=1)))
        kw, vw = permute_keys(kw, forward, inverse), permute_keys(vw, forward, inverse)
        lengths = jnp.asarray(real.sum(1), jnp.int32)[None, :, None]
    return from_windows(attend(qw, kw, vw, kv_lengths=lengths), grid, window)


def multires_attention(
    q: Array,
    k: Array,
    v: Array,
    segments: Sequence[tuple[int, Optional[Sequence[int]]]],
    window: Optional[int],
    *,
    implementation: Implementation = "auto",
) -> Array:
    """Joint attention over concatenated segments; ``window=None`` is the reference's global form.

    Args:
      q, k, v: (B, N, H, dh), queries already scaled, rotations applied.
      segments: (length, grid) per segment in sequence order; grid None = leading tokens (global).
      window: tile side in tokens for large grids, or None for global attention.
      implementation: fused attention implementation (:func:`jaxrat.ops.gpu.fused.choose_implementation`).

    Returns:
      (B, N, H, dh) attention output.
    """
    attend = functools.partial(fused_attention, implementation=implementation)
    return segment_attention(q, k, v, segments, window, attend=attend,
                             tiled=functools.partial(_windowed, attend=attend))
