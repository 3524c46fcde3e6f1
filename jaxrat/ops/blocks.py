"""Static kernel parameters: values fixed when a program is traced, shared by the dispatch
(:mod:`jaxrat.ops.policy` carries them) and the kernel families that read them (the way Pallas
attention takes ``BlockSizes``). It imports nothing from ``jaxrat.ops``, so every family may import it.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SparseSGABlocks:
    """How the gpu form's fused sparse SGA kernels run, fixed when the program is traced (the way
    Pallas attention takes ``BlockSizes``): part of every kernel's static tiling, so no switch can
    change a program after it was traced.

    Attributes:
      products: logits as matrix products over row segments on the tensor cores
        (:mod:`jaxrat.ops.gpu.sparse_sga.products`), else tap by tap.
      sweep_rows: output rows one program of a sweep takes (:mod:`jaxrat.ops.gpu.sparse_sga.sweep`:
        the column sums and the update, and d's gradient and the queries', as one sweep down the
        image each); 0 runs those passes apart.
      input_grad_features: the first layer's keys' pass writes the layer's input gradient itself for
        inputs of up to this many (power of two) channels (:mod:`jaxrat.ops.gpu.sparse_sga.projection`);
        0: XLA's product of the projection's gradient.
    """

    products: bool = False
    sweep_rows: int = 8
    input_grad_features: int = 256

    def __post_init__(self) -> None:
        if self.sweep_rows < 0 or self.input_grad_features < 0:
            raise ValueError(f"sweep_rows and input_grad_features must be >= 0, got {self}")
