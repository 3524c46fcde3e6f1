"""Attention operations of the RAT, dispatched on the kernel policy (:mod:`jaxrat.ops.policy`).

* :func:`grouping_attention`: dense SGA's update ``(P / (colsum(P) + eps)) @ V`` with
  ``P = softmax(q k^T)`` over the keys.
* :func:`sparse_grouping_attention`: the same with each group's keys limited to the window its
  strided convolution covers (:class:`Window`), on keys prepared once per layer (:func:`sparse_keys`);
  :func:`sparse_grouping_maps` its maps.
* :func:`softmax_attention`: plain attention ``softmax(q k^T) @ V`` (queries scaled beforehand).
* :func:`multires_attention`: the multi-resolution block's joint attention over all scales, global
  or windowed (:mod:`jaxrat.ops.portable.windowed_attention`).
* :func:`masked_attention`: multi-head attention with a key padding mask (DETR's decoder), the
  mask resolved once for many calls by :func:`pack_keys`.

The ``cpu`` and ``portable`` forms are the memory-bounded chunked kernels of
:mod:`jaxrat.ops.portable.chunked_attention` (the cpu form with the CPU's block and slice batching). The
``gpu`` form is fused: sparse SGA as Pallas (Triton) kernels that keep the window's logits on
chip (:mod:`jaxrat.ops.gpu.sparse_sga`, run per device under a mesh), the rest cuDNN (dense SGA as its flash
decomposition) wherever cuDNN takes the call (bfloat16/float16, head dims up to 128); a call it
refuses (float32 compute) takes the portable chunked kernel, which is memory-bounded at any
resolution, where the fused module's own fallback (materialised logits) would not be.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrat.ops import per_device
from jaxrat.ops.per_device import over_batch
from jaxrat.ops.policy import PORTABLE, KernelPolicy
from jaxrat.ops.portable import chunked_attention as chunked
from jaxrat.ops.portable import sparse_sga as sparse
from jaxrat.ops.portable.chunked_attention import EPS
from jaxrat.ops.portable.sparse_sga import Geometry as Window
from jaxrat.ops.portable.sparse_sga import strided_grid as window_grid
from jaxrat.ops.portable.windowed_attention import multires_attention as _windowed

Array = jax.Array
__all__ = ["EPS", "KeyPadding", "Window", "grouping_attention", "grouping_attention_reference", "grouping_maps",
           "masked_attention", "pack_keys", "multires_attention", "softmax_attention", "SparseKeys", "sparse_keys",
           "sparse_grouping_attention", "sparse_grouping_maps", "window_grid"]


def _chunked(kernel, q: Array, k: Array, v: Array, policy: KernelPolicy) -> Array:
    # Per device: the kernel loops over its slices (lax.map), and a loop over a sharded axis is
    # partitioned by gathering the whole operand onto every device on every trip.
    blocks = dict(max_block_elements=policy.block_elements, slice_batch=policy.slice_batch)
    if not policy.cpu:
        return over_batch(lambda q, k, v: kernel(q, k, v, **blocks), q, k, v)
    from jaxrat.ops.cpu import SCOPE
    from jaxrat.ops.cpu.cache import UNBATCHED_SLICE_ELEMENTS

    with jax.named_scope(SCOPE):
        return over_batch(lambda q, k, v: kernel(q, k, v, **blocks, unbatched_from=UNBATCHED_SLICE_ELEMENTS), q, k, v)


def _fused(policy: KernelPolicy, q: Array, k: Array, v: Array, form: str) -> bool:
    """Whether the gpu policy uses the fused GPU ``form`` (cuDNN) and that takes these operands."""
    if not policy.uses(form):
        return False
    from jaxrat.ops.gpu import why_not

    return why_not("cudnn", q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1], q.dtype) is None


def _scaled(x: Array, scale: Optional[Array]) -> Array:
    return x if scale is None else x * scale.astype(x.dtype)


def grouping_attention(q: Array, k: Array, v: Array, policy: KernelPolicy = PORTABLE) -> Array:
    """Dense SGA update: q (..., N_out, dh) groups, k (..., N_in, dh), v (..., N_in, dv) ->
    (..., N_out, dv); logits ``q @ k^T`` unscaled."""
    if _fused(policy, q, k, v, "dense_sga"):
        from jaxrat.ops.gpu import dense_sga

        return over_batch(lambda q, k, v: dense_sga(q, k, v, implementation="cudnn"), q, k, v)
    return _chunked(chunked.grouping_attention, q, k, v, policy)


class SparseKeys(NamedTuple):
    """Keys and values laid out for the policy's sparse SGA kernel (:func:`sparse_keys`): prepared
    once and shared by every grouping iteration of a layer."""

    k: Array
    v: Array
    window: Window
    fused: bool  # the GPU's fused kernels (head-major), else the portable kernel (stride-blocked)
    normalise_columns: bool = True
    tapes: tuple = ()  # fused: one per use (:func:`jaxrat.ops.gpu.sparse_sga.lay_out_keys`)


def _sparse_fused(policy: KernelPolicy) -> bool:
    """Whether the gpu policy uses one of sparse SGA's fused forms (its switches: ``policy.sparse_sga``)."""
    from jaxrat.ops.forms import FORMS

    return any(policy.uses(name) for name, form in FORMS.items() if form.operation == "sparse_sga")


