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
from typing import Iterable, Optional, Sequence

from jaxrat.ops.blocks import SparseSGABlocks
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
      gpu_forms: the fused GPU forms (:data:`jaxrat.ops.forms.FORMS`) the gpu form uses; an
        operation whose form is not here takes the portable form. As constructed, every form the
        main branch runs (:func:`resolve` narrows it to the validated ones).
      sparse_sga: the fused sparse SGA kernels' switches.
    """

    form: str = "portable"
    block_elements: int = DEFAULT_BLOCK_ELEMENTS
    slice_batch: int = 1
    gpu_forms: frozenset = dataclasses.field(default_factory=lambda: _candidates())
    sparse_sga: SparseSGABlocks = SparseSGABlocks()

    def __post_init__(self) -> None:
        if self.form not in FORMS:
            raise ValueError(f"kernel form must be one of {FORMS}, got {self.form!r}")
        if self.block_elements < 1 or self.slice_batch < 1:
            raise ValueError(f"block_elements and slice_batch must be >= 1, got {self}")
        from jaxrat.ops.forms import FORMS as GPU_FORMS

        object.__setattr__(self, "gpu_forms", frozenset(self.gpu_forms))
        unknown = sorted(set(self.gpu_forms) - set(GPU_FORMS))
        if unknown:
            raise ValueError(f"unknown GPU forms {unknown}; known: {sorted(GPU_FORMS)}")

    @property
    def cpu(self) -> bool:
        return self.form == "cpu"

    @property
    def gpu(self) -> bool:
        return self.form == "gpu"

    @property
    def rolled_rounds(self) -> bool:
        """Whether a layer's repeated rounds (SGA's grouping iterations) run as one loop. Yes but on the
        gpu form: XLA's CPU compiler makes machine code per fusion, and rolled the ISIC step compiles in
        a fraction of the time. On GPUs, under a mesh, XLA reduces (ZeRO-3: gathers and scatters) a
        loop's weights and their gradients on every trip, synchronously, where unrolled rounds' join
        the step's own overlapped collectives."""
        return self.form != "gpu"

    def uses(self, gpu_form: str) -> bool:
        """Whether this policy computes with the fused GPU form ``gpu_form`` (a name of
        :data:`jaxrat.ops.forms.FORMS`): the gpu form with that form among its ``gpu_forms``."""
        return self.form == "gpu" and gpu_form in self.gpu_forms


def _candidates() -> frozenset:
    from jaxrat.ops.forms import candidates

    return candidates()


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
            process_count: Optional[int] = None, gpu_forms: "str | Iterable[str]" = "validated",
            validated: Optional[frozenset] = None) -> KernelPolicy:
    """Turn ``config.model.kernels`` into a :class:`KernelPolicy`, once per run.

    Args:
      kernels: "auto", "cpu", "gpu", "portable", or a policy (returned as it is).
      platform: the platform of the run's devices, for "auto" (default: :func:`platform_of`).
      block_elements: the attention block; None: the form's default (on ``cpu`` sized from this
        machine's last-level cache when one process runs, else :data:`DEFAULT_BLOCK_ELEMENTS`,
        since every process of a run must compile the same program).
      slice_batch: attention slices processed together at least.
      process_count: processes in the run (default ``jax.process_count()``), for the cpu block.
      gpu_forms: on the gpu form, which fused forms (``config.model.gpu_forms``): "validated" (those
        whose code passed on a GPU, :mod:`jaxrat.ops.forms`), "all" (the experimental set), or names.
      validated: the validated forms' names (default: from the record, :func:`jaxrat.ops.forms.validated`).
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
    if form != "gpu":
        return KernelPolicy(form, int(block_elements), int(max(1, slice_batch)))
    chosen = select_gpu_forms(gpu_forms, validated)
    return KernelPolicy(form, int(block_elements), int(max(1, slice_batch)), chosen.used, blocks_of(chosen.used))


def select_gpu_forms(gpu_forms: "str | Iterable[str]" = "validated", validated: Optional[frozenset] = None):
    """:func:`jaxrat.ops.forms.select`: the fused forms a gpu run uses and those it holds back."""
    from jaxrat.ops.forms import select

    return select(gpu_forms, validated)


def blocks_of(gpu_forms: Iterable[str]) -> SparseSGABlocks:
    """The sparse SGA switches the chosen forms ran with (their fingerprinted ``blocks``)."""
    from jaxrat.ops.forms import FORMS

    fields: dict = {}
    for name in sorted(gpu_forms):
        fields.update(dict(FORMS[name].blocks))
    return SparseSGABlocks(**fields)
