"""The grid of a multi-tensor Pallas kernel: one program per block of one leaf, over many leaves.

XLA gives every small leaf-wise op (a parameter's update, its cast) a kernel of its own. A
multi-tensor kernel instead covers every leaf's blocks with one grid; each program finds its leaf
among static ranges and works on one block of it (:mod:`jaxrat.optim.gpu_adamw`,
:mod:`jaxrat.optim.gpu_cast`).
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax.numpy as jnp
from jax.experimental import pallas as pl


def programs(sizes: Sequence[int], block: int) -> int:
    """The grid's length: every leaf's blocks of ``block`` elements."""
    return sum(-(-n // block) for n in sizes)


def over_leaves(sizes: Sequence[int], block: int, body: Callable) -> None:
    """In a kernel over :func:`programs` ``(sizes, block)``: ``body(j, read, write, ok)`` for the
    program's leaf ``j``, with ``read`` its block's element indices (masked lanes clamped to a valid
    address), ``write`` the same pointing masked lanes past the end (not stored) and ``ok`` the mask."""
    pid = pl.program_id(0)
    start = 0
    for j, size in enumerate(sizes):
        blocks = -(-size // block)

        @pl.when((pid >= start) & (pid < start + blocks))
        def _(j=j, start=start, size=size):
            idx = (pid - start) * block + jnp.arange(block, dtype=jnp.int32)
            ok = idx < size
            body(j, jnp.minimum(idx, size - 1), jnp.where(ok, idx, size), ok)

        start += blocks
