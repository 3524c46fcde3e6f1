"""The fused sparse SGA kernels' device-memory traffic, estimated from shapes (no GPU needed): what
each pass of :mod:`jaxrat.ops.gpu.sparse_sga` reads and writes, to compare with a profile's bytes.

A helper the tests import (``tests/extended/test_sparse_sga_pallas.py``), not a benchmark of its own.
"""

from __future__ import annotations

import numpy as np

from jaxrat.ops.blocks import SparseSGABlocks
from jaxrat.ops.gpu.sparse_sga import sweep
from jaxrat.ops.gpu.sparse_sga.tiling import Tiling
from jaxrat.ops.portable.sparse_sga import Geometry


def hbm_bytes(geom: Geometry, q_shape, dv: int, dtype, normalise_columns: bool = True, uses: int = 1,
              blocks: SparseSGABlocks = SparseSGABlocks()) -> dict[str, int]:
    """Bytes each pass reads and writes in device memory for ``uses`` calls with queries of
    ``q_shape`` (B, N_out, H, dh) on one layer's keys, counting every operand it touches once (the
    transposes around the passes not included). Per-call passes are summed over the calls.

    That is the traffic when a tile's halo (the key rows its neighbours read too) comes from the
    L2 cache; tiles of neighbouring rows run together, so it does. Without that reuse the group
    passes would read keys and values ``ky/sy`` times over (each input row is in that many output
    rows' windows). A sweep's second pass reads what its first has just read and written.
    """
    b, n_out, h, dh = q_shape
    n_in, bh, e = int(np.prod(geom.grid)), b * h, np.dtype(dtype).itemsize
    size = dict(q=n_out * dh * e, g=n_out * dv * e, u=n_out * dv * e, dq=n_out * dh * e, r=n_out * 4,
                delta=n_out * 4, k=n_in * dh * e, v=n_in * dv * e, dk=n_in * dh * e, dv=n_in * dv * e,
                d=n_in * 4, gd=n_in * 4)
    if normalise_columns and sweep.applies(Tiling.of(geom, dh, dv, heads=h, blocks=blocks)):
        passes = {"fwd groups lse": "q k | r", "fwd sweep colsum update": "q k v r | d u",
                  "bwd sweep gd dq": "q k v u r g d | gd dq delta"}
        per_use = "q g r delta d gd"
    elif normalise_columns:
        passes = {"fwd groups lse": "q k | r", "fwd inputs colsum": "q k r | d", "fwd groups update": "q k v r d | u",
                  "bwd inputs gd": "q k v r g d | gd", "bwd groups dq": "q k v u r g d gd | dq delta"}
        per_use = "q g r delta d gd"
    else:
        passes = {"fwd groups flash": "q k v | r u", "bwd groups dq": "q k v u r g | dq delta"}
        per_use = "q g r delta"
    count = lambda names: bh * sum(size[x] for x in names.replace("|", " ").split())
    out = {name: uses * count(names) for name, names in passes.items()}
    out["bwd inputs dk dv"] = count("k v dk dv") + uses * count(per_use)
    return out
