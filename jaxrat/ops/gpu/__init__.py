"""GPU forms of the RAT's attention kernels, pure functions over (..., N, d) arrays.

Each takes ``implementation`` ("auto", "cudnn", "pallas" or "xla"), decided at trace time from
static shapes and dtypes (:func:`jaxrat.ops.gpu.fused.choose_implementation`), so a program built
for the GPU can be lowered for CUDA on any machine, and tests on a CPU force "xla".
"""

from jaxrat.ops.gpu.dense_sga import dense_sga
from jaxrat.ops.gpu.fused import IMPLEMENTATIONS, choose_implementation, fused_attention, why_not
from jaxrat.ops.gpu.masked import masked_attention
from jaxrat.ops.gpu.multires import multires_attention

__all__ = ["IMPLEMENTATIONS", "choose_implementation", "dense_sga", "fused_attention",
           "masked_attention", "multires_attention", "why_not"]
