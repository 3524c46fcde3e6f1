"""Sparse (windowed) spatial grouping attention as fused Pallas (Triton) kernels, for GPUs.

The API the dispatch (:mod:`jaxrat.ops.attention`) calls is :mod:`~jaxrat.ops.gpu.sparse_sga.api`,
re-exported here. The modules, from the API down:

- ``api``: token-major entry points, the layout of a layer's keys once for its grouping iterations,
  and the custom VJPs that order the passes;
- ``projection``: the first layer's key-value projection and layout as one kernel; ``input_grad``: the
  keys' pass that also writes that layer input's gradient;
- ``sweep``: an input pass and the group pass reading its statistic as one sweep down the image;
- ``passes``: the Pallas calls over group tiles and input tiles;
- ``taps`` and ``products``: the tile bodies, tap by tap or as matrix products;
- ``tiles``: the loads, stores and loops both forms share; ``tiling``: :class:`Tiling`, the static
  sizes every kernel is traced for.
"""

from jaxrat.ops.gpu.sparse_sga.api import (
    DTYPES,
    MAX_HEAD_DIM,
    MIN_HEAD_DIM,
    LaidOutKeys,
    laid_out_update,
    lay_out,
    lay_out_keys,
    lay_out_projection,
    sparse_update,
    supports,
)
from jaxrat.ops.gpu.sparse_sga.tiling import Tiling

__all__ = ["DTYPES", "MAX_HEAD_DIM", "MIN_HEAD_DIM", "LaidOutKeys", "Tiling", "laid_out_update", "lay_out",
           "lay_out_keys", "lay_out_projection", "sparse_update", "supports"]