def _device_angles(phase: Array) -> Array:
    """RoSE angles as per-device copies (devices, N, Hr, d/2), a batch operand of :func:`over_batch`
    whose cotangents stay on their devices: as :func:`jaxrat.ops.rotate.rotation_phase` makes them under
    a mesh, else copied (one device; or zero-sized angles, no head turned)."""
    return phase if phase.ndim == 4 else per_device.copies(phase)


def _head_major(x: Array) -> Array:
    return x.transpose(0, 2, 1, 3)  # (B, N, H, d) <-> (B, H, N, d)


def sparse_keys(k: Array, v: Array, window: Window, policy: KernelPolicy = PORTABLE, *, uses: int = 1,
                normalise_columns: bool = True) -> SparseKeys:
    """Keys (B, N_in, H, dh) and values (B, N_in, H, dv) on ``window.grid``, token-major as the
    projections make them, ready for ``uses`` calls of :func:`sparse_grouping_attention`, each with
    its own ``use`` index (on the gpu policy the calls' key and value gradients are summed in one
    pass over the keys, :func:`jaxrat.ops.gpu.sparse_sga.lay_out_keys`)."""
    if _sparse_fused(policy):
        from jaxrat.ops.gpu import sparse_sga as gpu_sparse

        n_out = int(np.prod(window.out))
        if gpu_sparse.supports(window, (k.shape[0], n_out, *k.shape[2:]), k.dtype) is None:
            lay = lambda k, v: tuple(gpu_sparse.lay_out_keys(k, v, window, uses, normalise_columns,
                                                             blocks=policy.sparse_sga))
            k, v, tapes = over_batch(lay, k, v)
            return SparseKeys(k, v, window, True, normalise_columns, tapes)
    # Laid out once (here and above): those arrays are then what every iteration's backward keeps,
    # and their gradients add up in that layout before one transpose back.
    return SparseKeys(sparse.sparse_blocks(_head_major(k), window), sparse.sparse_blocks(_head_major(v), window),
                      window, False, normalise_columns)


