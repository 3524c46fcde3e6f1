"""The sparse SGA passes as matrix products (``Tiling.products``): the tiles of
:mod:`jaxrat.ops.gpu.sparse_sga.taps` with their logits computed on the tensor cores against
contiguous runs of keys or groups, each window's taps kept by a band mask."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxrat.ops.gpu.sparse_sga.tiles import (
    NEG,
    ceil_div,
    clip,
    dot,
    keys_over_uses,
    load,
    load1,
    load_as,
    loop,
    rowdot,
    store,
    store1,
)
from jaxrat.ops.gpu.sparse_sga.tiling import Tiling


def group_products(R, mode: str, t: Tiling, exact: bool, at=None):
    """A group tile (:func:`jaxrat.ops.gpu.sparse_sga.passes.group_tile`) as matrix products. The windows of a
    tile's ``tw`` groups cover, on each of their ``ky`` input rows, one contiguous segment of
    ``t.segment`` inputs; the tile's logits against a segment are one (tw, dh) x (dh, segment)
    product, of which a band (each group's ``kx`` taps) is kept by a mask. The products compute
    segment / kx times the logits the taps need, but on the tensor cores and from contiguous loads,
    where the tap form gathers each tap's keys and reduces each logit across threads (it ran far
    below the H100's bandwidth, and further from its arithmetic). ``at``: the (tile, output row), read
    from the program's ids where None."""
    tile, oy = (pl.program_id(0), pl.program_id(1)) if at is None else at
    ox = tile * t.tw + jnp.arange(t.tw, dtype=jnp.int32)
    gok = ox < t.OX
    grow = oy * t.OX + clip(ox, t.OX)
    q = load_as(R["q"], grow, gok, t.dh, t.dhp)
    col = tile * t.tw * t.sx - t.px + jnp.arange(t.segment, dtype=jnp.int32)
    cok = (col >= 0) & (col < t.X)
    rel = col[None, :] - (ox * t.sx - t.px)[:, None]
    band = (rel >= 0) & (rel < t.kx) & gok[:, None] & cok[None, :]

    def segment(i):
        """Input row i of the windows: the segment's rows and validity, keys, logits and mask."""
        y = oy * t.sy - t.py + i
        yok = (y >= 0) & (y < t.Y)
        prow = clip(y, t.Y) * t.X + clip(col, t.X)
        k = load_as(R["k"], prow, cok & yok, t.dh, t.dhp)
        return prow, cok & yok, k, dot(q, k, exact, transpose_b=True), band & yok

    if mode == "lse":
        flash = "v" in R

        def body(i, carry):
            m, total, acc = carry
            prow, ok, _, s, keep = segment(i)
            s = jnp.where(keep, s, NEG)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            corr = jnp.exp(m - m_new)
            p = jnp.where(keep, jnp.exp(s - m_new[:, None]), 0.0)
            total = total * corr + jnp.sum(p, axis=1)
            if flash:
                acc = acc * corr[:, None] + dot(p, load_as(R["v"], prow, ok, t.dv, t.dvp), exact)
            return m_new, total, acc

        init = (jnp.full((t.tw,), NEG, jnp.float32), jnp.zeros((t.tw,), jnp.float32),
                jnp.zeros((t.tw, t.dvp), jnp.float32))
        m, total, acc = loop(t, t.ky, body, init)
        store1(R["r"], grow, gok, m + jnp.log(total))
        if flash:
            store(R["u"], grow, gok, t.dv, t.dvp, acc / total[:, None])
        return

    r = load1(R["r"], grow, gok)[:, None]

    def weights(i):
        """A = exp(l - r) on row i's band, values, and 1 / d of the segment (none unnormalised)."""
        prow, ok, k, s, keep = segment(i)
        a = jnp.where(keep, jnp.exp(jnp.where(keep, s, 0.0) - r), 0.0)
        v = load_as(R["v"], prow, ok, t.dv, t.dvp)
        inv_d = 1.0 / load1(R["d"], prow, ok, 1.0) if "d" in R else None
        return prow, ok, k, a, v, inv_d

    if mode == "update":
        def body(i, acc):
            _, _, _, a, v, inv_d = weights(i)
            return acc + dot(a * inv_d[None, :] if inv_d is not None else a, v, exact)

        acc = loop(t, t.ky, body, jnp.zeros((t.tw, t.dvp), jnp.float32))
        store(R["u"], grow, gok, t.dv, t.dvp, acc)
        return

    # mode == "grad", as the tap form: dq = sum_p A (dA - c) k - (delta - c) sum_p A k, c = g.u
    g = load_as(R["g"], grow, gok, t.dv, t.dvp)
    c = rowdot(g.astype(jnp.float32), load(R["u"], grow, gok, t.dv, t.dvp))[:, None]

    def body(i, carry):
        delta_c, dq_a, dq_k = carry
        prow, ok, k, a, v, inv_d = weights(i)
        da = dot(g, v, exact, transpose_b=True)
        if inv_d is not None:
            da = da * inv_d[None, :] + load1(R["gd"], prow, ok)[None, :]
        w = a * (da - c)
        return delta_c + jnp.sum(w, axis=1), dq_a + dot(w, k, exact), dq_k + dot(a, k, exact)

    zeros = jnp.zeros((t.tw, t.dhp), jnp.float32)
    delta_c, dq_a, dq_k = loop(t, t.ky, body, (jnp.zeros((t.tw,), jnp.float32), zeros, zeros))
    dq, delta = dq_a - delta_c[:, None] * dq_k, delta_c + c[:, 0]
    store(R["dq"], grow, gok, t.dh, t.dhp, dq)
    store1(R["delta"], grow, gok, delta)


def input_products(R, mode: str, t: Tiling, eps: float, uses: int, exact: bool, at=None):
    """An input tile (:func:`jaxrat.ops.gpu.sparse_sga.passes.input_tile`) as matrix products: the groups whose
    windows hold some input of the tile lie, on each of their ``nt`` output rows, in one run of
    ``t.covering`` columns; the tile's logits against them are one (tx, dh) x (dh, covering)
    product, of which each input's (at most ``mx``) covering groups are kept by a band mask. ``at``:
    the (tile, row) to work on, read from the program's ids where None."""
    tile, y = (pl.program_id(0), pl.program_id(1)) if at is None else at
    x = tile * t.tx + jnp.arange(t.tx, dtype=jnp.int32)
    xok = x < t.X
    prow = y * t.X + clip(x, t.X)
    k = load_as(R["k"], prow, xok, t.dh, t.dhp)
    first = ceil_div(tile * t.tx + t.px - t.kx + 1, t.sx, t.kx)  # the first group column over the tile
    ox = first + jnp.arange(t.covering, dtype=jnp.int32)
    rel = x[:, None] + t.px - ox[None, :] * t.sx
    band = (rel >= 0) & (rel < t.kx) & xok[:, None] & ((ox >= 0) & (ox < t.OX))[None, :]
    oy_lo = ceil_div(y + t.py - t.ky + 1, t.sy, t.ky)

    def groups(i, use=""):
        """Output row oy_lo + i: its run of groups' rows and validity, queries, and the weights A
        (tx, covering) of ``use``'s logits, zero off the band."""
        oy = oy_lo + i
        rel_y = y - (oy * t.sy - t.py)
        yok = (oy >= 0) & (oy < t.OY) & (rel_y >= 0) & (rel_y < t.ky)
        gok = yok & (ox >= 0) & (ox < t.OX)
        grow = clip(oy, t.OY) * t.OX + clip(ox, t.OX)
        q = load_as(R["q" + use], grow, gok, t.dh, t.dhp)
        r = load1(R["r" + use], grow, gok)
        keep = band & yok
        s = dot(k, q, exact, transpose_b=True)
        return grow, gok, q, jnp.where(keep, jnp.exp(jnp.where(keep, s, 0.0) - r[None, :]), 0.0)

    if mode == "colsum":
        def body(i, c):
            return c + jnp.sum(groups(i)[3], axis=1)

        c = loop(t, t.nt, body, jnp.zeros((t.tx,), jnp.float32))
        store1(R["d"], prow, xok, c + eps)
        return

    v = load_as(R["v"], prow, xok, t.dv, t.dvp)
    zeros_v = jnp.zeros((t.tx, t.dvp), jnp.float32)
    if mode == "gd":
        def body(i, gw):
            grow, gok, _, a = groups(i)
            return gw + dot(a, load_as(R["g"], grow, gok, t.dv, t.dvp), exact)

        gw = loop(t, t.nt, body, zeros_v)
        d = load1(R["d"], prow, xok, 1.0)
        store1(R["gd"], prow, xok, -rowdot(gw, v.astype(jnp.float32)) / (d * d))
        return

    # mode == "keys", as the tap form: dv = sum_o A g_o / d, dk = sum_o A (dA - delta_o) q_o
    def use_body(use, inv_d, gd):
        def body(i, carry):
            gw, dk = carry
            grow, gok, q, a = groups(i, use)
            g = load_as(R["g" + use], grow, gok, t.dv, t.dvp)
            da = dot(v, g, exact, transpose_b=True)
            if inv_d is not None:
                da = da * inv_d[:, None] + gd[:, None]
            w = a * (da - load1(R["delta" + use], grow, gok)[None, :])
            return gw + dot(a, g, exact), dk + dot(w, q, exact)
        return body

    return (prow, xok) + keys_over_uses(t, uses, R, prow, xok, zeros_v, use_body)
