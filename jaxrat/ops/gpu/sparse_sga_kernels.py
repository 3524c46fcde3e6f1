"""Pallas (Triton) kernels of sparse spatial grouping attention: the tiles and their passes.

Every pass works on one (image, head) slice and reads q, k, v in place; no logit, probability or
gradient of a logit ever leaves the chip. Two kinds of tile:

* a **group tile** (:func:`group_pass`): ``TW`` consecutive groups of one output row. Their windows
  cover ``ky`` input rows of ``CW = (TW-1)*sx + kx`` (padded to a power of two) columns; the pass
  loops over those rows, loading each row segment of keys/values once for the whole tile (the halo
  on chip), and masks the taps outside each group's own window.
* an **input tile** (:func:`input_pass`): ``TX`` consecutive inputs of one input row. The groups
  whose windows contain them lie on at most ``(ky-1)//sy + 1`` output rows and ``GW`` output
  columns; the pass loops over those rows and recomputes the covering groups' logits from their
  queries and log-sum-exps. This is how column sums and key/value gradients are gathered without
  atomics (each input's sums are owned by one program: deterministic, no float32 scratch in HBM).

Arrays are passed flat per slice, (B*H, N*d); loads use clipped indices under a mask (out-of-image
taps read a valid address and are masked), stores send masked lanes out of range, so the same
code is right in Triton and in interpret mode.
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

from jaxrat.ops.portable.sparse_sga import Geometry

Array = jax.Array
NEG = -1e30  # masked logit: finite, so a fully masked row never makes inf - inf
MIN_DOT = 16  # Triton's smallest matmul dimension


def _pow2(n: int) -> int:
    return max(MIN_DOT, int(pl.next_power_of_2(int(n))))


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
    cw: int  # input columns a group tile reads per input row
    tx: int  # inputs per input tile
    gw: int  # group columns an input tile reads per output row
    nt: int  # output rows whose windows contain one input row

    @classmethod
    def of(cls, geom: Geometry, dh: int, dv: int, tw: int = 16, tx: int = 32) -> "Tiling":
        (Y, X), (OY, OX) = geom.grid, geom.out
        (ky, kx), (sy, sx) = geom.kernel, geom.stride
        return cls(Y, X, OY, OX, ky, kx, sy, sx, (ky - 1) // 2, (kx - 1) // 2, dh, dv, _pow2(dh), _pow2(dv),
                   tw, _pow2((tw - 1) * sx + kx), tx, _pow2((tx + kx - 2) // sx + 1), (ky - 1) // sy + 1)


def _ceil_div(a, s: int, bound: int):
    """ceil(a / s) for a traced int32 a >= -bound (integer division truncates: shift it first)."""
    m = bound // s + 1
    return lax.div(a + s * m + s - 1, s) - m


def _clip(x, n: int):
    return jnp.minimum(jnp.maximum(x, 0), n - 1)


def _load(ref, rows, ok, d: int, dp: int, other=0.0):
    """(len(rows), dp) from a flat (N*d) ref; masked rows and padded features read ``other``."""
    feat = jnp.arange(dp, dtype=jnp.int32)
    mask = ok[:, None] & (feat < d)[None, :]
    idx = rows[:, None] * d + jnp.minimum(feat, d - 1)[None, :]
    return plgpu.load(ref.at[idx], mask=mask, other=other)


def _load1(ref, rows, ok, other=0.0):
    return plgpu.load(ref.at[rows], mask=ok, other=other)


def _store(ref, rows, ok, d: int, dp: int, val):
    feat = jnp.arange(dp, dtype=jnp.int32)
    mask = ok[:, None] & (feat < d)[None, :]
    # masked lanes point past the end: Triton does not store them, interpret mode drops them
    idx = jnp.where(mask, rows[:, None] * d + feat[None, :], ref.shape[0])
    plgpu.store(ref.at[idx], val.astype(ref.dtype), mask=mask)


def _store1(ref, rows, ok, val):
    plgpu.store(ref.at[jnp.where(ok, rows, ref.shape[0])], val.astype(ref.dtype), mask=ok)


def _dot(a, b, trans_b=False):
    # float32 stays float32 (no TF32) so the GPU matches the portable kernel to float32 rounding
    tf32 = None if a.dtype != jnp.float32 else False
    return plgpu.dot(a, b, trans_b=trans_b, allow_tf32=tf32)


def _group_kernel(*refs, names, mode: str, t: Tiling):
    """One group tile. Modes: "lse" (r; with v also the unnormalised update u), "update" (u from r
    and the column denominators d), "grad" (dq and the per-group delta = sum_p A dA)."""
    R = dict(zip(names, refs))
    tile, oy = pl.program_id(0), pl.program_id(1)
    ox = tile * t.tw + jnp.arange(t.tw, dtype=jnp.int32)
    gok = ox < t.OX
    grow = oy * t.OX + _clip(ox, t.OX)
    q = _load(R["q"], grow, gok, t.dh, t.dhp)
    cx = tile * (t.tw * t.sx) - t.px + jnp.arange(t.cw, dtype=jnp.int32)
    cok = (cx >= 0) & (cx < t.X)
    cxc = _clip(cx, t.X)
    rel = cx[None, :] - (ox * t.sx - t.px)[:, None]
    win = (rel >= 0) & (rel < t.kx) & cok[None, :]

    def row(i):
        y = oy * t.sy - t.py + i
        yok = (y >= 0) & (y < t.Y)
        prow = _clip(y, t.Y) * t.X + cxc
        ok = cok & yok
        k = _load(R["k"], prow, ok, t.dh, t.dhp)
        return prow, ok, k, win & yok, _dot(q, k, trans_b=True)

    def weights_and_values(i):
        """A_k = exp(l - r) on a row, the row's values and denominators (d = 1 unnormalised)."""
        prow, ok, k, valid, s = row(i)
        a = jnp.where(valid, jnp.exp(jnp.where(valid, s, 0.0) - r[:, None]), 0.0)
        v = _load(R["v"], prow, ok, t.dv, t.dvp)
        d = _load1(R["d"], prow, ok, 1.0) if "d" in R else None
        return a, k, v, d, prow, ok

    if mode == "lse":
        flash = "v" in R

        def body(i, carry):
            m, total, acc = carry
            prow, ok, _, valid, s = row(i)
            s = jnp.where(valid, s, NEG)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            corr = jnp.exp(m - m_new)
            p = jnp.where(valid, jnp.exp(s - m_new[:, None]), 0.0)
            total = total * corr + jnp.sum(p, axis=1)
            if flash:
                v = _load(R["v"], prow, ok, t.dv, t.dvp)
                acc = acc * corr[:, None] + _dot(p.astype(v.dtype), v)
            return m_new, total, acc

        init = (jnp.full((t.tw,), NEG, jnp.float32), jnp.zeros((t.tw,), jnp.float32),
                jnp.zeros((t.tw, t.dvp), jnp.float32))
        m, total, acc = lax.fori_loop(0, t.ky, body, init)
        _store1(R["r"], grow, gok, m + jnp.log(total))
        if flash:
            _store(R["u"], grow, gok, t.dv, t.dvp, acc / total[:, None])
        return

    r = _load1(R["r"], grow, gok)
    if mode == "update":
        def body(i, acc):
            a, _, v, d, _, _ = weights_and_values(i)
            return acc + _dot((a / d[None, :]).astype(v.dtype), v)

        acc = lax.fori_loop(0, t.ky, body, jnp.zeros((t.tw, t.dvp), jnp.float32))
        _store(R["u"], grow, gok, t.dv, t.dvp, acc)
        return

    # mode == "grad": dA[o,p] = g_o.v_p / d_p + gd_p, delta_o = sum_p A dA, dl = A (dA - delta)
    g = _load(R["g"], grow, gok, t.dv, t.dvp)

    def grad_a(i):
        a, k, v, d, prow, ok = weights_and_values(i)
        da = _dot(g.astype(v.dtype), v, trans_b=True)
        if d is not None:
            da = da / d[None, :] + _load1(R["gd"], prow, ok)[None, :]
        return a, da, k

    def delta_body(i, delta):
        a, da, _ = grad_a(i)
        return delta + jnp.sum(a * da, axis=1)

    # delta first, then dq from A (dA - delta) rounded once (as the portable kernel does), not
    # from two sums that cancel
    delta = lax.fori_loop(0, t.ky, delta_body, jnp.zeros((t.tw,), jnp.float32))

    def dq_body(i, dq):
        a, da, k = grad_a(i)
        return dq + _dot((a * (da - delta[:, None])).astype(k.dtype), k)

    dq = lax.fori_loop(0, t.ky, dq_body, jnp.zeros((t.tw, t.dhp), jnp.float32))
    _store(R["dq"], grow, gok, t.dh, t.dhp, dq)
    _store1(R["delta"], grow, gok, delta)


