"""Windowed multi-resolution attention: the linear-cost alternative to the MR block's global form.

The reference's multi-resolution block lets every token of every scale attend to every other
token. Its first block runs on the first SGA grid (86x86 = 7,396 tokens at 256 px, 342x342 =
116,964 at 1024 px), so its cost grows with the square of the pixel count. Here a scale whose grid
is larger than ``window`` along any axis is *large*; the others (and leading tokens) are *global*:

* a large scale's tokens attend to the tokens of their own non-overlapping ``window^sd`` tile
  plus every global token (coarse context from the small grids);
* global tokens attend to every token of every scale, as in the reference.

Per token the keys are bounded (window^sd + global tokens, and global tokens are at most
window^sd per scale), so the cost is linear in pixels. When every grid fits in one window nothing
is large and the result is exactly the global form; the parameters are the same either way, so
weights move freely between the two.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
MR_ATTENTION_TYPES = ("global", "windowed")
# Added to the logits of padding keys; exp underflows to exactly 0 in float32.
_MASKED = -1e9


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
    # (B, T1, w1, ..., Tsd, wsd, H, C) -> (B, T.., H, w.., C)
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


def broadcast_global(a: Array, b: int, nw: int) -> Array:
    """Global tokens (B, G, H, C) as every tile's extra keys: (B, num_windows, H, G, C)."""
    return jnp.broadcast_to(a.transpose(0, 2, 1, 3)[:, None], (b, nw, a.shape[2], a.shape[1], a.shape[-1]))


# A large segment's attention: (q, k, v of the segment, global keys and values, grid, window) -> (B, N_s, H, dh).
Tiled = Callable[[Array, Array, Array, Array, Array, Sequence[int], int], Array]


def segment_attention(q: Array, k: Array, v: Array, segments: Sequence[tuple[int, Optional[Sequence[int]]]],
                      window: Optional[int], *, attend: Callable[[Array, Array, Array], Array],
                      tiled: Tiled) -> Array:
    """The windowed rule's structure: global tokens attend to every token (``attend``), a large
    segment's tokens to their tile and the global tokens (``tiled``). Shapes as :func:`multires_attention`."""
    to_heads = lambda a: a.transpose(0, 2, 1, 3)  # (B, N, H, d) <-> (B, H, N, d)
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
            out[i] = tiled(q[:, sl], k[:, sl], v[:, sl], kg, vg, grid, window)
    return jnp.concatenate(out, axis=1)


def _masked_tiles(q: Array, k: Array, v: Array, kg: Array, vg: Array, grid: Sequence[int], window: int, *,
                  attend: Callable[[Array, Array, Array], Array]) -> Array:
    """A large segment's tiles attending to themselves and the global tokens, padding keys masked
    through one extra feature: q gets a 1, k gets 0 or _MASKED (any attention kernel can run it)."""
    qw, kwin, vwin = (to_windows(a, grid, window) for a in (q, k, v))
    b, nw = qw.shape[:2]
    real = real_tokens(grid, window)
    bias = None if real.all() else np.where(real, 0.0, _MASKED).astype(np.float32)
    if kg.shape[1]:  # every window also sees the global tokens
        kwin = jnp.concatenate([kwin, broadcast_global(kg, b, nw)], axis=3)
        vwin = jnp.concatenate([vwin, broadcast_global(vg, b, nw)], axis=3)
        if bias is not None:
            bias = np.concatenate([bias, np.zeros((nw, kg.shape[1]), np.float32)], axis=1)
    if bias is not None:
        qw = jnp.concatenate([qw, jnp.ones((*qw.shape[:-1], 1), qw.dtype)], axis=-1)
        kb = jnp.broadcast_to(jnp.asarray(bias, kwin.dtype)[None, :, None, :, None], (*kwin.shape[:-1], 1))
        kwin = jnp.concatenate([kwin, kb], axis=-1)
    return from_windows(attend(qw, kwin, vwin), grid, window)  # attend: (B, nw, H, t, dh)


def multires_attention(
    q: Array,
    k: Array,
    v: Array,
    segments: Sequence[tuple[int, Optional[Sequence[int]]]],
    window: Optional[int],
    *,
    attend: Callable[[Array, Array, Array], Array],
) -> Array:
    """Joint attention over concatenated segments; ``window=None`` is the reference's global form.

    Args:
      q, k, v: (B, N, H, dh), queries already scaled, rotations applied.
      segments: (length, grid) per segment in sequence order; grid None = leading tokens (global).
      window: tile side in tokens for large grids, or None for global attention.
      attend: plain softmax attention ``(…, Nq, d), (…, Nk, d), (…, Nk, dv) -> (…, Nq, dv)`` (queries
        scaled), the form the kernel policy chose.

    Returns:
      (B, N, H, dh) attention output.
    """
    return segment_attention(q, k, v, segments, window, attend=attend,
                             tiled=functools.partial(_masked_tiles, attend=attend))
