"""jaxrat: train the Resolution Aware Transformer with JAX/Flax on one machine or a cluster."""

__version__ = "0.1.0"
