"""Cache-sized MLP chunks for CPUs (the ``cpu`` kernel policy).

From :data:`CHUNK_HIDDEN_BYTES` of hidden activation in one call (up to the memory bound of
:mod:`jaxrat.ops.mlp`, where every form chunks), the MLP runs over token chunks of
:data:`CHUNK_BYTES` that keep what the backward needs instead of recomputing it: the memory is
that of the plain form, and each chunk's GELU, dropout and their gradients work in the cache.
Plain, those passes over a hidden activation out of the cache grew 12-27x from 256 to 512 px
(4x the tokens); chunked, the sparse RAT step at 512 px went 17.8 -> 15.5 s, 256 px 3.49 -> 3.40 s
(2-16 MiB chunks within noise of each other). Accelerators want the one wide product.
"""

from __future__ import annotations

CHUNK_HIDDEN_BYTES = 16 * 2**20
CHUNK_BYTES = 8 * 2**20
