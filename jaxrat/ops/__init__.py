"""The RAT's operations and the kernels that compute them, chosen by a kernel policy.

Model code (:mod:`jaxrat.models`) states the math and calls these operations with the
:class:`~jaxrat.ops.policy.KernelPolicy` it was built with; which kernel runs is decided here
(:mod:`jaxrat.ops.policy`), CPU kernels in :mod:`jaxrat.ops.cpu`, GPU ones in :mod:`jaxrat.ops.gpu`.
"""

from jaxrat.ops.policy import KERNELS, PORTABLE, KernelPolicy, resolve

__all__ = ["KERNELS", "PORTABLE", "KernelPolicy", "resolve"]
