"""Which kernel form the model's operations take: the kernel policy, chosen once per run.

The model code states the math and calls :mod:`jaxrat.ops`; the policy it was built with picks
how each operation is computed. Forms:

* ``cpu``: the CPU kernels (:mod:`jaxrat.ops.cpu`): attention blocks sized from the last-level
  cache, large slices unbatched, strided and strip convolutions, cache-sized MLP chunks, the RoSE
  rotation's hand-written angle gradient. Each was measured faster on CPUs; its module says by how much.
* ``gpu``: the forms for GPUs (:mod:`jaxrat.ops.gpu`, fused attention where it exists; the portable
  form elsewhere).
* ``portable``: plain XLA operations and no custom calls, so the program runs and serialises
  (``jax.export``) anywhere; the attention kernels keep their fixed memory-bounded blocks.

``auto`` (the default of ``config.model.kernels``) is resolved once, at start-up, from the platform
of the devices the run's mesh holds (:func:`resolve`), never from the process's default backend
while tracing: a model built with the ``gpu`` policy on a CPU machine traces the GPU program, which
is how that program is lowered and inspected without a GPU.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from jaxrat.ops.portable.chunked_attention import DEFAULT_BLOCK_ELEMENTS

KERNELS = ("auto", "cpu", "gpu", "portable")
FORMS = ("cpu", "gpu", "portable")
# Device platforms (``jax.Device.platform``) per form; anything else (TPU, ...) runs portable.
_PLATFORM_FORMS = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu"}


@dataclasses.dataclass(frozen=True)
class KernelPolicy:
    """A resolved kernel policy (hashable: it is static in the model's graph).

    Attributes:
      form: "cpu", "gpu" or "portable".
      block_elements: largest (queries x key-chunk) block the chunked attention kernels hold per
        slice (cpu: from the last-level cache; else :data:`DEFAULT_BLOCK_ELEMENTS`).
      slice_batch: (batch x head) slices the chunked attention kernels process together at least.
    """

    form: str = "portable"
    block_elements: int = DEFAULT_BLOCK_ELEMENTS
    slice_batch: int = 1

    def __post_init__(self) -> None:
        if self.form not in FORMS:
            raise ValueError(f"kernel form must be one of {FORMS}, got {self.form!r}")
        if self.block_elements < 1 or self.slice_batch < 1:
            raise ValueError(f"block_elements and slice_batch must be >= 1, got {self}")

    @property
    def cpu(self) -> bool:
        return self.form == "cpu"

    @property
    def gpu(self) -> bool:
        return self.form == "gpu"


PORTABLE = KernelPolicy("portable")


def require(kernels: object) -> KernelPolicy:
    """``kernels`` if it is a resolved policy; a model is never handed a name to resolve itself,
    since resolving reads the devices, which model code must not ask about."""
    if not isinstance(kernels, KernelPolicy):
        raise TypeError(f"kernels must be a resolved jaxrat.ops.KernelPolicy, got {kernels!r}; "
                        f"resolve a name once with jaxrat.ops.resolve({kernels!r}).")
    return kernels


def form_for_platform(platform: str) -> str:
    """The form ``auto`` means on devices of ``platform`` (``jax.Device.platform``)."""
    return _PLATFORM_FORMS.get(platform.lower(), "portable")


def platform_of(devices: Optional[Sequence] = None) -> str:
    """The platform of ``devices`` (e.g. a mesh's ``devices.flat``); default: ``jax.devices()``."""
    if devices is None:
        import jax

        devices = jax.devices()
    platforms = {d.platform for d in devices}
    if len(platforms) != 1:
        raise ValueError(f"devices of several platforms {sorted(platforms)}; a run uses one")
    return platforms.pop()


def resolve(kernels: "str | KernelPolicy" = "auto", platform: Optional[str] = None, *,
            block_elements: Optional[int] = None, slice_batch: int = 1,
            process_count: Optional[int] = None) -> KernelPolicy:
    """Turn ``config.model.kernels`` into a :class:`KernelPolicy`, once per run.

    Args:
      kernels: "auto", "cpu", "gpu", "portable", or a policy (returned as it is).
      platform: the platform of the run's devices, for "auto" (default: :func:`platform_of`).
      block_elements: the attention block; None: the form's default (on ``cpu`` sized from this
        machine's last-level cache when one process runs, else :data:`DEFAULT_BLOCK_ELEMENTS`,
        since every process of a run must compile the same program).
      slice_batch: attention slices processed together at least.
      process_count: processes in the run (default ``jax.process_count()``), for the cpu block.
    """
    if isinstance(kernels, KernelPolicy):
        return kernels
    if kernels not in KERNELS:
        raise ValueError(f"model.kernels must be one of {KERNELS}, got {kernels!r}")
    form = kernels
    if form == "auto":
        form = form_for_platform(platform if platform is not None else platform_of())
    if block_elements is None:
        block_elements = DEFAULT_BLOCK_ELEMENTS
        if form == "cpu":
            if process_count is None:
                import jax

                process_count = jax.process_count()
            if process_count == 1:
                from jaxrat.ops.cpu.cache import cpu_block_elements_here

                block_elements = cpu_block_elements_here()
    return KernelPolicy(form, int(block_elements), int(max(1, slice_batch)))
