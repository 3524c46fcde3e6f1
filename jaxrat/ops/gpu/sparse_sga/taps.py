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

Names in the tile bodies: ``refs`` the kernel's operands by name (:func:`~jaxrat.ops.gpu.sparse_sga.
passes.refs_of`); ``*_rows`` the flat token indices of groups or inputs into an operand (clipped, so
a masked lane still reads a valid address) and ``*_ok`` the mask of lanes that are real (on the grid,
inside the window); ``a`` the weights A = exp(l - r), ``da`` their gradient dA.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

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


class GroupTile(NamedTuple):
    """A group tile: ``tw`` consecutive groups of output row ``oy`` (traced int32 values)."""

    oy: Any  # the output row
    first_col: Any  # (tw,) each group's first window column, ox * sx - px
    ok: Any  # (tw,) whether each group is on the grid (a row's last tile runs past its end)
    rows: Any  # (tw,) the groups' token indices, clipped
    q: Any  # (tw, dhp) float32 queries


def _group_tile(refs: dict, t: Tiling, at) -> GroupTile:
    """The group tile ``at`` (tile, output row; the program's where None), its queries loaded."""
    tile, oy = (pl.program_id(0), pl.program_id(1)) if at is None else at
    ox = tile * t.tw + jnp.arange(t.tw, dtype=jnp.int32)
    group_ok = ox < t.OX
    group_rows = oy * t.OX + clip(ox, t.OX)
    q = load(refs["q"], group_rows, group_ok, t.dh, t.dhp)
    return GroupTile(oy, ox * t.sx - t.px, group_ok, group_rows, q)


def _window_row_taps(refs: dict, t: Tiling, groups: GroupTile, i) -> list:
    """Input row i of the windows: per tap j, (input rows, validity, keys, logits)."""
    y = groups.oy * t.sy - t.py + i
    y_ok = (y >= 0) & (y < t.Y)
    out = []
    for j in range(t.kx):
        x = groups.first_col + j
        ok = groups.ok & (x >= 0) & (x < t.X) & y_ok
        input_rows = clip(y, t.Y) * t.X + clip(x, t.X)
        k = load(refs["k"], input_rows, ok, t.dh, t.dhp)
        out.append((input_rows, ok, k, rowdot(groups.q, k)))
    return out


def _window_row_weights(refs: dict, t: Tiling, groups: GroupTile, r, i) -> list:
    """A_k = exp(l - r) per tap of row i, with the tap's rows, validity, keys, values and d."""
    out = []
    for input_rows, ok, k, s in _window_row_taps(refs, t, groups, i):
        a = jnp.where(ok, jnp.exp(jnp.where(ok, s, 0.0) - r), 0.0)
        v = load(refs["v"], input_rows, ok, t.dv, t.dvp)
        d = load1(refs["d"], input_rows, ok, 1.0) if "d" in refs else None
        out.append((input_rows, ok, k, a, v, d))
    return out


def _group_lse(refs: dict, t: Tiling, groups: GroupTile) -> None:
    """Mode "lse": r, an online log-sum-exp over the windows; with v also the unnormalised update u."""
    flash = "v" in refs

    def body(i, carry):
        m, total, acc = carry
        row = [(input_rows, ok, jnp.where(ok, s, NEG)) for input_rows, ok, _, s in _window_row_taps(refs, t, groups, i)]
        m_new = functools.reduce(jnp.maximum, [s for _, _, s in row], m)
        corr = jnp.exp(m - m_new)
        total, acc = total * corr, acc * corr[:, None]
        for input_rows, ok, s in row:
            p = jnp.where(ok, jnp.exp(s - m_new), 0.0)
            total = total + p
            if flash:
                acc = acc + p[:, None] * load(refs["v"], input_rows, ok, t.dv, t.dvp)
        return m_new, total, acc

    init = (jnp.full((t.tw,), NEG, jnp.float32), jnp.zeros((t.tw,), jnp.float32),
            jnp.zeros((t.tw, t.dvp), jnp.float32))
    m, total, acc = loop(t, t.ky, body, init)
    store1(refs["r"], groups.rows, groups.ok, m + jnp.log(total))
    if flash:
        store(refs["u"], groups.rows, groups.ok, t.dv, t.dvp, acc / total[:, None])


def _group_update(refs: dict, t: Tiling, groups: GroupTile, r) -> None:
    """Mode "update": u = sum_p A v_p / d_p, given r and the column denominators d."""
    def body(i, acc):
        for _, _, _, a, v, d in _window_row_weights(refs, t, groups, r, i):
            acc = acc + (a / d)[:, None] * v
        return acc

    acc = loop(t, t.ky, body, jnp.zeros((t.tw, t.dvp), jnp.float32))
    store(refs["u"], groups.rows, groups.ok, t.dv, t.dvp, acc)


def _group_grad(refs: dict, t: Tiling, groups: GroupTile, r) -> None:
    """Mode "grad": dA[o,p] = g_o.v_p / d_p + gd_p, delta_o = sum_p A dA, dl = A (dA - delta); stores
    dq = sum_p dl k_p and delta."""
    g = load(refs["g"], groups.rows, groups.ok, t.dv, t.dvp)

    def grads(i):
        out = []
        for input_rows, ok, k, a, v, d in _window_row_weights(refs, t, groups, r, i):
            da = rowdot(g, v)
            if d is not None:
                da = da / d + load1(refs["gd"], input_rows, ok)
            out.append((a, da, k))
        return out

    # dq = sum_p A (dA - delta) k in one sweep, as sum_p A (dA - c) k - (delta - c) sum_p A k for
    # c = g.u, the part of dA common to the window (delta = sum_p A dA = g.u + sum_p A gd): the two
    # sums then do not cancel (float32 throughout), whatever offset the values carry
    c = rowdot(g, load(refs["u"], groups.rows, groups.ok, t.dv, t.dvp))

    def body(i, carry):
        delta_c, dq_a, dq_k = carry
        for a, da, k in grads(i):
            w = a * (da - c)
            delta_c, dq_a, dq_k = delta_c + w, dq_a + w[:, None] * k, dq_k + a[:, None] * k
        return delta_c, dq_a, dq_k

    zeros = jnp.zeros((t.tw, t.dhp), jnp.float32)
    delta_c, dq_a, dq_k = loop(t, t.ky, body, (jnp.zeros((t.tw,), jnp.float32), zeros, zeros))
    dq, delta = dq_a - delta_c[:, None] * dq_k, delta_c + c
    store(refs["dq"], groups.rows, groups.ok, t.dh, t.dhp, dq)
    store1(refs["delta"], groups.rows, groups.ok, delta)


def group_taps(refs: dict, mode: str, t: Tiling, at=None) -> None:
    """:func:`~jaxrat.ops.gpu.sparse_sga.passes.group_tile` tap by tap."""
    groups = _group_tile(refs, t, at)
    if mode == "lse":
        return _group_lse(refs, t, groups)
    r = load1(refs["r"], groups.rows, groups.ok)
    if mode == "update":
        return _group_update(refs, t, groups, r)
    return _group_grad(refs, t, groups, r)  # mode == "grad"


class InputTile(NamedTuple):
    """An input tile: ``tx`` consecutive inputs of input row ``y`` (traced int32 values)."""

    y: Any  # the input row
    x: Any  # (tx,) the inputs' columns
    ok: Any  # (tx,) whether each input is on the grid (a row's last tile runs past its end)
    rows: Any  # (tx,) the inputs' token indices, clipped
    k: Any  # (tx, dhp) float32 keys
    last_col: Any  # (tx,) the last group column whose window holds each input
    first_row: Any  # the first output row whose windows may hold the tile's row


def _input_tile(refs: dict, t: Tiling, at) -> InputTile:
    """The input tile ``at`` (tile, row; the program's where None), its keys loaded."""
    tile, y = (pl.program_id(0), pl.program_id(1)) if at is None else at
    x = tile * t.tx + jnp.arange(t.tx, dtype=jnp.int32)
    input_ok = x < t.X
    input_rows = y * t.X + clip(x, t.X)
    k = load(refs["k"], input_rows, input_ok, t.dh, t.dhp)
    last_col = lax.div(x + t.px, t.sx)  # x + px >= 0
    first_row = ceil_div(y + t.py - t.ky + 1, t.sy, t.ky)
    return InputTile(y, x, input_ok, input_rows, k, last_col, first_row)


def _covering_groups(refs: dict, t: Tiling, inputs: InputTile, i, use: str = "") -> list:
    """The covering groups on output row ``first_row + i``, one per column offset m: their queries,
    weights A (tx,), rows and validity, from the queries and log-sum-exps of ``use``."""
    oy = inputs.first_row + i
    rel_y = inputs.y - (oy * t.sy - t.py)
    oy_ok = (oy >= 0) & (oy < t.OY) & (rel_y >= 0) & (rel_y < t.ky)
    out = []
    for m in range(t.mx):
        ox = inputs.last_col - m
        ok = inputs.ok & oy_ok & (ox >= 0) & (ox < t.OX) & (inputs.x + t.px - ox * t.sx < t.kx)
        group_rows = clip(oy, t.OY) * t.OX + clip(ox, t.OX)
        q = load(refs["q" + use], group_rows, ok, t.dh, t.dhp)
        s = rowdot(inputs.k, q)
        r = load1(refs["r" + use], group_rows, ok)
        out.append((q, jnp.where(ok, jnp.exp(jnp.where(ok, s, 0.0) - r), 0.0), group_rows, ok))
    return out


def _input_colsum(refs: dict, t: Tiling, inputs: InputTile, eps: float) -> None:
    """Mode "colsum": d = sum_o A[o, p] + eps."""
    def body(i, c):
        for _, a, _, _ in _covering_groups(refs, t, inputs, i):
            c = c + a
        return c

    c = loop(t, t.nt, body, jnp.zeros((t.tx,), jnp.float32))
    store1(refs["d"], inputs.rows, inputs.ok, c + eps)


def _input_gd(refs: dict, t: Tiling, inputs: InputTile, v, zeros_v) -> None:
    """Mode "gd": u = sum A w with w = v / d, so d's gradient is -(sum_o A g_o) . v / d^2."""
    def body(i, gw):
        for _, a, group_rows, ok in _covering_groups(refs, t, inputs, i):
            gw = gw + a[:, None] * load(refs["g"], group_rows, ok, t.dv, t.dvp)
        return gw

    gw = loop(t, t.nt, body, zeros_v)
    d = load1(refs["d"], inputs.rows, inputs.ok, 1.0)
    store1(refs["gd"], inputs.rows, inputs.ok, -rowdot(gw, v) / (d * d))


def _input_keys(refs: dict, t: Tiling, inputs: InputTile, uses: int, v, zeros_v) -> tuple:
    """Mode "keys": dv = sum_o A g_o / d and dk = sum_o A (dA - delta_o) q_o, dA = g_o . v / d + gd,
    added up over the uses in float32 on chip; returns (rows, validity, dk, dv)."""
    def use_body(use, inv_d, gd):
        def body(i, carry):
            gw, dk = carry
            for q, a, group_rows, ok in _covering_groups(refs, t, inputs, i, use):
                g = load(refs["g" + use], group_rows, ok, t.dv, t.dvp)
                gw = gw + a[:, None] * g
                da = rowdot(v, g)
                if inv_d is not None:
                    da = da * inv_d + gd
                dk = dk + (a * (da - load1(refs["delta" + use], group_rows, ok)))[:, None] * q
            return gw, dk
        return body

    return (inputs.rows, inputs.ok) + keys_over_uses(t, uses, refs, inputs.rows, inputs.ok, zeros_v, use_body)


def input_taps(refs: dict, mode: str, t: Tiling, eps: float, uses: int, exact: bool, at=None):
    """:func:`~jaxrat.ops.gpu.sparse_sga.passes.input_tile` tap by tap."""
    inputs = _input_tile(refs, t, at)
    if mode == "colsum":
        return _input_colsum(refs, t, inputs, eps)
    v = load(refs["v"], inputs.rows, inputs.ok, t.dv, t.dvp)
    zeros_v = jnp.zeros((t.tx, t.dvp), jnp.float32)
    if mode == "gd":
        return _input_gd(refs, t, inputs, v, zeros_v)
    return _input_keys(refs, t, inputs, uses, v, zeros_v)  # mode == "keys"
