"""The CPU's attention block, sized from its last-level cache (the ``cpu`` kernel policy).

The chunked attention kernels (:mod:`jaxrat.ops.portable.chunked_attention`) hold one (queries x
key-chunk) block per slice at a time; on CPU the block is a sixteenth of the last-level cache, so a
chunk step's four block-sized intermediates stay in the cache. Large slices run one per ``lax.map``
step, since vmapping them turns each product into a slower batched dot (docs/history/cpu.md, "CPU kernels").
"""

from __future__ import annotations

import functools
import glob
import os
from typing import Optional

from jaxrat.ops.portable.chunked_attention import DEFAULT_BLOCK_ELEMENTS

# The block is a sixteenth of the last-level cache, within these bounds.
CPU_BLOCK_BOUNDS = (1 << 19, 1 << 22)
UNBATCHED_SLICE_ELEMENTS = 1 << 16


def last_level_cache_bytes(root: str = "/sys/devices/system/cpu/cpu0/cache") -> Optional[int]:
    """Size of the CPU's largest cache level as Linux reports it, or None where it cannot be read."""
    best: tuple[int, int] | None = None
    for index in sorted(glob.glob(os.path.join(root, "index*"))):
        try:
            with open(os.path.join(index, "level")) as f:
                level = int(f.read())
            with open(os.path.join(index, "size")) as f:
                text = f.read().strip().upper()
            with open(os.path.join(index, "type")) as f:
                if f.read().strip() == "Instruction":
                    continue
        except (OSError, ValueError):
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            size = int(text.rstrip("KMG")) * scale
        except ValueError:
            continue
        if best is None or (level, size) > best:
            best = (level, size)
    return best[1] if best else None


def cpu_block_elements(cache_bytes: Optional[int]) -> int:
    """The CPU block for a last-level cache of ``cache_bytes``: a sixteenth of it in float32
    elements, rounded down to a power of two, within :data:`CPU_BLOCK_BOUNDS`."""
    if not cache_bytes or cache_bytes <= 0:
        return DEFAULT_BLOCK_ELEMENTS
    elements = 1 << max(0, (cache_bytes // 64).bit_length() - 1)
    return min(max(elements, CPU_BLOCK_BOUNDS[0]), CPU_BLOCK_BOUNDS[1])


@functools.lru_cache(maxsize=1)
def cpu_block_elements_here() -> int:
    """:func:`cpu_block_elements` for this machine's cache (read once per process)."""
    return cpu_block_elements(last_level_cache_bytes())
