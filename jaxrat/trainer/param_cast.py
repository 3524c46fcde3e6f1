"""The parameters a step reads only as a narrower dtype, cast once at its start in one kernel.

A bfloat16 step casts most float32 weights where it reads them; before a cuBLAS or cuDNN call that
cast is a kernel of its own. Under the gpu policy with replicated parameters (where the fused AdamW
applies) the step instead traces its loss once to find the leaves whose every read is one cast to
one narrower dtype, once (:func:`narrow_reads`), and hands the model those leaves already cast, by
:func:`jaxrat.optim.gpu_cast.multi_tensor_cast`. The values the model sees are the ones it cast
itself, and the gradients are the same casts' gradients: only the number of kernels changes.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax.extend import core

from jaxrat.ops.per_device import replicated
from jaxrat.optim import gpu_cast as cast

NARROW = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_MIXED = object()  # a leaf read otherwise than as one narrow cast
# Calls whose operands are their body's inputs one for one, and where that body's jaxpr is found.
# (A name unknown here makes its operands' leaves stay as they are: the walk never guesses.)
_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
          "checkpoint": "jaxpr", "remat": "jaxpr", "remat2": "jaxpr", "shard_map": "jaxpr"}


def _open(jaxpr: Any) -> Any:
    return getattr(jaxpr, "jaxpr", jaxpr)  # a ClosedJaxpr's jaxpr, or the Jaxpr itself


def _walk(jaxpr: Any, tracked: dict, reads: dict) -> None:
    """Appends to ``reads[i]`` the dtype of each cast of leaf ``i`` (``_MIXED`` for any other read)."""
    for eqn in jaxpr.eqns:
        for pos, v in enumerate(eqn.invars):
            if not isinstance(v, core.Var) or v not in tracked:
                continue
            i = tracked[v]
            name = eqn.primitive.name
            if name == "convert_element_type":
                to = jnp.dtype(eqn.params["new_dtype"])
                reads.setdefault(i, []).append(to if to in NARROW else _MIXED)
            elif name in _CALLS:  # custom derivatives are not followed: their rules may read the leaf as it is
                body = _open(eqn.params[_CALLS[name]])
                _walk(body, {body.invars[pos]: i}, reads)
            else:  # loops too: their bodies' casts run once an iteration
                reads.setdefault(i, []).append(_MIXED)
    for v in jaxpr.outvars:
        if isinstance(v, core.Var) and v in tracked:
            reads.setdefault(tracked[v], []).append(_MIXED)


def narrow_reads(fn: Callable[..., Any], params: Any, *args: Any) -> list[Optional[jnp.dtype]]:
    """For each leaf of ``params`` (in ``jax.tree.leaves`` order), the narrower dtype (bfloat16 or
    float16) that ``fn(params, *args)`` reads it as, where it is float32 and read exactly once, as that
    one cast; else None. Once, because the gradients of several reads of one cast copy would be added
    at the narrow dtype, where those of several casts are added at float32. Traces ``fn`` once
    (arguments may be arrays, tracers or shape structs)."""
    leaves = jax.tree.leaves(params)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, *args))
    jaxpr = jax.make_jaxpr(fn)(*shapes).jaxpr
    reads: dict = {}
    _walk(jaxpr, {v: i for i, v in enumerate(jaxpr.invars[:len(leaves)])}, reads)
    out = []
    for i, x in enumerate(leaves):
        seen = reads.get(i, [])
        ok = len(seen) == 1 and seen[0] is not _MIXED and jnp.dtype(x.dtype) == jnp.float32
        out.append(seen[0] if ok else None)
    return out


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _cast_on_each_device(leaves: tuple, dtype: jnp.dtype, interpret: bool) -> list:
    """The multi-tensor cast run by every device on its own replicated copy. Its gradient is the
    cotangents cast back, outside the ``shard_map``: differentiated through it (``check_vma=False``), the
    cotangents, already summed over the devices by the step, were divided and all-reduced once more,
    in float32 (compiled for 8 H100s: 14.7 MB more in the step's one exposed all-reduce)."""
    return replicated(lambda *xs: cast.multi_tensor_cast(xs, dtype, interpret=interpret), *leaves)


def _cast_fwd(leaves: tuple, dtype: jnp.dtype, interpret: bool) -> tuple[list, None]:
    return _cast_on_each_device(leaves, dtype, interpret), None


def _cast_bwd(dtype: jnp.dtype, interpret: bool, _: None, cotangents: list) -> tuple:
    return (tuple(g.astype(jnp.float32) for g in cotangents),)  # the leaves are float32 (narrow_reads)


_cast_on_each_device.defvjp(_cast_fwd, _cast_bwd)


def cast_narrow_reads(fn: Callable[..., Any], *, interpret: bool = False) -> Callable[..., Any]:
    """``fn(params, *args)`` with the leaves it reads only as a narrower dtype (:func:`narrow_reads`)
    cast before the call, in one multi-tensor kernel per dtype (per device under a mesh)."""

    def wrapped(params: Any, *args: Any) -> Any:
        targets = narrow_reads(fn, params, *args)
        leaves, treedef = jax.tree.flatten(params)
        for dtype in {t for t in targets if t is not None}:
            picked = [i for i, t in enumerate(targets) if t == dtype]
            with jax.named_scope("param_cast"):
                done = _cast_on_each_device(tuple(leaves[i] for i in picked), jnp.dtype(dtype), interpret)
            for i, x in zip(picked, done):
                leaves[i] = x
        return fn(jax.tree.unflatten(treedef, leaves), *args)

    return wrapped
