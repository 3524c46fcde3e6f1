"""Pallas (Triton) kernels of sparse spatial grouping attention: the tiles and their passes.

Every pass works on one (image, head) slice and reads q, k, v in place; no logit, probability or
gradient of a logit ever leaves the chip. Logits are formed tap by tap, each a row-wise dot of
(tile, d) operands in float32 (the head dims are small: 16 in the RAT), so only the k^2 taps of each
window are computed and exponentiated, none masked away. Two kinds of tile:

* a **group tile** (:func:`group_pass`): ``tw`` consecutive groups of one output row. The pass
  loops over the ``ky`` input rows of their windows and, within a row, the ``kx`` taps; tap j of
  every group of the tile is one strided gather of keys/values from a row segment the neighbouring
  taps share (the halo is read from memory once and reused from cache).
* an **input tile** (:func:`input_pass`): ``tx`` consecutive inputs of one input row. Each input
  lies in the windows of at most ``nt = (ky-1)//sy + 1`` output rows and ``mx = (kx-1)//sx + 1``
  output columns; the pass loops over those and recomputes each covering group's logit from its
  query and log-sum-exp. This is how column sums and key/value gradients are gathered without
  atomics: each input's sums belong to one program (deterministic, no float32 scratch in HBM).

Arrays are passed flat per slice, (B*H, N*d); loads use clipped indices under a mask (out-of-image
taps read a valid address and are masked), stores send masked lanes out of range, so the same
code is right in Triton and in interpret mode.

With ``Tiling.products`` (from the policy's :class:`jaxrat.ops.policy.SparseSGABlocks`) both kinds of
tile compute their logits as matrix products instead: a tile against one contiguous run of keys (group
tiles) or of covering groups (input tiles) per row, on the tensor cores, a band mask keeping each
window's taps.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxrat.ops.blocks import SparseSGABlocks
from jaxrat.ops.gpu.sparse_sga_products import group_products, input_products
from jaxrat.ops.gpu.sparse_sga_tiles import (
    NEG,
    ceil_div,
    clip,
    keys_over_uses,
    load,
    load1,
    loop,
    rowdot,
    store,
    store1,
    store_keys,
    strided_refs,
    token_major,
)
from jaxrat.ops.portable.sparse_sga import Geometry

Array = jax.Array


def _pow2(n: int) -> int:
    return int(pl.next_power_of_2(int(n)))


class Tiling(NamedTuple):
    """Static tile sizes of one geometry (2 spatial dims) and head dims."""

    Y: int
    X: int
    OY: int
    OX: int
    ky: int
    kx: int
    sy: int
    sx: int
    py: int
    px: int
    dh: int
    dv: int
    dhp: int
    dvp: int
    tw: int  # groups per group tile
    tx: int  # inputs per input tile
    nt: int  # output rows whose windows contain one input row
    mx: int  # output columns whose windows contain one input column
    warps: int = 4  # Triton warps per program
    unroll: bool = False  # the row loops as straight-line code
    products: bool = False  # logits as matrix products over row segments (sparse_sga_products)
    heads: int = 0  # > 0: group-level operands are token-major (B, N_out*heads*d), else per slice
    sweep_rows: int = 0  # > 0: output rows a sweep program takes (sparse_sga_sweep); 0: the passes apart
    input_grad_features: int = 0  # the first layer's keys' pass writes dx for inputs up to this wide

    @property
    def segment(self) -> int:
        """Input columns a group tile's windows span on one row, to a power of two (>= 16)."""
        return max(16, _pow2((self.tw - 1) * self.sx + self.kx))

    @property
    def covering(self) -> int:
        """Group columns whose windows hold some input of an input tile, to a power of two (>= 16)."""
        return max(16, _pow2((self.tx + self.kx - 2) // self.sx + 2))

    @classmethod
    def of(cls, geom: Geometry, dh: int, dv: int, tw: int | None = None, tx: int = 64, warps: int = 4,
           unroll: bool = False, products: bool | None = None, heads: int = 0,
           blocks: SparseSGABlocks = SparseSGABlocks()) -> "Tiling":
        """``tw`` None: 32 groups a tile tap by tap, 16 as products (at 32, compiled for an H100, the
        product form's gradient pass needs more than 255 registers a thread and spills; at 16 none does).
        ``heads`` > 0: queries, cotangents, updates and query gradients are read and written
        token-major, (B, N_out * heads * d), in place; 0: as (B*H, N_out*d) slices like the keys.
        ``blocks``: the policy's switches (``products`` None takes theirs)."""
        (Y, X), (OY, OX) = geom.grid, geom.out
        (ky, kx), (sy, sx) = geom.kernel, geom.stride
        products = blocks.products if products is None else products
        tw = (16 if products else 32) if tw is None else tw
        tw, tx = min(tw, _pow2(OX)), min(tx, _pow2(X))
        if products:  # a matrix product's sides are 16 at least
            tw, dhp, dvp = max(tw, 16), max(16, _pow2(dh)), max(16, _pow2(dv))
        else:
            dhp, dvp = _pow2(dh), _pow2(dv)
        return cls(Y, X, OY, OX, ky, kx, sy, sx, (ky - 1) // 2, (kx - 1) // 2, dh, dv, dhp, dvp,
                   tw, tx, (ky - 1) // sy + 1, (kx - 1) // sx + 1, warps, unroll, products, heads,
                   blocks.sweep_rows, blocks.input_grad_features)


def _group_kernel(*refs, names, mode: str, t: Tiling, exact: bool = False):
    """One group tile. Modes: "lse" (r; with v also the unnormalised update u), "update" (u from r
    and the column denominators d), "grad" (dq and the per-group delta = sum_p A dA, given the update u)."""
    group_tile(refs_of(names, refs, t), mode, t, exact)


def group_tile(R, mode: str, t: Tiling, exact: bool, at=None):
    """:func:`_group_kernel` on the group tile ``at`` (tile, output row; the program's where None), in
    the tiling's form: tap by tap, or as matrix products."""
    return group_products(R, mode, t, exact, at) if t.products else group_taps(R, mode, t, at)


def group_taps(R, mode: str, t: Tiling, at=None):
    """:func:`group_tile` tap by tap."""
    tile, oy = (pl.program_id(0), pl.program_id(1)) if at is None else at
    ox = tile * t.tw + jnp.arange(t.tw, dtype=jnp.int32)
    gok = ox < t.OX
    grow = oy * t.OX + clip(ox, t.OX)
    q = load(R["q"], grow, gok, t.dh, t.dhp)
    x0 = ox * t.sx - t.px  # each group's first window column

    def taps(i):
        """Input row i of the windows: per tap j, (input rows, validity, keys, logits)."""
        y = oy * t.sy - t.py + i
        yok = (y >= 0) & (y < t.Y)
        out = []
        for j in range(t.kx):
            x = x0 + j
            ok = gok & (x >= 0) & (x < t.X) & yok
            prow = clip(y, t.Y) * t.X + clip(x, t.X)
            k = load(R["k"], prow, ok, t.dh, t.dhp)
            out.append((prow, ok, k, rowdot(q, k)))
        return out

    def weights(i):
        """A_k = exp(l - r) per tap of row i, with the tap's rows, validity, keys, values and d."""
        out = []
        for prow, ok, k, s in taps(i):
            a = jnp.where(ok, jnp.exp(jnp.where(ok, s, 0.0) - r), 0.0)
            v = load(R["v"], prow, ok, t.dv, t.dvp)
            d = load1(R["d"], prow, ok, 1.0) if "d" in R else None
            out.append((prow, ok, k, a, v, d))
        return out

    if mode == "lse":
        flash = "v" in R

        def body(i, carry):
            m, total, acc = carry
            row = [(prow, ok, jnp.where(ok, s, NEG)) for prow, ok, _, s in taps(i)]
            m_new = functools.reduce(jnp.maximum, [s for _, _, s in row], m)
            corr = jnp.exp(m - m_new)
            total, acc = total * corr, acc * corr[:, None]
            for prow, ok, s in row:
                p = jnp.where(ok, jnp.exp(s - m_new), 0.0)
                total = total + p
                if flash:
                    acc = acc + p[:, None] * load(R["v"], prow, ok, t.dv, t.dvp)
            return m_new, total, acc

        init = (jnp.full((t.tw,), NEG, jnp.float32), jnp.zeros((t.tw,), jnp.float32),
                jnp.zeros((t.tw, t.dvp), jnp.float32))
        m, total, acc = loop(t, t.ky, body, init)
        store1(R["r"], grow, gok, m + jnp.log(total))
        if flash:
            store(R["u"], grow, gok, t.dv, t.dvp, acc / total[:, None])
        return

    r = load1(R["r"], grow, gok)
    if mode == "update":
        def body(i, acc):
            for _, _, _, a, v, d in weights(i):
                acc = acc + (a / d)[:, None] * v
            return acc

        acc = loop(t, t.ky, body, jnp.zeros((t.tw, t.dvp), jnp.float32))
        store(R["u"], grow, gok, t.dv, t.dvp, acc)
        return

    # mode == "grad": dA[o,p] = g_o.v_p / d_p + gd_p, delta_o = sum_p A dA, dl = A (dA - delta)
    g = load(R["g"], grow, gok, t.dv, t.dvp)

    def grads(i):
        out = []
        for prow, ok, k, a, v, d in weights(i):
            da = rowdot(g, v)
            if d is not None:
                da = da / d + load1(R["gd"], prow, ok)
            out.append((a, da, k))
        return out

    # dq = sum_p A (dA - delta) k in one sweep, as sum_p A (dA - c) k - (delta - c) sum_p A k for
    # c = g.u, the part of dA common to the window (delta = sum_p A dA = g.u + sum_p A gd): the two
    # sums then do not cancel (float32 throughout), whatever offset the values carry
    c = rowdot(g, load(R["u"], grow, gok, t.dv, t.dvp))

    def body(i, carry):
        delta_c, dq_a, dq_k = carry
        for a, da, k in grads(i):
            w = a * (da - c)
            delta_c, dq_a, dq_k = delta_c + w, dq_a + w[:, None] * k, dq_k + a[:, None] * k
        return delta_c, dq_a, dq_k

    zeros = jnp.zeros((t.tw, t.dhp), jnp.float32)
    delta_c, dq_a, dq_k = loop(t, t.ky, body, (jnp.zeros((t.tw,), jnp.float32), zeros, zeros))
    dq, delta = dq_a - delta_c[:, None] * dq_k, delta_c + c
    store(R["dq"], grow, gok, t.dh, t.dhp, dq)
    store1(R["delta"], grow, gok, delta)


def _input_kernel(*refs, names, mode: str, t: Tiling, eps: float, uses: int = 1, exact: bool = False):
    """One input tile. Modes: "colsum" (d = c + eps), "gd" (gd = dL/dd), "keys" (dk and dv summed
    over ``uses`` grouping iterations, each given by its operands suffixed 0, 1, ...)."""
    R = refs_of(names, refs, t)
    out = input_tile(R, mode, t, eps, uses, exact)
    if mode == "keys":
        head = lax.rem(pl.program_id(2), t.heads) if t.heads else 0
        store_keys(R, t, *out, head, tile_index() * (t.dh + t.dv))


def tile_index():
    """The program's input tile among one slice's (tiles, rows) grid."""
    return pl.program_id(0) * pl.num_programs(1) + pl.program_id(1)


def input_tile(R, mode: str, t: Tiling, eps: float, uses: int, exact: bool, at=None):
    """:func:`_input_kernel` on the input tile ``at`` (tile, row; the program's where None: interpret
    mode lowers no program id inside a loop), in the tiling's form; in "keys" mode returns (rows,
    validity, dk, dv) unstored."""
    return (input_products if t.products else input_taps)(R, mode, t, eps, uses, exact, at)


def input_taps(R, mode: str, t: Tiling, eps: float, uses: int, exact: bool, at=None):
    """:func:`input_tile` tap by tap."""
    tile, y = (pl.program_id(0), pl.program_id(1)) if at is None else at
    x = tile * t.tx + jnp.arange(t.tx, dtype=jnp.int32)
    xok = x < t.X
    prow = y * t.X + clip(x, t.X)
    k = load(R["k"], prow, xok, t.dh, t.dhp)
    ox_hi = lax.div(x + t.px, t.sx)  # the last group column whose window holds x (x + px >= 0)
    oy_lo = ceil_div(y + t.py - t.ky + 1, t.sy, t.ky)

    def groups(i, use=""):
        """The covering groups on output row oy_lo + i, one per column offset m: their queries,
        weights A (tx,), rows and validity, from the queries and log-sum-exps of ``use``."""
        oy = oy_lo + i
        rel_y = y - (oy * t.sy - t.py)
        yok = (oy >= 0) & (oy < t.OY) & (rel_y >= 0) & (rel_y < t.ky)
        out = []
        for m in range(t.mx):
            ox = ox_hi - m
            ok = xok & yok & (ox >= 0) & (ox < t.OX) & (x + t.px - ox * t.sx < t.kx)
            grow = clip(oy, t.OY) * t.OX + clip(ox, t.OX)
            q = load(R["q" + use], grow, ok, t.dh, t.dhp)
            s = rowdot(k, q)
            r = load1(R["r" + use], grow, ok)
            out.append((q, jnp.where(ok, jnp.exp(jnp.where(ok, s, 0.0) - r), 0.0), grow, ok))
        return out

    if mode == "colsum":
        def body(i, c):
            for _, a, _, _ in groups(i):
                c = c + a
            return c

        c = loop(t, t.nt, body, jnp.zeros((t.tx,), jnp.float32))
        store1(R["d"], prow, xok, c + eps)
        return

    v = load(R["v"], prow, xok, t.dv, t.dvp)
    zeros_v = jnp.zeros((t.tx, t.dvp), jnp.float32)
    if mode == "gd":  # u = sum A w with w = v / d: d's gradient is -(sum_o A g_o) . v / d^2
        def body(i, gw):
            for _, a, grow, ok in groups(i):
                gw = gw + a[:, None] * load(R["g"], grow, ok, t.dv, t.dvp)
            return gw

        gw = loop(t, t.nt, body, zeros_v)
        d = load1(R["d"], prow, xok, 1.0)
        store1(R["gd"], prow, xok, -rowdot(gw, v) / (d * d))
        return

    # mode == "keys": dv = sum_o A g_o / d and dk = sum_o A (dA - delta_o) q_o, dA = g_o . v / d + gd,
    # added up over the uses in float32 on chip
    def use_body(use, inv_d, gd):
        def body(i, carry):
            gw, dk = carry
            for q, a, grow, ok in groups(i, use):
                g = load(R["g" + use], grow, ok, t.dv, t.dvp)
                gw = gw + a[:, None] * g
                da = rowdot(v, g)
                if inv_d is not None:
                    da = da * inv_d + gd
                dk = dk + (a * (da - load1(R["delta" + use], grow, ok)))[:, None] * q
            return gw, dk
        return body

    return (prow, xok) + keys_over_uses(t, uses, R, prow, xok, zeros_v, use_body)


def refs_of(names, refs, t: Tiling) -> dict:
    """The kernel's operands by name, the group-level ones as their head's strided view where the
    tiling has them token-major."""
    R = dict(zip(names, refs))
    head = lax.rem(pl.program_id(2), t.heads) if t.heads else None
    return strided_refs(R, t.heads, dict(q=t.dh, dq=t.dh, g=t.dv, u=t.dv), head)


def call(kernel, t: Tiling, grid, ins: dict, outs: dict, name: str, interpret: bool, per_image: bool = False,
          warps: int | None = None, **kw):
    """pallas_call over grid (tiles, rows, B*H) with each operand's whole slice as its block.

    ``ins``/``outs`` map names to (B*H, n) arrays / ShapeDtypeStructs, the group-level ones (B, n)
    where the tiling has them token-major (all heads of an image: the program's head is then a
    stride and an offset, :func:`_refs`); the kernel sees them by name. ``per_image``: the grid's
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
