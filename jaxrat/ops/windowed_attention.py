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


def _to_windows(x: Array, grid: Sequence[int], window: int) -> tuple[Array, tuple[int, ...]]:
    """(B, N, H, C) on ``grid`` -> (B, num_windows, H, window^sd, C), zero-padded to whole tiles."""
    b, _, h, c = x.shape
    sd = len(grid)
    tiles = tuple(-(-int(g) // window) for g in grid)
    x = x.reshape(b, *grid, h, c)
    x = jnp.pad(x, [(0, 0)] + [(0, t * window - g) for t, g in zip(tiles, grid)] + [(0, 0), (0, 0)])
    shape = [b]
    for t in tiles:
        shape += [t, window]
    x = x.reshape(*shape, h, c)
    # (B, T1, w1, ..., Tsd, wsd, H, C) -> (B, T.., H, w.., C)
    perm = [0] + [1 + 2 * d for d in range(sd)] + [1 + 2 * sd] + [2 + 2 * d for d in range(sd)] + [2 + 2 * sd]
    x = x.transpose(perm)
    return x.reshape(b, int(np.prod(tiles)), h, window**sd, c), tiles


def _from_windows(x: Array, grid: Sequence[int], tiles: Sequence[int], window: int) -> Array:
    """Inverse of :func:`_to_windows`: (B, num_windows, H, window^sd, C) -> (B, N, H, C)."""
    b, _, h, _, c = x.shape
    sd = len(grid)
    x = x.reshape(b, *tiles, h, *([window] * sd), c)
    # (B, T.., H, w.., C) -> (B, T1, w1, ..., H, C)
    perm = [0]
    for d in range(sd):
        perm += [1 + d, 2 + sd + d]
    perm += [1 + sd, 2 + 2 * sd]
    x = x.transpose(perm).reshape(b, *[t * window for t in tiles], h, c)
    x = x[(slice(None),) + tuple(slice(0, int(g)) for g in grid)]
    return x.reshape(b, -1, h, c)


def _padding_bias(grid: Sequence[int], tiles: Sequence[int], window: int) -> Optional[np.ndarray]:
    """(num_windows, window^sd) 0 / _MASKED for real / padding tokens, or None without padding."""
    if all(t * window == g for t, g in zip(tiles, grid)):
        return None
    pad = np.ones([t * window for t in tiles], bool)
    pad[tuple(slice(0, int(g)) for g in grid)] = False
    sd = len(grid)
    shape = []
    for t in tiles:
        shape += [t, window]
    pad = pad.reshape(shape).transpose([2 * d for d in range(sd)] + [2 * d + 1 for d in range(sd)])
    return np.where(pad.reshape(int(np.prod(tiles)), -1), _MASKED, 0.0).astype(np.float32)


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
    for i, (n, grid) in enumerate(segments):
        if not large[i]:
            continue
        sl = slice(starts[i], starts[i + 1])
        qw, tiles = _to_windows(q[:, sl], grid, window)
        kwin, _ = _to_windows(k[:, sl], grid, window)
        vwin, _ = _to_windows(v[:, sl], grid, window)
        b, nw, h, t, dh = qw.shape
        bias = _padding_bias(grid, tiles, window)
        if glob.size:  # every window also sees the global tokens
            expand = lambda a: jnp.broadcast_to(to_heads(a)[:, None], (b, nw, h, glob.size, a.shape[-1]))
            kwin = jnp.concatenate([kwin, expand(kg)], axis=3)
            vwin = jnp.concatenate([vwin, expand(vg)], axis=3)
            if bias is not None:
                bias = np.concatenate([bias, np.zeros((nw, glob.size), np.float32)], axis=1)
        if bias is not None:
            # Padding keys are masked through one extra feature: q gets a 1, k gets 0 or _MASKED.
            qw = jnp.concatenate([qw, jnp.ones((*qw.shape[:-1], 1), qw.dtype)], axis=-1)
            kb = jnp.broadcast_to(jnp.asarray(bias, kwin.dtype)[None, :, None, :, None], (*kwin.shape[:-1], 1))
            kwin = jnp.concatenate([kwin, kb], axis=-1)
        u = attend(qw, kwin, vwin)  # (B, nw, H, t, dh)
        out[i] = _from_windows(u, grid, tiles, window)
    return jnp.concatenate(out, axis=1)