def _input_kernel(*refs, names, mode: str, t: Tiling, eps: float):
    """One input tile. Modes: "colsum" (d = c + eps), "dv" (dv and gd = dL/dd), "dk", "dvdk"."""
    R = dict(zip(names, refs))
    tile, y = pl.program_id(0), pl.program_id(1)
    x = tile * t.tx + jnp.arange(t.tx, dtype=jnp.int32)
    xok = x < t.X
    prow = y * t.X + _clip(x, t.X)
    k = _load(R["k"], prow, xok, t.dh, t.dhp)
    gx = _ceil_div(tile * t.tx + t.px - t.kx + 1, t.sx, t.kx) + jnp.arange(t.gw, dtype=jnp.int32)
    gok = (gx >= 0) & (gx < t.OX)
    gxc = _clip(gx, t.OX)
    rel = x[:, None] - (gx * t.sx - t.px)[None, :]
    win = (rel >= 0) & (rel < t.kx) & gok[None, :] & xok[:, None]
    oy_lo = _ceil_div(y + t.py - t.ky + 1, t.sy, t.ky)
    v = _load(R["v"], prow, xok, t.dv, t.dvp) if "v" in R else None
    d = _load1(R["d"], prow, xok, 1.0) if "d" in R else None
    gd = _load1(R["gd"], prow, xok) if "gd" in R else None

    def groups(i):
        """The covering groups on output row oy_lo + i: queries, weights A (TX, GW), rows."""
        oy = oy_lo + i
        rel_y = y - (oy * t.sy - t.py)
        yok = (oy >= 0) & (oy < t.OY) & (rel_y >= 0) & (rel_y < t.ky)
        grow = _clip(oy, t.OY) * t.OX + gxc
        ok = gok & yok
        q = _load(R["q"], grow, ok, t.dh, t.dhp)
        r = _load1(R["r"], grow, ok)
        s = _dot(k, q, trans_b=True)
        valid = win & yok
        a = jnp.where(valid, jnp.exp(jnp.where(valid, s, 0.0) - r[None, :]), 0.0)
        return q, a, grow, ok

    if mode == "colsum":
        def body(i, c):
            return c + jnp.sum(groups(i)[1], axis=1)

        c = lax.fori_loop(0, t.nt, body, jnp.zeros((t.tx,), jnp.float32))
        _store1(R["d"], prow, xok, c + eps)
        return

    want_dv, want_dk = mode in ("dv", "dvdk"), mode in ("dk", "dvdk")

    def body(i, carry):
        gw, dk = carry
        q, a, grow, ok = groups(i)
        g = _load(R["g"], grow, ok, t.dv, t.dvp)
        if want_dv:
            gw = gw + _dot(a.astype(g.dtype), g)
        if want_dk:
            da = _dot(v, g.astype(v.dtype), trans_b=True)
            if d is not None:
                da = da / d[:, None] + gd[:, None]
            dl = a * (da - _load1(R["delta"], grow, ok)[None, :])
            dk = dk + _dot(dl.astype(q.dtype), q)
        return gw, dk

    init = (jnp.zeros((t.tx, t.dvp), jnp.float32), jnp.zeros((t.tx, t.dhp), jnp.float32))
    gw, dk = lax.fori_loop(0, t.nt, body, init)
    if want_dk:
        _store(R["dk"], prow, xok, t.dh, t.dhp, dk)
    if want_dv:
        if d is None:
            _store(R["dv"], prow, xok, t.dv, t.dvp, gw)
        else:  # u = sum A w with w = v / d: dv = gw / d, and d's own gradient gd
            _store(R["dv"], prow, xok, t.dv, t.dvp, gw / d[:, None])
            _store1(R["gd"], prow, xok, -jnp.sum(gw * v.astype(jnp.float32), axis=1) / (d * d))


