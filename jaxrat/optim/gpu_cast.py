"""Many float32 parameters cast to a narrower dtype in one kernel (a multi-tensor cast), for GPUs.

A bfloat16 step reads most weights as ``w.astype(bfloat16)``. Where the reader is a cuBLAS or cuDNN
call XLA cannot fuse that cast into it, so every such weight cost a kernel of its own of a few
microseconds (51 in the ISIC RAT step). Here one Pallas (Triton) kernel casts up to
:data:`LEAVES_PER_CALL` leaves, a program a block of :data:`BLOCK` elements of one leaf
(:mod:`jaxrat.optim.multi_tensor`).

The values are exactly ``w.astype(dtype)``; the gradient is the cotangent cast back to each leaf's
dtype, as autodiff of ``astype`` gives it.
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
BLOCK = 1024  # elements a program casts: 8 a thread at 4 warps
LEAVES_PER_CALL = 96  # 2 pointers a leaf: 192 kernel arguments, well under CUDA's 4 KB of parameters


def _kernel(*refs, sizes: tuple[int, ...]):
    ins, outs = refs[:len(sizes)], refs[len(sizes):]

    def leaf(j, read, write, ok):
        x = plgpu.load(ins[j].at[read], mask=ok, other=0.0)
        plgpu.store(outs[j].at[write], x.astype(outs[j].dtype), mask=ok)

    over_leaves(sizes, BLOCK, leaf)


def _call(leaves: Sequence[Array], dtype: jnp.dtype, interpret: bool) -> list[Array]:
    sizes = tuple(int(x.size) for x in leaves)
    res = pl.pallas_call(
        partial(_kernel, sizes=sizes),
        grid=(programs(sizes, BLOCK),),
        out_shape=[jax.ShapeDtypeStruct((n,), dtype) for n in sizes],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="multi_tensor_cast",
    )(*[x.reshape(-1) for x in leaves])
    return [r.reshape(x.shape) for r, x in zip(res, leaves)]


def supports(leaves: Sequence[Array]) -> str | None:
    """None when every leaf is float32, non-empty and under 2^31 elements, else why not."""
    for x in leaves:
        if jnp.dtype(x.dtype) != jnp.float32:
            return f"the multi-tensor cast reads float32 leaves, not {jnp.dtype(x.dtype).name}"
        if x.size == 0 or x.size >= 2**31 - BLOCK:
            return "the multi-tensor cast takes non-empty leaves of fewer than 2^31 elements"
    return None


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _cast(leaves: tuple, dtype: jnp.dtype, interpret: bool) -> list[Array]:
    out: list[Array] = []
    for lo in range(0, len(leaves), LEAVES_PER_CALL):
        out.extend(_call(leaves[lo:lo + LEAVES_PER_CALL], dtype, interpret))
    return out


def _cast_fwd(leaves: tuple, dtype: jnp.dtype, interpret: bool) -> tuple[list[Array], None]:
    return _cast(leaves, dtype, interpret), None


def _cast_bwd(dtype: jnp.dtype, interpret: bool, _: None, cts: list) -> tuple:
    return (tuple(g.astype(jnp.float32) for g in cts),)  # every leaf is float32 (supports)


_cast.defvjp(_cast_fwd, _cast_bwd)


def multi_tensor_cast(leaves: Sequence[Array], dtype: jnp.dtype, *, interpret: bool = False) -> list[Array]:
    """``[x.astype(dtype) for x in leaves]`` in ``ceil(len(leaves) / LEAVES_PER_CALL)`` kernels,
    differentiable (the cotangents come back as float32). ``interpret``: Pallas interpret mode (tests)."""
    why = supports(leaves)
    if why:
        raise ValueError(why)
    if not leaves:
        return []
    return _cast(tuple(leaves), jnp.dtype(dtype), interpret)
