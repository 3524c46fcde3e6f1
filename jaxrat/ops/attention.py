"""Attention operations of the RAT, dispatched on the kernel policy (:mod:`jaxrat.ops.policy`).

* :func:`grouping_attention`: dense SGA's update ``(P / (colsum(P) + eps)) @ V`` with
  ``P = softmax(q k^T)`` over the keys.
* :func:`sparse_grouping_attention`: the same with each group's keys limited to the window its
  strided convolution covers (:class:`Window`), on keys prepared once per layer (:func:`sga_keys` from
  the layer's inputs and key-value projection, :func:`sparse_keys` from keys and values);
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

The Pallas modules (sparse SGA's) are imported when a gpu policy first takes them (:func:`_pallas`):
importing Pallas's Triton backend is a cost at every start that a run on other devices never needs.
"""

from __future__ import annotations

import importlib
from typing import Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrat.ops import per_device
from jaxrat.ops.cpu import SCOPE
from jaxrat.ops.cpu.cache import UNBATCHED_SLICE_ELEMENTS
from jaxrat.ops.forms import FORMS
from jaxrat.ops.gpu import dense_sga, fused_attention, why_not
from jaxrat.ops.gpu import masked as gpu_masked
from jaxrat.ops.gpu import masked_attention as gpu_masked_attention
from jaxrat.ops.gpu import multires_attention as gpu_multires
from jaxrat.ops.gpu.fused import fused_attention_heads
from jaxrat.ops.per_device import over_batch
from jaxrat.ops.policy import PORTABLE, KernelPolicy
from jaxrat.ops.portable import chunked_attention as chunked
from jaxrat.ops.portable import sparse_sga as sparse
from jaxrat.ops.portable.chunked_attention import EPS
from jaxrat.ops.portable.sparse_sga import Geometry as Window
from jaxrat.ops.portable.sparse_sga import strided_grid as window_grid
from jaxrat.ops.portable.windowed_attention import multires_attention as _windowed
from jaxrat.ops.rotate import rotate_heads

Array = jax.Array
__all__ = ["EPS", "KeyPadding", "Window", "grouping_attention", "grouping_attention_reference", "grouping_maps",
           "masked_attention", "pack_keys", "multires_attention", "rolled_rounds", "sga_keys", "softmax_attention",
           "SparseKeys", "sparse_keys", "sparse_grouping_attention", "sparse_grouping_maps", "window_grid"]
# The Pallas kernels' modules by the name the dispatch below uses, imported on first use (:func:`_pallas`).
_PALLAS_MODULES = {"sparse_sga": "jaxrat.ops.gpu.sparse_sga",
                   "sparse_sga_projection": "jaxrat.ops.gpu.sparse_sga.projection"}


def _pallas(name: str):
    return importlib.import_module(_PALLAS_MODULES[name])


def _chunked(kernel, q: Array, k: Array, v: Array, policy: KernelPolicy) -> Array:
    # Per device: the kernel loops over its slices (lax.map), and a loop over a sharded axis is
    # partitioned by gathering the whole operand onto every device on every trip.
    blocks = dict(max_block_elements=policy.block_elements, slice_batch=policy.slice_batch)
    if not policy.cpu:
        return over_batch(lambda q, k, v: kernel(q, k, v, **blocks), q, k, v)
    with jax.named_scope(SCOPE):
        return over_batch(lambda q, k, v: kernel(q, k, v, **blocks, unbatched_from=UNBATCHED_SLICE_ELEMENTS), q, k, v)


def _fused(policy: KernelPolicy, q: Array, k: Array, v: Array, form: str) -> bool:
    """Whether the gpu policy uses the fused GPU ``form`` (cuDNN) and that takes these operands."""
    if not policy.uses(form):
        return False
    return why_not("cudnn", q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1], q.dtype) is None


def _scaled(x: Array, scale: Optional[Array]) -> Array:
    return x if scale is None else x * scale.astype(x.dtype)


def grouping_attention(q: Array, k: Array, v: Array, policy: KernelPolicy = PORTABLE) -> Array:
    """Dense SGA update: q (..., N_out, dh) groups, k (..., N_in, dh), v (..., N_in, dv) ->
    (..., N_out, dv); logits ``q @ k^T`` unscaled."""
    if _fused(policy, q, k, v, "dense_sga"):
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
    return any(policy.uses(name) for name, form in FORMS.items() if form.operation == "sparse_sga")


def _device_angles(phase: Array) -> Array:
    """RoSE angles as per-device copies (devices, N, Hr, d/2), a batch operand of :func:`over_batch`
    whose cotangents stay on their devices: as :func:`jaxrat.ops.rotate.rotation_phase` makes them under
    a mesh, else copied (one device; or zero-sized angles, no head turned)."""
    return phase if phase.ndim == 4 else per_device.copies(phase)


