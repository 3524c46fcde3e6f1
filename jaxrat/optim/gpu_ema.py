"""The parameters' exponential moving average over many leaves in a few kernels, for GPUs.

XLA gives every leaf's average (``decay * ema + (1 - decay) * param``, kept where the step was not
finite) a kernel of its own: with ``optimizer.ema_decay`` set, the step compiled for an H100 had a
kernel more per parameter leaf than without the average. Here one Pallas (Triton) kernel
averages up to :data:`LEAVES_PER_CALL` leaves in place, a program a block of :data:`BLOCK` elements of
one leaf (:mod:`jaxrat.optim.multi_tensor`). The arithmetic is :func:`leaf_ema`, the expression
:func:`jaxrat.trainer.optimizer.update_ema` applies leaf by leaf.
"""

from __future__ import annotations

from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxrat.optim.multi_tensor import over_leaves, programs

Array = jax.Array
BLOCK = 1024  # elements a program averages: 8 a thread at 4 warps
LEAVES_PER_CALL = 64  # 3 pointers a leaf: 193 kernel arguments, well under CUDA's 4 KB of parameters


def leaf_ema(ema: Array, param: Array, decay: Array) -> Array:
    """One leaf's average after the step, float32 (``update_ema``'s expression)."""
    return decay * ema + (1.0 - decay) * param


def _kernel(*refs, sizes: tuple[int, ...]):
    n = len(sizes)
    s_ref, emas, params, outs = refs[0], refs[1:1 + n], refs[1 + n:1 + 2 * n], refs[1 + 2 * n:]
    decay, ok = s_ref[0], s_ref[1] > 0

    def leaf(j, read, write, mask):
        e = plgpu.load(emas[j].at[read], mask=mask, other=0.0)
        p = plgpu.load(params[j].at[read], mask=mask, other=0.0)
        plgpu.store(outs[j].at[write], jnp.where(ok, leaf_ema(e, p, decay), e), mask=mask)

    over_leaves(sizes, BLOCK, leaf)


def _call(s: Array, emas: Sequence[Array], params: Sequence[Array], interpret: bool) -> list[Array]:
    sizes = tuple(int(x.size) for x in emas)
    res = pl.pallas_call(
        partial(_kernel, sizes=sizes),
        grid=(programs(sizes, BLOCK),),
        out_shape=[jax.ShapeDtypeStruct((n,), jnp.float32) for n in sizes],
        input_output_aliases={1 + j: j for j in range(len(sizes))},  # each average updated in place
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="multi_tensor_ema",
    )(s, *[x.reshape(-1) for x in emas], *[x.reshape(-1) for x in params])
    return [r.reshape(x.shape) for r, x in zip(res, emas)]


def supports(emas: Sequence, params: Sequence) -> str | None:
    """None when the averages and parameters are float32, pairwise of one shape, non-empty and under
    2^31 elements each, else why not."""
    if len(emas) != len(params):
        return "the averages do not mirror the parameters"
    for e, p in zip(emas, params):
        if jnp.dtype(e.dtype) != jnp.float32 or jnp.dtype(p.dtype) != jnp.float32:
            return "the multi-tensor average takes float32 averages and parameters"
        if tuple(e.shape) != tuple(p.shape):
            return "the averages do not mirror the parameters"
        if e.size == 0 or e.size >= 2**31 - BLOCK:
            return "the multi-tensor average takes non-empty leaves of fewer than 2^31 elements"
    return None


def multi_tensor_ema(emas: Sequence[Array], params: Sequence[Array], decay: Array, ok: Array, *,
                     interpret: bool = False) -> list[Array]:
    """``[where(ok, leaf_ema(e, p, decay), e) for e, p in zip(emas, params)]`` in
    ``ceil(len(emas) / LEAVES_PER_CALL)`` kernels, each average updated in place. ``interpret``:
    Pallas interpret mode (tests)."""
    why = supports(emas, params)
    if why:
        raise ValueError(why)
    s = jnp.stack([jnp.asarray(decay, jnp.float32), jnp.asarray(ok, jnp.float32)])
    out: list[Array] = []
    for lo in range(0, len(emas), LEAVES_PER_CALL):
        out.extend(_call(s, emas[lo:lo + LEAVES_PER_CALL], params[lo:lo + LEAVES_PER_CALL], interpret))
    return out