def _call(kernel, t: Tiling, grid, ins: dict, outs: dict, name: str, interpret: bool, **kw):
    """pallas_call over grid (tiles, rows, B*H) with each operand's whole (B*H) slice as its block.

    ``ins``/``outs`` map names to (B*H, n) arrays / ShapeDtypeStructs; the kernel sees them by name.
    """
    names = list(ins) + list(outs)
    spec = lambda a: pl.BlockSpec((None, a.shape[1]), lambda i, j, b: (b, 0))
    res = pl.pallas_call(
        functools.partial(kernel, names=names, t=t, **kw),
        grid=grid,
        in_specs=[spec(a) for a in ins.values()],
        out_specs=[spec(a) for a in outs.values()],
        out_shape=list(outs.values()),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name=name,
    )(*ins.values())
    return dict(zip(outs, res))


def group_pass(mode: str, t: Tiling, ins: dict, outs: dict, interpret: bool) -> dict:
    """Run :func:`_group_kernel` over every group tile of every slice."""
    bh = next(iter(ins.values())).shape[0]
    grid = (-(-t.OX // t.tw), t.OY, bh)
    return _call(_group_kernel, t, grid, ins, outs, f"sparse_sga_groups_{mode}", interpret, mode=mode)


def input_pass(mode: str, t: Tiling, ins: dict, outs: dict, eps: float, interpret: bool) -> dict:
    """Run :func:`_input_kernel` over every input tile of every slice."""
    bh = next(iter(ins.values())).shape[0]
    grid = (-(-t.X // t.tx), t.Y, bh)
    return _call(_input_kernel, t, grid, ins, outs, f"sparse_sga_inputs_{mode}", interpret, mode=mode, eps=eps)


def stats(bh: int, n: int) -> jax.ShapeDtypeStruct:
    """A per-token float32 statistic (log-sum-exp, denominator, delta) of every slice."""
    return jax.ShapeDtypeStruct((bh, n), jnp.float32)


def flat_like(bh: int, n: int, d: int, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((bh, n * d), np.dtype(dtype))