def sparse_keys_of_projection(kv: Array, window: Window, policy: KernelPolicy = PORTABLE, *, heads: int,
                              rotation: Optional[tuple[Array, int]] = None, uses: int = 1,
                              normalise_columns: bool = True) -> SparseKeys:
    """:func:`sparse_keys` of a key-value projection's output ``kv`` (B, N_in, 2 H d): its first half
    the keys, its second the values, ``heads`` heads each; ``rotation`` (angles (N_in, Hr, d/2),
    Hr) turns the keys' first Hr heads (RoSE, :func:`jaxrat.ops.rotate.rotate_heads`) first.

    On the gpu policy the split, the rotation and the layout are one step whose backward writes the
    projection's gradient whole (:func:`jaxrat.ops.gpu.sparse_sga.lay_out_projection`); elsewhere
    they are the plain operations."""
    b, n_in, width = kv.shape
    dh = width // (2 * heads)
    phase, rotated = rotation if rotation is not None else (None, 0)
    if _sparse_fused(policy):
        from jaxrat.ops.gpu import sparse_sga as gpu_sparse

        n_out = int(np.prod(window.out))
        if gpu_sparse.supports(window, (b, n_out, heads, dh), kv.dtype) is None and width == 2 * heads * dh:
            angles = _device_angles(phase if rotated else jnp.zeros((n_in, 0, dh // 2), jnp.float32))

            def lay(kv, angles):
                return tuple(gpu_sparse.lay_out_projection(kv, angles[0], window, heads, uses, normalise_columns,
                                                           blocks=policy.sparse_sga))

            k, v, tapes = over_batch(lay, kv, angles)
            return SparseKeys(k, v, window, True, normalise_columns, tapes)
    from jaxrat.ops.rotate import rotate_heads

    k, v = jnp.split(kv, 2, axis=-1)
    k = k.reshape(b, n_in, heads, dh)
    if rotated:
        k = rotate_heads(k, phase, rotated, policy)
    return sparse_keys(k, v.reshape(b, n_in, heads, dh), window, policy, uses=uses,
                       normalise_columns=normalise_columns)


def sparse_keys_of_inputs(x: Array, kernel: Array, bias: Optional[Array], window: Window,
                          policy: KernelPolicy = PORTABLE, *, heads: int, dtype=None,
                          rotation: Optional[tuple[Array, int]] = None, uses: int = 1,
                          normalise_columns: bool = True) -> SparseKeys:
    """:func:`sparse_keys_of_projection` of ``x @ kernel + bias`` (B, N_in, C) @ (C, 2 H d), computed at
    ``dtype`` as flax's ``nnx.Linear`` computes it: operands cast (to their promoted dtype when
    ``dtype`` is None), one product, the bias added.

    On the gpu policy, where the layer's shapes allow, the product, the rotation and the layout are one
    kernel (:func:`jaxrat.ops.gpu.sparse_sga.projection.lay_out_inputs`): the projection is never
    written token-major. The bias is added in float32 and gets a float32 gradient."""
    dt = jnp.dtype(dtype) if dtype is not None else jnp.result_type(x, kernel, *([] if bias is None else [bias]))
    b, n_in, _ = x.shape
    width = kernel.shape[1]
    dh = width // (2 * heads)
    phase, rotated = rotation if rotation is not None else (None, 0)
    if _sparse_fused(policy) and policy.uses("sparse_sga_projection"):
        from jaxrat.ops.gpu import sparse_sga as gpu_sparse
        from jaxrat.ops.gpu.sparse_sga import projection as gpu_projection

        n_out = int(np.prod(window.out))
        if (gpu_sparse.supports(window, (b, n_out, heads, dh), dt) is None and width == 2 * heads * dh
                and gpu_projection.kernel_supports(n_in, x.shape[2], dh, dt)):
            angles = _device_angles(phase if rotated else jnp.zeros((n_in, 0, dh // 2), jnp.float32))
            full_bias = jnp.zeros((width,), jnp.float32) if bias is None else bias.astype(jnp.float32)

            def lay(x, angles, w, bias):
                return tuple(gpu_projection.lay_out_inputs(x, w, bias, angles[0], window, heads, uses,
                                                           normalise_columns, blocks=policy.sparse_sga))

            # the weights rounded here, as the Linear rounds them: a cast the train step makes with the
            # others' in one kernel (jaxrat/trainer/param_cast.py), and the backward's product needs
            k, v, tapes = over_batch(lay, x.astype(dt), angles, replicated=(kernel.astype(dt), full_bias))
            return SparseKeys(k, v, window, True, normalise_columns, tapes)
    kv = jax.lax.dot_general(x.astype(dt), kernel.astype(dt), (((x.ndim - 1,), (0,)), ((), ())))
    if bias is not None:
        kv = kv + bias.astype(dt)
    return sparse_keys_of_projection(kv, window, policy, heads=heads, rotation=rotation, uses=uses,
                                     normalise_columns=normalise_columns)


def sparse_grouping_attention(q: Array, keys: SparseKeys, policy: KernelPolicy = PORTABLE, *, use: int = 0,
                              key_scale: Optional[Array] = None) -> Array:
    """Sparse SGA update: group o of q (B, N_out, H, dh) attends to the keys and values
    (:func:`sparse_keys`) of its window only; logits ``q . (key_scale k)``, probabilities over the
    window's taps, then divided by each key's total over the windows holding it (unless the keys
    were prepared with ``normalise_columns`` off). ``use``: which of the keys' uses this call is.
    Returns (B, N_out, H, dv)."""
    # The scale goes on the queries (as many as the keys / stride^2): the same logits, and the
    # scale's gradient then does not keep the full-resolution scaled keys alive for the backward.
    q = _scaled(q, key_scale)
    if keys.fused:
        from jaxrat.ops.gpu import sparse_sga as gpu_sparse

        if not 0 <= use < len(keys.tapes):
            raise ValueError(f"use {use} of sparse keys prepared for {len(keys.tapes)} uses")

        def fused(q, k, v, tape):  # only this use's tape goes in: the others get no cotangent from it
            laid = gpu_sparse.LaidOutKeys(k, v, (tape,))
            return gpu_sparse.laid_out_update(q.astype(k.dtype), laid, 0, keys.window, keys.normalise_columns,
                                              blocks=policy.sparse_sga)

        return over_batch(fused, q, keys.k, keys.v, keys.tapes[use])
    update = lambda q, k, v: sparse.sparse_update(q, k, v, keys.window, keys.normalise_columns)  # noqa: E731
    return _head_major(over_batch(update, _head_major(q), keys.k, keys.v))


def sparse_grouping_maps(q: Array, k: Array, window: Window, *,
                         key_scale: Optional[Array] = None) -> tuple[Array, Array]:
    """Materialised (A_q, A_k) of :func:`sparse_grouping_attention` for token-major q and k, dense
    (B, H, N_out, N_in), for returning grouping maps only."""
    q, k = _head_major(_scaled(q, key_scale)), _head_major(k)
    _, a_q, a_k = sparse.sparse_grouping(q, k, k, window.grid, window.kernel, window.stride)
    idx, ok = sparse.window_indices(window.grid, window.kernel, window.stride)
    return tuple(sparse.scatter_window_map(a, idx, ok, k.shape[-2]) for a in (a_q, a_k))


def softmax_attention(q: Array, k: Array, v: Array, policy: KernelPolicy = PORTABLE) -> Array:
    """Plain softmax attention over the last two axes, (..., Nq, d) x (..., Nk, d) -> (..., Nq, dv)."""
    if _fused(policy, q, k, v, "attention"):
        from jaxrat.ops.gpu import fused_attention

        return over_batch(lambda q, k, v: fused_attention(q, k, v, implementation="cudnn"), q, k, v)
    return _chunked(chunked.softmax_attention, q, k, v, policy)


def multires_attention(q: Array, k: Array, v: Array, segments: Sequence[tuple[int, Optional[Sequence[int]]]],
                       window: Optional[int], policy: KernelPolicy = PORTABLE) -> Array:
    """Joint attention over concatenated segments, (B, N, H, dh) each, queries scaled and rotated;
    ``window`` None is the reference's global form (:func:`jaxrat.ops.portable.windowed_attention.multires_attention`;
    the gpu form: windows in the batch axis, padded keys by sequence lengths, :mod:`jaxrat.ops.gpu.multires`)."""
    # Per device, whole: the windows, the segments' joins and cuDNN's batch split stay within each
    # device's images (partitioned by XLA they moved activations between devices).
    if _fused(policy, q, k, v, "attention"):
        from jaxrat.ops.gpu import multires_attention as gpu_multires

        return over_batch(lambda q, k, v: gpu_multires(q, k, v, segments, window, implementation="cudnn"), q, k, v)
    return over_batch(lambda q, k, v: _windowed(q, k, v, segments, window,
                                                attend=lambda a, b, c: softmax_attention(a, b, c, policy)), q, k, v)


class KeyPadding(NamedTuple):
    """Which keys of (B, Nk) token sequences are real, for many :func:`masked_attention` calls over keys
    and values made token by token from the same sequences (:func:`pack_keys`)."""

    ok: Array  # (B, Nk) bool, in the sequences' (possibly packed) order
    lengths: Optional[Array] = None  # (B,) int32 where each row's real keys were packed to its front


def pack_keys(key_ok: Array, arrays: Sequence[Array], policy: KernelPolicy = PORTABLE
              ) -> tuple[KeyPadding, tuple[Array, ...]]:
    """``key_ok`` (B, Nk) bool and the (B, Nk, ...) ``arrays`` that attention keys and values are later
    made from token by token (DETR's memory and its positions), ready for :func:`masked_attention`.

    On the gpu policy each row's real tokens are gathered to its front once, in one stable order,
    for every array (differentiated by the inverse order): the fused kernel then masks each call by
    length, where every call would otherwise gather its own keys and values (compiled for an H100,
    tens of gigabytes a step in the COCO RAT-DETR decoder's six layers at 800 px). Softmax does not care
    about key order. Elsewhere the arrays are returned as they are."""
    if not policy.uses("masked_attention"):
        return KeyPadding(key_ok), tuple(arrays)
    from jaxrat.ops.gpu import masked as gpu_masked

    lengths, packed = gpu_masked.pack(key_ok, arrays)
    return KeyPadding(jnp.arange(key_ok.shape[1])[None, :] < lengths[:, None], lengths), packed


def masked_attention(q: Array, k: Array, v: Array, key_ok: Optional[Array | KeyPadding] = None,
                     policy: KernelPolicy = PORTABLE) -> Array:
    """Multi-head ``softmax(q k^T / sqrt(d)) v`` on (B, N, H, d) arrays, keys where ``key_ok`` ((B, Nk)
    bool, or a :class:`KeyPadding` of keys made from :func:`pack_keys`' arrays; None: all), every row
    keeping at least one key. The portable form materialises the logits in float32 (the DETR
    decoder's are small)."""
    heads = lambda a: a.transpose(0, 2, 1, 3)  # (B, N, H, d) <-> (B, H, N, d)
    d = q.shape[-1]
    lengths = None
    if isinstance(key_ok, KeyPadding):
        key_ok, lengths = key_ok
    if _fused(policy, heads(q), heads(k), heads(v), "masked_attention"):
        from jaxrat.ops.gpu import masked_attention as gpu_masked
        from jaxrat.ops.gpu.fused import fused_attention_heads

        if key_ok is None or lengths is not None:  # packed: the first `lengths` keys of a row are its real ones
            return fused_attention_heads(q, k, v, scale=d**-0.5, kv_lengths=lengths, implementation="cudnn")
        out = gpu_masked(heads(q), heads(k), heads(v), key_ok[:, None, :], scale=d**-0.5, implementation="cudnn")
        return heads(out)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
    logits = logits / jnp.sqrt(d).astype(jnp.float32)
    if key_ok is not None:
        logits = jnp.where(key_ok[:, None, None, :], logits, -1e9)
    weights = jax.nn.softmax(logits, -1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


def grouping_maps(q: Array, k: Array) -> tuple[Array, Array]:
    """Materialised (A_q, A_k) of shape (..., N_out, N_in), for returning grouping maps only."""
    a_k = jax.nn.softmax(jnp.einsum("...qd,...kd->...qk", q, k, preferred_element_type=jnp.float32), axis=-1)
    a_q = a_k / (a_k.sum(axis=-2, keepdims=True) + EPS)
    return a_q, a_k


def grouping_attention_reference(q: Array, k: Array, v: Array) -> Array:
    """Naive fully materialised SGA update, for tests and benchmarks."""
    a_q, _ = grouping_maps(q, k)
    return jnp.einsum("...qk,...kd->...qd", a_q, v.astype(jnp.float32)).astype(q.dtype)
