"""The transformer MLP (:func:`mlp`): fused on the gpu policy, else over token chunks when the memory
or the CPU asks for it, else flax's layers as they are (:data:`FORMS`, chosen by :func:`form`).

On the ``gpu`` policy, calls the fused kernels take (:func:`fused`) run as one Pallas (Triton)
kernel forward and two backward, the hidden activation never in memory (:mod:`jaxrat.ops.gpu.mlp`).

Above :data:`CHUNK_HIDDEN_BYTES` of hidden activation in one call (every form but the fused one, which
keeps nothing hidden-sized for the backward: its dropout masks are drawn again there), the MLP runs
as a scan over token chunks, each rematerialised in the backward pass: at 1024 px the first SGA
layer's three MLPs would otherwise keep gigabytes of GELU inputs, outputs and dropout masks alive. The
``cpu`` policy also chunks smaller calls, keeping fc1's output (:mod:`jaxrat.ops.cpu.mlp`).
"""

from __future__ import annotations

import contextlib
import importlib
import math
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxrat.ops import per_device
from jaxrat.ops.cpu import SCOPE
from jaxrat.ops.cpu import mlp as cpu_mlp
from jaxrat.ops.per_device import splits
from jaxrat.ops.policy import KernelPolicy

Array = jax.Array
CHUNK_HIDDEN_BYTES = 256 * 2**20
CHUNK_TOKENS_BYTES = 32 * 2**20  # hidden bytes of one rematerialised chunk
# The gpu policy fuses calls with at least this much hidden activation: every call. At 8 MiB the small
# layers' MLPs (the third and fourth SGA layers', the MR blocks' on the small grids) were XLA's: with
# their dropout masks drawn by XLA, dozens of kernels more in the ISIC step compiled for an H100, for a
# few seconds less compile (benchmarks/gpu_cost.py).
FUSED_HIDDEN_BYTES = 0


def _gpu_mlp():
    """:mod:`jaxrat.ops.gpu.mlp`, imported when a gpu policy first asks for it: it loads Pallas's Triton
    backend, a cost at every start that a run on other devices never needs."""
    return importlib.import_module("jaxrat.ops.gpu.mlp")


class Chunks(NamedTuple):
    """How to chunk one MLP call: hidden bytes per chunk, whether chunks are recomputed, and
    whether this is the CPU's form."""

    chunk_bytes: int
    remat: bool
    cpu: bool = False


def chunking(hidden_bytes: int, policy: KernelPolicy) -> Optional[Chunks]:
    """The chunking for a call with ``hidden_bytes`` of hidden activation; None: one plain call. Under
    a mesh the batch is split over the devices, and what a device holds is what counts: judged on the
    whole batch, 16 GPUs of 16 images each chunked (and recomputed) MLPs that one GPU of 16 does not."""
    hidden_bytes //= splits()
    if hidden_bytes > CHUNK_HIDDEN_BYTES:
        return Chunks(CHUNK_TOKENS_BYTES, True)
    if policy.cpu and hidden_bytes > cpu_mlp.CHUNK_HIDDEN_BYTES:
        return Chunks(cpu_mlp.CHUNK_BYTES, False, cpu=True)
    return None


def fused(policy: KernelPolicy, x_shape: tuple, hidden: int, dtype, dropout_rate: float) -> bool:
    """Whether the gpu policy's fused MLP takes this call: bfloat16 ones, as with the fused attention (a
    float32 model on the gpu policy is a parity run, and runs anywhere: XLA's products), with at least
    :data:`FUSED_HIDDEN_BYTES` of hidden activation."""
    if not policy.uses("mlp") or len(x_shape) < 2 or dropout_rate >= 1.0 or jnp.dtype(dtype) != jnp.bfloat16:
        return False
    if math.prod(x_shape[:-1]) * hidden * jnp.dtype(dtype).itemsize < FUSED_HIDDEN_BYTES:
        return False
    return _gpu_mlp().supports(math.prod(x_shape[:-1]), x_shape[-1], hidden, dtype) is None


def fused_mlp(x: Array, w1: Array, b1: Array, w2: Array, b2: Array, *, dropout_rate: float,
              dropout_key: Optional[Array], output_rate: float = 0.0) -> Array:
    """``dropout(fc2(dropout(gelu(fc1(x)))))`` (exact GELU) with the kernels :func:`fused` chose, per device
    under a mesh: the hidden units dropped at ``dropout_rate`` and the output at ``output_rate``, both
    drawn inside the kernels from ``dropout_key`` (None: no dropout), the same masks on any mesh."""
    gpu_fused = _gpu_mlp().fused_mlp
    weights = (w1, b1, w2, b2)
    if dropout_key is None or not (dropout_rate or output_rate):
        return per_device.over_batch(lambda x, *w: gpu_fused(x, *w), x, replicated=weights)
    seed = jax.random.bits(dropout_key, (4,), jnp.uint32)
    per_row = math.prod(x.shape[1:-1])  # tokens per batch row: the kernels number tokens over the batch

    def run(first_row, x, seed, *w):
        return gpu_fused(x, *w, seed, (dropout_rate, output_rate), first_row * per_row)

    return per_device.over_batch(run, x, replicated=(seed, *weights), first_row=True)


