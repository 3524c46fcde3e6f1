"""Kernels for CPUs, chosen only by the ``cpu`` kernel policy (:mod:`jaxrat.ops.policy`).

Each was measured faster than XLA's own form on CPUs, and each module's docstring gives the
measurement: cache-sized attention blocks and unbatched large slices (:mod:`.cache`,
:mod:`jaxrat.ops.portable.chunked_attention`), strided convolutions as stride-block matmuls
(:mod:`.strided_conv`), stride-1 weight gradients over row strips (:mod:`.strip_conv`), cache-sized
MLP chunks (:mod:`.mlp`) and the RoSE rotation's angle gradient summed image by image
(:mod:`.rotate`).

Their operations run under the named scope :data:`SCOPE`, so a compiled program shows which of
its ops are CPU kernels (a program built for another form has none).
"""

SCOPE = "cpu_kernels"
