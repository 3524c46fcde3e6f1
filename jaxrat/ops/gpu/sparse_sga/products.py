"""The sparse SGA passes as matrix products (``Tiling.products``): the tiles of
:mod:`jaxrat.ops.gpu.sparse_sga.taps` with their logits computed on the tensor cores against
contiguous runs of keys or groups, each window's taps kept by a band mask.

Names as in :mod:`~jaxrat.ops.gpu.sparse_sga.taps`; ``band`` masks the (tile, run) logits that are
some group's window taps, ``keep`` that band on one row.
"""

from __future__ import annotations

from typing import Any, NamedTuple

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


class GroupSegments(NamedTuple):
    """A group tile as products: ``tw`` groups of output row ``oy`` and the ``segment`` input columns
    their windows span on each input row (traced int32 values)."""

    oy: Any  # the output row
    ok: Any  # (tw,) whether each group is on the grid
    rows: Any  # (tw,) the groups' token indices, clipped
    q: Any  # (tw, dhp) queries in their dtype
    cols: Any  # (segment,) the input columns
    cols_ok: Any  # (segment,) whether each column is on the grid
    band: Any  # (tw, segment) whether a column is one of a group's kx taps


def _group_segments(refs: dict, t: Tiling, at) -> GroupSegments:
    """The group tile ``at`` (tile, output row; the program's where None), its queries loaded."""
    tile, oy = (pl.program_id(0), pl.program_id(1)) if at is None else at
    ox = tile * t.tw + jnp.arange(t.tw, dtype=jnp.int32)
    group_ok = ox < t.OX
    group_rows = oy * t.OX + clip(ox, t.OX)
    q = load_as(refs["q"], group_rows, group_ok, t.dh, t.dhp)
    cols = tile * t.tw * t.sx - t.px + jnp.arange(t.segment, dtype=jnp.int32)
    cols_ok = (cols >= 0) & (cols < t.X)
    rel = cols[None, :] - (ox * t.sx - t.px)[:, None]
    band = (rel >= 0) & (rel < t.kx) & group_ok[:, None] & cols_ok[None, :]
    return GroupSegments(oy, group_ok, group_rows, q, cols, cols_ok, band)


def _segment(refs: dict, t: Tiling, groups: GroupSegments, i, exact: bool) -> tuple:
    """Input row i of the windows: the segment's rows and validity, keys, logits and mask."""
    y = groups.oy * t.sy - t.py + i
    y_ok = (y >= 0) & (y < t.Y)
    input_rows = clip(y, t.Y) * t.X + clip(groups.cols, t.X)
    k = load_as(refs["k"], input_rows, groups.cols_ok & y_ok, t.dh, t.dhp)
    return input_rows, groups.cols_ok & y_ok, k, dot(groups.q, k, exact, transpose_b=True), groups.band & y_ok


def _segment_weights(refs: dict, t: Tiling, groups: GroupSegments, r, i, exact: bool) -> tuple:
    """A = exp(l - r) on row i's band, values, and 1 / d of the segment (none unnormalised)."""
    input_rows, ok, k, s, keep = _segment(refs, t, groups, i, exact)
    a = jnp.where(keep, jnp.exp(jnp.where(keep, s, 0.0) - r), 0.0)
    v = load_as(refs["v"], input_rows, ok, t.dv, t.dvp)
    inv_d = 1.0 / load1(refs["d"], input_rows, ok, 1.0) if "d" in refs else None
    return input_rows, ok, k, a, v, inv_d


