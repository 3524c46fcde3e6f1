"""XLA options for compiling a run's parameter initialisation, per platform.

On a CPU the initialisation is a program of its own, compiled before the first step: one random
draw per parameter, some 900 fused kernels of integer hashing (threefry) and float transforms, which
LLVM optimises at XLA's default level 3 for seconds of CPU although the program runs once, in a
fraction of a second. At level 1 it compiles 2-4x faster on the shipped configs and draws
bit-identical parameters (``docs/history/cpu.md``; level 0 changes them). The train and eval steps
keep XLA's default: on an idle machine level 1 compiled the full RAT's step no faster. A user's own
``--xla_backend_optimization_level`` in ``XLA_FLAGS`` wins: per-compile options would override it.
"""

from __future__ import annotations

import os
from typing import Any

CPU_INIT_OPTIMIZATION_LEVEL = 1


def init_compiler_options(platform: str) -> dict[str, Any]:
    """The ``compiler_options`` for ``jax.jit`` of a state's initialisation on ``platform`` ("cpu", "gpu", ...)."""
    if platform != "cpu" or "xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", ""):
        return {}
    return {"xla_backend_optimization_level": CPU_INIT_OPTIMIZATION_LEVEL}
