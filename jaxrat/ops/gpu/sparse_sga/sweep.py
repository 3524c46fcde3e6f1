"""Two of sparse SGA's passes as one sweep down the image: an input pass whose per-input statistic a
group pass then reads, the forward's column sums d before the update u, the backward's d-gradient gd
before the queries' gradient dq (and delta).

As two passes each reads the slice's keys (and values) whole, and the second cannot start before the
first has finished everywhere, though output row j only needs the statistic of its window's ``ky``
input rows. Here one program takes one (image, head) slice's output rows [c R, (c + 1) R) in order:
before row j it computes the statistic of the ``sy`` input rows j's window ends with (the ``ky - sy``
before them once, at its first row), then, after a barrier (so every thread of the program sees what
the others stored), row j's group tiles, which read those statistics back where they were just
written and the keys and values the input tiles have just read: from the SM's caches, not device
memory. Compiled for an H100, the ISIC step's first layer's two passes of a round move about a third
fewer bytes forward as one kernel than as two, and about half as many backward, counting each kernel's
operands once (what is saved is the second pass's operands: it already read the keys and values whole).

Input rows two neighbouring programs both need (the ``ky - sy`` rows where their windows overlap),
and rows off the image (clamped to its edge), are computed by each of them: the same code on the same
operands gives the same bits, so their stores agree and a read sees the right value whichever
landed. The statistic is stored for every input row (the keys' pass reads it), the rows below the
last window by the last program. Both forms of the tiles sweep (tap by tap, and as matrix products).
"""

from __future__ import annotations

from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxrat.ops.gpu.sparse_sga import passes
from jaxrat.ops.gpu.sparse_sga.tiles import clip
from jaxrat.ops.gpu.sparse_sga.tiling import Tiling


def applies(t: Tiling) -> bool:
    """Whether ``t``'s passes sweep: asked for (``t.sweep_rows`` > 0, the output rows a program sweeps:
    fewer make more programs, the ISIC first layer's 86 rows x 128 slices make 1,408 at 8, but recompute
    more overlap rows, ky - sy input rows a program: 4 of 28 there; 0 runs the passes apart, the form
    last timed on an H100), and windows that leave no input row between them."""
    return t.sweep_rows > 0 and t.sy <= t.ky


def _sweep_kernel(*flat_refs, names, t: Tiling, modes: tuple, eps: float, rows: int, exact: bool):
    """One program: output rows [first, first + rows) of one slice, each after the input rows its
    windows end with (:func:`sweep`)."""
    refs = passes.refs_of(names, flat_refs, t)
    input_mode, group_mode = modes
    first = pl.program_id(1) * rows  # read here: interpret mode lowers no program id in a loop
    last = pl.program_id(1) == pl.num_programs(1) - 1
    in_tiles, out_tiles = -(-t.X // t.tx), -(-t.OX // t.tw)

    def inputs(y0, n: int):
        def row(i, carry):
            y = clip(y0 + i, t.Y)

            def tile(column_tile, carry):
                passes.input_tile(refs, input_mode, t, eps, 1, exact, at=(column_tile, y))
                return carry

            return lax.fori_loop(0, in_tiles, tile, carry)

        lax.fori_loop(0, n, row, 0)

    inputs(first * t.sy - t.py, t.ky - t.sy)

    def step(i, carry):
        j = first + i  # the output row
        inputs(j * t.sy - t.py + t.ky - t.sy, t.sy)
        if not exact:  # on a GPU (interpret mode runs a program's threads as one, and has no barrier)
            plgpu.debug_barrier()
        oy = clip(j, t.OY)

        def tile(column_tile, carry):
            passes.group_tile(refs, group_mode, t, exact, at=(column_tile, oy))
            return carry

        return lax.fori_loop(0, out_tiles, tile, carry)

    lax.fori_loop(0, rows, step, 0)
    tail = t.Y - ((t.OY - 1) * t.sy - t.py + t.ky)  # input rows below the last window
    if tail > 0:
        @pl.when(last)
        def _():
            inputs(t.Y - tail, tail)


def sweep(modes: tuple[str, str], t: Tiling, ins: dict, outs: dict, eps: float, interpret: bool) -> dict:
    """The input pass ``modes[0]`` ("colsum" or "gd") and the group pass ``modes[1]`` ("update" or
    "grad") that reads its statistic, as one kernel; operands and results as the two passes take and
    give them (the statistic among ``outs``)."""
    bh = ins["k"].shape[0]
    rows = min(t.sweep_rows, t.OY)
    grid = (1, -(-t.OY // rows), bh)
    return passes.call(_sweep_kernel, t, grid, ins, outs, f"sparse_sga_sweep_{modes[0]}_{modes[1]}", interpret,
                  modes=modes, eps=eps, rows=rows, exact=interpret)