def chunked_mlp(x: Array, fc1: Callable[[Array], Array], fc2: Callable[[Array], Array], *, hidden_bytes: int,
                chunks: Chunks, dropout_rate: float, dropout_key: Optional[Array]) -> Array:
    """``fc2(dropout(gelu(fc1(x))))`` as a scan over chunks of axis -2 (the caller applies the
    output dropout). ``dropout_key`` None: no dropout (evaluation, or rate 0).

    A scan (not one ``jax.checkpoint``) because XLA's scheduler runs independent recomputations
    side by side; a loop forces one chunk's hidden activation at a time.
    """
    n = x.shape[-2]
    num = max(2, -(-(hidden_bytes // splits()) // chunks.chunk_bytes))  # chunks of a device's share
    size = -(-n // num)
    num = -(-n // size)
    pad = num * size - n
    xp = jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, pad), (0, 0)]) if pad else x
    xs = jnp.moveaxis(xp.reshape(*x.shape[:-2], num, size, x.shape[-1]), -3, 0)
    train = dropout_key is not None
    keys = jax.random.split(dropout_key, num) if train else jnp.zeros((num,), jnp.uint32)

    def body(carry, chunk_and_key):
        chunk, key = chunk_and_key
        h = jax.nn.gelu(checkpoint_name(fc1(chunk), "mlp_fc1"), approximate=False)
        if train:
            keep = jax.random.bernoulli(key, 1.0 - dropout_rate, h.shape)
            h = jnp.where(keep, h / (1.0 - dropout_rate), jnp.zeros_like(h))
        return carry, fc2(h)

    # Without remat only fc1's output is kept: GELU and the dropout mask are recomputed from it
    # in the cache, and the backward holds one hidden-sized array per chunk, not three.
    policy = None if chunks.remat else jax.checkpoint_policies.save_only_these_names("mlp_fc1")
    with jax.named_scope(SCOPE) if chunks.cpu else contextlib.nullcontext():
        _, ys = jax.lax.scan(jax.checkpoint(body, policy=policy), None, (xs, keys))
    y = jnp.moveaxis(ys, 0, -3).reshape(*x.shape[:-2], num * size, ys.shape[-1])
    return y[..., :n, :] if pad else y



class Layers(NamedTuple):
    """An MLP's layers, as flax holds them: fc1 -> exact GELU -> drop1 -> fc2 -> drop2."""

    fc1: nnx.Linear
    fc2: nnx.Linear
    drop1: nnx.Dropout
    drop2: nnx.Dropout


def _dropout_key(drop: nnx.Dropout) -> Optional[Array]:
    """The key ``drop`` would draw its mask with (advancing its stream as it does), None when it would
    not draw: for the forms that apply the dropout themselves."""
    return drop.rngs() if not drop.deterministic and drop.rate > 0.0 else None


def _hidden_bytes(x: Array, m: Layers, dtype) -> int:
    return math.prod(x.shape[:-1]) * m.fc1.out_features * jnp.dtype(dtype).itemsize


def _plain(x: Array, m: Layers, dtype, policy: KernelPolicy) -> Array:
    return m.drop2(m.fc2(m.drop1(jax.nn.gelu(m.fc1(x), approximate=False))))


def _chunked(x: Array, m: Layers, dtype, policy: KernelPolicy) -> Array:
    hidden_bytes = _hidden_bytes(x, m, dtype)
    y = chunked_mlp(x, m.fc1, m.fc2, hidden_bytes=hidden_bytes, chunks=chunking(hidden_bytes, policy),
                    dropout_rate=m.drop1.rate, dropout_key=_dropout_key(m.drop1))
    return m.drop2(y)


def _fused(x: Array, m: Layers, dtype, policy: KernelPolicy) -> Array:
    bias = lambda fc: fc.bias[...] if fc.bias is not None else jnp.zeros((fc.out_features,), jnp.float32)
    w = (m.fc1.kernel[...], bias(m.fc1), m.fc2.kernel[...], bias(m.fc2))
    key = _dropout_key(m.drop1)
    # drop2's mask is drawn in the kernels too (from drop1's key: one draw from the stream); without a
    # key drop2 is off as well, or runs as itself.
    out_rate = m.drop2.rate if key is not None and not m.drop2.deterministic else 0.0
    # float32 weights as they are: the kernels round them on chip (no cast kernels), and their
    # gradients stay float32
    y = fused_mlp(x.astype(dtype), *w, dropout_rate=m.drop1.rate, dropout_key=key, output_rate=out_rate)
    return y if key is not None else m.drop2(y)


FORMS: dict[str, Callable[[Array, Layers, object, KernelPolicy], Array]] = {
    "fused": _fused, "chunked": _chunked, "plain": _plain}


def form(x: Array, m: Layers, dtype, policy: KernelPolicy) -> str:
    """Which of :data:`FORMS` computes this call: the gpu policy's kernels where they take it
    (:func:`fused`), else chunks where :func:`chunking` asks for them, else the plain layers."""
    if fused(policy, x.shape, m.fc1.out_features, dtype, m.drop1.rate):
        return "fused"
    if x.ndim >= 2 and chunking(_hidden_bytes(x, m, dtype), policy) is not None:
        return "chunked"
    return "plain"


def mlp(x: Array, layers: Layers, policy: KernelPolicy) -> Array:
    """``drop2(fc2(drop1(gelu(fc1(x)))))`` (exact GELU) of ``layers``, computed at fc1's dtype (else x's)
    by the policy's form (:func:`form`): the same values; in training, other dropout draws."""
    dtype = layers.fc1.dtype or x.dtype
    return FORMS[form(x, layers, dtype, policy)](x, layers, dtype, policy)