def _group_lse(refs: dict, t: Tiling, groups: GroupSegments, exact: bool) -> None:
    """Mode "lse", as the tap form."""
    flash = "v" in refs

    def body(i, carry):
        m, total, acc = carry
        input_rows, ok, _, s, keep = _segment(refs, t, groups, i, exact)
        s = jnp.where(keep, s, NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        corr = jnp.exp(m - m_new)
        p = jnp.where(keep, jnp.exp(s - m_new[:, None]), 0.0)
        total = total * corr + jnp.sum(p, axis=1)
        if flash:
            acc = acc * corr[:, None] + dot(p, load_as(refs["v"], input_rows, ok, t.dv, t.dvp), exact)
        return m_new, total, acc

    init = (jnp.full((t.tw,), NEG, jnp.float32), jnp.zeros((t.tw,), jnp.float32),
            jnp.zeros((t.tw, t.dvp), jnp.float32))
    m, total, acc = loop(t, t.ky, body, init)
    store1(refs["r"], groups.rows, groups.ok, m + jnp.log(total))
    if flash:
        store(refs["u"], groups.rows, groups.ok, t.dv, t.dvp, acc / total[:, None])


def _group_update(refs: dict, t: Tiling, groups: GroupSegments, r, exact: bool) -> None:
    """Mode "update", as the tap form."""
    def body(i, acc):
        _, _, _, a, v, inv_d = _segment_weights(refs, t, groups, r, i, exact)
        return acc + dot(a * inv_d[None, :] if inv_d is not None else a, v, exact)

    acc = loop(t, t.ky, body, jnp.zeros((t.tw, t.dvp), jnp.float32))
    store(refs["u"], groups.rows, groups.ok, t.dv, t.dvp, acc)


def _group_grad(refs: dict, t: Tiling, groups: GroupSegments, r, exact: bool) -> None:
    """Mode "grad", as the tap form: dq = sum_p A (dA - c) k - (delta - c) sum_p A k, c = g.u."""
    g = load_as(refs["g"], groups.rows, groups.ok, t.dv, t.dvp)
    c = rowdot(g.astype(jnp.float32), load(refs["u"], groups.rows, groups.ok, t.dv, t.dvp))[:, None]

    def body(i, carry):
        delta_c, dq_a, dq_k = carry
        input_rows, ok, k, a, v, inv_d = _segment_weights(refs, t, groups, r, i, exact)
        da = dot(g, v, exact, transpose_b=True)
        if inv_d is not None:
            da = da * inv_d[None, :] + load1(refs["gd"], input_rows, ok)[None, :]
        w = a * (da - c)
        return delta_c + jnp.sum(w, axis=1), dq_a + dot(w, k, exact), dq_k + dot(a, k, exact)

    zeros = jnp.zeros((t.tw, t.dhp), jnp.float32)
    delta_c, dq_a, dq_k = loop(t, t.ky, body, (jnp.zeros((t.tw,), jnp.float32), zeros, zeros))
    dq, delta = dq_a - delta_c[:, None] * dq_k, delta_c + c[:, 0]
    store(refs["dq"], groups.rows, groups.ok, t.dh, t.dhp, dq)
    store1(refs["delta"], groups.rows, groups.ok, delta)


def group_products(refs: dict, mode: str, t: Tiling, exact: bool, at=None) -> None:
    """A group tile (:func:`jaxrat.ops.gpu.sparse_sga.passes.group_tile`) as matrix products. The windows of a
    tile's ``tw`` groups cover, on each of their ``ky`` input rows, one contiguous segment of
    ``t.segment`` inputs; the tile's logits against a segment are one (tw, dh) x (dh, segment)
    product, of which a band (each group's ``kx`` taps) is kept by a mask. The products compute
    segment / kx times the logits the taps need, but on the tensor cores and from contiguous loads,
    where the tap form gathers each tap's keys and reduces each logit across threads (it ran far
    below the H100's bandwidth, and further from its arithmetic). ``at``: the (tile, output row), read
    from the program's ids where None."""
    groups = _group_segments(refs, t, at)
    if mode == "lse":
        return _group_lse(refs, t, groups, exact)
    r = load1(refs["r"], groups.rows, groups.ok)[:, None]
    if mode == "update":
        return _group_update(refs, t, groups, r, exact)
    return _group_grad(refs, t, groups, r, exact)  # mode == "grad"


class InputRuns(NamedTuple):
    """An input tile as products: ``tx`` inputs of input row ``y`` and the ``covering`` group columns
    whose windows hold some of them (traced int32 values)."""

    y: Any  # the input row
    ok: Any  # (tx,) whether each input is on the grid
    rows: Any  # (tx,) the inputs' token indices, clipped
    k: Any  # (tx, dhp) keys in their dtype
    cols: Any  # (covering,) the group columns
    band: Any  # (tx, covering) whether a group's window holds an input (its row aside)
    first_row: Any  # the first output row whose windows may hold the tile's row


def _input_runs(refs: dict, t: Tiling, at) -> InputRuns:
    """The input tile ``at`` (tile, row; the program's where None), its keys loaded."""
    tile, y = (pl.program_id(0), pl.program_id(1)) if at is None else at
    x = tile * t.tx + jnp.arange(t.tx, dtype=jnp.int32)
    input_ok = x < t.X
    input_rows = y * t.X + clip(x, t.X)
    k = load_as(refs["k"], input_rows, input_ok, t.dh, t.dhp)
    first = ceil_div(tile * t.tx + t.px - t.kx + 1, t.sx, t.kx)  # the first group column over the tile
    ox = first + jnp.arange(t.covering, dtype=jnp.int32)
    rel = x[:, None] + t.px - ox[None, :] * t.sx
    band = (rel >= 0) & (rel < t.kx) & input_ok[:, None] & ((ox >= 0) & (ox < t.OX))[None, :]
    first_row = ceil_div(y + t.py - t.ky + 1, t.sy, t.ky)
    return InputRuns(y, input_ok, input_rows, k, ox, band, first_row)


def _covering_run(refs: dict, t: Tiling, inputs: InputRuns, i, exact: bool, use: str = "") -> tuple:
    """Output row ``first_row + i``: its run of groups' rows and validity, queries, and the weights A
    (tx, covering) of ``use``'s logits, zero off the band."""
    oy = inputs.first_row + i
    rel_y = inputs.y - (oy * t.sy - t.py)
    oy_ok = (oy >= 0) & (oy < t.OY) & (rel_y >= 0) & (rel_y < t.ky)
    group_ok = oy_ok & (inputs.cols >= 0) & (inputs.cols < t.OX)
    group_rows = clip(oy, t.OY) * t.OX + clip(inputs.cols, t.OX)
    q = load_as(refs["q" + use], group_rows, group_ok, t.dh, t.dhp)
    r = load1(refs["r" + use], group_rows, group_ok)
    keep = inputs.band & oy_ok
    s = dot(inputs.k, q, exact, transpose_b=True)
    return group_rows, group_ok, q, jnp.where(keep, jnp.exp(jnp.where(keep, s, 0.0) - r[None, :]), 0.0)


def _input_keys(refs: dict, t: Tiling, inputs: InputRuns, uses: int, exact: bool, v, zeros_v) -> tuple:
    """Mode "keys", as the tap form: dv = sum_o A g_o / d, dk = sum_o A (dA - delta_o) q_o."""
    def use_body(use, inv_d, gd):
        def body(i, carry):
            gw, dk = carry
            group_rows, group_ok, q, a = _covering_run(refs, t, inputs, i, exact, use)
            g = load_as(refs["g" + use], group_rows, group_ok, t.dv, t.dvp)
            da = dot(v, g, exact, transpose_b=True)
            if inv_d is not None:
                da = da * inv_d[:, None] + gd[:, None]
            w = a * (da - load1(refs["delta" + use], group_rows, group_ok)[None, :])
            return gw + dot(a, g, exact), dk + dot(w, q, exact)
        return body

    return (inputs.rows, inputs.ok) + keys_over_uses(t, uses, refs, inputs.rows, inputs.ok, zeros_v, use_body)


def input_products(refs: dict, mode: str, t: Tiling, eps: float, uses: int, exact: bool, at=None):
    """An input tile (:func:`jaxrat.ops.gpu.sparse_sga.passes.input_tile`) as matrix products: the groups whose
    windows hold some input of the tile lie, on each of their ``nt`` output rows, in one run of
    ``t.covering`` columns; the tile's logits against them are one (tx, dh) x (dh, covering)
    product, of which each input's (at most ``mx``) covering groups are kept by a band mask. ``at``:
    the (tile, row) to work on, read from the program's ids where None."""
    inputs = _input_runs(refs, t, at)
    if mode == "colsum":
        def body(i, c):
            return c + jnp.sum(_covering_run(refs, t, inputs, i, exact)[3], axis=1)

        c = loop(t, t.nt, body, jnp.zeros((t.tx,), jnp.float32))
        store1(refs["d"], inputs.rows, inputs.ok, c + eps)
        return

    v = load_as(refs["v"], inputs.rows, inputs.ok, t.dv, t.dvp)
    zeros_v = jnp.zeros((t.tx, t.dvp), jnp.float32)
    if mode == "gd":
        def body(i, gw):
            group_rows, group_ok, _, a = _covering_run(refs, t, inputs, i, exact)
            return gw + dot(a, load_as(refs["g"], group_rows, group_ok, t.dv, t.dvp), exact)

        gw = loop(t, t.nt, body, zeros_v)
        d = load1(refs["d"], inputs.rows, inputs.ok, 1.0)
        store1(refs["gd"], inputs.rows, inputs.ok, -rowdot(gw, v.astype(jnp.float32)) / (d * d))
        return

    return _input_keys(refs, t, inputs, uses, exact, v, zeros_v)  # mode == "keys"
