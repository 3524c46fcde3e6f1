"""The sparse SGA tiles tap by tap: logits formed one window tap at a time, each a row-wise dot of
(tile, d) operands in float32 (the head dims are small: 16 in the RAT), so only the k^2 taps of each
window are computed and exponentiated, none masked away.

* a group tile (:func:`group_taps`): ``tw`` consecutive groups of one output row. It loops over the
  ``ky`` input rows of their windows and, within a row, the ``kx`` taps; tap j of every group of the
  tile is one strided gather of keys/values from a row segment the neighbouring taps share (the halo
  is read from memory once and reused from cache).
* an input tile (:func:`input_taps`): ``tx`` consecutive inputs of one input row. Each input lies in
  the windows of at most ``nt`` output rows and ``mx`` output columns; the tile loops over those and
  recomputes each covering group's logit from its query and log-sum-exp. This is how column sums and
  key/value gradients are gathered without atomics: each input's sums belong to one program
  (deterministic, no float32 scratch in HBM).

Names in the tile bodies: ``ok`` masks (which lanes are real, inside the image and the window),
``*_row`` flat token indices into an operand (clipped, so a masked lane still reads a valid address),
``a`` the weights A = exp(l - r), ``da`` their gradient dA.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxrat.ops.gpu.sparse_sga.tiles import (
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
)
from jaxrat.ops.gpu.sparse_sga.tiling import Tiling


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
