"""The static shape of the sparse SGA kernels' work: :class:`Tiling`, one geometry's grid sizes, window,
head dims and tile sizes, and the switches that choose the kernels' form.

Every pass (:mod:`jaxrat.ops.gpu.sparse_sga.passes`) and every tile body (tap by tap,
:mod:`~jaxrat.ops.gpu.sparse_sga.taps`; as matrix products, :mod:`~jaxrat.ops.gpu.sparse_sga.products`)
takes one; its fields are Python ints and bools, so each distinct tiling traces its own kernels.
"""

from __future__ import annotations

from typing import NamedTuple

from jax.experimental import pallas as pl

from jaxrat.ops.blocks import SparseSGABlocks
from jaxrat.ops.portable.sparse_sga import Geometry


def _pow2(n: int) -> int:
    return int(pl.next_power_of_2(int(n)))


class Tiling(NamedTuple):
    """Static tile sizes of one geometry (2 spatial dims) and head dims.

    The short names are the kernels' arithmetic's: an input (key) p sits at row y, column x of the
    input grid (Y x X); a group o at row oy, column ox of the output grid (OY x OX) attends to the
    window of ky x kx inputs whose top-left corner is (oy * sy - py, ox * sx - px).
    """

    Y: int  # input grid rows (the keys' and values' image)
    X: int  # input grid columns
    OY: int  # output grid rows (the groups': queries, updates)
    OX: int  # output grid columns
    ky: int  # window rows
    kx: int  # window columns
    sy: int  # stride between the windows of neighbouring group rows
    sx: int  # stride between the windows of neighbouring group columns
    py: int  # rows a window starts above its group's strided position, (ky - 1) // 2
    px: int  # columns a window starts left of its group's strided position, (kx - 1) // 2
    dh: int  # query and key head dim
    dv: int  # value head dim
    dhp: int  # dh padded to a power of two (at least 16 as products): the width of a tile's key registers
    dvp: int  # dv padded likewise: the width of a tile's value registers
    tw: int  # groups per group tile (consecutive groups of one output row)
    tx: int  # inputs per input tile (consecutive inputs of one input row)
    nt: int  # output rows whose windows contain one input row, (ky - 1) // sy + 1
    mx: int  # output columns whose windows contain one input column, (kx - 1) // sx + 1
    warps: int = 4  # Triton warps per program
    unroll: bool = False  # the row loops as straight-line code
    products: bool = False  # logits as matrix products over row segments (sparse_sga.products)
    heads: int = 0  # > 0: group-level operands are token-major (B, N_out*heads*d), else per slice
    sweep_rows: int = 0  # > 0: output rows a sweep program takes (sparse_sga.sweep); 0: the passes apart
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
