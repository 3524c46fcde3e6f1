"""The keys' pass of a sparse SGA layer whose keys and values are a projection of its input (the
first layer's, :mod:`jaxrat.ops.gpu.sparse_sga.projection`), writing the input's gradient as well.

The plain keys' pass (:func:`jaxrat.ops.gpu.sparse_sga.passes.input_pass`) runs one program per
(image, head) slice and writes the projection's gradient dkv (B, N_in, 2 H d); cuBLAS then read it
back for the input's gradient dx = dkv W^T. Here one program takes an input tile of an image
through every head in turn (the same tile code, on that head's views of the operands), stores its
part of dkv as before, and multiplies its gradients by its head's columns of W on the tensor cores,
summing dx over the heads in float32 on chip: dx is written once and dkv read back only for the
weights' gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jaxrat.ops.gpu.sparse_sga import passes
from jaxrat.ops.gpu.sparse_sga.tiles import Strided, clip, dot, load_as, store, store_keys, strided_refs
from jaxrat.ops.gpu.sparse_sga.tiling import Tiling


def _head_views(refs: dict, t: Tiling, head) -> dict:
    """An image's operands (all heads, :func:`keys_pass_with_inputs`) as head ``head``'s: the
    group-level ones token-major at its stride and offset, the per-slice ones (keys, values,
    statistics) at its slice's offset."""
    n_in, n_out = t.Y * t.X, t.OY * t.OX
    out = strided_refs(refs, t.heads, dict(q=t.dh, dq=t.dh, g=t.dv, u=t.dv), head)
    sizes = dict(k=(t.dh, n_in), v=(t.dv, n_in), r=(1, n_out), delta=(1, n_out), d=(1, n_in), gd=(1, n_in))
    for name, ref in refs.items():
        base = name if name in ("k", "v") else name.rstrip("0123456789")
        if base in sizes:
            d, n = sizes[base]
            out[name] = Strided(ref, d, head * n * d)
    return out


def _keys_with_inputs_kernel(*flat_refs, names, t: Tiling, eps: float, uses: int, exact: bool, features: int):
    """The keys' pass over one input tile of every head of one image, which also multiplies each
    head's gradients by its columns of the projection's weights ``w`` (C, 2 H d) and sums them over
    the heads on chip: the layer input's gradient dx (tile, C), stored once (float32 sums, the
    products in the weights' dtype, as cuBLAS's product of the stored gradient)."""
    refs = dict(zip(names, flat_refs))
    at = pl.program_id(0), pl.program_id(1)  # read here: interpret mode lowers no program id in a loop
    x = at[0] * t.tx + jnp.arange(t.tx, dtype=jnp.int32)
    input_ok = x < t.X
    input_rows = at[1] * t.X + clip(x, t.X)
    width = t.heads * (t.dh + t.dv)
    rows = jnp.arange(features, dtype=jnp.int32)
    every = rows >= 0
    per_slice = pl.num_programs(0) * pl.num_programs(1) * (t.dh + t.dv)  # dbias entries of one head
    bias_at = passes.tile_index() * (t.dh + t.dv)

    def per_head(head, dx):
        head_refs = _head_views(refs, t, head)
        _, _, dk, dv = passes.input_tile(head_refs, "keys", t, eps, uses, exact, at)
        dk = store_keys(head_refs, t, input_rows, input_ok, dk, dv, head, head * per_slice + bias_at)
        dt = refs["w"].dtype
        wk = load_as(Strided(refs["w"], width, head * t.dh), rows, every, t.dh, t.dhp)
        wv = load_as(Strided(refs["w"], width, t.heads * t.dh + head * t.dv), rows, every, t.dv, t.dvp)
        return dx + dot(dk.astype(dt), wk, exact, transpose_b=True) + dot(dv.astype(dt), wv, exact, transpose_b=True)

    dx = lax.fori_loop(0, t.heads, per_head, jnp.zeros((t.tx, features), jnp.float32))
    store(refs["dx"], input_rows, input_ok, features, features, dx)


def keys_pass_with_inputs(t: Tiling, ins: dict, outs: dict, eps: float, interpret: bool, uses: int) -> dict:
    """The keys' pass into a projection's gradient ``dkv`` (and ``dbias``) that also writes the layer
    input's gradient ``dx`` (B, N_in * C) from the weights ``w`` (1, C * 2 H d): one program per
    input tile of an image, looping over its heads (:func:`_keys_with_inputs_kernel`). Operands as
    :func:`~jaxrat.ops.gpu.sparse_sga.passes.input_pass` takes them, reshaped (B, H * n) (their bytes unmoved)."""
    b = outs["dkv"].shape[0]
    features = outs["dx"].shape[1] // (t.Y * t.X)
    flat = {n: a.reshape(b, -1) if n not in ("phase", "w") else a for n, a in ins.items()}
    shapes = {n: jax.ShapeDtypeStruct((b, int(np.prod(s.shape)) // b), s.dtype) for n, s in outs.items()}
    grid = (-(-t.X // t.tx), t.Y, b)
    return passes.call(_keys_with_inputs_kernel, t, grid, flat, shapes, "sparse_sga_inputs_keys_dx", interpret,
                 per_image=True, eps=eps, uses=uses, exact=interpret, features=features)


def tiling_with_inputs(t: Tiling, features: int) -> Tiling:
    """``t`` for :func:`keys_pass_with_inputs` of inputs of ``features`` channels: tiles of at most
    4096 / features inputs (at least 16, a product's side), so that the input gradient's float32 sums
    take 32 registers of a thread of 4 warps. Compiled for an H100 at 128 channels (ptxas): tiles of 32
    take 168 registers (3 programs an SM), of 64 on 4 warps 246, on 8 warps 191 (one program an SM)."""
    return t._replace(tx=min(t.tx, max(16, 4096 // features)), warps=4)
