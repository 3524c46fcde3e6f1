"""AdamW over many parameters in a few kernels (a multi-tensor apply), for GPUs.

XLA gives every parameter's update a kernel of its own (one loop fusion writing that leaf's value
and both moments), and the XLA of jax 0.10 has no horizontal fusion of them: a RAT of ~190 leaves
spent ~190 kernels of a few microseconds on its optimizer. Here one Pallas (Triton) kernel updates
up to :data:`LEAVES_PER_CALL` leaves in place: its grid covers every leaf's blocks of
:data:`BLOCK` elements, and each program finds its leaf among static ranges
(:mod:`jaxrat.optim.multi_tensor`).

The arithmetic is :func:`leaf_update`, which is also the reference the tests hold the kernel to:
optax's ``clip_by_global_norm`` (jaxrat's form), ``scale_by_adam``, masked ``add_decayed_weights``,
``scale_by_learning_rate`` and an optional per-leaf factor (layer-wise decay), operation for
operation, so that the kernel computes what the optax chain computes. The step's scalars (bias
corrections, step size, clipping norm, the finite guard) come in as one float32 vector
(:func:`scalars`).
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxrat.optim.multi_tensor import over_leaves, programs

Array = jax.Array
BLOCK = 1024  # elements a program updates: 8 a thread at 4 warps
LEAVES_PER_CALL = 48  # 6 pointers a leaf: 290 kernel arguments, under CUDA's 4 KB of parameters
KEEP, NORM, MAX_NORM, BC1, BC2, STEP, OK = range(7)  # slots of the scalar vector
SCALARS = 8


class Hyper(NamedTuple):
    """The static hyperparameters of the update."""

    b1: float
    b2: float
    eps: float
    eps_root: float
    weight_decay: float
    clip: bool  # the scalars carry a global norm and the bound it is clipped to


def scalars(*, count_inc: Array, step_size: Array, ok: Array, hyper: Hyper, norm: Array | None = None,
            max_norm: float = 0.0) -> Array:
    """The step's scalars as float32 (``SCALARS``,): ``count_inc`` Adam's count after this step,
    ``step_size`` the signed learning rate (optax's ``-lr(count)``), ``ok`` whether the step applies,
    ``norm`` the gradients' global norm when clipping to ``max_norm``."""
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    norm = f32(1.0) if norm is None else f32(norm)
    out = [f32(norm < max_norm), norm, f32(max_norm),
           1 - hyper.b1 ** count_inc, 1 - hyper.b2 ** count_inc,  # optax's bias corrections, as optax writes them
           f32(step_size), f32(ok), f32(0.0)]
    return jnp.stack([f32(x) for x in out])


def leaf_update(p: Array, g: Array, mu: Array, nu: Array, s: Sequence, hyper: Hyper, decay: bool,
                scale: float) -> tuple[Array, Array, Array]:
    """One leaf's (parameter, first moment, second moment) after the step, in float32, in optax's order
    of operations; unchanged where the scalars say the step does not apply."""
    if hyper.clip:
        g = jnp.where(s[KEEP] > 0, g, (g / s[NORM]) * s[MAX_NORM])
    mu2 = (1 - hyper.b1) * g + hyper.b1 * mu
    nu2 = (1 - hyper.b2) * (g * g) + hyper.b2 * nu
    u = (mu2 / s[BC1]) / (jnp.sqrt(nu2 / s[BC2] + hyper.eps_root) + hyper.eps)
    if decay and hyper.weight_decay:
        u = u + hyper.weight_decay * p
    u = s[STEP] * u
    if scale != 1.0:
        u = u * jnp.float32(scale)
    ok = s[OK] > 0
    return jnp.where(ok, p + u, p), jnp.where(ok, mu2, mu), jnp.where(ok, nu2, nu)


def _kernel(*refs, sizes: tuple[int, ...], offsets: tuple[int, ...], decays: tuple[bool, ...],
            scales: tuple[float, ...], hyper: Hyper):
    n = len(sizes)
    s_ref, g_ref, ins, outs = refs[0], refs[1], refs[2:2 + 3 * n], refs[2 + 3 * n:]
    s = [s_ref[i] for i in range(SCALARS)]

    def leaf(j, read, write, ok):
        p, mu, nu = (plgpu.load(r.at[read], mask=ok, other=0.0) for r in ins[3 * j:3 * j + 3])
        g = plgpu.load(g_ref.at[offsets[j] + read], mask=ok, other=0.0)
        new = leaf_update(p, g, mu, nu, s, hyper, decays[j], scales[j])
        for r, x in zip(outs[3 * j:3 * j + 3], new):
            plgpu.store(r.at[write], x, mask=ok)

    over_leaves(sizes, BLOCK, leaf)


def _call(s: Array, flat_grads: Array, first: int, params, mu, nu, decays, scales, hyper: Hyper, interpret: bool):
    sizes = tuple(int(p.size) for p in params)
    offsets = tuple(first + int(o) for o in np.cumsum((0,) + sizes[:-1]))
    ins = [x.reshape(-1) for leaf in zip(params, mu, nu) for x in leaf]
    outs = [jax.ShapeDtypeStruct((n,), jnp.float32) for n in sizes for _ in range(3)]
    # parameter and moments updated in place: operand 2 + 3j (+1, +2) is result 3j (+1, +2)
    aliases = {2 + 3 * j + i: 3 * j + i for j in range(len(sizes)) for i in range(3)}
    res = pl.pallas_call(
        partial(_kernel, sizes=sizes, offsets=offsets, decays=tuple(decays), scales=tuple(scales), hyper=hyper),
        grid=(programs(sizes, BLOCK),),
        out_shape=outs,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="multi_tensor_adamw",
    )(s, flat_grads, *ins)
    shaped = [r.reshape(params[i // 3].shape) for i, r in enumerate(res)]
    return shaped[0::3], shaped[1::3], shaped[2::3]


def supports(params: Sequence, moments: Sequence = ()) -> str | None:
    """None when every parameter and moment is float32 and non-empty and the parameters are fewer than
    2^31 elements in all, else why not."""
    if sum(int(x.size) for x in params) >= 2**31 - BLOCK:  # the kernels index the gradients in int32
        return "the fused AdamW indexes parameters in int32 and takes fewer than 2^31 elements in all"
    for x in (*params, *moments):
        if jnp.dtype(x.dtype) != jnp.float32:
            return f"the fused AdamW updates float32 parameters and moments, not {jnp.dtype(x.dtype).name}"
        if x.size == 0:
            return "the fused AdamW does not take empty parameters"
    return None


def multi_tensor_adamw(params: Sequence[Array], flat_grads: Array, mu: Sequence[Array], nu: Sequence[Array],
                       s: Array, hyper: Hyper, decays: Sequence[bool], scales: Sequence[float], *,
                       interpret: bool = False) -> tuple[list[Array], list[Array], list[Array]]:
    """Every leaf's :func:`leaf_update` in ``ceil(len(params) / LEAVES_PER_CALL)`` kernels: returns the new
    parameters, first and second moments, as lists in the order given. ``flat_grads``: the gradients
    raveled and concatenated in that order, float32 (:func:`flatten`: the vector the step's global norm
    is taken over, so XLA writes it once and no gradient needs a buffer of its own). ``decays[j]``: leaf
    j takes weight decay; ``scales[j]``: its update's factor. ``interpret``: Pallas interpret mode (tests)."""
    why = supports(params, [*mu, *nu])
    if why:
        raise ValueError(why)
    if not (len(params) == len(mu) == len(nu) == len(decays) == len(scales)):
        raise ValueError("params, moments, decays and scales must have one entry per leaf")
    if flat_grads.dtype != jnp.float32 or flat_grads.shape != (sum(int(p.size) for p in params),):
        raise ValueError(f"flat_grads must be float32 of {sum(int(p.size) for p in params)} elements, the "
                         f"parameters' count; got {flat_grads.dtype} {flat_grads.shape}")
    out: tuple[list, list, list] = ([], [], [])
    first = 0
    for lo in range(0, len(params), LEAVES_PER_CALL):
        part = slice(lo, lo + LEAVES_PER_CALL)
        for acc, new in zip(out, _call(s, flat_grads, first, params[part], mu[part], nu[part], decays[part],
                                       scales[part], hyper, interpret)):
            acc.extend(new)
        first += sum(int(p.size) for p in params[part])
    return out


def flatten(leaves: Sequence[Array]) -> Array:
    """The leaves raveled and concatenated, float32 (:func:`multi_tensor_adamw`'s gradients)."""
    return jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in leaves])
