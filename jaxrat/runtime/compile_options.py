"""XLA options for compiling a run's programs (its state's initialisation, train and eval steps), per platform.

On a CPU these compiles are most of the wait before the first step (a full RAT at 256 px: about a
minute on 2 cores), and most of that is LLVM optimising thousands of fused kernels at its default
level 2. Level 1 compiles the step ~13% and the initialisation ~34% faster, runs the step no slower
and draws the same initial parameters (``docs/history/cpu.md``), so the run asks for it on CPU. A
user's own ``--xla_backend_optimization_level`` in ``XLA_FLAGS`` wins: per-compile options would
override it.
"""

from __future__ import annotations

import os
from typing import Any

CPU_OPTIMIZATION_LEVEL = 1


def step_compiler_options(platform: str) -> dict[str, Any]:
    """The ``compiler_options`` for ``jax.jit`` of a run's programs on ``platform`` ("cpu", "gpu", ...)."""
    if platform != "cpu" or "xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", ""):
        return {}
    return {"xla_backend_optimization_level": CPU_OPTIMIZATION_LEVEL}
