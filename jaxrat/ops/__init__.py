"""Kernels for a machine: the model states the math, the ops layer picks an implementation.

``jaxrat.ops.gpu`` holds the GPU forms (fused attention, the flash decomposition of dense SGA,
windowed multi-resolution attention with windows in the batch axis)."""
