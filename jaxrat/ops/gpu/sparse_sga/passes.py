"""The sparse SGA passes: Pallas (Triton) calls over a slice's group tiles or input tiles.

Every pass works on one (image, head) slice and reads q, k, v in place; no logit, probability or
gradient of a logit ever leaves the chip. Two kinds of tile, each in two forms (tap by tap,
:mod:`jaxrat.ops.gpu.sparse_sga.taps`; with ``Tiling.products`` as matrix products on the tensor cores,
:mod:`jaxrat.ops.gpu.sparse_sga.products`):

* a **group tile** (:func:`group_pass`): ``tw`` consecutive groups of one output row, which loops over
  the ``ky`` input rows of their windows;
* an **input tile** (:func:`input_pass`): ``tx`` consecutive inputs of one input row, which loops over
  the groups whose windows cover them and recomputes their logits from their queries and log-sum-exps
  (column sums and key/value gradients without atomics).

Arrays are passed flat per slice, (B*H, N*d); loads use clipped indices under a mask (out-of-image
taps read a valid address and are masked), stores send masked lanes out of range, so the same
code is right in Triton and in interpret mode.

A tile body sees its operands as ``refs``: a dict from operand name (``q``, ``k``, ``v``, ``r``, ``d``,
``g`` ...; a use's tape operands suffixed 0, 1, ...) to its Pallas ref (:func:`refs_of`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxrat.ops.gpu.sparse_sga.products import group_products, input_products
from jaxrat.ops.gpu.sparse_sga.taps import group_taps, input_taps
from jaxrat.ops.gpu.sparse_sga.tiles import store_keys, strided_refs, token_major
from jaxrat.ops.gpu.sparse_sga.tiling import Tiling


def _group_kernel(*flat_refs, names, mode: str, t: Tiling, exact: bool = False):
    """One group tile. Modes: "lse" (r; with v also the unnormalised update u), "update" (u from r
    and the column denominators d), "grad" (dq and the per-group delta = sum_p A dA, given the update u)."""
    group_tile(refs_of(names, flat_refs, t), mode, t, exact)


def group_tile(refs, mode: str, t: Tiling, exact: bool, at=None):
    """:func:`_group_kernel` on the group tile ``at`` (tile, output row; the program's where None), in
    the tiling's form: tap by tap, or as matrix products."""
    return group_products(refs, mode, t, exact, at) if t.products else group_taps(refs, mode, t, at)


def _input_kernel(*flat_refs, names, mode: str, t: Tiling, eps: float, uses: int = 1, exact: bool = False):
    """One input tile. Modes: "colsum" (d = c + eps), "gd" (gd = dL/dd), "keys" (dk and dv summed
    over ``uses`` grouping iterations, each given by its operands suffixed 0, 1, ...)."""
    refs = refs_of(names, flat_refs, t)
    out = input_tile(refs, mode, t, eps, uses, exact)
    if mode == "keys":
        head = lax.rem(pl.program_id(2), t.heads) if t.heads else 0
        store_keys(refs, t, *out, head, tile_index() * (t.dh + t.dv))


def tile_index():
    """The program's input tile among one slice's (tiles, rows) grid."""
    return pl.program_id(0) * pl.num_programs(1) + pl.program_id(1)


def input_tile(refs, mode: str, t: Tiling, eps: float, uses: int, exact: bool, at=None):
    """:func:`_input_kernel` on the input tile ``at`` (tile, row; the program's where None: interpret
    mode lowers no program id inside a loop), in the tiling's form; in "keys" mode returns (rows,
    validity, dk, dv) unstored."""
    return (input_products if t.products else input_taps)(refs, mode, t, eps, uses, exact, at)


def refs_of(names, flat_refs, t: Tiling) -> dict:
    """The kernel's operands by name, the group-level ones as their head's strided view where the
    tiling has them token-major."""
    refs = dict(zip(names, flat_refs))
    head = lax.rem(pl.program_id(2), t.heads) if t.heads else None
    return strided_refs(refs, t.heads, dict(q=t.dh, dq=t.dh, g=t.dv, u=t.dv), head)


def call(kernel, t: Tiling, grid, ins: dict, outs: dict, name: str, interpret: bool, per_image: bool = False,
          warps: int | None = None, **kw):
    """pallas_call over grid (tiles, rows, B*H) with each operand's whole slice as its block.

    ``ins``/``outs`` map names to (B*H, n) arrays / ShapeDtypeStructs, the group-level ones (B, n)
    where the tiling has them token-major (all heads of an image: the program's head is then a
    stride and an offset, :func:`refs_of`); the kernel sees them by name. ``per_image``: the grid's
    last axis is the image and every operand is (B, n), all heads of that image a block.
    """
    names = list(ins) + list(outs)
    heads = t.heads

    def spec(name, a):
        if name in ("phase", "w"):  # RoSE's angles, the weights: the same for every image and head
            return pl.BlockSpec((None, a.shape[1]), lambda i, j, b: (0, 0))
        if not per_image and heads and (token_major(name) or name == "dkv"):
            return pl.BlockSpec((None, a.shape[1]), lambda i, j, b: (b // heads, 0))
        return pl.BlockSpec((None, a.shape[1]), lambda i, j, b: (b, 0))

    res = pl.pallas_call(
        functools.partial(kernel, names=names, t=t, **kw),
        grid=grid,
        in_specs=[spec(n, a) for n, a in ins.items()],
        out_specs=[spec(n, a) for n, a in outs.items()],
        out_shape=list(outs.values()),
        compiler_params=plgpu.CompilerParams(num_warps=warps or t.warps, num_stages=2),
        interpret=interpret,
        name=name,
    )(*ins.values())
    return dict(zip(outs, res))


def group_pass(mode: str, t: Tiling, ins: dict, outs: dict, interpret: bool) -> dict:
    """Run :func:`_group_kernel` over every group tile of every slice."""
    bh = ins["k"].shape[0]
    grid = (-(-t.OX // t.tw), t.OY, bh)
    return call(_group_kernel, t, grid, ins, outs, f"sparse_sga_groups_{mode}", interpret, mode=mode,
                 exact=interpret)


def input_pass(mode: str, t: Tiling, ins: dict, outs: dict, eps: float, interpret: bool, uses: int = 1) -> dict:
    """Run :func:`_input_kernel` over every input tile of every slice."""
    bh = ins["k"].shape[0]
    grid = (-(-t.X // t.tx), t.Y, bh)
    return call(_input_kernel, t, grid, ins, outs, f"sparse_sga_inputs_{mode}", interpret, mode=mode, eps=eps,
                 uses=uses, exact=interpret)


def stats(bh: int, n: int) -> jax.ShapeDtypeStruct:
    """A per-token float32 statistic (log-sum-exp, denominator, delta) of every slice."""
    return jax.ShapeDtypeStruct((bh, n), jnp.float32)


def flat_like(bh: int, n: int, d: int, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((bh, n * d), np.dtype(dtype))
