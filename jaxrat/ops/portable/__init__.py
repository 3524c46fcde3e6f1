"""Plain-XLA kernels: memory-bounded, no custom calls, so the program runs and serialises anywhere.

The CPU and GPU kernel families build on these (they import downward only); the dispatch modules
above (:mod:`jaxrat.ops.attention`, ...) choose among them.
"""
