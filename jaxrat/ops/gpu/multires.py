"""Multi-resolution attention (global and windowed) as fused attention calls, for GPUs.

The same function as :func:`jaxrat.ops.windowed_attention.multires_attention`: global tokens
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

Array = jax.Array


def is_large(grid: Sequence[int], window: int) -> bool:
    """Whether a grid is tiled into windows (some axis longer than ``window``)."""
    return any(int(g) > window for g in grid)


def _tiles(grid: Sequence[int], window: int) -> tuple[int, ...]:
    return tuple(-(-int(g) // window) for g in grid)


def to_windows(x: Array, grid: Sequence[int], window: int) -> Array:
    """(B, N, H, C) on ``grid`` -> (B, num_windows, H, window^sd, C), zero-padded to whole tiles."""
    b, _, h, c = x.shape
    sd, tiles = len(grid), _tiles(grid, window)
    x = x.reshape(b, *grid, h, c)
    x = jnp.pad(x, [(0, 0)] + [(0, t * window - int(g)) for t, g in zip(tiles, grid)] + [(0, 0), (0, 0)])
    x = x.reshape(b, *[n for t in tiles for n in (t, window)], h, c)
    perm = [0] + [1 + 2 * d for d in range(sd)] + [1 + 2 * sd] + [2 + 2 * d for d in range(sd)] + [2 + 2 * sd]
    return x.transpose(perm).reshape(b, int(np.prod(tiles)), h, window**sd, c)


def from_windows(x: Array, grid: Sequence[int], window: int) -> Array:
    """Inverse of :func:`to_windows`: (B, num_windows, H, window^sd, C) -> (B, N, H, C)."""
    b, _, h, _, c = x.shape
    sd, tiles = len(grid), _tiles(grid, window)
    x = x.reshape(b, *tiles, h, *([window] * sd), c)
    perm = [0] + [i for d in range(sd) for i in (1 + d, 2 + sd + d)] + [1 + sd, 2 + 2 * sd]
    x = x.transpose(perm).reshape(b, *[t * window for t in tiles], h, c)
    x = x[(slice(None),) + tuple(slice(0, int(g)) for g in grid)]
    return x.reshape(b, -1, h, c)


def real_tokens(grid: Sequence[int], window: int) -> np.ndarray:
    """(num_windows, window^sd) bool: which slots of each tile hold a token (not padding)."""
    tiles, sd = _tiles(grid, window), len(grid)
    real = np.zeros([t * window for t in tiles], bool)
    real[tuple(slice(0, int(g)) for g in grid)] = True
    real = real.reshape([n for t in tiles for n in (t, window)])
    real = real.transpose([2 * d for d in range(sd)] + [2 * d + 1 for d in range(sd)])
    return real.reshape(int(np.prod(tiles)), -1)


def _windowed(q, k, v, kg, vg, grid, window, attend):
    qw, kw, vw = (to_windows(a, grid, window) for a in (q, k, v))
    b, nw, h, t, _ = qw.shape
    real = real_tokens(grid, window)
    if kg.shape[1]:  # every tile also sees the global tokens, after its own
        expand = lambda a: jnp.broadcast_to(a.transpose(0, 2, 1, 3)[:, None], (b, nw, h, *a.shape[1:2], a.shape[-1]))
        kw = jnp.concatenate([kw, expand(kg)], axis=3)
        vw = jnp.concatenate([vw, expand(vg)], axis=3)
        real = np.concatenate([real, np.ones((nw, kg.shape[1]), bool)], axis=1)
    lengths = None
    if not real.all():
        # A stable sort puts each tile's real keys first, in order; the padding follows, masked by length.
        order = jnp.asarray(np.argsort(~real, axis=1, kind="stable"))[None, :, None, :, None]
        kw, vw = (jnp.take_along_axis(a, order, axis=3) for a in (kw, vw))
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
    to_heads = lambda a: a.transpose(0, 2, 1, 3)  # (B, N, H, d) <-> (B, H, N, d)
    attend = functools.partial(fused_attention, implementation=implementation)
    large = [window is not None and g is not None and is_large(g, window) for _, g in segments]
    if not any(large):
        return to_heads(attend(to_heads(q), to_heads(k), to_heads(v)))
    starts = np.cumsum([0] + [n for n, _ in segments])
    glob = np.concatenate([np.arange(starts[i], starts[i + 1]) for i, big in enumerate(large) if not big] or
                          [np.zeros((0,), np.int64)])
    out = [None] * len(segments)
    if glob.size:  # global tokens see everything, as in the reference
        u = to_heads(attend(to_heads(q[:, glob]), to_heads(k), to_heads(v)))
        pos = 0
        for i, big in enumerate(large):
            if not big:
                out[i] = u[:, pos:pos + segments[i][0]]
                pos += segments[i][0]
    kg, vg = k[:, glob], v[:, glob]
    for i, (_, grid) in enumerate(segments):
        if large[i]:
            sl = slice(starts[i], starts[i + 1])
            out[i] = _windowed(q[:, sl], k[:, sl], v[:, sl], kg, vg, grid, window, attend)
    return jnp.concatenate(out, axis=1)