def _head_major(x: Array) -> Array:
    return x.transpose(0, 2, 1, 3)  # (B, N, H, d) <-> (B, H, N, d)


class _Projection(NamedTuple):
    """What :func:`sga_keys` projects: inputs x (B, N_in, C) by ``kernel`` (C, 2 H d) and ``bias``."""

    x: Array
    kernel: Array
    bias: Optional[Array]
    dtype: jnp.dtype
    heads: int
    rotation: Optional[tuple[Array, int]]  # (angles (N_in, Hr, d/2), Hr): RoSE on the keys' first Hr heads

    @property
    def head_dim(self) -> int:
        return self.kernel.shape[1] // (2 * self.heads)

    def product(self) -> Array:
        """``x @ kernel + bias`` as flax's ``nnx.Linear`` computes it: operands cast, one product, the bias added."""
        x, dt = self.x, self.dtype
        kv = jax.lax.dot_general(x.astype(dt), self.kernel.astype(dt), (((x.ndim - 1,), (0,)), ((), ())))
        return kv if self.bias is None else kv + self.bias.astype(dt)

    def angles(self) -> Array:
        phase, rotated = self.rotation if self.rotation is not None else (None, 0)
        n_in, dh = self.x.shape[1], self.head_dim
        return _device_angles(phase if rotated else jnp.zeros((n_in, 0, dh // 2), jnp.float32))


def _keys_form(policy: KernelPolicy, window: Window, shape: tuple, dtype, inputs: Optional[_Projection]) -> str:
    """Which form lays out sparse SGA's keys and values for ``shape`` (B, N_in, H, dh) of ``dtype``: the
    fused sparse kernels' where the policy uses them and they take the window and shapes, from the
    inputs in one kernel (``inputs``, the ``sparse_sga_projection`` form) where that takes them too,
    else from the projection ("projection") or the keys ("keys"); else the portable one."""
    n_out = int(np.prod(window.out))
    if not _sparse_fused(policy) or _pallas("sparse_sga").supports(window, (shape[0], n_out, *shape[2:]),
                                                                   dtype) is not None:
        return "portable"
    if inputs is None:
        return "keys"
    if inputs.kernel.shape[1] != 2 * shape[2] * shape[3]:
        return "portable"
    if policy.uses("sparse_sga_projection") and _pallas("sparse_sga_projection").kernel_supports(
            shape[1], inputs.x.shape[2], shape[3], dtype):
        return "inputs"
    return "projection"


def _fused_keys(k: Array, v: Array, window: Window, policy: KernelPolicy, uses: int,
                normalise_columns: bool) -> SparseKeys:
    lay = lambda k, v: tuple(_pallas("sparse_sga").lay_out_keys(k, v, window, uses, normalise_columns,
                                                                blocks=policy.sparse_sga))
    k, v, tapes = over_batch(lay, k, v)
    return SparseKeys(k, v, window, True, normalise_columns, tapes)


def _portable_keys(k: Array, v: Array, window: Window, policy: KernelPolicy, uses: int,
                   normalise_columns: bool) -> SparseKeys:
    # Laid out once: those arrays are then what every iteration's backward keeps, and their gradients
    # add up in that layout before one transpose back.
    return SparseKeys(sparse.sparse_blocks(_head_major(k), window), sparse.sparse_blocks(_head_major(v), window),
                      window, False, normalise_columns)


def _keys_from_inputs(p: _Projection, window: Window, policy: KernelPolicy, uses: int,
                      normalise_columns: bool) -> SparseKeys:
    """The product, the rotation and the layout as one kernel: the projection is never written token-major.
    The bias is added in float32 and gets a float32 gradient."""
    full_bias = jnp.zeros((p.kernel.shape[1],), jnp.float32) if p.bias is None else p.bias.astype(jnp.float32)

    def lay(x, angles, w, bias):
        return tuple(_pallas("sparse_sga_projection").lay_out_inputs(x, w, bias, angles[0], window, p.heads, uses,
                                                                     normalise_columns, blocks=policy.sparse_sga))

    # the weights rounded here, as the Linear rounds them: a cast the train step makes with the others'
    # in one kernel (jaxrat/trainer/param_cast.py), and the backward's product needs
    k, v, tapes = over_batch(lay, p.x.astype(p.dtype), p.angles(), replicated=(p.kernel.astype(p.dtype), full_bias))
    return SparseKeys(k, v, window, True, normalise_columns, tapes)


def _keys_from_projection(p: _Projection, window: Window, policy: KernelPolicy, uses: int,
                          normalise_columns: bool) -> SparseKeys:
    """XLA's product; the split, the rotation and the layout one step whose backward writes the
    projection's gradient whole (:func:`jaxrat.ops.gpu.sparse_sga.lay_out_projection`)."""
    kv = p.product()

    def lay(kv, angles):
        return tuple(_pallas("sparse_sga").lay_out_projection(kv, angles[0], window, p.heads, uses,
                                                              normalise_columns, blocks=policy.sparse_sga))

    k, v, tapes = over_batch(lay, kv, p.angles())
    return SparseKeys(k, v, window, True, normalise_columns, tapes)


def _keys_of_projection_portable(p: _Projection, window: Window, policy: KernelPolicy, uses: int,
                                 normalise_columns: bool) -> SparseKeys:
    """The plain operations: product, split, rotation (:func:`jaxrat.ops.rotate.rotate_heads`), layout."""
    b, n_in, _ = p.x.shape
    k, v = jnp.split(p.product(), 2, axis=-1)
    k = k.reshape(b, n_in, p.heads, p.head_dim)
    if p.rotation is not None and p.rotation[1]:
        k = rotate_heads(k, *p.rotation, policy)
    return _portable_keys(k, v.reshape(b, n_in, p.heads, p.head_dim), window, policy, uses, normalise_columns)


# The forms of sparse SGA's keys (:func:`_keys_form`), from keys and values or from the layer's inputs.
_KEYS_FORMS: dict[str, Callable[..., SparseKeys]] = {"keys": _fused_keys, "portable": _portable_keys}
_SGA_KEYS_FORMS: dict[str, Callable[..., SparseKeys]] = {
    "inputs": _keys_from_inputs, "projection": _keys_from_projection, "portable": _keys_of_projection_portable}


def sparse_keys(k: Array, v: Array, window: Window, policy: KernelPolicy = PORTABLE, *, uses: int = 1,
                normalise_columns: bool = True) -> SparseKeys:
    """Keys (B, N_in, H, dh) and values (B, N_in, H, dv) on ``window.grid``, token-major as the
    projections make them, ready for ``uses`` calls of :func:`sparse_grouping_attention`, each with
    its own ``use`` index (on the gpu policy the calls' key and value gradients are summed in one
    pass over the keys, :func:`jaxrat.ops.gpu.sparse_sga.lay_out_keys`)."""
    form = _keys_form(policy, window, k.shape, k.dtype, None)
    return _KEYS_FORMS[form](k, v, window, policy, uses, normalise_columns)


def sga_keys(x: Array, kernel: Array, bias: Optional[Array], window: Window, policy: KernelPolicy = PORTABLE, *,
             heads: int, dtype=None, rotation: Optional[tuple[Array, int]] = None, uses: int = 1,
             normalise_columns: bool = True) -> SparseKeys:
    """:func:`sparse_keys` of a sparse SGA layer's inputs ``x`` (B, N_in, C) projected by ``kernel`` (C, 2 H d)
    and ``bias`` as flax's ``nnx.Linear`` projects them at ``dtype`` (None: the operands' promoted dtype):
    the first half the keys, the second the values, ``heads`` heads each; ``rotation`` (angles
    (N_in, Hr, d/2), Hr) turns the keys' first Hr heads (RoSE, :func:`jaxrat.ops.rotate.rotate_heads`).

    The policy's form (:func:`_keys_form`): on the gpu policy, where the layer's shapes allow, the
    product, the rotation and the layout one kernel (:func:`jaxrat.ops.gpu.sparse_sga.projection.
    lay_out_inputs`), or XLA's product and then one step; elsewhere the plain operations."""
    dt = jnp.dtype(dtype) if dtype is not None else jnp.result_type(x, kernel, *([] if bias is None else [bias]))
    p = _Projection(x, kernel, bias, dt, heads, rotation)
    form = _keys_form(policy, window, (x.shape[0], x.shape[1], heads, p.head_dim), dt, p)
    return _SGA_KEYS_FORMS[form](p, window, policy, uses, normalise_columns)


def rolled_rounds(keys: Optional[SparseKeys], policy: KernelPolicy) -> bool:
    """Whether a layer's grouping rounds over ``keys`` run as one loop (:attr:`KernelPolicy.rolled_rounds`):
    the portable layout's; the fused kernels keep their rounds unrolled (each round's ``use`` its tape)."""
    return keys is not None and not keys.fused and policy.rolled_rounds


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
        gpu_sparse = _pallas("sparse_sga")
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
        if key_ok is None or lengths is not None:  # packed: the first `lengths` keys of a row are its real ones
            return fused_attention_heads(q, k, v, scale=d**-0.5, kv_lengths=lengths, implementation="cudnn")
        out = gpu_masked_attention(heads(q), heads(k), heads(v), key_ok[:, None, :], scale=d**-0.5,
                                   implementation="cudnn")
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
